//! Throughput on the real broker, one run, the same server and the same messages for each
//! consumer:
//!
//! - **raw**: a consumer that only acknowledges (the broker's pace, for scale);
//! - **hand-written**: the cheapest dedupe there is, `SET key pending NX PX` then `SET key
//!   result PX` in Redis around a no-op handler, then the ack (none of idem's guarantees: no
//!   fencing, no heartbeat, no conflict detection, no retry or dead-lettering);
//! - **runner**: [`AmqpRunner`] with the Redis store around the same no-op handler;
//! - and, for the runner's own share, the runner over a `MemoryStore` (no store round trip).
//!
//! Every consumer runs with the same prefetch (the raw and hand-written ones each delivery in its
//! own task, the runner the deliveries at hand in groups) over 20,000
//! persistent messages of which 20% are duplicates. Prints messages per second and the
//! runner / hand-written ratio (target: 0.8 or more).
//!
//! `cargo bench -p idem-amqp --bench amqp_throughput` with RabbitMQ and Redis up
//! (`scripts/services.sh rabbitmq redis`); `IDEM_AMQP_BENCH_MESSAGES` changes the count.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use idem_amqp::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idem_amqp::lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use idem_amqp::lapin::{BasicProperties, Connection, ConnectionProperties};
use idem_amqp::{AmqpMessage, AmqpRunner, QueueTopology, RunnerOptions};
use idem_core::DynStore;
use idem_executor::{Executor, ExecutorConfig, HandlerContext, HandlerError, Message};
use idem_redis::{RedisConfig, RedisStore};
use tokio_util::sync::CancellationToken;

/// How long the bench's records (ours and the hand-written consumer's) stay in the shared
/// server: long enough for the run, short enough not to crowd the server for later runs.
const RECORD_TTL: std::time::Duration = std::time::Duration::from_secs(600);

const PREFETCH: u16 = 64;

