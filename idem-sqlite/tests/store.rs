//! `SqliteStore` beyond the conformance suite: statements per call, records surviving a
//! reopen, WAL mode, a locked database, writes queued behind a lock, a missing table, a table of
//! another shape, files and values that are not ours,
//! whether opening created the table, a cursor only when a record follows, one new file opened
//! by several connections at once, paths that name no file all connections share.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::db_path;
use idem_core::kit::storage_key;
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Error, IdempotencyKey, IdempotencyStore, Lease,
    ListQuery, ManualClock, Namespace,
};
use idem_sqlite::{Offload, SqliteOptions, SqliteStore, Synchronous};
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

/// Connections opening one new file at once all open it: the one switching it to WAL makes the
/// others' switch answer "database is locked" at once (no busy handler), which is waited out.
/// Before, about 1 open in 140 failed here.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_opening_one_new_file_at_once_all_open_it() {
    let mut failures = Vec::new();
    for round in 0..150 {
        let path = db_path("opened-at-once");
        let opens: Vec<_> = (0..6)
            .map(|_| {
                let path = path.clone();
                tokio::spawn(async move { SqliteStore::open(&path).await.map(drop) })
            })
            .collect();
        for open in opens {
            if let Err(e) = open.await.unwrap() {
                failures.push(format!("round {round}: {e}"));
            }
        }
    }
    assert_eq!(failures, Vec::<String>::new());
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_queued_behind_a_held_lock_each_give_up_within_the_busy_timeout() {
    let path = db_path("queued");
    let timeout = Duration::from_millis(300);
    let store = SqliteStore::open_with(&path, SqliteOptions::default().with_busy_timeout(timeout))
        .await
        .unwrap();
    let other = Connection::open(&path).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();

    // Sixteen writes at once, all behind the process's one write connection. Each used to
    // wait a full timeout in turn once it reached the connection (up to sixteen timeouts).
    let calls = (0..16).map(|i| {
        let store = store.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let r = store
                .acquire(&AcquireRequest::new(key(&format!("q{i}")), "a"))
                .await;
            (r, started.elapsed())
        })
    });
    let mut slowest = Duration::ZERO;
    for call in futures::future::join_all(calls).await {
        let (r, waited) = call.unwrap();
        assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
        slowest = slowest.max(waited);
    }
    // Each call: a write, a reload, one more write (`max_ambiguous` 1), the writes bounded
    // together with their time in the queue.
    assert!(
        slowest < timeout * 2 + Duration::from_secs(2),
        "every queued write gives up within about the timeout, the slowest took {slowest:?}"
    );
    other.execute_batch("ROLLBACK").unwrap();
    for i in 0..16 {
        acquired(&store, &format!("q{i}"), "a").await;
    }
}

/// What the docs of `Offload` say: in place, a statement blocks the task that makes the call, so
/// a `tokio::time::timeout` around the call cannot fire before the call ends (it then answers
/// the call's own result), and calls one task makes at once (`join_all`) run one after another;
/// on the blocking pool, the timeout fires on time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_place_a_timeout_cannot_cut_a_call_short_and_one_tasks_calls_run_in_turn() {
    let timeout = Duration::from_millis(100);
    for offload in [Offload::InPlace, Offload::BlockingPool] {
        let path = db_path("offload");
        let options = SqliteOptions::default()
            .with_busy_timeout(timeout)
            .with_offload(offload);
        let store = SqliteStore::open_with(&path, options).await.unwrap();
        let leases = [
            acquired(&store, "a", "w").await,
            acquired(&store, "b", "w").await,
        ];
        // Another process holds the write lock.
        let other = Connection::open(&path).unwrap();
        other.execute_batch("BEGIN IMMEDIATE").unwrap();

        let started = Instant::now();
        let r = tokio::time::timeout(Duration::from_millis(10), store.release(&leases[0])).await;
        let waited = started.elapsed();
        match offload {
            // A write, a reload, one more write: about twice the busy timeout.
            Offload::InPlace => {
                assert!(matches!(r, Ok(Err(Error::Unavailable { .. }))), "{r:?}");
                assert!(waited >= timeout * 2, "{waited:?}");
            }
            _ => assert!(r.is_err(), "the timeout fired: {r:?}"),
        }

        let started = Instant::now();
        let extends = leases
            .iter()
            .map(|lease| store.extend(lease, Duration::from_secs(30)));
        for r in futures::future::join_all(extends).await {
            assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
        }
        let waited = started.elapsed();
        if offload == Offload::InPlace {
            // Each about twice the busy timeout, in turn (on the blocking pool, about twice
            // the busy timeout together).
            assert!(waited >= timeout * 4, "in turn: {waited:?}");
        }
        other.execute_batch("ROLLBACK").unwrap();
    }
}

/// The `CREATE TABLE` of each table of another shape, and the schema SQLite keeps for it.
fn schema(path: &std::path::Path) -> Vec<String> {
    let conn = Connection::open(path).unwrap();
    let mut stmt = conn
        .prepare("SELECT name, sql FROM sqlite_schema ORDER BY name")
        .unwrap();
    stmt.query_map([], |row| {
        Ok(format!(
            "{}: {:?}",
            row.get::<_, String>(0)?,
            row.get::<_, Option<String>>(1)?
        ))
    })
    .unwrap()
    .collect::<rusqlite::Result<_>>()
    .unwrap()
}

