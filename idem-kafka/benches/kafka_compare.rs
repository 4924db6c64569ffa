//! The runner against what a consumer can do by hand, on the same topic in the same run.
//!
//! ```text
//! scripts/services.sh kafka redis
//! cargo bench -p idem-kafka --bench kafka_compare
//! IDEM_BENCH_RECORDS=20000 cargo bench -p idem-kafka --bench kafka_compare
//! ```
//!
//! For 1 and 3 partitions, one topic of `IDEM_BENCH_RECORDS` records (default 100,000), every
//! key fresh, read by three consumer groups one after the other:
//!
//! 1. **raw**: an rdkafka consumer that only counts the records (no store), for scale;
//! 2. **hand-written**: an rdkafka consumer that dedupes each poll batch (what one poll returns
//!    at once, up to 1,000 records) in Redis with one pipeline of `SET key 1 NX PX 30000`, then one
//!    pipeline of `SET key done EX 600` for the keys it got, and commits offsets every second:
//!    the cheapest dedupe there is, with none of the runner's guarantees (no fencing, no
//!    heartbeats, no replayed results, no dead letters);
//! 3. **runner**: `KafkaRunner` with a `RedisStore`, default options (`max_in_flight` set to the
//!    partition count times [`max_batches_per_partition`](RunnerOptions::max_batches_per_partition),
//!    so that every partition can have all its batches in process) and a no-op handler;
//! 4. **runner, memory**: the same runner with a `MemoryStore` (no server round trip): the
//!    runner's own ceiling on this broker, for telling its cost apart from the store's.
//!
//! Each figure is records per second from the first record received to the last one processed
//! (the group join excluded). Prints the four, and the ratio runner / hand-written.
//! `IDEM_BENCH_ROUNDS` (default 1) reads the topic that many times with the last three, one
//! after the other, and prints each round and the medians: the hand-written consumer's figure
//! swings with the machine's other load, so one round's ratio says little.
//! `IDEM_BENCH_PARTITIONS` (default `1,3`) lists the partition counts.
//!
//! Beside each rate it prints the CPU time each record cost, in µs: this process's (the
//! consumer, its rdkafka threads, the Redis client) and the Redis server's (`INFO cpu`, the
//! whole server: on a server other clients use, theirs too). On a noisy machine these say more
//! than the rates: two builds whose rates overlap can differ clearly in what a record costs.
//! Each consumer's keys are deleted from Redis after it ran, so that every one meets the
//! server as the first did.
//! `IDEM_BENCH_MAX_BATCH` sets the runner's [`max_batch`](RunnerOptions::max_batch) and both
//! stores' [`Limits::max_batch`](idem_core::Limits::max_batch) (default: the runner's default,
//! 100); `IDEM_BENCH_BATCHES_PER_PARTITION` sets
//! [`max_batches_per_partition`](RunnerOptions::max_batches_per_partition) (default: the runner's
//! default, 2).
//! Endpoints as in the tests (`IDEM_KAFKA_BROKERS`, `IDEM_REDIS_URL`); without them it prints one
//! "skipped" line (with `CI=true`: fails).
#![allow(missing_docs)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use idem_executor::{ExecutorConfig, HandlerContext, HandlerError};
use idem_kafka::{KafkaMessage, KafkaRunner, RunnerOptions};
use idem_redis::RedisConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::{Message, Offset, TopicPartitionList};

/// How long the bench's records (ours and the hand-written consumer's) stay in the shared
/// server: long enough for the run, short enough not to crowd the server for later runs.
const RECORD_TTL: std::time::Duration = std::time::Duration::from_secs(600);

/// Longest wait for one consumer to read the topic.
const LIMIT: Duration = Duration::from_secs(900);
/// Most records the hand-written consumer takes from one poll batch.
const POLL_BATCH: usize = 1000;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The Redis server's CPU time so far (`used_cpu_user` + `used_cpu_sys`), in seconds.
async fn server_cpu(redis: &mut redis::aio::ConnectionManager) -> f64 {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(redis)
        .await
        .expect("INFO cpu");
    info.lines()
        .filter_map(|line| line.split_once(':'))
        .filter(|(name, _)| matches!(*name, "used_cpu_user" | "used_cpu_sys"))
        .map(|(_, value)| value.trim().parse::<f64>().expect("a CPU time"))
        .sum()
}

