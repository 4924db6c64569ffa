//! Store-level throughput of batches against single calls, on Redis, Redis Cluster and
//! PostgreSQL, in one run.
//!
//! ```text
//! cargo bench -p idem --features redis,postgres --bench batch_bench
//! ```
//!
//! For each store, 64 concurrent tasks (`IDEM_BENCH_TASKS`) process fresh keys (a fingerprint, a 2-byte result):
//!
//! - unbatched: each task loops `acquire` then `complete`, one message at a time;
//! - batched: each task loops `acquire_many` of 100 keys then `complete_many` of the 100 leases.
//!
//! and prints messages per second of each and their ratio. On the cluster it runs the batched
//! loop twice: with ids spread over the slots (one script call per slot, so about one per key,
//! sent concurrently) and with the ids of each batch under one hash tag (one call per batch).
//! Prints figures only; asserts nothing.
//!
//! Servers: `IDEM_REDIS_URL` (default `redis://127.0.0.1:6379`), `IDEM_REDIS_CLUSTER_NODES`
//! (default the three nodes `127.0.0.1:7001-7003`), `IDEM_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`; the bench migrates a schema of its own and drops
//! it at the end). A store that cannot be reached is reported and skipped.
//! `IDEM_BENCH_SECONDS` (default 3): the length of each measurement. `IDEM_BENCH_STORES`
//! (default all): a comma-separated choice of `redis`, `redis-cluster`, `postgres`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem::postgres::{PostgresConfig, PostgresStore};
use idem::redis::{RedisConfig, RedisStore};
use idem::{
    AcquireOutcome, AcquireRequest, Bytes, Completion, DynStore, Fingerprint, IdempotencyStore,
    Namespace,
};

