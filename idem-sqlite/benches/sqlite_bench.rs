//! Acquire + complete on `SqliteStore`, against raw rusqlite running the same statements, in
//! the same run, at 1 and 16 concurrent tasks, for both durability settings and both ways of
//! keeping statements off the async scheduling.
//!
//! `cargo bench -p idem-sqlite --bench sqlite_bench` (`IDEM_SQLITE_BENCH_MESSAGES`: messages per
//! run, 4000 by default; `IDEM_SQLITE_BENCH_ROUNDS`: interleaved rounds, best of each variant
//! printed, 3 by default).
//!
//! Per message both do what the kit does for a fresh key: `SELECT` (acquire's load), `INSERT`
//! (acquire's write), `SELECT` (complete's load), `UPDATE` (complete's write). The raw baseline
//! is the same shape as the store, without the store: each thread has its own read connection,
//! writes go through one shared connection behind a mutex, prepared statements are cached, the
//! values written are blobs of the size of the kit's records, and everything runs on plain
//! threads (no async runtime, no thread hop per statement, no encoding, no state machine).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_core::{AcquireOutcome, AcquireRequest, Bytes, IdempotencyStore, Namespace};
use idem_sqlite::{Offload, SqliteOptions, SqliteStore, Synchronous};
use rusqlite::{Connection, OptionalExtension, params};

fn messages() -> usize {
    std::env::var("IDEM_SQLITE_BENCH_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4000)
}

fn rounds() -> usize {
    std::env::var("IDEM_SQLITE_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
}

struct Dir(PathBuf);

impl Dir {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("idem-sqlite-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
    fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn store_run(
    path: &Path,
    sync: Synchronous,
    offload: Offload,
    tasks: usize,
    total: usize,
) -> f64 {
    let options = SqliteOptions::default()
        .with_synchronous(sync)
        .with_offload(offload);
    let store = SqliteStore::open_with(path, options).await.unwrap();
    let ns = Namespace::new("bench").unwrap();
    let per_task = total / tasks;
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let (store, ns) = (store.clone(), ns.clone());
            tokio::spawn(async move {
                for i in 0..per_task {
                    let key = ns.key(format!("t{t}-m{i}")).unwrap();
                    let req = AcquireRequest::new(key, "bench-worker");
                    let AcquireOutcome::Acquired { lease, .. } = store.acquire(&req).await.unwrap()
                    else {
                        panic!("fresh keys are acquired");
                    };
                    store
                        .complete(&lease, Bytes::from_static(b"ok"), Duration::from_secs(3600))
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.await.unwrap();
    }
    (per_task * tasks) as f64 / started.elapsed().as_secs_f64()
}

fn connect(path: &Path, sync: Synchronous) -> Connection {
    let conn = Connection::open(path).unwrap();
    conn.busy_timeout(Duration::from_secs(5)).unwrap();
    conn.pragma_update(None, "journal_mode", "WAL").unwrap();
    let sync = match sync {
        Synchronous::Normal => "NORMAL",
        _ => "FULL",
    };
    conn.pragma_update(None, "synchronous", sync).unwrap();
    conn
}

fn raw_run(path: &Path, sync: Synchronous, threads: usize, total: usize) -> f64 {
    let writer = connect(path, sync);
    writer.execute_batch(idem_sqlite::CREATE_TABLE).unwrap();
    let writer = Arc::new(Mutex::new(writer));
    let per_thread = total / threads;
    // The sizes of the kit's values: an in-progress record, then a completed one.
    let (acquired, completed) = (vec![7u8; 48], vec![9u8; 56]);
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (writer, acquired, completed) = (writer.clone(), &acquired, &completed);
            s.spawn(move || {
                let reader = connect(path, sync);
                let load = |key: &[u8]| -> Option<(Vec<u8>, i64)> {
                    reader
                        .prepare_cached("SELECT value, version FROM idem_records WHERE key = ?1")
                        .unwrap()
                        .query_row([key], |r| Ok((r.get(0)?, r.get(1)?)))
                        .optional()
                        .unwrap()
                };
                for i in 0..per_thread {
                    let key = format!("bench:t{t}-m{i}").into_bytes();
                    assert!(load(&key).is_none());
                    let inserted = writer
                        .lock()
                        .unwrap()
                        .prepare_cached(
                            "INSERT INTO idem_records (key, version, value) \
                             VALUES (?1, random() / 4, ?2) ON CONFLICT (key) DO NOTHING",
                        )
                        .unwrap()
                        .execute(params![key, acquired])
                        .unwrap();
                    assert_eq!(inserted, 1);
                    let (_, version) = load(&key).unwrap();
                    let updated = writer
                        .lock()
                        .unwrap()
                        .prepare_cached(
                            "UPDATE idem_records SET value = ?2, version = version + 1 \
                             WHERE key = ?1 AND version = ?3",
                        )
                        .unwrap()
                        .execute(params![key, completed, version])
                        .unwrap();
                    assert_eq!(updated, 1);
                }
            });
        }
    });
    (per_thread * threads) as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    let total = messages();
    let dir = Dir::new();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    println!(
        "sqlite_bench: {total} messages per run (acquire + complete of a fresh key), best of {} \
         interleaved rounds, {} cores",
        rounds(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "{:<7} {:>5} {:>11} {:>11} {:>11} {:>6} {:>6}",
        "sync", "tasks", "store", "store/pool", "raw", "ratio", "pool"
    );
    for sync in [Synchronous::Normal, Synchronous::Full] {
        for tasks in [1, 16] {
            let name = format!("{sync:?}-{tasks}").to_lowercase();
            let file = |what: &str| dir.file(&format!("{what}-{name}.db"));
            // Interleaved rounds, best of each: the machine's other load hits every variant.
            let (mut store, mut pool, mut raw) = (0f64, 0f64, 0f64);
            for round in 0..rounds() {
                let file = |what: &str| file(&format!("{what}-{round}"));
                raw = raw.max(raw_run(&file("raw"), sync, tasks, total));
                store = store.max(rt.block_on(store_run(
                    &file("store"),
                    sync,
                    Offload::InPlace,
                    tasks,
                    total,
                )));
                pool = pool.max(rt.block_on(store_run(
                    &file("pool"),
                    sync,
                    Offload::BlockingPool,
                    tasks,
                    total,
                )));
            }
            println!(
                "{:<7} {:>5} {:>11.0} {:>11.0} {:>11.0} {:>6.2} {:>6.2}",
                format!("{sync:?}"),
                tasks,
                store,
                pool,
                raw,
                store / raw,
                pool / raw
            );
        }
    }
    println!(
        "messages/s; store: the default (Offload::InPlace), store/pool: Offload::BlockingPool; \
         ratio = store / raw, pool = store/pool / raw (target: ratio >= 0.8)"
    );
}
