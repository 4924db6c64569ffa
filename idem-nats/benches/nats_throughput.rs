//! Throughput on the real server, one run, the same server and the same messages for each
//! consumer:
//!
//! - **raw**: a pull consumer that only acknowledges (the server's pace, for scale);
//! - **hand-written**: the cheapest dedupe there is, `SET key pending NX PX` then `SET key
//!   result PX` in Redis around a no-op handler, then the ack (none of idem's guarantees: no
//!   fencing, no heartbeat or progress ack, no conflict detection, no nak or dead letter);
//! - **runner**: [`NatsRunner`] with the Redis store around the same no-op handler (double acks,
//!   progress acks, pulls sized to the free slots);
//! - and, for the runner's own share, the runner over a `MemoryStore` (no store round trip).
//!
//! The raw and hand-written consumers read `messages()` (the client's prefetching pull stream)
//! and run each message in its own task, at most [`IN_FLIGHT`] at once, as the runner does.
//! 20,000 messages of which 20% are duplicates, on a file-backed stream. Prints messages per
//! second and the runner / hand-written ratio (target: 0.8 or more).
//!
//! `cargo bench -p idem-nats --bench nats_throughput` with NATS and Redis up
//! (`scripts/services.sh nats redis`); `IDEM_NATS_BENCH_MESSAGES` changes the count,
//! `IDEM_NATS_BENCH_MAX_BATCH` the runner's `max_batch` (default 64) and
//! `IDEM_NATS_BENCH_RUNNER_IN_FLIGHT` its `max_in_flight` (default [`RUNNER_IN_FLIGHT`]: the
//! hand-written consumer holds up to [`IN_FLIGHT`] messages in its handlers and up to as many
//! again in its prefetching stream, all delivered and not yet acknowledged; the runner, which
//! never prefetches, gets the same bound on what it holds unacknowledged).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use idem_executor::{Executor, ExecutorConfig, HandlerContext, HandlerError, Message};
use idem_nats::async_nats::jetstream::{self, consumer, stream};
use idem_nats::async_nats::{self, HeaderMap};
use idem_nats::{NatsMessage, NatsRunner, RunnerOptions};
use idem_redis::{RedisConfig, RedisStore};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// How long the bench's records (ours and the hand-written consumer's) stay in the shared
/// server: long enough for the run, short enough not to crowd the server for later runs.
const RECORD_TTL: std::time::Duration = std::time::Duration::from_secs(600);

const IN_FLIGHT: usize = 64;

/// The runner's `max_in_flight` unless `IDEM_NATS_BENCH_RUNNER_IN_FLIGHT` says otherwise: the
/// hand-written consumer's bound on messages delivered and not yet acknowledged ([`IN_FLIGHT`]
/// in its handlers, as many again in its prefetching stream).
const RUNNER_IN_FLIGHT: usize = 2 * IN_FLIGHT;

