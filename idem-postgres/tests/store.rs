//! PostgreSQL-specific behaviour of the plain store: migrations, round trips, hostile input,
//! the sweeper, errors and timeouts.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::proxy::{Counts, Proxy};
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Error, FailureKind, Fingerprint, IdempotencyStore,
    LostLease, Namespace, RecordState, StateKind, TransactionalStore,
};
use idem_postgres::{PostgresConfig, PostgresStore, SweeperConfig, Transition, ddl};

fn ns() -> Namespace {
    Namespace::new(format!("t-{:08x}", rand::random::<u32>())).unwrap()
}

fn acquired(outcome: AcquireOutcome) -> idem_core::Lease {
    match outcome {
        AcquireOutcome::Acquired { lease, .. } => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

const RETENTION: Duration = Duration::from_secs(3600);

/// Different tables migrated at once into one schema that does not exist yet: each migration
/// creates the schema, and none may fail because another created it first.
#[tokio::test]
async fn migrations_of_different_tables_into_one_new_schema_run_at_once() {
    if !common::server() {
        return;
    }
    let admin = common::admin().await;
    for _round in 0..6 {
        let schema = common::fresh_schema();
        let mut stores = Vec::new();
        for table in ["a", "b", "c", "d"] {
            let config = common::config(&schema).with_table(format!("new_schema_{table}"));
            stores.push(PostgresStore::connect(config).await.unwrap());
        }
        let runs = futures::future::join_all(stores.iter().map(PostgresStore::migrate)).await;
        for run in &runs {
            let report = run.as_ref().expect("every table's migration succeeds");
            let every: Vec<u32> = (1..=idem_postgres::SCHEMA_VERSION).collect();
            assert_eq!(report.applied, every, "{runs:?}");
        }
        admin
            .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn migrate_is_idempotent_and_concurrent() {
    if !common::server() {
        return;
    }
    let schema = common::fresh_schema();
    let config = common::config(&schema).with_table("concurrent_mig");
    let store = PostgresStore::connect(config).await.unwrap();
    let _ = common::admin().await;
    let runs = futures::future::join_all((0..4).map(|_| {
        let store = store.clone();
        async move { store.migrate().await }
    }))
    .await;
    let applied: Vec<_> = runs
        .into_iter()
        .map(|r| r.expect("concurrent migrate").applied)
        .collect();
    assert_eq!(
        applied.iter().filter(|a| !a.is_empty()).count(),
        1,
        "exactly one run applies the migrations: {applied:?}"
    );
    assert!(
        applied.contains(&vec![1, 2, 3]),
        "every version, in order: {applied:?}"
    );
    let again = store.migrate().await.unwrap();
    assert!(again.applied.is_empty(), "{again:?}");
    assert_eq!(again.version, idem_postgres::SCHEMA_VERSION);
    let admin = common::admin().await;
    let row = admin
        .query_one(
            &format!("SELECT count(*) FROM \"{schema}\".\"concurrent_mig_migrations\""),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        row.get::<_, i64>(0),
        i64::from(idem_postgres::SCHEMA_VERSION)
    );
    let idx = admin
        .query_one(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND indexname = 'concurrent_mig_expires_at_idx'",
            &[&schema],
        )
        .await
        .unwrap();
    assert_eq!(idx.get::<_, i64>(0), 1, "sweeper index exists");
    admin
        .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .await
        .unwrap();
}

#[tokio::test]
async fn hostile_identifiers_are_rejected_before_any_statement() {
    let hostile = [
        "x\"; DROP TABLE t; --",
        "a b",
        "Robert'); DROP TABLE students;--",
        "$1",
        "ä",
        "",
        "1abc",
        "pg_catalog",
        "UPPER",
        "a.b",
    ];
    for name in hostile {
        // The server is never contacted: the config points at a dead port.
        let schema = PostgresConfig::new("postgres://postgres@127.0.0.1:1/test")
            .unwrap()
            .with_schema(name);
        let r = PostgresStore::connect(schema).await;
        assert!(
            matches!(
                r,
                Err(Error::InvalidInput {
                    field: "schema",
                    ..
                })
            ),
            "schema {name:?}: {r:?}"
        );
        if name != "pg_catalog" {
            let table = PostgresConfig::new("postgres://postgres@127.0.0.1:1/test")
                .unwrap()
                .with_table(name);
            let r = PostgresStore::connect(table).await;
            assert!(
                matches!(r, Err(Error::InvalidInput { field: "table", .. })),
                "table {name:?}: {r:?}"
            );
            assert!(ddl("idem", name).is_err(), "{name:?}");
        }
    }
    let too_long = "t".repeat(idem_postgres::MAX_TABLE_LEN + 1);
    let r = PostgresStore::connect(
        PostgresConfig::new("postgres://postgres@127.0.0.1:1/test")
            .unwrap()
            .with_table(too_long),
    )
    .await;
    assert!(
        matches!(r, Err(Error::InvalidInput { field: "table", .. })),
        "{r:?}"
    );
    assert!(
        ddl("idem", "records")
            .unwrap()
            .contains("\"idem\".\"records\"")
    );
}

#[tokio::test]
async fn hostile_keys_cannot_change_a_query() {
    let Some(store) = common::store().await else {
        return;
    };
    let ns = ns();
    let ids = [
        "'",
        "''",
        "\"",
        "'; DROP TABLE idem.records; --",
        "Robert'); DROP TABLE students;--",
        "a; SELECT pg_sleep(10);",
        "$1",
        "$2::text",
        "%",
        "_",
        "\\",
        "\\x00",
        "E'\\n'",
        "ключ",
        "键🔑",
        "e\u{301}", // e + combining accent
        "\u{e9}",   // precomposed é: a different key
        " ",
        "a\nb",
        "{}:*",
    ];
    for (i, id) in ids.iter().enumerate() {
        let key = ns.key(id).unwrap();
        let lease = acquired(
            store
                .acquire(
                    &AcquireRequest::new(key.clone(), format!("owner'; --{i}"))
                        .with_fingerprint(Fingerprint::of(id)),
                )
                .await
                .unwrap(),
        );
        store
            .complete(&lease, Bytes::from(format!("result of {id}")), RETENTION)
            .await
            .unwrap();
    }
    let mut seen = HashSet::new();
    for (i, id) in ids.iter().enumerate() {
        let key = ns.key(id).unwrap();
        let record = store.get(&key).await.unwrap().expect("record");
        assert_eq!(record.key.id(), *id);
        assert_eq!(record.owner, format!("owner'; --{i}"));
        assert_eq!(
            record.state,
            RecordState::Completed {
                result: Bytes::from(format!("result of {id}"))
            }
        );
        assert!(seen.insert(record.token), "tokens are distinct");
        let replay = store
            .acquire(&AcquireRequest::new(key, "other").with_fingerprint(Fingerprint::of(id)))
            .await
            .unwrap();
        assert_eq!(
            replay,
            AcquireOutcome::Replayed {
                result: Bytes::from(format!("result of {id}"))
            }
        );
    }
    // Exactly one row per key, stored verbatim, and the table is still there.
    let admin = common::admin().await;
    let rows = admin
        .query(
            &format!(
                "SELECT id FROM {} WHERE namespace = $1 ORDER BY id",
                store.qualified_table()
            ),
            &[&ns.as_str()],
        )
        .await
        .unwrap();
    let stored: HashSet<String> = rows.iter().map(|r| r.get(0)).collect();
    let expected: HashSet<String> = ids.iter().map(|s| s.to_string()).collect();
    assert_eq!(rows.len(), ids.len());
    assert_eq!(stored, expected);
}

/// Runs `op` through the proxy and returns what the client sent for it.
async fn counted<T>(proxy: &Proxy, op: impl std::future::Future<Output = T>) -> (T, Counts) {
    let before = proxy.counts();
    let out = op.await;
    (out, proxy.counts() - before)
}

/// One statement execution and one round trip per transition, counted on the wire.
#[tokio::test]
async fn one_statement_per_transition() {
    let Some((store, proxy)) = common::proxied_store(|c| c.with_pool_size(1)).await else {
        return;
    };
    let ns = ns();
    let key = |i: u32| ns.key(format!("k{i}")).unwrap();

    // Warm up: open the connection and prepare every statement once.
    let lease = acquired(
        store
            .acquire(&AcquireRequest::new(key(0), "w"))
            .await
            .unwrap(),
    );
    let lease = store.extend(&lease, Duration::from_secs(30)).await.unwrap();
    store.release(&lease).await.unwrap();
    let lease = acquired(
        store
            .acquire(&AcquireRequest::new(key(0), "w"))
            .await
            .unwrap(),
    );
    store
        .fail(&lease, "x", FailureKind::Retryable, RETENTION)
        .await
        .unwrap();
    let lease = acquired(
        store
            .acquire(&AcquireRequest::new(key(0), "w"))
            .await
            .unwrap(),
    );
    store
        .complete(&lease, Bytes::from_static(b"r"), RETENTION)
        .await
        .unwrap();
    store.get(&key(0)).await.unwrap();
    store.delete(&key(0)).await.unwrap();
    store.purge_expired(10).await.unwrap();

    let one = Counts {
        query: 0,
        parse: 0,
        bind: 1,
        execute: 1,
        sync: 1,
    };
    let mut report = Vec::new();
    let (lease, c) = counted(&proxy, async {
        store.acquire(&AcquireRequest::new(key(1), "w")).await
    })
    .await;
    let lease = acquired(lease.unwrap());
    report.push(("acquire (fresh)", c));
    let (r, c) = counted(&proxy, async {
        store.acquire(&AcquireRequest::new(key(1), "w2")).await
    })
    .await;
    assert!(matches!(r, Ok(AcquireOutcome::InProgress { .. })), "{r:?}");
    report.push(("acquire (busy)", c));
    let (lease, c) = counted(&proxy, async {
        store.extend(&lease, Duration::from_secs(30)).await
    })
    .await;
    let lease = lease.unwrap();
    report.push(("extend", c));
    let (r, c) = counted(&proxy, async { store.release(&lease).await }).await;
    r.unwrap();
    report.push(("release", c));
    let (r, c) = counted(&proxy, async { store.release(&lease).await }).await;
    r.unwrap();
    report.push(("release (replayed)", c));
    let (lease, c) = counted(&proxy, async {
        store.acquire(&AcquireRequest::new(key(1), "w")).await
    })
    .await;
    let lease = acquired(lease.unwrap());
    report.push(("acquire (after release)", c));
    let (r, c) = counted(&proxy, async {
        store
            .fail(&lease, "boom", FailureKind::Retryable, RETENTION)
            .await
    })
    .await;
    r.unwrap();
    report.push(("fail", c));
    let (r, c) = counted(&proxy, async {
        store
            .fail(&lease, "boom", FailureKind::Retryable, RETENTION)
            .await
    })
    .await;
    r.unwrap();
    report.push(("fail (replayed)", c));
    let (lease, c) = counted(&proxy, async {
        store.acquire(&AcquireRequest::new(key(1), "w")).await
    })
    .await;
    let lease = acquired(lease.unwrap());
    report.push(("acquire (retry after failure)", c));
    let (r, c) = counted(&proxy, async {
        store
            .complete(&lease, Bytes::from_static(b"done"), RETENTION)
            .await
    })
    .await;
    r.unwrap();
    report.push(("complete", c));
    let (r, c) = counted(&proxy, async {
        store
            .complete(&lease, Bytes::from_static(b"done"), RETENTION)
            .await
    })
    .await;
    r.unwrap();
    report.push(("complete (replayed)", c));
    let (r, c) = counted(&proxy, async {
        store.acquire(&AcquireRequest::new(key(1), "w")).await
    })
    .await;
    assert!(matches!(r, Ok(AcquireOutcome::Replayed { .. })), "{r:?}");
    report.push(("acquire (duplicate: replay)", c));
    let (r, c) = counted(&proxy, async {
        store
            .complete(&lease, Bytes::from_static(b"x"), RETENTION)
            .await
    })
    .await;
    assert!(
        matches!(
            r,
            Err(Error::LeaseLost {
                why: LostLease::NotInProgress {
                    state: StateKind::Completed
                },
                ..
            })
        ),
        "{r:?}"
    );
    report.push(("complete (other bytes: LeaseLost)", c));
    let (r, c) = counted(&proxy, async { store.get(&key(1)).await }).await;
    r.unwrap().unwrap();
    report.push(("get", c));
    let (r, c) = counted(&proxy, async { store.delete(&key(1)).await }).await;
    assert!(r.unwrap());
    report.push(("delete", c));
    let (r, c) = counted(&proxy, async { store.purge_expired(100).await }).await;
    r.unwrap();
    report.push(("purge_expired", c));

    for (what, c) in &report {
        println!("{what:32} {c:?}");
    }
    for (what, c) in &report {
        assert_eq!(
            *c, one,
            "{what}: expected one statement in one round trip, got {c:?}"
        );
    }
}

#[tokio::test]
async fn sweeper_purges_in_batches_and_runs_concurrently() {
    let schema = common::fresh_schema();
    let Some(store) = common::store_with(common::config(&schema).with_table("sweep")).await else {
        return;
    };
    let ns = ns();
    let n = 250;
    for i in 0..n {
        let lease = acquired(
            store
                .acquire(&AcquireRequest::new(ns.key(format!("k{i}")).unwrap(), "w"))
                .await
                .unwrap(),
        );
        store
            .complete(&lease, Bytes::from_static(b"r"), Duration::from_millis(1))
            .await
            .unwrap();
    }
    // One record that must survive.
    let keep = acquired(
        store
            .acquire(&AcquireRequest::new(ns.key("keep").unwrap(), "w"))
            .await
            .unwrap(),
    );
    store
        .complete(&keep, Bytes::from_static(b"r"), RETENTION)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;

    assert_eq!(store.purge_expired(0).await.unwrap(), 0);
    assert_eq!(store.purge_expired(10).await.unwrap(), 10, "bounded batch");
    // Four sweepers at once, small batches: together they delete each record exactly once.
    let totals = futures::future::join_all((0..4).map(|_| {
        let store = store.clone();
        async move { store.sweep(7, 1_000).await.unwrap() }
    }))
    .await;
    assert_eq!(totals.iter().sum::<u64>(), n - 10, "{totals:?}");
    assert!(store.get(&keep.key).await.unwrap().is_some());

    // The periodic helper.
    let lease = acquired(
        store
            .acquire(&AcquireRequest::new(ns.key("late").unwrap(), "w"))
            .await
            .unwrap(),
    );
    store
        .complete(&lease, Bytes::from_static(b"r"), Duration::from_millis(1))
        .await
        .unwrap();
    let sweeper = store.spawn_sweeper(
        SweeperConfig::default()
            .with_interval(Duration::from_millis(20))
            .with_batch(5),
    );
    let admin = common::admin().await;
    let count = format!("SELECT count(*) FROM {}", store.qualified_table());
    let mut left = i64::MAX;
    for _ in 0..200 {
        left = admin.query_one(&count, &[]).await.unwrap().get(0);
        if left == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(left, 1, "only the retained record is left");
    assert!(sweeper.shutdown().await >= 1);
    admin
        .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .await
        .unwrap();
}

#[tokio::test]
async fn unreachable_server_fails_fast_with_unavailable() {
    let store = PostgresStore::connect(
        PostgresConfig::new("postgres://postgres@127.0.0.1:1/test")
            .unwrap()
            .with_connect_timeout(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    let key = ns().key("k").unwrap();
    let started = Instant::now();
    let r = store.acquire(&AcquireRequest::new(key, "w")).await;
    assert!(
        matches!(
            r,
            Err(Error::Unavailable {
                store: "postgres",
                ..
            })
        ),
        "{r:?}"
    );
    let e = r.unwrap_err();
    assert!(e.is_retryable());
    // Display shows the cause below the driver's own words.
    let text = e.to_string();
    assert!(
        text.starts_with("postgres store unavailable: error connecting to server: "),
        "{text}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

/// A server that accepts connections but never answers (the proxy frozen from the start), and
/// one that stops answering mid-session: both end in `Unavailable` within the configured bounds.
#[tokio::test]
async fn silent_server_fails_fast_with_unavailable() {
    let Some((store, proxy)) = common::proxied_store(|c| {
        c.with_pool_size(1)
            .with_connect_timeout(Duration::from_millis(500))
            .with_lock_timeout(Duration::from_millis(200))
            .with_statement_timeout(Duration::from_millis(500))
    })
    .await
    else {
        return;
    };
    let key = ns().key("k").unwrap();

    proxy.freeze(true);
    let started = Instant::now();
    let r = store.get(&key).await;
    assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );

    proxy.freeze(false);
    store
        .get(&key)
        .await
        .expect("works again once the server answers");
    proxy.freeze(true);
    let started = Instant::now();
    let r = store.acquire(&AcquireRequest::new(key.clone(), "w")).await;
    assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    proxy.freeze(false);
    // The timed-out connection was dropped, not reused half-read: the next call works.
    let r = store.acquire(&AcquireRequest::new(key, "w")).await;
    assert!(r.is_ok(), "{r:?}");
}

/// Killed backends (`pg_terminate_backend`, SQLSTATE 57P01) surface as retryable `Unavailable`,
/// never `Backend`, and the pool recovers.
#[tokio::test]
async fn killed_connections_are_retryable() {
    let app = format!("idem-kill-{:08x}", rand::random::<u32>());
    let Some(store) = common::store_with(
        common::config(common::run_schema())
            .with_application_name(app.clone())
            .with_pool_size(2),
    )
    .await
    else {
        return;
    };
    let admin = common::admin().await;
    let ns = ns();
    let mut unavailable = 0;
    for i in 0..20 {
        let key = ns.key(format!("k{i}")).unwrap();
        store.get(&key).await.ok(); // make sure a connection is open
        admin
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
                &[&app],
            )
            .await
            .unwrap();
        match store.acquire(&AcquireRequest::new(key, "w")).await {
            Ok(_) => {}
            Err(e @ Error::Unavailable { .. }) => {
                assert!(e.is_retryable());
                unavailable += 1;
            }
            Err(e) => panic!("a killed connection must be Unavailable, got {e:?}"),
        }
    }
    println!("{unavailable} of 20 calls hit the killed connection");
    // The pool recovers: dead connections are dropped as they are found (each costs the caller
    // one retryable error at most), and fresh ones are opened.
    let key = ns.key("after").unwrap();
    let mut outcome = None;
    for _ in 0..3 {
        match store.acquire(&AcquireRequest::new(key.clone(), "w")).await {
            Ok(o) => {
                outcome = Some(o);
                break;
            }
            Err(e) => assert!(e.is_retryable(), "{e:?}"),
        }
    }
    assert!(
        matches!(outcome, Some(AcquireOutcome::Acquired { .. })),
        "{outcome:?}"
    );
}

#[tokio::test]
async fn undecodable_row_is_corrupt_record() {
    let schema = common::fresh_schema();
    let Some(store) = common::store_with(common::config(&schema).with_table("corrupt")).await
    else {
        return;
    };
    let admin = common::admin().await;
    let ns = ns();
    let key = ns.key("bad").unwrap();
    admin
        .batch_execute(&format!(
            "ALTER TABLE {t} DROP CONSTRAINT corrupt_state_check; \
             INSERT INTO {t} (namespace, id, state, token, owner, attempts, created_at, updated_at, \
                expires_at) \
             VALUES ('{ns}', 'bad', 'bogus', 1, 'x', 1, now(), now(), now() + interval '1 hour')",
            t = store.qualified_table()
        ))
        .await
        .unwrap();
    let r = store.get(&key).await;
    assert!(
        matches!(
            r,
            Err(Error::CorruptRecord {
                store: "postgres",
                ..
            })
        ),
        "{r:?}"
    );
    let r = store.acquire(&AcquireRequest::new(key, "w")).await;
    assert!(matches!(r, Err(Error::CorruptRecord { .. })), "{r:?}");
    // An undecodable record past retention counts as absent, like any expired record.
    admin
        .batch_execute(&format!(
            "INSERT INTO {t} (namespace, id, state, token, owner, attempts, created_at, updated_at, \
                expires_at) \
             VALUES ('{ns}', 'old', 'bogus', 1, 'x', 1, now(), now(), now() - interval '1 hour')",
            t = store.qualified_table()
        ))
        .await
        .unwrap();
    let old = ns.key("old").unwrap();
    assert_eq!(store.get(&old).await.unwrap(), None);
    let r = store.acquire(&AcquireRequest::new(old, "w")).await;
    assert!(
        matches!(
            r,
            Ok(AcquireOutcome::Acquired {
                takeover: false,
                ..
            })
        ),
        "{r:?}"
    );
    admin
        .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .await
        .unwrap();
}

#[tokio::test]
async fn oversized_and_bad_input_write_nothing() {
    let Some(store) = common::store_with(
        common::config(common::run_schema())
            .with_limits(idem_core::Limits::default().with_max_result_len(8)),
    )
    .await
    else {
        return;
    };
    let key = ns().key("k").unwrap();
    let lease = acquired(
        store
            .acquire(&AcquireRequest::new(key.clone(), "w"))
            .await
            .unwrap(),
    );
    let r = store
        .complete(&lease, Bytes::from_static(b"123456789"), RETENTION)
        .await;
    assert!(
        matches!(r, Err(Error::ResultTooLarge { len: 9, max: 8 })),
        "{r:?}"
    );
    let r = store.extend(&lease, Duration::ZERO).await;
    assert!(
        matches!(
            r,
            Err(Error::InvalidInput {
                field: "lease_ttl",
                ..
            })
        ),
        "{r:?}"
    );
    let r = store
        .acquire(&AcquireRequest::new(key.clone(), "w").with_max_attempts(0))
        .await;
    assert!(
        matches!(
            r,
            Err(Error::InvalidInput {
                field: "max_attempts",
                ..
            })
        ),
        "{r:?}"
    );
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::InProgress);
    assert_eq!(record.attempts, 1);
    // An error text with NUL (which PostgreSQL text cannot hold) is refused, never altered.
    let r = store
        .fail(&lease, "bad\0byte", FailureKind::Terminal, RETENTION)
        .await;
    assert!(
        matches!(r, Err(Error::InvalidInput { field: "error", .. })),
        "{r:?}"
    );
    assert_eq!(store.get(&key).await.unwrap().unwrap(), record);
}

/// The store's clock is the server's: a lease's end is server time + ttl, whatever the caller's
/// clock says.
#[tokio::test]
async fn leases_use_the_server_clock() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let key = ns().key("clock").unwrap();
    let before: std::time::SystemTime = admin
        .query_one("SELECT clock_timestamp()", &[])
        .await
        .unwrap()
        .get(0);
    let lease = acquired(
        store
            .acquire(&AcquireRequest::new(key.clone(), "w").with_lease_ttl(Duration::from_secs(10)))
            .await
            .unwrap(),
    );
    let after: std::time::SystemTime = admin
        .query_one("SELECT clock_timestamp()", &[])
        .await
        .unwrap()
        .get(0);
    assert!(lease.expires_at >= before + Duration::from_secs(10));
    assert!(lease.expires_at <= after + Duration::from_secs(10));
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.lease_expires_at, Some(lease.expires_at));
    assert!(record.created_at >= before && record.created_at <= after);
    assert_eq!(record.expires_at, None);
}

/// Asserts `r` is `NotSetUp` for `table`, saying to run `migrate`; returns its text.
#[track_caller]
fn assert_not_set_up<T: std::fmt::Debug>(
    what: &str,
    r: idem_core::Result<T>,
    table: &str,
) -> String {
    match r {
        Err(e @ Error::NotSetUp { .. }) => {
            let Error::NotSetUp {
                store,
                missing,
                fix,
            } = &e
            else {
                unreachable!()
            };
            assert_eq!(*store, "postgres", "{what}");
            assert!(
                missing.contains(table),
                "{what}: {missing:?} should name {table}"
            );
            assert!(
                fix.contains("PostgresStore::migrate()") && fix.contains("idem_postgres::ddl("),
                "{what}: {fix:?}"
            );
            e.to_string()
        }
        other => panic!("{what}: expected NotSetUp naming {table}, got {other:?}"),
    }
}

/// A database the store's statements cannot run on (no schema, no table, a missing column)
/// answers `NotSetUp`, naming the table and saying how to create it, on every path.
#[tokio::test]
async fn unmigrated_database_is_not_set_up() {
    if !common::server() {
        return;
    }
    let admin = common::admin().await;
    let schema = common::fresh_schema();
    let store = PostgresStore::connect(common::config(&schema).with_table("unmigrated"))
        .await
        .unwrap();
    let table = format!("\"{schema}\".\"unmigrated\"");
    let key = ns().key("k").unwrap();
    let req = AcquireRequest::new(key.clone(), "w");

    // No schema at all (3F000 or 42P01, depending on the statement).
    let text = assert_not_set_up("acquire", store.acquire(&req).await, &table);
    assert!(
        text.starts_with(&format!("postgres store is not set up: table {table}")),
        "{text}"
    );
    assert!(text.contains("run PostgresStore::migrate()"), "{text}");
    assert_not_set_up("get", store.get(&key).await, &table);
    assert_not_set_up("delete", store.delete(&key).await, &table);
    assert_not_set_up("purge", store.purge_expired(10).await, &table);
    let lease = idem_core::Lease {
        key: key.clone(),
        owner: "w".into(),
        token: idem_core::FencingToken::new(1),
        attempt: 1,
        expires_at: std::time::SystemTime::now(),
    };
    assert_not_set_up(
        "complete",
        store
            .complete(&lease, Bytes::from_static(b"r"), RETENTION)
            .await,
        &table,
    );
    assert_not_set_up(
        "fail",
        store
            .fail(&lease, "e", FailureKind::Terminal, RETENTION)
            .await,
        &table,
    );
    assert_not_set_up("release", store.release(&lease).await, &table);
    assert_not_set_up(
        "extend",
        store.extend(&lease, Duration::from_secs(1)).await,
        &table,
    );
    assert_not_set_up(
        "complete_with",
        store
            .complete_with(
                &lease,
                Bytes::from_static(b"r"),
                RETENTION,
                idem_postgres::PgWrites::new().execute("SELECT 1", ()),
            )
            .await,
        &table,
    );
    let mode = store
        .in_transaction(idem_executor::ExecutorConfig::new("unmigrated"))
        .unwrap();
    let r = mode
        .run_with_key::<(), _>("k", None, |_, _| {
            Box::pin(async { panic!("the handler must not run") })
        })
        .await;
    match r {
        Err(idem_executor::ExecutorError::Store {
            stage: idem_executor::StoreStage::Acquire,
            handler_ran: false,
            source,
            ..
        }) => {
            assert_not_set_up("in-transaction mode", Err::<(), _>(source), &table);
        }
        other => panic!("in-transaction mode: expected a store error at acquire, got {other:?}"),
    }

    // The schema exists, the table does not.
    admin
        .batch_execute(&format!("CREATE SCHEMA \"{schema}\""))
        .await
        .unwrap();
    assert_not_set_up("acquire (no table)", store.acquire(&req).await, &table);

    // Migrated, then a column dropped by hand (42703).
    store.migrate().await.unwrap();
    admin
        .batch_execute(&format!("ALTER TABLE {table} DROP COLUMN fingerprint"))
        .await
        .unwrap();
    let text = assert_not_set_up("acquire (no column)", store.acquire(&req).await, &table);
    assert!(text.contains("fingerprint"), "names the column: {text}");

    admin
        .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .await
        .unwrap();
}

/// The schema as version 1 of the crate created it (frozen copy: what databases in the field
/// hold), with its bookkeeping row.
fn v1_schema(schema: &str, table: &str) -> String {
    let t = format!("\"{schema}\".\"{table}\"");
    format!(
        "CREATE SCHEMA IF NOT EXISTS \"{schema}\"; \
         CREATE SEQUENCE IF NOT EXISTS \"{schema}\".\"{table}_token_seq\" AS bigint MINVALUE 1 NO CYCLE; \
         CREATE TABLE IF NOT EXISTS {t} (\
            namespace        text        NOT NULL, \
            id               text        NOT NULL, \
            state            text        NOT NULL CHECK (state IN ('in_progress', 'released', \
                                            'completed', 'failed_retryable', 'failed_terminal')), \
            fingerprint      bytea       CHECK (octet_length(fingerprint) = 32), \
            token            bigint      NOT NULL CHECK (token > 0), \
            owner            text        NOT NULL, \
            attempts         integer     NOT NULL CHECK (attempts >= 0), \
            lease_expires_at timestamptz CHECK ((state = 'in_progress') = (lease_expires_at IS NOT NULL)), \
            result           bytea       CHECK ((state = 'completed') = (result IS NOT NULL)), \
            error            text        CHECK ((state LIKE 'failed%') = (error IS NOT NULL)), \
            created_at       timestamptz NOT NULL, \
            updated_at       timestamptz NOT NULL, \
            expires_at       timestamptz CHECK ((state IN ('in_progress', 'released')) = (expires_at IS NULL)), \
            PRIMARY KEY (namespace, id)); \
         CREATE INDEX IF NOT EXISTS \"{table}_expires_at_idx\" ON {t} (expires_at) WHERE expires_at IS NOT NULL; \
         CREATE TABLE IF NOT EXISTS \"{schema}\".\"{table}_migrations\" (\
            version     integer     PRIMARY KEY, \
            description text        NOT NULL, \
            applied_at  timestamptz NOT NULL DEFAULT now()); \
         INSERT INTO \"{schema}\".\"{table}_migrations\" (version, description) \
            VALUES (1, 'records table, token sequence, expiry index');"
    )
}

/// A table created by version 1 of the crate, with records in it, is upgraded in place: until
/// then the new failure kind answers `NotSetUp`; after `migrate` the old records read as before,
/// the new kind is stored and replayed, the new constraint is validated, and `migrate` again
/// does nothing.
#[tokio::test]
async fn a_v1_table_is_upgraded_in_place() {
    if !common::server() {
        return;
    }
    let admin = common::admin().await;
    let schema = common::fresh_schema();
    admin
        .batch_execute(&v1_schema(&schema, "old"))
        .await
        .unwrap();
    let store = PostgresStore::connect(common::config(&schema).with_table("old"))
        .await
        .unwrap();
    let ns = ns();
    let req = |id: &str| AcquireRequest::new(ns.key(id).unwrap(), "w");

    // Version 1 records, written by this crate before the upgrade.
    let lease = acquired(store.acquire(&req("done")).await.unwrap());
    store
        .complete(&lease, Bytes::from_static(b"r"), RETENTION)
        .await
        .unwrap();
    let lease = acquired(store.acquire(&req("terminal")).await.unwrap());
    store
        .fail(&lease, "bad", FailureKind::Terminal, RETENTION)
        .await
        .unwrap();
    let lease = acquired(store.acquire(&req("lost")).await.unwrap());
    let r = store
        .fail(&lease, "too big", FailureKind::ResultNotStored, RETENTION)
        .await;
    let text = assert_not_set_up("a v2 state on v1", r, &format!("\"{schema}\".\"old\""));
    assert!(
        text.contains(&format!("schema version {}", idem_postgres::SCHEMA_VERSION)),
        "{text}"
    );
    assert_eq!(
        store.get(&lease.key).await.unwrap().unwrap().state,
        RecordState::InProgress,
        "nothing was written"
    );

    let report = store.migrate().await.unwrap();
    assert_eq!(report.applied, vec![2, 3]);
    assert_eq!(report.version, 3);
    let list_index: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND indexname = 'old_list_idx'",
            &[&schema],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        list_index, 1,
        "migrate adds the listing index to the old table"
    );
    let validated: bool = admin
        .query_one(
            "SELECT convalidated FROM pg_constraint \
             WHERE conrelid = $1::text::regclass AND conname = 'old_state_check'",
            &[&format!("\"{schema}\".\"old\"")],
        )
        .await
        .unwrap()
        .get(0);
    assert!(validated, "migrate validates the new constraint");
    let again = store.migrate().await.unwrap();
    assert!(again.applied.is_empty(), "{again:?}");

    assert_eq!(
        store.acquire(&req("done")).await.unwrap(),
        AcquireOutcome::Replayed {
            result: Bytes::from_static(b"r")
        }
    );
    assert_eq!(
        store.acquire(&req("terminal")).await.unwrap(),
        AcquireOutcome::Failed {
            error: "bad".into(),
            kind: FailureKind::Terminal
        }
    );
    store
        .fail(&lease, "too big", FailureKind::ResultNotStored, RETENTION)
        .await
        .unwrap();
    assert_eq!(
        store.acquire(&req("lost")).await.unwrap(),
        AcquireOutcome::Failed {
            error: "too big".into(),
            kind: FailureKind::ResultNotStored
        }
    );
    // The new constraint still refuses what no version writes.
    let r = admin
        .batch_execute(&format!(
            "UPDATE \"{schema}\".\"old\" SET state = 'bogus' WHERE id = 'done'"
        ))
        .await;
    assert!(r.is_err(), "{r:?}");
    admin
        .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .await
        .unwrap();
}

/// `Display` of a server error shows the server's message, not only "db error".
#[tokio::test]
async fn server_errors_show_their_message() {
    let schema = common::fresh_schema();
    let Some(store) = common::store_with(common::config(&schema).with_table("display")).await
    else {
        return;
    };
    let admin = common::admin().await;
    admin
        .batch_execute(&format!(
            "ALTER TABLE {} ADD CONSTRAINT no_evil_owner CHECK (owner <> 'evil')",
            store.qualified_table()
        ))
        .await
        .unwrap();
    let r = store
        .acquire(&AcquireRequest::new(ns().key("k").unwrap(), "evil"))
        .await;
    let Err(e @ Error::Backend { .. }) = r else {
        panic!("expected Backend, got {r:?}");
    };
    let text = e.to_string();
    assert!(
        text.starts_with(
            "postgres store error: db error: ERROR: new row for relation \"display\" violates \
             check constraint \"no_evil_owner\""
        ),
        "{text}"
    );
    admin
        .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .await
        .unwrap();
}

/// A transition re-sent while its first send is still running (holding the row lock, not yet
/// committed) waits for it, then answers as a replay: `Ok` with the same arguments, `LeaseLost`
/// saying the record is completed with other ones; if the first send rolls back instead, the
/// re-send applies.
#[tokio::test]
async fn a_resend_behind_the_first_send_is_a_replay() {
    let app = format!("idem-resend-{:08x}", rand::random::<u32>());
    let Some(store) =
        common::store_with(common::config(common::run_schema()).with_application_name(app.clone()))
            .await
    else {
        return;
    };
    let admin = common::admin().await;
    let ns = ns();
    for (id, resent, commit_first, expect_ok) in [
        ("same", &b"done"[..], true, true),
        ("other", &b"else"[..], true, false),
        ("rolled-back", &b"else"[..], false, true),
    ] {
        let key = ns.key(id).unwrap();
        let lease = acquired(
            store
                .acquire(&AcquireRequest::new(key.clone(), "w"))
                .await
                .unwrap(),
        );
        // The first send, still in flight: the store's own statement in an open transaction.
        let mut first = common::admin().await;
        let tx = first.transaction().await.unwrap();
        let token = lease.token.get() as i64;
        let retention_us = RETENTION.as_micros() as i64;
        let result: &[u8] = b"done";
        let row = tx
            .query_one(
                store.statement_sql(Transition::Complete),
                &[&ns.as_str(), &id, &token, &result, &retention_us],
            )
            .await
            .unwrap();
        assert!(row.get::<_, bool>("done"));

        let resend = tokio::spawn({
            let store = store.clone();
            let lease = lease.clone();
            let resent = Bytes::copy_from_slice(resent);
            async move { store.complete(&lease, resent, RETENTION).await }
        });
        // Wait until the re-send is blocked on the first send's row lock.
        let mut waiting = false;
        for _ in 0..500 {
            waiting = admin
                .query_one(
                    "SELECT count(*) > 0 FROM pg_stat_activity \
                     WHERE application_name = $1 AND wait_event_type = 'Lock'",
                    &[&app],
                )
                .await
                .unwrap()
                .get(0);
            if waiting {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(waiting, "{id}: the re-send waits on the row lock");
        if commit_first {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
        let r = resend.await.unwrap();
        if expect_ok {
            r.unwrap_or_else(|e| panic!("{id}: the re-send must be Ok: {e:?}"));
        } else {
            assert!(
                matches!(
                    r,
                    Err(Error::LeaseLost {
                        why: LostLease::NotInProgress {
                            state: StateKind::Completed
                        },
                        ..
                    })
                ),
                "{id}: {r:?}"
            );
        }
        let stored = if commit_first {
            b"done".as_slice()
        } else {
            resent
        };
        assert_eq!(
            store.get(&key).await.unwrap().unwrap().state,
            RecordState::Completed {
                result: Bytes::copy_from_slice(stored)
            },
            "{id}"
        );
    }
}

/// Under a stricter `default_transaction_isolation` than `READ COMMITTED` (set here per
/// connection, as a server, database or role setting would), racing calls answer as on every
/// store, never the `Unavailable` of a serialization failure (`40001`): acquires of one key, single
/// and in batches, one `Acquired` and the others `InProgress`; a completion and its re-sent copy
/// both `Ok`; a delete beside a re-acquire.
#[tokio::test]
async fn racing_calls_answer_as_under_read_committed_under_a_stricter_default_isolation() {
    for level in ["repeatable read", "serializable"] {
        let url = format!(
            "{}?options=-c%20default_transaction_isolation%3D{}",
            common::url(),
            level.replace(' ', "%5C%20")
        );
        let config = PostgresConfig::new(&url)
            .unwrap()
            .with_schema(common::run_schema());
        let Some(store) = common::store_with(config).await else {
            return;
        };
        let ns = ns();
        for round in 0..10 {
            let key = ns.key(format!("race-{round}")).unwrap();
            let racers: Vec<_> = (0..16)
                .map(|i| {
                    let (store, key) = (store.clone(), key.clone());
                    tokio::spawn(async move {
                        let req = AcquireRequest::new(key, format!("w{i}"))
                            .with_fingerprint(Fingerprint::of("p"));
                        if i % 2 == 0 {
                            return store.acquire(&req).await;
                        }
                        // A batch: the raced key, then a key of this racer's own.
                        let own = AcquireRequest::new(
                            req.key
                                .namespace()
                                .key(format!("{}-own-{i}", req.key.id()))?,
                            format!("w{i}"),
                        );
                        let mut batch = store.acquire_many(&[req, own]).await?.into_iter();
                        let raced = batch.next().expect("two items");
                        match batch.next().expect("two items") {
                            Ok(AcquireOutcome::Acquired { .. }) => raced,
                            other => panic!("a racer's own key answered {other:?}"),
                        }
                    })
                })
                .collect();
            let (mut won, mut busy) = (Vec::new(), 0);
            for racer in racers {
                match racer.await.unwrap() {
                    Ok(AcquireOutcome::Acquired { lease, .. }) => won.push(lease),
                    Ok(AcquireOutcome::InProgress { .. }) => busy += 1,
                    other => panic!("{level}: a racing acquire answered {other:?}"),
                }
            }
            assert_eq!((won.len(), busy), (1, 15), "{level}");
            // A completion and its re-sent copy racing (the replay rule): both `Ok`.
            let lease = &won[0];
            let (a, b) = tokio::join!(
                store.complete(lease, Bytes::from_static(b"r"), RETENTION),
                store.complete(lease, Bytes::from_static(b"r"), RETENTION),
            );
            assert!(a.is_ok() && b.is_ok(), "{level}: {a:?} {b:?}");
            // An operator's delete racing the holder's completion of another key: the delete
            // answers, and the completion is `Ok` or finds the record gone.
            let other = ns.key(format!("deleted-{round}")).unwrap();
            let lease = acquired(
                store
                    .acquire(&AcquireRequest::new(other.clone(), "holder"))
                    .await
                    .unwrap(),
            );
            let (deleted, completed) = tokio::join!(
                store.delete(&other),
                store.complete(&lease, Bytes::from_static(b"r"), RETENTION),
            );
            assert!(deleted.is_ok(), "{level}: delete answered {deleted:?}");
            assert!(
                matches!(completed, Ok(()) | Err(Error::LeaseLost { .. })),
                "{level}: {completed:?}"
            );
        }
        // The URL's option really sets the level (else this test proves nothing).
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        let row = client
            .query_one("SHOW transaction_isolation", &[])
            .await
            .unwrap();
        assert_eq!(row.get::<_, String>(0), level);
    }
}
