//! Requests per message and latency of acquire + complete on `DynamoStore`, at 1 and 16
//! concurrent tasks; then messages per second of the transactional path (acquire, then
//! `complete_with` carrying one `Put` of the effect: one `TransactWriteItems`) against the plain
//! path (acquire + `complete`, no effect) and the effect written outside the store (acquire,
//! `PutItem`, `complete`), in the same run, with the ratio.
//!
//! ```text
//! scripts/services.sh dynamo
//! cargo bench -p idem-dynamo --bench dynamo_bench
//! ```
//!
//! Environment: `IDEM_DYNAMO_ENDPOINT` (default `http://127.0.0.1:8000`), `IDEM_BENCH_MESSAGES`
//! (messages per run, default 2000). Run by `cargo test --benches` (without `--bench`) it does a
//! short smoke run of 32 messages. Without a server it prints one "skipped" line and exits
//! (it fails with `CI` set).
//!
//! DynamoDB Local's latency says nothing about DynamoDB on AWS (a JVM on SQLite on the same
//! machine versus a network round trip to a managed service); the request counts are the figures
//! that carry over, since DynamoDB's cost and latency are per request.

use std::time::{Duration, Instant};

use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Fingerprint, IdempotencyStore, Namespace,
    TransactionalStore,
};
use idem_dynamo::aws_sdk_dynamodb::primitives::Blob;
use idem_dynamo::aws_sdk_dynamodb::types::{AttributeValue, Put};
use idem_dynamo::{DynamoConfig, DynamoStore, DynamoWrites};

const RETENTION: Duration = Duration::from_secs(3600);

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

/// One run: `messages` fresh messages over `tasks` tasks, then one duplicate of each.
async fn run(store: &DynamoStore, tasks: usize, messages: usize) {
    let ns = Namespace::new(format!("bench-{}", uuid::Uuid::new_v4().simple())).unwrap();
    let per_task = messages.div_ceil(tasks);
    let payload = Bytes::from(vec![b'r'; 256]);

    store.requests().reset();
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let (store, ns, payload) = (store.clone(), ns.clone(), payload.clone());
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(per_task);
                for i in 0..per_task {
                    let key = ns.key(format!("msg-{t}-{i}")).unwrap();
                    let req = AcquireRequest::new(key, format!("bench-{t}"))
                        .with_fingerprint(Fingerprint::of(format!("{t}-{i}")));
                    let t0 = Instant::now();
                    let lease = match store.acquire(&req).await.expect("acquire") {
                        AcquireOutcome::Acquired { lease, .. } => lease,
                        other => panic!("fresh key should be acquired, got {other:?}"),
                    };
                    store
                        .complete(&lease, payload.clone(), RETENTION)
                        .await
                        .expect("complete");
                    latencies.push(t0.elapsed());
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(per_task * tasks);
    for handle in handles {
        latencies.extend(handle.await.expect("bench task"));
    }
    let elapsed = started.elapsed();
    let fresh_requests = store.requests().snapshot();
    let fresh_total = store.requests().total();
    latencies.sort();
    let n = latencies.len();

    // Duplicates: every message delivered once more.
    store.requests().reset();
    let mut dup_latencies = Vec::with_capacity(n);
    for t in 0..tasks {
        for i in 0..per_task {
            let key = ns.key(format!("msg-{t}-{i}")).unwrap();
            let req = AcquireRequest::new(key, "bench-dup")
                .with_fingerprint(Fingerprint::of(format!("{t}-{i}")));
            let t0 = Instant::now();
            match store.acquire(&req).await.expect("duplicate acquire") {
                AcquireOutcome::Replayed { .. } => {}
                other => panic!("duplicate should replay, got {other:?}"),
            }
            dup_latencies.push(t0.elapsed());
            if dup_latencies.len() >= n.min(500) {
                break;
            }
        }
        if dup_latencies.len() >= n.min(500) {
            break;
        }
    }
    let dup_total = store.requests().total();
    let dups = dup_latencies.len();
    dup_latencies.sort();

    println!(
        "concurrency {tasks:>2}: {n} messages in {elapsed:.2?} ({:.0} msg/s)",
        n as f64 / elapsed.as_secs_f64()
    );
    println!(
        "  acquire+complete latency: p50 {}  p95 {}  p99 {}  max {}",
        ms(percentile(&latencies, 50.0)),
        ms(percentile(&latencies, 95.0)),
        ms(percentile(&latencies, 99.0)),
        ms(percentile(&latencies, 100.0)),
    );
    println!(
        "  requests per fresh message: {:.3} {fresh_requests:?}",
        fresh_total as f64 / n as f64
    );
    println!(
        "  duplicate (sequential, {dups}): {:.3} requests each, p50 {}  p99 {}",
        dup_total as f64 / dups as f64,
        ms(percentile(&dup_latencies, 50.0)),
        ms(percentile(&dup_latencies, 99.0)),
    );
}

/// How a message's effect is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// acquire + complete, no effect.
    Plain,
    /// acquire + complete_with carrying the effect's Put.
    Transactional,
    /// acquire + PutItem of the effect + complete.
    Outside,
}

impl Path {
    fn name(self) -> &'static str {
        match self {
            Self::Plain => "plain (no effect)",
            Self::Transactional => "transactional",
            Self::Outside => "effect outside",
        }
    }
}

