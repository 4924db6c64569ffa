//! Runner throughput against a raw aws-sdk-sqs receive/delete loop, on the same queue in the
//! same run: the queue is filled, drained by the raw loop (`ReceiveMessage` of 10, then one
//! `DeleteMessageBatch`, in `IDEM_BENCH_LOOPS` loops at once), filled again and drained by the
//! runner (a handler that does no work, Redis as the store: one acquire and one complete per
//! message). Both are bounded by the SQS server's own speed (LocalStack's here); the ratio is
//! what the runner keeps of it.
//!
//! ```text
//! scripts/services.sh localstack redis
//! cargo bench -p idem-sqs --bench sqs_bench
//! IDEM_BENCH_MESSAGES=10000 IDEM_BENCH_IN_FLIGHT=64 cargo bench -p idem-sqs --bench sqs_bench
//! ```
//!
//! Without LocalStack or Redis it prints one "skipped" line and exits 0.
#![allow(missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_executor::{Executor, ExecutorConfig, HandlerContext, HandlerError};
use idem_redis::{RedisConfig, RedisStore};
use idem_sqs::aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use idem_sqs::aws_sdk_sqs::types::{
    DeleteMessageBatchRequestEntry, MessageAttributeValue, SendMessageBatchRequestEntry,
};
use idem_sqs::aws_sdk_sqs::{self, Client};
use idem_sqs::{RunnerOptions, SqsMessage, SqsRunner};
use tokio_util::sync::CancellationToken;

/// How long the bench's records (ours and the hand-written consumer's) stay in the shared
/// server: long enough for the run, short enough not to crowd the server for later runs.
const RECORD_TTL: std::time::Duration = std::time::Duration::from_secs(600);

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn client(endpoint: &str) -> Client {
    Client::from_conf(
        aws_sdk_sqs::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .endpoint_url(endpoint)
            .region(Region::new("us-east-1"))
            .credentials_provider(Credentials::new("bench", "bench", None, None, "idem-bench"))
            .build(),
    )
}

async fn create(client: &Client, name: &str) -> String {
    client
        .create_queue()
        .queue_name(name)
        .send()
        .await
        .unwrap_or_else(|e| panic!("CreateQueue {name}: {}", aws_sdk_sqs::Error::from(e)))
        .queue_url
        .expect("a queue url")
}

/// Sends `n` keyed messages (`run`-`i`), 10 per call, 4 calls at once.
async fn fill(client: &Client, url: &str, run: &str, n: usize) {
    let mut calls = tokio::task::JoinSet::new();
    for start in (0..n).step_by(10) {
        let entries: Vec<_> = (start..(start + 10).min(n))
            .map(|i| {
                SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(format!("{{\"order\":{i},\"amount\":{}}}", 100 + i))
                    .message_attributes(
                        "idempotency-key",
                        MessageAttributeValue::builder()
                            .data_type("String")
                            .string_value(format!("{run}-{i}"))
                            .build()
                            .unwrap(),
                    )
                    .build()
                    .unwrap()
            })
            .collect();
        let (client, url) = (client.clone(), url.to_owned());
        calls.spawn(async move {
            client
                .send_message_batch()
                .queue_url(url)
                .set_entries(Some(entries))
                .send()
                .await
                .expect("SendMessageBatch")
        });
        if calls.len() >= 4 {
            calls.join_next().await.unwrap().unwrap();
        }
    }
    while let Some(r) = calls.join_next().await {
        r.unwrap();
    }
}

