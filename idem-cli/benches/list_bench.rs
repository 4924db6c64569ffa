//! Lists 100,000 records on every store and prints the time: `MemoryStore`, SQLite, Redis, a
//! Redis Cluster, PostgreSQL and DynamoDB Local.
//!
//! `cargo bench -p idem-cli --bench list_bench` (`IDEM_LIST_BENCH_RECORDS` to change the count,
//! `IDEM_LIST_BENCH_STORES=redis,postgres` to measure only some stores).
//! Each store gets a namespace (and key prefix, schema or table) of its own, filled through the
//! library in batches by 16 tasks at once (4 on DynamoDB Local) (completed records, 4 minutes of retention), then listed in pages of
//! `MAX_PAGE` records, every status, and once more for one state among many (the 100 terminal
//! failures among them). A store whose server does not answer is skipped with one line (see
//! `scripts/services.sh`). Afterwards the PostgreSQL schema and the DynamoDB table are dropped;
//! Redis records expire by themselves after their retention.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_conformance::servers;
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Completion, DynStore, FailureKind, IdempotencyStore,
    ListQuery, MAX_PAGE, MemoryStore, Namespace, Status,
};
use idem_dynamo::{DynamoConfig, DynamoStore};
use idem_postgres::{PostgresConfig, PostgresStore};
use idem_redis::{RedisConfig, RedisStore};
use idem_sqlite::{SqliteOptions, SqliteStore, Synchronous};

/// Long enough for a slow fill and listing; short, so that the Redis records leave the shared
/// servers (whose `SCAN`s they lengthen) soon after.
const RETENTION: Duration = Duration::from_secs(240);
/// Records failed terminally among the completed ones: the "one state among many".
const TERMINAL: usize = 100;