/// Deletes the keys under `prefix` (one consumer's records).
async fn delete_prefix(redis: &mut redis::aio::ConnectionManager, prefix: &str) {
    let mut cursor = 0_u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(10_000)
            .query_async(redis)
            .await
            .expect("SCAN");
        if !keys.is_empty() {
            let () = redis::cmd("UNLINK")
                .arg(&keys)
                .query_async(redis)
                .await
                .expect("UNLINK");
        }
        if next == 0 {
            return;
        }
        cursor = next;
    }
}

/// One consumer's figures: records per second, and the µs of CPU time each record cost this
/// process and the Redis server.
#[derive(Clone, Copy)]
struct Figures {
    rate: f64,
    cpu: f64,
    server: f64,
}

/// Runs `consumer` (which answers its rate) and measures what its records cost.
async fn measured(
    redis: &mut redis::aio::ConnectionManager,
    records: usize,
    consumer: impl std::future::Future<Output = f64>,
) -> Figures {
    let server_before = server_cpu(redis).await;
    let cpu = cpu_time::ProcessTime::now();
    let rate = consumer.await;
    let cpu = cpu.elapsed().as_secs_f64();
    let server = server_cpu(redis).await - server_before;
    let per_record = |seconds: f64| seconds * 1e6 / records as f64;
    Figures {
        rate,
        cpu: per_record(cpu),
        server: per_record(server),
    }
}

fn consumer(group: &str, topic: &str) -> BaseConsumer {
    let consumer: BaseConsumer = consumer_config(group)
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    consumer.subscribe(&[topic]).expect("subscribe");
    consumer
}

/// Records per second of a consumer that only counts.
fn raw(topic: &str, records: usize) -> f64 {
    let consumer = consumer(&unique("raw"), topic);
    let started = Instant::now();
    let mut first = None;
    let mut seen = 0;
    while seen < records {
        assert!(started.elapsed() < LIMIT, "raw consumer stalled at {seen}");
        if let Some(m) = consumer.poll(Duration::from_millis(100)) {
            m.expect("record");
            first.get_or_insert_with(Instant::now);
            seen += 1;
        }
    }
    let first = first.unwrap_or(started);
    (records - 1) as f64 / first.elapsed().as_secs_f64()
}

/// Records per second of the hand-written pipelined `SET NX` + `SET` consumer, its keys under
/// `prefix`.
async fn hand_written(topic: &str, records: usize, prefix: &str) -> f64 {
    let consumer = consumer(&unique("hand"), topic);
    let mut redis = redis_conn().await;
    let started = Instant::now();
    let mut first = None;
    let mut seen = 0;
    let mut next_offsets: HashMap<i32, i64> = HashMap::new();
    let mut last_commit = Instant::now();
    let mut batch: Vec<(i32, i64, String)> = Vec::with_capacity(POLL_BATCH);
    while seen < records {
        assert!(
            started.elapsed() < LIMIT,
            "hand-written consumer stalled at {seen}"
        );
        batch.clear();
        let mut wait = Duration::from_millis(100);
        while batch.len() < POLL_BATCH {
            let Some(m) = consumer.poll(wait) else { break };
            let m = m.expect("record");
            first.get_or_insert_with(Instant::now);
            let key = format!(
                "{prefix}{}",
                String::from_utf8_lossy(m.key().expect("keyed record"))
            );
            batch.push((m.partition(), m.offset(), key));
            // The rest of what the client already holds, without waiting.
            wait = Duration::ZERO;
        }
        if batch.is_empty() {
            continue;
        }
        let mut claim = redis::pipe();
        for (_, _, key) in &batch {
            claim
                .cmd("SET")
                .arg(key)
                .arg("1")
                .arg("NX")
                .arg("PX")
                .arg(30_000);
        }
        let claimed: Vec<Option<String>> = claim.query_async(&mut redis).await.expect("SET NX");
        let mut finish = redis::pipe();
        let mut finished = 0;
        for ((_, _, key), claimed) in batch.iter().zip(&claimed) {
            if claimed.is_some() {
                // The no-op handler would run here.
                finish
                    .cmd("SET")
                    .arg(key)
                    .arg("done")
                    .arg("EX")
                    .arg(RECORD_TTL.as_secs())
                    .ignore();
                finished += 1;
            }
        }
        if finished > 0 {
            let () = finish.query_async(&mut redis).await.expect("SET");
        }
        for (partition, offset, _) in &batch {
            next_offsets.insert(*partition, offset + 1);
        }
        seen += batch.len();
        if last_commit.elapsed() >= Duration::from_secs(1) {
            let mut tpl = TopicPartitionList::new();
            for (&partition, &offset) in &next_offsets {
                tpl.add_partition_offset(topic, partition, Offset::Offset(offset))
                    .expect("offset");
            }
            consumer.commit(&tpl, CommitMode::Async).expect("commit");
            last_commit = Instant::now();
        }
    }
    let first = first.unwrap_or(started);
    (records - 1) as f64 / first.elapsed().as_secs_f64()
}