/// The raw loop: receive 10, delete them in one batch; `loops` of them until `n` are deleted.
async fn raw(client: &Client, url: &str, n: u64, loops: usize) -> Duration {
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..loops {
        let (client, url, done) = (client.clone(), url.to_owned(), Arc::clone(&done));
        tasks.spawn(async move {
            while done.load(Ordering::Relaxed) < n {
                let out = client
                    .receive_message()
                    .queue_url(&url)
                    .max_number_of_messages(10)
                    .wait_time_seconds(1)
                    .message_attribute_names("All")
                    .send()
                    .await
                    .expect("ReceiveMessage");
                let messages = out.messages.unwrap_or_default();
                if messages.is_empty() {
                    continue;
                }
                let entries: Vec<_> = messages
                    .iter()
                    .enumerate()
                    .map(|(i, m)| {
                        DeleteMessageBatchRequestEntry::builder()
                            .id(i.to_string())
                            .receipt_handle(m.receipt_handle().unwrap())
                            .build()
                            .unwrap()
                    })
                    .collect();
                let out = client
                    .delete_message_batch()
                    .queue_url(&url)
                    .set_entries(Some(entries))
                    .send()
                    .await
                    .expect("DeleteMessageBatch");
                done.fetch_add(out.successful().len() as u64, Ordering::Relaxed);
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    started.elapsed()
}

/// The runner, until `n` messages are deleted.
async fn runner(
    client: &Client,
    url: &str,
    dlq: &str,
    redis: &str,
    n: u64,
    in_flight: usize,
    delete_calls: usize,
) -> Duration {
    let prefix = format!("idem-sqs-bench-{}:", uuid::Uuid::new_v4().simple());
    let store = RedisStore::connect_with(redis, RedisConfig::default().with_prefix(prefix))
        .await
        .expect("redis");
    let executor = Executor::new(
        Arc::new(store),
        ExecutorConfig::new("bench").with_retention(RECORD_TTL),
    )
    .unwrap();
    let handler =
        |_msg: SqsMessage, ctx: HandlerContext| async move { Ok::<_, HandlerError>(ctx.attempt()) };
    let runner = SqsRunner::builder(client.clone(), url, executor, handler)
        .dead_letter_queue(dlq)
        .options(
            RunnerOptions::default()
                .with_max_in_flight(in_flight)
                .with_max_delete_calls(delete_calls)
                .with_wait_time(Duration::from_secs(1)),
        )
        .build()
        .unwrap();
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let shutdown = stop.clone();
    let started = Instant::now();
    let task = tokio::spawn(runner.run(async move { shutdown.cancelled().await }));
    while stats.deleted() < n {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = started.elapsed();
    stop.cancel();
    task.await.unwrap().unwrap();
    assert_eq!(stats.executed(), n, "{stats:?}");
    eprintln!(
        "runner: {} receives, {} delete calls ({:.1} deletes per call)",
        stats.receives(),
        stats.delete_calls(),
        stats.deleted() as f64 / stats.delete_calls().max(1) as f64
    );
    took
}

fn reachable(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let host = rest.split(['/', '?']).next().unwrap_or(rest);
    let host = host.rsplit_once('@').map_or(host, |(_, h)| h);
    std::net::TcpStream::connect(host).is_ok()
}

fn main() {
    let endpoint = std::env::var("IDEM_LOCALSTACK_ENDPOINT")
        .unwrap_or_else(|_| "http://127.0.0.1:4566".into());
    let redis = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    if !reachable(&endpoint) || !reachable(&redis) {
        println!(
            "skipped: the sqs bench needs LocalStack at {endpoint} (IDEM_LOCALSTACK_ENDPOINT) and \
             Redis at {redis} (IDEM_REDIS_URL): scripts/services.sh localstack redis"
        );
        return;
    }
    let n: usize = env("IDEM_BENCH_MESSAGES", 5000);
    let loops: usize = env("IDEM_BENCH_LOOPS", 2);
    let in_flight: usize = env("IDEM_BENCH_IN_FLIGHT", 32);
    let delete_calls: usize = env(
        "IDEM_BENCH_DELETE_CALLS",
        RunnerOptions::default().max_delete_calls,
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = client(&endpoint);
        let run = uuid::Uuid::new_v4().simple().to_string();
        let url = create(&client, &format!("idem-bench-{run}")).await;
        let dlq = create(&client, &format!("idem-bench-{run}-dlq")).await;

        fill(&client, &url, "raw", n).await;
        let raw_took = raw(&client, &url, n as u64, loops).await;
        fill(&client, &url, "runner", n).await;
        let runner_took = runner(&client, &url, &dlq, &redis, n as u64, in_flight, delete_calls).await;

        let rate = |took: Duration| n as f64 / took.as_secs_f64();
        println!(
            "raw aws-sdk-sqs loop ({loops} loops, receive 10 + delete batch): {n} messages in {raw_took:.2?}: {:.0} msg/s",
            rate(raw_took)
        );
        println!(
            "idem-sqs runner (max_in_flight {in_flight}, max_delete_calls {delete_calls}, Redis store, no-op handler): {n} messages in {runner_took:.2?}: {:.0} msg/s",
            rate(runner_took)
        );
        println!(
            "ratio runner / raw: {:.2}",
            rate(runner_took) / rate(raw_took)
        );
        let _ = client.delete_queue().queue_url(&url).send().await;
        let _ = client.delete_queue().queue_url(&dlq).send().await;
    });
}
