//! `SqliteStore` beyond the conformance suite: statements per call, records surviving a
//! reopen, WAL mode, a locked database, a missing table, files and values that are not ours.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::db_path;
use idem_core::kit::storage_key;
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Error, IdempotencyKey, IdempotencyStore, Lease,
    ManualClock, Namespace,
};
use idem_sqlite::{SqliteOptions, SqliteStore, Synchronous};
use rusqlite::Connection;

const RETENTION: Duration = Duration::from_secs(3600);

fn key(id: &str) -> IdempotencyKey {
    Namespace::new("sqlite").unwrap().key(id).unwrap()
}

async fn acquired(store: &SqliteStore, id: &str, owner: &str) -> Lease {
    match store.acquire(&AcquireRequest::new(key(id), owner)).await {
        Ok(AcquireOutcome::Acquired { lease, .. }) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

#[tokio::test]
async fn statements_per_call() {
    let store = SqliteStore::open(db_path("statements")).await.unwrap();
    let count = || store.backend().statements();
    macro_rules! costs {
        ($op:expr) => {{
            let before = count();
            let out = $op;
            (out, count() - before)
        }};
    }
    let (lease, n) = costs!(acquired(&store, "k", "a").await);
    assert_eq!(n, 2, "acquire (fresh): SELECT + INSERT");
    let (_, n) = costs!(
        store
            .acquire(&AcquireRequest::new(key("k"), "b"))
            .await
            .unwrap()
    );
    assert_eq!(n, 1, "acquire (busy): SELECT");
    let (lease, n) = costs!(store.extend(&lease, Duration::from_secs(60)).await.unwrap());
    assert_eq!(n, 2, "extend: SELECT + UPDATE");
    let (_, n) = costs!(
        store
            .complete(&lease, Bytes::from_static(b"r"), RETENTION)
            .await
            .unwrap()
    );
    assert_eq!(n, 2, "complete: SELECT + UPDATE");
    let (_, n) = costs!(
        store
            .complete(&lease, Bytes::from_static(b"r"), RETENTION)
            .await
            .unwrap()
    );
    assert_eq!(n, 1, "complete (replayed): SELECT");
    let (out, n) = costs!(
        store
            .acquire(&AcquireRequest::new(key("k"), "b"))
            .await
            .unwrap()
    );
    assert!(matches!(out, AcquireOutcome::Replayed { .. }));
    assert_eq!(n, 1, "acquire (duplicate): SELECT");
    let (_, n) = costs!(store.get(&key("k")).await.unwrap());
    assert_eq!(n, 1, "get: SELECT");
}

#[tokio::test]
async fn records_survive_a_reopen() {
    let path = db_path("reopen");
    let store = SqliteStore::open(&path).await.unwrap();
    let lease = acquired(&store, "k", "a").await;
    store
        .complete(&lease, Bytes::from_static(b"receipt"), RETENTION)
        .await
        .unwrap();
    let busy = acquired(&store, "busy", "a").await;
    drop(store);
    let store = SqliteStore::open(&path).await.unwrap();
    assert_eq!(
        store
            .acquire(&AcquireRequest::new(key("k"), "b"))
            .await
            .unwrap(),
        AcquireOutcome::Replayed {
            result: Bytes::from_static(b"receipt")
        }
    );
    let record = store.get(&key("busy")).await.unwrap().expect("kept");
    assert_eq!(record.token, busy.token);
}

#[tokio::test]
async fn the_database_is_in_wal_mode_with_the_durability_asked_for() {
    let path = db_path("wal");
    let _store = SqliteStore::open(&path).await.unwrap();
    let conn = Connection::open(&path).unwrap();
    let mode: String = conn
        .pragma_query_value(None, "journal_mode", |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    let _normal = SqliteStore::open_with(
        db_path("normal"),
        SqliteOptions::default().with_synchronous(Synchronous::Normal),
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_held_past_the_busy_timeout_is_unavailable_and_duplicates_still_answer() {
    let path = db_path("locked");
    let timeout = Duration::from_millis(300);
    let store = SqliteStore::open_with(&path, SqliteOptions::default().with_busy_timeout(timeout))
        .await
        .unwrap();
    let lease = acquired(&store, "done", "a").await;
    store
        .complete(&lease, Bytes::from_static(b"r"), RETENTION)
        .await
        .unwrap();

    // Another process holds the write lock.
    let other = Connection::open(&path).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();

    let started = Instant::now();
    let r = store.acquire(&AcquireRequest::new(key("fresh"), "a")).await;
    let waited = started.elapsed();
    assert!(
        matches!(
            r,
            Err(Error::Unavailable {
                store: "sqlite",
                ..
            })
        ),
        "{r:?}"
    );
    assert!(waited >= timeout, "waited the busy timeout, got {waited:?}");
    // Write once, then one reload and one more write (`max_ambiguous` 1), each bounded.
    assert!(
        waited < timeout * 2 + Duration::from_secs(2),
        "bounded: {waited:?}"
    );
    // A duplicate needs no write: WAL readers are not blocked.
    assert!(matches!(
        store.acquire(&AcquireRequest::new(key("done"), "b")).await,
        Ok(AcquireOutcome::Replayed { .. })
    ));
    other.execute_batch("ROLLBACK").unwrap();
    acquired(&store, "fresh", "a").await;
}

#[tokio::test]
async fn a_missing_table_is_not_set_up() {
    let path = db_path("bare");
    Connection::open(&path).unwrap();
    let r = SqliteStore::open_with(&path, SqliteOptions::default().with_create(false)).await;
    match r {
        Err(
            e @ Error::NotSetUp {
                store: "sqlite", ..
            },
        ) => {
            let text = e.to_string();
            assert!(
                text.contains("idem_records") && text.contains("CREATE TABLE"),
                "{text}"
            );
        }
        other => panic!("expected NotSetUp, got {other:?}"),
    }
    // Created by a default open, then found without create.
    SqliteStore::open(&path).await.unwrap();
    let store = SqliteStore::open_with(&path, SqliteOptions::default().with_create(false))
        .await
        .unwrap();
    acquired(&store, "k", "a").await;
    // Dropped under a running store.
    Connection::open(&path)
        .unwrap()
        .execute_batch("DROP TABLE idem_records")
        .unwrap();
    let r = store.get(&key("k")).await;
    assert!(matches!(r, Err(Error::NotSetUp { .. })), "{r:?}");
}

#[tokio::test]
async fn files_and_values_that_are_not_ours_are_refused() {
    let path = db_path("garbage");
    std::fs::write(&path, vec![0x5a; 8192]).unwrap();
    let r = SqliteStore::open(&path).await;
    assert!(
        matches!(
            r,
            Err(Error::Backend {
                store: "sqlite",
                ..
            })
        ),
        "{r:?}"
    );

    let r = SqliteStore::open(db_path("x").join("in-a-missing-dir.db")).await;
    assert!(
        matches!(
            r,
            Err(Error::Unavailable {
                store: "sqlite",
                ..
            })
        ),
        "{r:?}"
    );
    let r = SqliteStore::open_with(
        db_path("absent"),
        SqliteOptions::default().with_create(false),
    )
    .await;
    assert!(
        matches!(
            r,
            Err(Error::Unavailable {
                store: "sqlite",
                ..
            })
        ),
        "{r:?}"
    );

    let path = db_path("foreign");
    let store = SqliteStore::open(&path).await.unwrap();
    Connection::open(&path)
        .unwrap()
        .execute(
            "INSERT INTO idem_records (key, version, value) VALUES (?1, 1, ?2)",
            rusqlite::params![storage_key(&key("foreign")), b"not a record".to_vec()],
        )
        .unwrap();
    let r = store
        .acquire(&AcquireRequest::new(key("foreign"), "a"))
        .await;
    assert!(
        matches!(
            r,
            Err(Error::CorruptRecord {
                store: "sqlite",
                ..
            })
        ),
        "{r:?}"
    );
}

#[tokio::test]
async fn purge_turns_expired_records_into_tombstones() {
    let clock = Arc::new(ManualClock::default());
    let store = SqliteStore::open_with(
        db_path("purge"),
        SqliteOptions::default().with_clock(clock.clone()),
    )
    .await
    .unwrap();
    let mut leases = Vec::new();
    for i in 0..300 {
        let lease = acquired(&store, &format!("k{i:03}"), "a").await;
        store
            .complete(&lease, Bytes::from_static(b"r"), Duration::from_secs(1))
            .await
            .unwrap();
        leases.push(lease);
    }
    acquired(&store, "live", "a").await;
    clock.advance(Duration::from_secs(2));
    assert_eq!(store.purge_expired(1000).await.unwrap(), 300);
    assert_eq!(store.purge_expired(1000).await.unwrap(), 0);
    let b = acquired(&store, "k000", "b").await;
    assert!(b.token > leases[0].token);
    assert!(store.get(&key("live")).await.unwrap().is_some());
}