/// Records per second of the runner with Redis, its keys under `prefix` (`memory`: with a
/// `MemoryStore`).
async fn runner(topic: &str, records: usize, partitions: usize, memory: bool, prefix: &str) -> f64 {
    let max_batch = env_or("IDEM_BENCH_MAX_BATCH", RunnerOptions::default().max_batch);
    let per_partition = env_or(
        "IDEM_BENCH_BATCHES_PER_PARTITION",
        RunnerOptions::default().max_batches_per_partition,
    );
    let limits = idem_core::Limits::default().with_max_batch(max_batch);
    let store = if memory {
        shared(idem_core::MemoryStore::with_options(
            Arc::new(idem_core::SystemClock),
            limits,
        ))
    } else {
        shared(
            redis_store_with(
                RedisConfig::default()
                    .with_prefix(prefix)
                    .with_limits(limits),
            )
            .await,
        )
    };
    let handler = |_msg: KafkaMessage, _ctx: HandlerContext| async { Ok::<_, HandlerError>(()) };
    let runner = KafkaRunner::builder(
        consumer_config(&unique("runner")),
        executor(
            store,
            ExecutorConfig::new("compare").with_retention(RECORD_TTL),
        ),
        handler,
    )
    .topic(topic)
    .options(
        RunnerOptions::default()
            .with_max_in_flight(partitions * per_partition)
            .with_max_batch(max_batch)
            .with_max_batches_per_partition(per_partition),
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
        if first.is_none() && stats.received() > 0 {
            first = Some(Instant::now());
        }
        assert!(started.elapsed() < LIMIT, "runner stalled: {stats:?}");
        assert!(!task.is_finished(), "the runner stopped: {:?}", task.await);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let rate = (records - 1) as f64 / first.unwrap_or(started).elapsed().as_secs_f64();
    let _ = tx.send(());
    task.await.expect("runner task").expect("runner");
    assert_eq!(stats.executed(), records as u64, "{stats:?}");
    rate
}

/// The median of `values` (the mean of the middle two for an even count).
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len().is_multiple_of(2) {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
    }
}

/// One partition count's figures: the raw consumer's, then per round the hand-written
/// consumer's, the runner's and the runner's over a `MemoryStore`.
struct Row {
    partitions: i32,
    raw: Figures,
    hand: Vec<Figures>,
    ours: Vec<Figures>,
    memory: Vec<Figures>,
}

/// The median of each figure of `figures`.
fn medians(figures: &[Figures]) -> Figures {
    let of = |f: fn(&Figures) -> f64| median(&figures.iter().map(f).collect::<Vec<_>>());
    Figures {
        rate: of(|f| f.rate),
        cpu: of(|f| f.cpu),
        server: of(|f| f.server),
    }
}