/// Concurrent tasks (`IDEM_BENCH_TASKS`, default 64).
fn tasks() -> usize {
    std::env::var("IDEM_BENCH_TASKS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64)
}
const BATCH: usize = 100;
const RETENTION: Duration = Duration::from_secs(600);

fn seconds() -> Duration {
    let s = std::env::var("IDEM_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    Duration::from_secs_f64(s)
}

fn request(ns: &Namespace, id: String, owner: &str) -> AcquireRequest {
    AcquireRequest::new(ns.key(id).expect("a valid id"), owner)
        .with_fingerprint(Fingerprint::of("payload"))
}

/// How ids are made for one batch of task `task`, batch number `n`.
#[derive(Clone, Copy)]
enum Ids {
    /// `t{task}-{n}-{i}`: spread over the cluster's slots.
    Spread,
    /// `{t{task}-{n}}:{i}`: one hash tag per batch.
    Tagged,
}

impl Ids {
    fn id(self, task: usize, n: u64, i: usize) -> String {
        match self {
            Self::Spread => format!("t{task}-{n}-{i}"),
            Self::Tagged => format!("{{t{task}-{n}}}:{i}"),
        }
    }
}

/// Messages per second of [`tasks`] tasks, each looping single acquires and completions.
async fn unbatched(store: &DynStore, ns: &Namespace) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + seconds();
    let start = Instant::now();
    let tasks: Vec<_> = (0..tasks())
        .map(|task| {
            let (store, ns, done) = (store.clone(), ns.clone(), done.clone());
            tokio::spawn(async move {
                let owner = format!("bench-{task}");
                let mut n = 0u64;
                while Instant::now() < until {
                    n += 1;
                    let req = request(&ns, format!("u{task}-{n}"), &owner);
                    match store.acquire(&req).await.expect("acquire") {
                        AcquireOutcome::Acquired { lease, .. } => {
                            store
                                .complete(&lease, Bytes::from_static(b"ok"), RETENTION)
                                .await
                                .expect("complete");
                        }
                        other => panic!("a fresh key must be acquired, got {other:?}"),
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// Messages per second of [`tasks`] tasks, each looping `acquire_many` and `complete_many` of
/// `BATCH` keys.
async fn batched(store: &DynStore, ns: &Namespace, ids: Ids) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + seconds();
    let start = Instant::now();
    let tasks: Vec<_> = (0..tasks())
        .map(|task| {
            let (store, ns, done) = (store.clone(), ns.clone(), done.clone());
            tokio::spawn(async move {
                let owner = format!("bench-{task}");
                let mut n = 0u64;
                while Instant::now() < until {
                    n += 1;
                    let reqs: Vec<_> = (0..BATCH)
                        .map(|i| request(&ns, ids.id(task, n, i), &owner))
                        .collect();
                    let outcomes = store.acquire_many(&reqs).await.expect("acquire_many");
                    let completions: Vec<_> = outcomes
                        .into_iter()
                        .map(|o| match o {
                            Ok(AcquireOutcome::Acquired { lease, .. }) => {
                                Completion::new(lease, Bytes::from_static(b"ok"))
                            }
                            other => panic!("a fresh key must be acquired, got {other:?}"),
                        })
                        .collect();
                    let results = store
                        .complete_many(&completions, RETENTION)
                        .await
                        .expect("complete_many");
                    for r in results {
                        r.expect("complete");
                    }
                    done.fetch_add(BATCH as u64, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

fn row(store: &str, mode: &str, rate: f64, base: f64) {
    println!(
        "| {store:<14} | {mode:<44} | {rate:>12.0} | {:>6.1}x |",
        rate / base
    );
}

/// Measures `store`; returns the namespace it wrote in.
async fn measure(name: &str, store: DynStore, tagged_too: bool) -> Namespace {
    let ns = Namespace::new(format!("bench-{:08x}", rand_u32())).expect("namespace");
    let single = unbatched(&store, &ns).await;
    row(
        name,
        "unbatched: acquire + complete, 64 tasks",
        single,
        single,
    );
    let spread = batched(&store, &ns, Ids::Spread).await;
    row(
        name,
        "batches of 100: acquire_many + complete_many",
        spread,
        single,
    );
    if tagged_too {
        let tagged = batched(&store, &ns, Ids::Tagged).await;
        row(
            name,
            "batches of 100, one hash tag per batch",
            tagged,
            single,
        );
    }
    ns
}

/// Removes what the bench wrote in a Redis store (a listing on the same server, such as the
/// conformance suite's, would otherwise scan it until it expires).
async fn clean(name: &str, store: &RedisStore, ns: &Namespace) {
    match store.drop_namespace(ns).await {
        Ok(n) => println!("{name}: removed the bench's {n} records"),
        Err(e) => println!(
            "{name}: could not remove the bench's records ({e}); they expire after {}s",
            RETENTION.as_secs()
        ),
    }
}

fn rand_u32() -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    t.subsec_nanos() ^ (t.as_secs() as u32).rotate_left(13) ^ std::process::id()
}

fn env_or(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        println!(
            "store-level messages/s, {} tasks, fresh keys, {:?} per measurement",
            tasks(),
            seconds()
        );
        println!(
            "| {:<14} | {:<44} | {:>12} | {:>7} |",
            "store", "mode", "messages/s", "vs 1x1"
        );
        println!("|{:-<16}|{:-<46}|{:-<14}|{:-<9}|", "", "", "", "");

        let only = std::env::var("IDEM_BENCH_STORES").ok();
        let wanted = |name: &str| {
            only.as_deref()
                .is_none_or(|o| o.split(',').any(|s| s.trim() == name))
        };
        let prefix = format!("idem-bench-{:08x}:", rand_u32());
        let url = env_or("IDEM_REDIS_URL", "redis://127.0.0.1:6379");
        if wanted("redis") {
            match RedisStore::connect_with(&url, RedisConfig::default().with_prefix(&prefix)).await
            {
                Ok(store) => {
                    let ns = measure("redis", Arc::new(store.clone()), false).await;
                    clean("redis", &store, &ns).await;
                }
                Err(e) => println!("| redis          | skipped: {e}"),
            }
        }
        let nodes: Vec<String> = env_or(
            "IDEM_REDIS_CLUSTER_NODES",
            "redis://127.0.0.1:7001,redis://127.0.0.1:7002,redis://127.0.0.1:7003",
        )
        .split(',')
        .map(str::to_owned)
        .collect();
        if wanted("redis-cluster") {
            let config = RedisConfig::default().with_prefix(&prefix);
            match RedisStore::connect_cluster_with(&nodes, config).await {
                Ok(store) => {
                    let ns = measure("redis-cluster", Arc::new(store.clone()), true).await;
                    clean("redis-cluster", &store, &ns).await;
                }
                Err(e) => println!("| redis-cluster  | skipped: {e}"),
            }
        }
        let pg_url = env_or(
            "IDEM_POSTGRES_URL",
            "postgres://postgres@127.0.0.1:5432/test",
        );
        let schema = format!("idem_bench_{:08x}", rand_u32());
        if wanted("postgres") {
            match postgres(&pg_url, &schema).await {
                Ok(store) => {
                    let _ = measure("postgres", Arc::new(store.clone()), false).await;
                    drop_schema(&store, &schema).await;
                }
                Err(e) => println!("| postgres       | skipped: {e}"),
            }
        }
    });
}

async fn postgres(url: &str, schema: &str) -> idem_core::Result<PostgresStore> {
    let config = PostgresConfig::new(url)?.with_schema(schema);
    let store = PostgresStore::connect(config).await?;
    store.migrate().await?;
    Ok(store)
}

async fn drop_schema(store: &PostgresStore, schema: &str) {
    match store.pool().get().await {
        Ok(client) => {
            if let Err(e) = client
                .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
                .await
            {
                println!("could not drop the bench schema {schema}: {e}");
            }
        }
        Err(e) => println!("could not drop the bench schema {schema}: {e}"),
    }
}