/// The effect of message `id`: one item in the effects table.
fn effect(table: &str, id: &str, token: u64) -> Put {
    Put::builder()
        .table_name(table)
        .item("pk", AttributeValue::S(id.to_owned()))
        .item("token", AttributeValue::N(token.to_string()))
        .item("payload", AttributeValue::B(Blob::new(vec![b'e'; 128])))
        .build()
        .expect("table and item are set")
}

/// `messages` fresh messages over `tasks` tasks on `path`: messages per second and requests
/// per message.
async fn throughput(
    store: &DynamoStore,
    effects: &str,
    path: Path,
    tasks: usize,
    messages: usize,
) -> (f64, f64) {
    let ns = Namespace::new(format!("cmp-{}", uuid::Uuid::new_v4().simple())).unwrap();
    let per_task = messages.div_ceil(tasks);
    let payload = Bytes::from(vec![b'r'; 256]);
    store.requests().reset();
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let (store, ns, payload) = (store.clone(), ns.clone(), payload.clone());
            let effects = effects.to_owned();
            tokio::spawn(async move {
                for i in 0..per_task {
                    let key = ns.key(format!("msg-{t}-{i}")).unwrap();
                    let id = key.to_string();
                    let req = AcquireRequest::new(key, format!("bench-{t}"));
                    let lease = match store.acquire(&req).await.expect("acquire") {
                        AcquireOutcome::Acquired { lease, .. } => lease,
                        other => panic!("fresh key should be acquired, got {other:?}"),
                    };
                    let put = || effect(&effects, &id, lease.token.get());
                    match path {
                        Path::Plain => store.complete(&lease, payload.clone(), RETENTION).await,
                        Path::Transactional => {
                            let writes = DynamoWrites::new().put(put());
                            store
                                .complete_with(&lease, payload.clone(), RETENTION, writes)
                                .await
                        }
                        Path::Outside => {
                            let put = put();
                            store
                                .client()
                                .put_item()
                                .table_name(&effects)
                                .set_item(Some(put.item))
                                .send()
                                .await
                                .expect("the effect's PutItem");
                            store.complete(&lease, payload.clone(), RETENTION).await
                        }
                    }
                    .expect("complete");
                }
            })
        })
        .collect();
    for handle in handles {
        handle.await.expect("bench task");
    }
    let elapsed = started.elapsed();
    let n = per_task * tasks;
    let requests = store.requests().total() as f64 / n as f64;
    (n as f64 / elapsed.as_secs_f64(), requests)
}

/// The three paths at `tasks` concurrent tasks, twice each, alternating (the better of the two
/// runs counts, so that a pause of the JVM does not decide the comparison).
async fn compare(store: &DynamoStore, effects: &str, tasks: usize, messages: usize) {
    let paths = [Path::Plain, Path::Transactional, Path::Outside];
    let mut best = [(0.0f64, 0.0f64); 3];
    for _ in 0..2 {
        for (i, path) in paths.iter().enumerate() {
            let (rate, requests) = throughput(store, effects, *path, tasks, messages).await;
            if rate > best[i].0 {
                best[i] = (rate, requests);
            }
        }
    }
    println!("concurrency {tasks:>2}, {messages} messages per path (best of 2):");
    for (path, (rate, requests)) in paths.iter().zip(best) {
        println!(
            "  {:<18} {rate:>7.0} msg/s  {requests:.2} requests per message",
            path.name()
        );
    }
    println!(
        "  transactional / plain: {:.2}   transactional / effect outside: {:.2}",
        best[1].0 / best[0].0,
        best[1].0 / best[2].0
    );
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let messages: usize = if full {
        std::env::var("IDEM_BENCH_MESSAGES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2000)
    } else {
        32
    };
    // Without a server: one "skipped" line and success outside CI, a failure in CI.
    let Some(endpoint) = idem_conformance::servers::endpoint(
        "dynamo (bench)",
        "IDEM_DYNAMO_ENDPOINT",
        "http://127.0.0.1:8000",
    ) else {
        return;
    };
    let table = format!("idem-bench-{}", uuid::Uuid::new_v4().simple());
    let store = DynamoStore::connect(
        DynamoConfig::new(&table)
            .with_endpoint_url(&endpoint)
            .with_region("us-east-1")
            .with_static_credentials("idembench", "idembench"),
    )
    .await
    .expect("store");
    if let Err(e) = store.create_table_if_missing().await {
        panic!(
            "DynamoDB at {endpoint} could not create the bench table: {e}. Start DynamoDB Local \
             with `scripts/services.sh dynamo` or set IDEM_DYNAMO_ENDPOINT."
        );
    }
    println!("idem-dynamo bench: {endpoint}, table {table}, {messages} messages per run");
    // Warm up connections and the JIT of DynamoDB Local.
    run(&store, 4, messages.min(200)).await;
    println!("(warm-up above)");
    for tasks in [1, 16] {
        run(&store, tasks, messages).await;
    }

    // The transactional path against the plain one, on a second table for the effects.
    let effects = format!("{table}-effects");
    DynamoStore::connect(
        DynamoConfig::new(&effects)
            .with_endpoint_url(&endpoint)
            .with_region("us-east-1")
            .with_static_credentials("idembench", "idembench"),
    )
    .await
    .expect("effects store")
    .create_table_if_missing()
    .await
    .expect("create the effects table");
    for tasks in [1, 16] {
        compare(&store, &effects, tasks, messages).await;
    }

    for table in [&table, &effects] {
        store
            .client()
            .delete_table()
            .table_name(table)
            .send()
            .await
            .expect("delete bench table");
    }
}