/// A table cell: the rate, then the µs each record cost this process and the server.
fn cell(f: Figures) -> String {
    format!("{:.0} ({:.1} / {:.1})", f.rate, f.cpu, f.server)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    let records = env_or("IDEM_BENCH_RECORDS", 100_000);
    let rounds = env_or("IDEM_BENCH_ROUNDS", 1).max(1);
    let partition_counts: Vec<i32> = std::env::var("IDEM_BENCH_PARTITIONS")
        .unwrap_or_else(|_| "1,3".to_owned())
        .split(',')
        .map(|p| {
            p.trim()
                .parse()
                .expect("IDEM_BENCH_PARTITIONS: partition counts")
        })
        .collect();
    let mut redis = redis_conn().await;
    let mut rows = Vec::new();
    for partitions in partition_counts {
        let topic = unique("compare");
        create_topic(&topic, partitions).await;
        let recs: Vec<Rec> = (0..records)
            .map(|i| {
                Rec::keyed(
                    i as i32 % partitions,
                    &format!("k{i}"),
                    format!("{{\"n\":{i}}}"),
                )
            })
            .collect();
        let t = Instant::now();
        produce(&topic, &recs).await;
        eprintln!(
            "produced {records} records on {partitions} partitions in {:?}",
            t.elapsed()
        );
        let raw_topic = topic.clone();
        let raw = measured(&mut redis, records, async move {
            tokio::task::spawn_blocking(move || raw(&raw_topic, records))
                .await
                .expect("raw consumer")
        })
        .await;
        eprintln!("  raw: {}", cell(raw));
        let mut row = Row {
            partitions,
            raw,
            hand: Vec::new(),
            ours: Vec::new(),
            memory: Vec::new(),
        };
        for round in 1..=rounds {
            let prefix = format!("{}:", unique("hand"));
            let hand = measured(&mut redis, records, hand_written(&topic, records, &prefix)).await;
            delete_prefix(&mut redis, &prefix).await;
            eprintln!("  round {round}: hand-written: {}", cell(hand));
            let prefix = format!("{}:", unique("idem-kafka-compare"));
            let ours = measured(
                &mut redis,
                records,
                runner(&topic, records, partitions as usize, false, &prefix),
            )
            .await;
            delete_prefix(&mut redis, &prefix).await;
            eprintln!("  round {round}: runner: {}", cell(ours));
            let memory = measured(
                &mut redis,
                records,
                runner(&topic, records, partitions as usize, true, ""),
            )
            .await;
            eprintln!("  round {round}: runner, memory: {}", cell(memory));
            row.hand.push(hand);
            row.ours.push(ours);
            row.memory.push(memory);
        }
        rows.push(row);
    }
    println!(
        "kafka_compare: {records} records, every key fresh, no-op handler, Redis store, {rounds} round(s)."
    );
    println!("Each cell: records/s (µs of CPU per record: this process / the Redis server).");
    println!(
        "| partitions | round | raw rdkafka, no store | hand-written SET NX + SET | runner | runner / hand-written | runner, MemoryStore |"
    );
    println!("|---|---|---|---|---|---|---|");
    for row in rows {
        let raw = cell(row.raw);
        let partitions = row.partitions;
        let mut lines: Vec<(String, Figures, Figures, Figures)> = row
            .hand
            .iter()
            .zip(&row.ours)
            .zip(&row.memory)
            .enumerate()
            .map(|(i, ((&hand, &ours), &memory))| ((i + 1).to_string(), hand, ours, memory))
            .collect();
        if rounds > 1 {
            lines.push((
                "median".to_owned(),
                medians(&row.hand),
                medians(&row.ours),
                medians(&row.memory),
            ));
        }
        for (round, hand, ours, memory) in lines {
            println!(
                "| {partitions} | {round} | {raw} | {} | {} | {:.2}x | {} |",
                cell(hand),
                cell(ours),
                ours.rate / hand.rate,
                cell(memory)
            );
        }
    }
}