#[tokio::test]
async fn a_table_of_another_shape_is_not_set_up_and_left_alone() {
    let shapes = [
        (
            "CREATE TABLE idem_records (id INTEGER PRIMARY KEY, payload TEXT)",
            "no column key",
        ),
        (
            "CREATE TABLE idem_records (key TEXT PRIMARY KEY, version TEXT, value TEXT)",
            "column key is TEXT",
        ),
        (
            "CREATE TABLE idem_records (key BLOB, version INTEGER NOT NULL, value BLOB NOT NULL)",
            "column key is BLOB",
        ),
        (
            "CREATE TABLE idem_records (key BLOB NOT NULL, version INTEGER NOT NULL, \
             value BLOB NOT NULL, PRIMARY KEY (key, version))",
            "in the primary key",
        ),
        (
            "CREATE TABLE idem_records (key BLOB PRIMARY KEY, version INTEGER, value BLOB NOT NULL)",
            "column version is INTEGER",
        ),
        (
            "CREATE TABLE idem_records (key BLOB PRIMARY KEY, version INTEGER NOT NULL, \
             value BLOB NOT NULL, extra INT NOT NULL)",
            "column extra is NOT NULL without a default",
        ),
    ];
    for (i, (create, says)) in shapes.into_iter().enumerate() {
        let path = db_path(&format!("shape-{i}"));
        Connection::open(&path)
            .unwrap()
            .execute_batch(create)
            .unwrap();
        let before = schema(&path);
        for options in [
            SqliteOptions::default(),
            SqliteOptions::default().with_create(false),
        ] {
            match SqliteStore::open_with(&path, options).await {
                Err(e @ Error::NotSetUp { .. }) => {
                    let text = e.to_string();
                    assert!(text.contains(says), "{create}: {text}");
                }
                other => panic!("{create}: expected NotSetUp, got {other:?}"),
            }
        }
        assert_eq!(schema(&path), before, "{create}: left as it was");
    }

    // Columns a row need not fill are the operator's business.
    let path = db_path("shape-extra");
    Connection::open(&path)
        .unwrap()
        .execute_batch(
            "CREATE TABLE idem_records (key BLOB PRIMARY KEY NOT NULL, version INTEGER NOT NULL, \
             value BLOB NOT NULL, note TEXT, seen INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID",
        )
        .unwrap();
    let store = SqliteStore::open(&path).await.unwrap();
    acquired(&store, "k", "a").await;
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

/// Each SQLite connection to `""` or `:memory:` gets a private database of its own: the store's
/// write connection and read connections would not share one (every call failed with
/// `NotSetUp`). SQLite URIs are not taken either (a relative one would follow the working
/// directory).
#[tokio::test]
async fn in_memory_and_empty_paths_and_uris_are_refused() {
    for (path, says) in [
        ("", "private temporary database"),
        (":memory:", "private in-memory database"),
        ("file::memory:", "in-memory SQLite URI"),
        ("file:idem?mode=memory&cache=shared", "in-memory SQLite URI"),
        ("file:idem.db", "is a SQLite URI"),
    ] {
        match SqliteStore::open(path).await {
            Err(e @ Error::InvalidInput { field: "path", .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains(says) && text.contains("must all open one database file"),
                    "{path:?}: {text}"
                );
            }
            other => panic!("{path:?}: expected InvalidInput, got {other:?}"),
        }
    }
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

#[tokio::test]
async fn opening_says_whether_it_created_the_table() {
    let path = db_path("created");
    let first = SqliteStore::open(&path).await.unwrap();
    assert!(first.backend().created_table());
    let again = SqliteStore::open(&path).await.unwrap();
    assert!(!again.backend().created_table());
}

/// A page that ends with the namespace's last record carries no cursor; a page with more after
/// it does, and the next page holds the rest.
#[tokio::test]
async fn a_cursor_only_when_a_record_follows() {
    let store = SqliteStore::open(db_path("cursor")).await.unwrap();
    for i in 0..5 {
        let lease = acquired(&store, &format!("r{i}"), "w").await;
        store
            .complete(&lease, Bytes::from_static(b"ok"), RETENTION)
            .await
            .unwrap();
    }
    // Another namespace after this one in key order: its keys are not "more records".
    let later = Namespace::new("sqlite_later").unwrap().key("x").unwrap();
    store
        .acquire(&AcquireRequest::new(later, "w"))
        .await
        .unwrap();
    let ns = Namespace::new("sqlite").unwrap();
    let whole = store
        .list(&ListQuery::new(ns.clone()).with_limit(5))
        .await
        .unwrap();
    assert_eq!(whole.records.len(), 5);
    assert_eq!(whole.next, None, "the last record ends the listing");
    let first = store
        .list(&ListQuery::new(ns.clone()).with_limit(4))
        .await
        .unwrap();
    assert_eq!(first.records.len(), 4);
    let next = first.next.expect("a record follows");
    let rest = store
        .list(&ListQuery::new(ns).with_limit(4).with_cursor(Some(next)))
        .await
        .unwrap();
    assert_eq!(rest.records.len(), 1);
    assert_eq!(rest.next, None);
}

/// The SQLite backend keeps every rule of a kit backend, checked on the backend itself (the
/// store-level scenarios cannot see a version reused after a delete or a delete that does not
/// compare).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_keeps_the_kit_backend_rules() {
    let store = SqliteStore::open(db_path("backend-rules")).await.unwrap();
    idem_conformance::backend::check_backend(store.backend(), "sqlite").await;
}