fn records() -> usize {
    std::env::var("IDEM_LIST_BENCH_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000)
}

/// Fills `ns` with `count` records: all completed, but the last [`TERMINAL`] failed terminally.
/// `tasks` tasks write batches at once.
async fn fill(store: &DynStore, ns: &Namespace, count: usize, tasks: usize) {
    assert!(tasks > 0, "at least one fill task");
    let (tasks_n, mut tasks) = (tasks, tokio::task::JoinSet::new());
    let batch = store.limits().max_batch.min(100);
    let chunks: Vec<std::ops::Range<usize>> = (0..count)
        .step_by(batch)
        .map(|start| start..(start + batch).min(count))
        .collect();
    let chunks = Arc::new(chunks);
    for task in 0..tasks_n {
        let (store, ns, chunks) = (store.clone(), ns.clone(), chunks.clone());
        tasks.spawn(async move {
            for chunk in chunks.iter().skip(task).step_by(tasks_n) {
                fill_chunk(&store, &ns, chunk.clone(), count).await;
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("a fill task panicked");
    }
}

async fn fill_chunk(store: &DynStore, ns: &Namespace, chunk: std::ops::Range<usize>, count: usize) {
    let reqs: Vec<AcquireRequest> = chunk
        .clone()
        .map(|i| AcquireRequest::new(ns.key(format!("order-{i:07}")).unwrap(), "bench-worker"))
        .collect();
    let outcomes = store.acquire_many(&reqs).await.expect("acquire_many");
    let mut done = Vec::new();
    for (outcome, index) in outcomes.into_iter().zip(chunk) {
        let AcquireOutcome::Acquired { lease, .. } = outcome.expect("acquire") else {
            panic!("{index}: not acquired");
        };
        if index + TERMINAL >= count {
            store
                .fail(&lease, "declined", FailureKind::Terminal, RETENTION)
                .await
                .expect("fail");
        } else {
            done.push(Completion::new(lease, Bytes::from_static(b"ok")));
        }
    }
    for result in store
        .complete_many(&done, RETENTION)
        .await
        .expect("complete_many")
    {
        result.expect("complete");
    }
}

/// Lists every page of `query`: the records and pages seen, and the time it took.
async fn list_all(store: &DynStore, query: ListQuery) -> (usize, usize, Duration) {
    let started = Instant::now();
    let mut query = query;
    let (mut records, mut pages) = (0, 0);
    loop {
        let page = store.list(&query).await.expect("list");
        records += page.records.len();
        pages += 1;
        match page.next {
            None => break,
            next => query = query.with_cursor(next),
        }
    }
    (records, pages, started.elapsed())
}

/// Whether the store named `name` is to be measured: all of them, or those named in
/// `IDEM_LIST_BENCH_STORES` (comma-separated: memory, sqlite, redis, redis-cluster, postgres,
/// dynamodb-local).
fn wanted(name: &str) -> bool {
    std::env::var("IDEM_LIST_BENCH_STORES")
        .map(|list| list.split(',').any(|s| s.trim() == name))
        .unwrap_or(true)
}

async fn bench(name: &str, store: DynStore, count: usize, tasks: usize) {
    let ns = Namespace::new(format!("bench-{}", uuid::Uuid::new_v4().simple())).unwrap();
    let started = Instant::now();
    fill(&store, &ns, count, tasks).await;
    let filled = started.elapsed();
    let (all, pages, took) =
        list_all(&store, ListQuery::new(ns.clone()).with_limit(MAX_PAGE)).await;
    assert_eq!(all, count, "{name}: every record listed once");
    let (terminal, _, took_terminal) = list_all(
        &store,
        ListQuery::new(ns)
            .with_statuses([Status::FailedTerminal])
            .with_limit(MAX_PAGE),
    )
    .await;
    assert_eq!(terminal, TERMINAL, "{name}: the terminal failures");
    println!(
        "{name:<14} filled {count} in {:>8.2?}; listed all {all} in {pages:>4} pages in \
         {took:>9.2?} ({:>9.0} records/s); the {terminal} terminal failures in {took_terminal:>9.2?}",
        filled,
        all as f64 / took.as_secs_f64(),
    );
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let count = records();
        println!("listing {count} records per store (pages of {MAX_PAGE})");

        if wanted("memory") {
            bench("memory", Arc::new(MemoryStore::new()), count, 16).await;
        }

        let dir = tempfile::tempdir().unwrap();
        let options = SqliteOptions::default().with_synchronous(Synchronous::Normal);
        let sqlite = SqliteStore::open_with(dir.path().join("bench.db"), options)
            .await
            .unwrap();
        if wanted("sqlite") {
            bench("sqlite", Arc::new(sqlite), count, 16).await;
        }

        let prefix = format!("idem-bench-{}:", uuid::Uuid::new_v4().simple());
        if let Some(url) = servers::endpoint("redis", "IDEM_REDIS_URL", "redis://127.0.0.1:6379")
            && wanted("redis")
        {
            let config = RedisConfig::default().with_prefix(prefix.clone());
            let store = RedisStore::connect_with(&url, config).await.unwrap();
            bench("redis", Arc::new(store), count, 16).await;
        }
        if let Some(nodes) = servers::endpoint(
            "redis-cluster",
            "IDEM_REDIS_CLUSTER_NODES",
            "redis://127.0.0.1:7001,redis://127.0.0.1:7002,redis://127.0.0.1:7003",
        ) && wanted("redis-cluster")
        {
            let config = RedisConfig::default().with_prefix(prefix.clone());
            let store = RedisStore::connect_cluster_with(nodes.split(','), config)
                .await
                .unwrap();
            bench("redis-cluster", Arc::new(store), count, 16).await;
        }
        if let Some(url) = servers::endpoint(
            "postgres",
            "IDEM_POSTGRES_URL",
            "postgres://postgres@127.0.0.1:5432/test",
        ) && wanted("postgres")
        {
            let schema = format!("idem_bench_{}", uuid::Uuid::new_v4().simple());
            let config = PostgresConfig::new(&url)
                .unwrap()
                .with_schema(&schema)
                .with_pool_size(16);
            let store = PostgresStore::connect(config).await.unwrap();
            store.migrate().await.unwrap();
            bench("postgres", Arc::new(store.clone()), count, 16).await;
            let client = store.pool().get().await.unwrap();
            client
                .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
                .await
                .unwrap();
        }
        if let Some(endpoint) =
            servers::endpoint("dynamo", "IDEM_DYNAMO_ENDPOINT", "http://127.0.0.1:8000")
            && wanted("dynamodb-local")
        {
            let table = format!("idem-bench-{}", uuid::Uuid::new_v4().simple());
            let config = DynamoConfig::new(&table)
                .with_endpoint_url(endpoint)
                .with_region("us-east-1")
                .with_static_credentials("idemtest", "idemtest")
                // DynamoDB Local on a busy machine answers slowly under load.
                .with_attempt_timeout(Duration::from_secs(20))
                .with_operation_timeout(Duration::from_secs(60));
            let store = DynamoStore::connect(config).await.unwrap();
            store.create_table_if_missing().await.unwrap();
            bench("dynamodb-local", Arc::new(store.clone()), count, 4).await;
            store
                .client()
                .delete_table()
                .table_name(&table)
                .send()
                .await
                .unwrap();
        }
    });
}