fn nats_url() -> String {
    std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

fn redis_url() -> String {
    std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(bench());
}

async fn bench() {
    let url = nats_url();
    let Ok(client) = async_nats::connect(&url).await else {
        println!("nats_throughput: skipped: no NATS at {url} (scripts/services.sh nats)");
        return;
    };
    let Ok(redis_client) = redis::Client::open(redis_url()) else {
        println!("nats_throughput: skipped: bad IDEM_REDIS_URL");
        return;
    };
    let Ok(redis) = redis::aio::ConnectionManager::new(redis_client).await else {
        println!(
            "nats_throughput: skipped: no Redis at {} (scripts/services.sh redis)",
            redis_url()
        );
        return;
    };
    let js = jetstream::new(client.clone());
    let n = env_or("IDEM_NATS_BENCH_MESSAGES", 20_000);
    let unique = n - n / 5;
    let keys: Vec<String> = (0..n)
        .map(|i| format!("k{}", if i < unique { i } else { (i * 7919) % unique }))
        .collect();
    let run = &uuid::Uuid::new_v4().simple().to_string()[..12];
    println!(
        "nats_throughput: {n} messages ({unique} keys, {} duplicates), {IN_FLIGHT} handlers (+ {IN_FLIGHT} prefetched) in the hand-written consumers, runner max_in_flight {}, one run on {url}",
        n - unique,
        runner_in_flight()
    );

    let name = format!("bench_raw_{run}");
    let raw = Box::pin(measure(
        &js,
        &name,
        &keys,
        raw_consumer(js.clone(), name.clone(), n),
    ))
    .await;
    println!(
        "  raw consumer (ack only):         {:>9.0} msg/s",
        rate(n, raw)
    );

    let name = format!("bench_hand_{run}");
    let hand = Box::pin(measure(
        &js,
        &name,
        &keys,
        hand_written(
            js.clone(),
            name.clone(),
            n,
            redis.clone(),
            format!("{name}:"),
        ),
    ))
    .await;
    println!(
        "  hand-written SET NX + SET:       {:>9.0} msg/s",
        rate(n, hand)
    );

    let name = format!("bench_runner_{run}");
    let requests = Arc::new(AtomicU64::new(0));
    let runner = Box::pin(measure(
        &js,
        &name,
        &keys,
        with_runner(
            client.clone(),
            name.clone(),
            n,
            Some((format!("{name}:"), Arc::clone(&requests))),
        ),
    ))
    .await;
    println!(
        "  NatsRunner + RedisStore:         {:>9.0} msg/s ({:.2} store requests per message)",
        rate(n, runner),
        requests.load(Ordering::Relaxed) as f64 / n as f64
    );

    let name = format!("bench_memory_{run}");
    let memory = Box::pin(measure(
        &js,
        &name,
        &keys,
        with_runner(client.clone(), name.clone(), n, None),
    ))
    .await;
    println!(
        "  NatsRunner + MemoryStore:        {:>9.0} msg/s (the runner and the server without a store round trip)",
        rate(n, memory)
    );
    println!(
        "  runner / hand-written: {:.2} (target >= 0.80); raw / runner: {:.1}",
        hand.as_secs_f64() / runner.as_secs_f64(),
        runner.as_secs_f64() / raw.as_secs_f64()
    );
}

/// The runner's `max_in_flight`: `IDEM_NATS_BENCH_RUNNER_IN_FLIGHT`, or [`RUNNER_IN_FLIGHT`].
fn runner_in_flight() -> usize {
    env_or("IDEM_NATS_BENCH_RUNNER_IN_FLIGHT", RUNNER_IN_FLIGHT)
}

/// The number in the environment variable `name`, or `default`.
fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

/// Publishes the messages to a fresh stream, then times `consume` until it settled them all.
async fn measure(
    js: &jetstream::Context,
    name: &str,
    keys: &[String],
    consume: impl std::future::Future<Output = Instant>,
) -> Duration {
    js.create_stream(stream::Config {
        name: name.to_owned(),
        subjects: vec![format!("{name}.>")],
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await
    .expect("create stream");
    let mut acks = Vec::new();
    for key in keys {
        let mut headers = HeaderMap::new();
        headers.insert("idempotency-key", key.as_str());
        acks.push(
            js.publish_with_headers(
                format!("{name}.orders"),
                headers,
                format!("{{\"key\":\"{key}\"}}").into(),
            )
            .await
            .unwrap(),
        );
        if acks.len() >= 1000 {
            for a in acks.drain(..) {
                a.await.unwrap();
            }
        }
    }
    for a in acks {
        a.await.unwrap();
    }
    let started = Instant::now();
    // The instant the last message was settled (a shutdown's drain afterwards is not counted).
    let settled = tokio::time::timeout(Duration::from_secs(300), consume)
        .await
        .expect("consumed within 5 minutes");
    let took = settled - started;
    let _ = js.delete_stream(name).await;
    took
}

async fn pull_consumer(js: &jetstream::Context, name: &str) -> consumer::PullConsumer {
    js.get_stream(name)
        .await
        .unwrap()
        .get_or_create_consumer(
            "workers",
            consumer::pull::Config {
                durable_name: Some("workers".to_owned()),
                ack_policy: consumer::AckPolicy::Explicit,
                ..Default::default()
            },
        )
        .await
        .unwrap()
}

/// Reads `messages()` and runs `each` in a task per message (at most [`IN_FLIGHT`] at once),
/// then acks it, until `total` are acked.
async fn consume_all<F, Fut>(js: jetstream::Context, name: String, total: usize, each: F) -> Instant
where
    F: Fn(async_nats::Message) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let consumer = pull_consumer(&js, &name).await;
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(IN_FLIGHT)
        .messages()
        .await
        .unwrap();
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let done = Arc::new(AtomicU64::new(0));
    let all = CancellationToken::new();
    let each = Arc::new(each);
    loop {
        let slot = Arc::clone(&slots).acquire_owned().await.unwrap();
        let message = tokio::select! {
            () = all.cancelled() => break Instant::now(),
            next = messages.next() => next.expect("stream ended").expect("message"),
        };
        let (done, all, each) = (Arc::clone(&done), all.clone(), Arc::clone(&each));
        tokio::spawn(async move {
            let _slot = slot;
            let (message, acker) = message.split();
            each(message).await;
            acker.ack().await.unwrap();
            if done.fetch_add(1, Ordering::Relaxed) + 1 == total as u64 {
                all.cancel();
            }
        });
    }
}

async fn raw_consumer(js: jetstream::Context, name: String, total: usize) -> Instant {
    consume_all(js, name, total, |_| async {}).await
}

async fn hand_written(
    js: jetstream::Context,
    name: String,
    total: usize,
    redis: redis::aio::ConnectionManager,
    prefix: String,
) -> Instant {
    consume_all(js, name, total, move |message| {
        let mut redis = redis.clone();
        let prefix = prefix.clone();
        async move {
            let msg = NatsMessage::new(
                message.subject.to_string(),
                message.payload,
                message.headers,
            );
            let key = format!(
                "{prefix}{}",
                String::from_utf8_lossy(msg.header("idempotency-key").unwrap())
            );
            let fresh: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg("pending")
                .arg("NX")
                .arg("PX")
                .arg(30_000)
                .query_async(&mut redis)
                .await
                .unwrap();
            if fresh.is_some() {
                let result = format!("handled {} bytes", msg.payload().len());
                let _: () = redis::cmd("SET")
                    .arg(&key)
                    .arg(result)
                    .arg("PX")
                    .arg(RECORD_TTL.as_millis() as u64)
                    .query_async(&mut redis)
                    .await
                    .unwrap();
            }
        }
    })
    .await
}

/// The runner over the Redis store under a prefix (then the requests it sent are stored in the
/// counter given), or over a `MemoryStore` (`None`).
async fn with_runner(
    client: async_nats::Client,
    name: String,
    total: usize,
    redis: Option<(String, Arc<AtomicU64>)>,
) -> Instant {
    let mut counted = None;
    let store: idem_core::DynStore = match redis {
        Some((prefix, requests)) => {
            let store =
                RedisStore::connect_with(&redis_url(), RedisConfig::default().with_prefix(prefix))
                    .await
                    .unwrap();
            counted = Some((store.clone(), requests));
            Arc::new(store)
        }
        None => Arc::new(idem_core::MemoryStore::new()),
    };
    let executor = Executor::new(
        store,
        ExecutorConfig::new("bench").with_retention(RECORD_TTL),
    )
    .unwrap();
    let handler = |msg: NatsMessage, _ctx: HandlerContext| async move {
        Ok::<_, HandlerError>(format!("handled {} bytes", msg.payload().len()))
    };
    let runner = NatsRunner::builder(client, name, "workers", executor, handler)
        .options(
            RunnerOptions::default()
                .with_max_in_flight(runner_in_flight())
                .with_max_batch(env_or("IDEM_NATS_BENCH_MAX_BATCH", 64)),
        )
        .build()
        .unwrap();
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let watch = stop.clone();
    let watcher = tokio::spawn(async move {
        while stats.executed() + stats.replayed() < total as u64 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let settled = Instant::now();
        watch.cancel();
        settled
    });
    runner.run(stop.cancelled_owned()).await.unwrap();
    let settled = watcher.await.unwrap();
    if let Some((store, requests)) = counted {
        requests.store(store.requests_sent(), Ordering::Relaxed);
    }
    settled
}
