//! Throughput of the runner with Redis as the store: records per second from the first record
//! resolved to the last, on a real Kafka-protocol broker.
//!
//! ```text
//! scripts/services.sh kafka redis
//! cargo bench -p idem-kafka --bench kafka_throughput
//! IDEM_BENCH_RECORDS=50000 IDEM_BENCH_PARTITIONS=12 cargo bench -p idem-kafka --bench kafka_throughput
//! ```
//!
//! Each record costs the store one acquire and one complete (a duplicate: one acquire); the
//! handler does no work, so the figure is the runner's and the store's overhead. 10% of the
//! records are duplicates. Endpoints as in the tests (`IDEM_KAFKA_BROKERS`, `IDEM_REDIS_URL`).
#![allow(missing_docs)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;
use idem_executor::{ExecutorConfig, HandlerContext, HandlerError};
use idem_kafka::{KafkaMessage, KafkaRunner, RunnerOptions};

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // Without the servers: one "skipped" line and nothing measured (with `CI=true`: a failure).
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    let records = env_or("IDEM_BENCH_RECORDS", 20_000);
    let partitions = env_or("IDEM_BENCH_PARTITIONS", 3) as i32;
    let topic = unique("bench");
    let group = unique("bench-group");
    create_topic(&topic, partitions).await;
    let unique_keys = records - records / 10;
    let recs: Vec<Rec> = (0..records)
        .map(|i| {
            let n = if i < unique_keys { i } else { i - unique_keys };
            Rec::keyed(
                n as i32 % partitions,
                &format!("k{n}"),
                format!("{{\"n\":{n}}}"),
            )
        })
        .collect();
    let t = Instant::now();
    produce(&topic, &recs).await;
    eprintln!(
        "produced {records} records on {partitions} partitions in {:?}",
        t.elapsed()
    );

    let store = shared(redis_store(&format!("{}:", unique("idem-kafka-bench"))).await);
    let handler = |_msg: KafkaMessage, _ctx: HandlerContext| async { Ok::<_, HandlerError>(()) };
    let mut consumer = consumer_config(&group);
    // Extra consumer properties, e.g. IDEM_BENCH_CONSUMER="fetch.wait.max.ms=100;debug=fetch".
    for kv in std::env::var("IDEM_BENCH_CONSUMER")
        .unwrap_or_default()
        .split(';')
    {
        if let Some((k, v)) = kv.split_once('=') {
            consumer.set(k.trim(), v.trim());
        }
    }
    let runner = KafkaRunner::builder(
        consumer,
        executor(store, ExecutorConfig::new("bench")),
        handler,
    )
    .topic(&topic)
    .options(
        RunnerOptions::default()
            .with_max_in_flight(partitions as usize)
            .with_max_buffered_per_partition(env_or(
                "IDEM_BENCH_BUFFER",
                RunnerOptions::default().max_buffered_per_partition,
            )),
    )
    .build()
    .expect("runner");
    let stats = runner.stats();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let started = Instant::now();
    let task = tokio::spawn(runner.run(async {
        let _ = rx.await;
    }));
    let mut first = None;
    while stats.resolved() < records as u64 {
        if first.is_none() && stats.resolved() > 0 {
            first = Some((Instant::now(), stats.resolved()));
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "stalled: {stats:?}"
        );
        assert!(!task.is_finished(), "the runner stopped: {:?}", task.await);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let done = Instant::now();
    let _ = tx.send(());
    task.await.unwrap().unwrap();
    let (first_at, first_n) = first.unwrap_or((started, 0));
    let steady = done.duration_since(first_at).as_secs_f64();
    let rate = (records as u64 - first_n) as f64 / steady;
    println!(
        "kafka_throughput: {records} records ({} duplicates) on {partitions} partitions, Redis store: \
         {rate:.0} records/s steady ({:.0} records/s including the {:?} group join); {} executed, {} replayed",
        records - unique_keys,
        records as f64 / done.duration_since(started).as_secs_f64(),
        first_at.duration_since(started),
        stats.executed(),
        stats.replayed(),
    );
}