fn amqp_url() -> String {
    std::env::var("IDEM_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
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
    let url = amqp_url();
    let Ok(conn) = Connection::connect(&url, ConnectionProperties::default()).await else {
        println!("amqp_throughput: skipped: no RabbitMQ at {url} (scripts/services.sh rabbitmq)");
        return;
    };
    let Ok(client) = redis::Client::open(redis_url()) else {
        println!("amqp_throughput: skipped: bad IDEM_REDIS_URL");
        return;
    };
    let Ok(redis) = redis::aio::ConnectionManager::new(client).await else {
        println!(
            "amqp_throughput: skipped: no Redis at {} (scripts/services.sh redis)",
            redis_url()
        );
        return;
    };
    let n: usize = std::env::var("IDEM_AMQP_BENCH_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let unique = n - n / 5;
    let keys: Vec<String> = (0..n)
        .map(|i| format!("k{}", if i < unique { i } else { (i * 7919) % unique }))
        .collect();
    let run = uuid::Uuid::new_v4().simple().to_string();
    println!(
        "amqp_throughput: {n} messages ({unique} keys, {} duplicates), prefetch {PREFETCH}, one run on {url}",
        n - unique
    );

    let raw = measure(&conn, &format!("bench-raw-{run}"), &keys, |queue| {
        raw_consumer(url.clone(), queue)
    })
    .await;
    println!(
        "  raw consumer (ack only):         {:>9.0} msg/s",
        rate(n, raw)
    );

    let prefix = format!("bench-hand-{run}:");
    let hand = measure(&conn, &format!("bench-hand-{run}"), &keys, |queue| {
        hand_written(url.clone(), queue, redis.clone(), prefix.clone())
    })
    .await;
    println!(
        "  hand-written SET NX + SET:       {:>9.0} msg/s",
        rate(n, hand)
    );

    let runner = measure(&conn, &format!("bench-runner-{run}"), &keys, |queue| {
        with_runner(url.clone(), queue, Some(format!("bench-runner-{run}:")))
    })
    .await;
    println!(
        "  AmqpRunner + RedisStore:         {:>9.0} msg/s",
        rate(n, runner)
    );
    let memory = measure(&conn, &format!("bench-memory-{run}"), &keys, |queue| {
        with_runner(url.clone(), queue, None)
    })
    .await;
    println!(
        "  AmqpRunner + MemoryStore:        {:>9.0} msg/s (the runner and the broker without a store round trip)",
        rate(n, memory)
    );
    println!(
        "  runner / hand-written: {:.2} (target >= 0.80); raw / runner: {:.1}",
        hand.as_secs_f64() / runner.as_secs_f64(),
        runner.as_secs_f64() / raw.as_secs_f64()
    );
    let _ = conn.close(200, "bye".into()).await;
}

fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

/// Publishes the messages to a fresh queue, then times `consume` until it has settled them all.
async fn measure<F, Fut>(conn: &Connection, queue: &str, keys: &[String], consume: F) -> Duration
where
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = Instant>,
{
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirms = Vec::new();
    for key in keys {
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("idempotency-key"),
            AMQPValue::LongString(LongString::from(key.as_str())),
        );
        confirms.push(
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                format!("{{\"key\":\"{key}\"}}").as_bytes(),
                BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_headers(headers),
            )
            .await
            .unwrap(),
        );
        if confirms.len() >= 1000 {
            for c in confirms.drain(..) {
                assert!(c.await.unwrap().is_ack());
            }
        }
    }
    for c in confirms {
        assert!(c.await.unwrap().is_ack());
    }
    let started = Instant::now();
    // The instant the last message was settled (a shutdown's drain afterwards is not counted).
    let settled = tokio::time::timeout(Duration::from_secs(300), consume(queue.to_owned()))
        .await
        .expect("consumed within 5 minutes");
    let took = settled - started;
    let topology = QueueTopology::new(queue);
    for q in [queue, &topology.retry_queue, &topology.dead_letter_queue] {
        let _ = ch
            .queue_delete(q.into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = ch
        .exchange_delete(
            topology.dead_letter_exchange.as_str().into(),
            ExchangeDeleteOptions::default(),
        )
        .await;
    let _ = ch.close(200, "bye".into()).await;
    took
}

/// Consumes `queue` until it is empty, calling `each` in a task per delivery.
async fn consume_all<F, Fut>(url: String, queue: String, total: u64, each: F) -> Instant
where
    F: Fn(Vec<u8>, BasicProperties) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(PREFETCH, BasicQosOptions::default())
        .await
        .unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let done = Arc::new(AtomicU64::new(0));
    let all = CancellationToken::new();
    let each = Arc::new(each);
    let settled = loop {
        tokio::select! {
            () = all.cancelled() => break Instant::now(),
            next = consumer.next() => {
                let delivery = next.expect("consumer ended").expect("delivery");
                let (done, all, each) = (Arc::clone(&done), all.clone(), Arc::clone(&each));
                tokio::spawn(async move {
                    each(delivery.data, delivery.properties).await;
                    delivery.acker.ack(BasicAckOptions::default()).await.unwrap();
                    if done.fetch_add(1, Ordering::Relaxed) + 1 == total {
                        all.cancel();
                    }
                });
            }
        }
    };
    let _ = conn.close(200, "bye".into()).await;
    settled
}

async fn raw_consumer(url: String, queue: String) -> Instant {
    let total = depth(&url, &queue).await;
    consume_all(url, queue, total, |_, _| async {}).await
}

async fn hand_written(
    url: String,
    queue: String,
    redis: redis::aio::ConnectionManager,
    prefix: String,
) -> Instant {
    let total = depth(&url, &queue).await;
    consume_all(url, queue, total, move |body, props| {
        let mut redis = redis.clone();
        let prefix = prefix.clone();
        async move {
            let msg = AmqpMessage::new(body, props);
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

/// The runner over the Redis store (keys under `prefix`), or over a `MemoryStore` (`None`);
/// returns when every message was settled.
async fn with_runner(url: String, queue: String, prefix: Option<String>) -> Instant {
    let total = depth(&url, &queue).await;
    let store: DynStore = match prefix {
        Some(prefix) => Arc::new(
            RedisStore::connect_with(&redis_url(), RedisConfig::default().with_prefix(prefix))
                .await
                .unwrap(),
        ),
        None => Arc::new(idem_core::MemoryStore::new()),
    };
    let executor = Executor::new(
        store,
        ExecutorConfig::new("bench").with_retention(RECORD_TTL),
    )
    .unwrap();
    let handler = |msg: AmqpMessage, _ctx: HandlerContext| async move {
        Ok::<_, HandlerError>(format!("handled {} bytes", msg.payload().len()))
    };
    let runner = AmqpRunner::builder(url, QueueTopology::new(queue), executor, handler)
        .options(RunnerOptions::default().with_prefetch(PREFETCH))
        .build()
        .unwrap();
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let watch = stop.clone();
    let watcher = tokio::spawn(async move {
        while stats.executed() + stats.replayed() < total {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let settled = Instant::now();
        watch.cancel();
        settled
    });
    runner.run(stop.cancelled_owned()).await.unwrap();
    watcher.await.unwrap()
}

async fn depth(url: &str, queue: &str) -> u64 {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let _ = conn.close(200, "bye".into()).await;
    u64::from(q.message_count())
}
