//! Requests per message and latency of acquire + complete on `DynamoStore`, at 1 and 16
//! concurrent tasks.
//!
//! ```text
//! scripts/services.sh dynamo
//! cargo bench -p idem-dynamo --bench dynamo_bench
//! ```
//!
//! Environment: `IDEM_DYNAMO_ENDPOINT` (default `http://127.0.0.1:8000`), `IDEM_BENCH_MESSAGES`
//! (messages per run, default 2000). Run by `cargo test --benches` (without `--bench`) it does a
//! short smoke run of 32 messages.
//!
//! DynamoDB Local's latency says nothing about DynamoDB on AWS (a JVM on SQLite on the same
//! machine versus a network round trip to a managed service); the request counts are the figures
//! that carry over, since DynamoDB's cost and latency are per request.

use std::time::{Duration, Instant};

use idem_core::{AcquireOutcome, AcquireRequest, Bytes, Fingerprint, IdempotencyStore, Namespace};
use idem_dynamo::{DynamoConfig, DynamoStore};

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
    let endpoint = std::env::var("IDEM_DYNAMO_ENDPOINT")
        .unwrap_or_else(|_| "http://127.0.0.1:8000".to_owned());
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
    store
        .client()
        .delete_table()
        .table_name(&table)
        .send()
        .await
        .expect("delete bench table");
}
