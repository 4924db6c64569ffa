//! Transactional mode: business writes and the idempotency record commit or roll back together.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Error, FailureKind, IdempotencyStore, Namespace,
    RecordState,
};
use idem_postgres::{HandlerError, PostgresStore, TxOutcome, UNCOMMITTED_OWNER};
use rand::seq::SliceRandom;
use tokio::sync::oneshot;

const RETENTION: Duration = Duration::from_secs(3600);

fn ns() -> Namespace {
    Namespace::new(format!("tx-{:08x}", rand::random::<u32>())).unwrap()
}

/// A business table of its own in this run's schema: one row per effect, deliberately without a
/// unique constraint, so a duplicate effect would show instead of being refused.
async fn effects_table(admin: &tokio_postgres::Client) -> String {
    let table = format!(
        "\"{}\".\"effects_{:08x}\"",
        common::run_schema(),
        rand::random::<u32>()
    );
    admin
        .batch_execute(&format!(
            "CREATE TABLE {table} (msg text NOT NULL, token bigint NOT NULL, \
             at timestamptz NOT NULL DEFAULT clock_timestamp())"
        ))
        .await
        .unwrap();
    table
}

async fn effect_count(admin: &tokio_postgres::Client, table: &str, msg: &str) -> i64 {
    admin
        .query_one(
            &format!("SELECT count(*) FROM {table} WHERE msg = $1"),
            &[&msg],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn executed_commits_business_writes_with_the_completion() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let effects = effects_table(&admin).await;
    let key = ns().key("m1").unwrap();
    let req = AcquireRequest::new(key.clone(), "w1");

    let sql = format!("INSERT INTO {effects} (msg, token) VALUES ($1, $2)");
    let outcome = store
        .transactional(&req, RETENTION, |tx, lease| {
            let sql = sql.clone();
            Box::pin(async move {
                tx.execute(&sql, &[&lease.key.id(), &(lease.token.get() as i64)])
                    .await?;
                Ok(Bytes::from_static(b"paid"))
            })
        })
        .await
        .unwrap();
    let TxOutcome::Executed { result, lease } = outcome else {
        panic!("expected Executed, got {outcome:?}");
    };
    assert_eq!(result, Bytes::from_static(b"paid"));
    assert_eq!(lease.attempt, 1);
    assert_eq!(effect_count(&admin, &effects, "m1").await, 1);
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(
        record.state,
        RecordState::Completed {
            result: Bytes::from_static(b"paid")
        }
    );
    assert_eq!(record.token, lease.token);

    // A duplicate is replayed without running the handler.
    let outcome = store
        .transactional(&req, RETENTION, |_, _| {
            Box::pin(async { panic!("the handler must not run for a duplicate") })
        })
        .await
        .unwrap();
    assert_eq!(
        outcome,
        TxOutcome::NotRun(AcquireOutcome::Replayed {
            result: Bytes::from_static(b"paid")
        })
    );
    assert_eq!(effect_count(&admin, &effects, "m1").await, 1);
}

#[tokio::test]
async fn handler_error_rolls_back_business_writes_but_counts_the_attempt() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let effects = effects_table(&admin).await;
    let key = ns().key("poison").unwrap();
    let req = AcquireRequest::new(key.clone(), "w1").with_max_attempts(2);
    let sql = format!("INSERT INTO {effects} (msg, token) VALUES ($1, $2)");

    for attempt in 1..=2u32 {
        let sql = sql.clone();
        let outcome = store
            .transactional(&req, RETENTION, move |tx, lease| {
                Box::pin(async move {
                    assert_eq!(lease.attempt, attempt);
                    tx.execute(&sql, &[&lease.key.id(), &(lease.token.get() as i64)])
                        .await?;
                    Err(HandlerError::retryable(format!(
                        "downstream said no ({attempt})"
                    )))
                })
            })
            .await
            .unwrap();
        assert_eq!(
            outcome,
            TxOutcome::HandlerFailed {
                error: format!("downstream said no ({attempt})"),
                retryable: true,
                recorded: true
            }
        );
        assert_eq!(
            effect_count(&admin, &effects, "poison").await,
            0,
            "rolled back"
        );
        let record = store.get(&key).await.unwrap().unwrap();
        assert_eq!(record.attempts, attempt);
        assert_eq!(
            record.state,
            RecordState::Failed {
                error: format!("downstream said no ({attempt})"),
                kind: FailureKind::Retryable
            }
        );
    }
    let outcome = store
        .transactional(&req, RETENTION, |_, _| {
            Box::pin(async { panic!("an exhausted key must not run") })
        })
        .await
        .unwrap();
    assert_eq!(
        outcome,
        TxOutcome::NotRun(AcquireOutcome::Exhausted {
            attempts: 2,
            last_error: Some("downstream said no (2)".into())
        })
    );
}

#[tokio::test]
async fn terminal_handler_error_is_replayed() {
    let Some(store) = common::store().await else {
        return;
    };
    let key = ns().key("bad-request").unwrap();
    let req = AcquireRequest::new(key.clone(), "w1");
    let outcome = store
        .transactional(&req, RETENTION, |_, _| {
            Box::pin(async { Err(HandlerError::terminal("invalid amount")) })
        })
        .await
        .unwrap();
    assert!(
        matches!(
            outcome,
            TxOutcome::HandlerFailed {
                retryable: false,
                recorded: true,
                ..
            }
        ),
        "{outcome:?}"
    );
    let outcome = store
        .transactional(&req, RETENTION, |_, _| {
            Box::pin(async { panic!("never re-run") })
        })
        .await
        .unwrap();
    assert_eq!(
        outcome,
        TxOutcome::NotRun(AcquireOutcome::Failed {
            error: "invalid amount".into(),
            kind: FailureKind::Terminal
        })
    );
}

/// While one transaction holds the key, a concurrent duplicate (transactional or plain) waits at
/// most the lock timeout and answers "in progress"; after the holder commits it is a replay.
#[tokio::test]
async fn concurrent_duplicate_gets_in_progress_within_the_lock_timeout() {
    let lock_timeout = Duration::from_millis(300);
    let Some(store) =
        common::store_with(common::config(common::run_schema()).with_lock_timeout(lock_timeout))
            .await
    else {
        return;
    };
    let key = ns().key("dup").unwrap();
    let req = AcquireRequest::new(key.clone(), "holder");

    let (entered_tx, entered) = oneshot::channel::<()>();
    let (release_tx, release) = oneshot::channel::<()>();
    let holder = {
        let store = store.clone();
        let req = req.clone();
        tokio::spawn(async move {
            store
                .transactional(&req, RETENTION, move |_, _| {
                    Box::pin(async move {
                        entered_tx.send(()).unwrap();
                        release.await.unwrap();
                        Ok(Bytes::from_static(b"first"))
                    })
                })
                .await
        })
    };
    entered.await.unwrap();

    let dup = AcquireRequest::new(key.clone(), "duplicate");
    let started = Instant::now();
    let outcome = store
        .transactional(&dup, RETENTION, |_, _| {
            Box::pin(async { panic!("the duplicate must not run") })
        })
        .await
        .unwrap();
    let waited = started.elapsed();
    assert_eq!(
        outcome,
        TxOutcome::NotRun(AcquireOutcome::InProgress {
            owner: UNCOMMITTED_OWNER.into(),
            retry_after: lock_timeout
        })
    );
    // It waited for the lock (not answered from a stale snapshot), and not much longer.
    assert!(waited >= lock_timeout, "{waited:?}");
    assert!(waited < lock_timeout + Duration::from_secs(3), "{waited:?}");

    // A plain acquire is bounded the same way.
    let started = Instant::now();
    let plain = store.acquire(&dup).await.unwrap();
    assert!(
        matches!(plain, AcquireOutcome::InProgress { .. }),
        "{plain:?}"
    );
    assert!(started.elapsed() < lock_timeout + Duration::from_secs(3));

    release_tx.send(()).unwrap();
    let first = holder.await.unwrap().unwrap();
    assert!(matches!(first, TxOutcome::Executed { .. }), "{first:?}");
    let again = store.acquire(&dup).await.unwrap();
    assert_eq!(
        again,
        AcquireOutcome::Replayed {
            result: Bytes::from_static(b"first")
        }
    );
}

/// A crash anywhere before commit (here: the future is dropped mid-handler, as when the task is
/// cancelled or the process dies) rolls back the business writes and the acquisition.
#[tokio::test]
async fn crash_before_commit_rolls_everything_back() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let effects = effects_table(&admin).await;
    let key = ns().key("crash").unwrap();
    let req = AcquireRequest::new(key.clone(), "w1");
    let sql = format!("INSERT INTO {effects} (msg, token) VALUES ($1, $2)");
    let (inserted_tx, inserted) = oneshot::channel::<()>();
    let task = {
        let store = store.clone();
        let req = req.clone();
        let sql = sql.clone();
        tokio::spawn(async move {
            store
                .transactional(&req, RETENTION, move |tx, lease| {
                    Box::pin(async move {
                        tx.execute(&sql, &[&lease.key.id(), &(lease.token.get() as i64)])
                            .await?;
                        inserted_tx.send(()).unwrap();
                        std::future::pending::<()>().await;
                        Ok(Bytes::new())
                    })
                })
                .await
        })
    };
    inserted.await.unwrap();
    task.abort();
    let _ = task.await;

    // Everything is as before: no effect, no record, and the key is acquirable at once.
    let mut record = store.get(&key).await.unwrap();
    for _ in 0..50 {
        if record.is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        record = store.get(&key).await.unwrap();
    }
    assert_eq!(record, None);
    assert_eq!(effect_count(&admin, &effects, "crash").await, 0);
    let outcome = store
        .transactional(&req, RETENTION, |_, lease| {
            let attempt = lease.attempt;
            Box::pin(async move { Ok(Bytes::from(attempt.to_string())) })
        })
        .await
        .unwrap();
    assert!(
        matches!(&outcome, TxOutcome::Executed { result, .. } if result == "1"),
        "{outcome:?}"
    );
}

#[tokio::test]
async fn inside_a_transaction_the_caller_opened() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let effects = effects_table(&admin).await;
    let ns = ns();
    let sql = format!("INSERT INTO {effects} (msg, token) VALUES ($1, $2)");
    let mut client = store.pool().get().await.unwrap();

    // Commit: the caller's own statement, the handler's and the completion land together.
    let key = ns.key("ext-commit").unwrap();
    let req = AcquireRequest::new(key.clone(), "w1");
    let mut tx = client.transaction().await.unwrap();
    tx.execute(&sql, &[&"before", &0i64]).await.unwrap();
    let s = sql.clone();
    let outcome = store
        .transactional_in(&mut tx, &req, RETENTION, move |tx, lease| {
            Box::pin(async move {
                tx.execute(&s, &[&lease.key.id(), &(lease.token.get() as i64)])
                    .await?;
                Ok(Bytes::from_static(b"ok"))
            })
        })
        .await
        .unwrap();
    assert!(matches!(outcome, TxOutcome::Executed { .. }), "{outcome:?}");
    assert_eq!(
        store.get(&key).await.unwrap(),
        None,
        "not visible before the commit"
    );
    tx.commit().await.unwrap();
    assert_eq!(effect_count(&admin, &effects, "before").await, 1);
    assert_eq!(effect_count(&admin, &effects, "ext-commit").await, 1);
    assert!(matches!(
        store.get(&key).await.unwrap().unwrap().state,
        RecordState::Completed { .. }
    ));

    // Handler failure: rolled back to the savepoint, the caller's transaction stays usable, and
    // the failed attempt is recorded outside it (so it stays even if the caller rolls back).
    let key = ns.key("ext-fail").unwrap();
    let req = AcquireRequest::new(key.clone(), "w1");
    let mut tx = client.transaction().await.unwrap();
    tx.execute(&sql, &[&"kept", &0i64]).await.unwrap();
    let s = sql.clone();
    let outcome = store
        .transactional_in(&mut tx, &req, RETENTION, move |tx, lease| {
            Box::pin(async move {
                tx.execute(&s, &[&lease.key.id(), &(lease.token.get() as i64)])
                    .await?;
                Err(HandlerError::retryable("nope"))
            })
        })
        .await
        .unwrap();
    assert!(
        matches!(outcome, TxOutcome::HandlerFailed { recorded: true, .. }),
        "{outcome:?}"
    );
    tx.execute(&sql, &[&"after", &0i64]).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(effect_count(&admin, &effects, "kept").await, 1);
    assert_eq!(effect_count(&admin, &effects, "after").await, 1);
    assert_eq!(effect_count(&admin, &effects, "ext-fail").await, 0);
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.attempts, 1);
    assert!(matches!(
        record.state,
        RecordState::Failed {
            kind: FailureKind::Retryable,
            ..
        }
    ));

    // The caller rolls back after success: nothing happened, the key is free.
    let key = ns.key("ext-rollback").unwrap();
    let req = AcquireRequest::new(key.clone(), "w1");
    let mut tx = client.transaction().await.unwrap();
    let outcome = store
        .transactional_in(&mut tx, &req, RETENTION, |_, _| {
            Box::pin(async { Ok(Bytes::from_static(b"x")) })
        })
        .await
        .unwrap();
    assert!(matches!(outcome, TxOutcome::Executed { .. }), "{outcome:?}");
    tx.rollback().await.unwrap();
    assert_eq!(store.get(&key).await.unwrap(), None);
}

/// The acceptance test: 20 workers deliver each of 2,000 messages three times, with
/// random aborts mid-transaction and connections killed with `pg_terminate_backend` (both by the
/// handler itself and by a background killer at random moments: during acquire, handler,
/// completion or commit). Every message must end completed, with exactly one effect in the
/// business table, written by the acquisition that completed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_once_effect_under_aborts_and_killed_connections() {
    const MESSAGES: usize = 2_000;
    const DELIVERIES: usize = 3;
    const WORKERS: usize = 20;

    let app = format!("idem-chaos-{:08x}", rand::random::<u32>());
    let Some(store) = common::store_with(
        common::config(common::run_schema())
            .with_application_name(app.clone())
            .with_pool_size(WORKERS + 4)
            .with_lock_timeout(Duration::from_millis(200)),
    )
    .await
    else {
        return;
    };
    let admin = Arc::new(common::admin().await);
    let effects = effects_table(&admin).await;
    let ns = ns();

    // A quarter of the messages arrive with their copies back to back (so different workers
    // hold them at the same time and meet the lock timeout); the rest are scattered.
    let mut groups: Vec<Vec<usize>> = (0..MESSAGES)
        .flat_map(|m| {
            if m % 4 == 0 {
                vec![vec![m; DELIVERIES]]
            } else {
                vec![vec![m]; DELIVERIES]
            }
        })
        .collect();
    groups.shuffle(&mut rand::rng());
    let deliveries: Vec<usize> = groups.into_iter().flatten().collect();
    let queue = Arc::new(std::sync::Mutex::new(deliveries));

    #[derive(Default)]
    struct Stats {
        executed: AtomicU64,
        replayed: AtomicU64,
        in_progress: AtomicU64,
        aborted: AtomicU64,
        self_killed: AtomicU64,
        unavailable: AtomicU64,
        killer_kills: AtomicU64,
    }
    let stats = Arc::new(Stats::default());

    // Background killer: every ~25 ms terminates one random backend of the store.
    let (stop_tx, mut stop) = tokio::sync::watch::channel(false);
    let killer = {
        let admin = admin.clone();
        let app = app.clone();
        let stats = stats.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(25)) => {}
                    _ = stop.changed() => break,
                }
                let killed: i64 = admin
                    .query_one(
                        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                         WHERE application_name = $1 AND state <> 'idle' \
                         ORDER BY random() LIMIT 1) k",
                        &[&app],
                    )
                    .await
                    .map(|r| r.get(0))
                    .unwrap_or(0);
                stats
                    .killer_kills
                    .fetch_add(killed as u64, Ordering::Relaxed);
            }
        })
    };

    let insert = format!("INSERT INTO {effects} (msg, token) VALUES ($1, $2)");
    let started = Instant::now();
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let (store, queue, stats, admin, insert, ns) = (
                store.clone(),
                queue.clone(),
                stats.clone(),
                admin.clone(),
                insert.clone(),
                ns.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let Some(m) = queue.lock().unwrap().pop() else {
                        break;
                    };
                    let id = format!("msg-{m}");
                    let req = AcquireRequest::new(ns.key(&id).unwrap(), format!("worker-{w}"))
                        .with_max_attempts(10_000);
                    // Deliver until the consumer would ack: executed or replayed.
                    for round in 0.. {
                        assert!(round < 1_000, "{id} never finished");
                        let (insert, admin, stats2) =
                            (insert.clone(), admin.clone(), stats.clone());
                        let outcome = store
                            .transactional(&req, RETENTION, move |tx, lease| {
                                Box::pin(async move {
                                    tx.execute(
                                        &insert,
                                        &[&lease.key.id(), &(lease.token.get() as i64)],
                                    )
                                    .await?;
                                    let dice: f64 = rand::random();
                                    if dice < 0.08 {
                                        return Err(HandlerError::retryable("random abort"));
                                    }
                                    if dice < 0.12 {
                                        // Kill our own connection mid-transaction.
                                        let pid: i32 = tx
                                            .query_one("SELECT pg_backend_pid()", &[])
                                            .await?
                                            .get(0);
                                        admin
                                            .execute("SELECT pg_terminate_backend($1)", &[&pid])
                                            .await
                                            .map_err(HandlerError::retryable)?;
                                        stats2.self_killed.fetch_add(1, Ordering::Relaxed);
                                    } else if dice < 0.14 {
                                        // Slower than the lock timeout: a concurrent copy of
                                        // this message answers "in progress".
                                        tokio::time::sleep(Duration::from_millis(300)).await;
                                    } else if dice < 0.17 {
                                        tokio::time::sleep(Duration::from_millis(5)).await;
                                    }
                                    Ok(Bytes::from(lease.key.id().to_owned()))
                                })
                            })
                            .await;
                        match outcome {
                            Ok(TxOutcome::Executed { .. }) => {
                                stats.executed.fetch_add(1, Ordering::Relaxed);
                                break;
                            }
                            Ok(TxOutcome::NotRun(AcquireOutcome::Replayed { result })) => {
                                assert_eq!(result, id.as_bytes());
                                stats.replayed.fetch_add(1, Ordering::Relaxed);
                                break;
                            }
                            Ok(TxOutcome::NotRun(AcquireOutcome::InProgress { .. })) => {
                                stats.in_progress.fetch_add(1, Ordering::Relaxed);
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                            Ok(TxOutcome::HandlerFailed { .. }) => {
                                stats.aborted.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(other) => panic!("{id}: unexpected {other:?}"),
                            Err(e) if e.is_retryable() => {
                                stats.unavailable.fetch_add(1, Ordering::Relaxed);
                                tokio::time::sleep(Duration::from_millis(5)).await;
                            }
                            Err(e) => panic!("{id}: non-retryable error {e:?}"),
                        }
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    let _ = stop_tx.send(true);
    killer.await.unwrap();
    let elapsed = started.elapsed();

    let s = |a: &AtomicU64| a.load(Ordering::Relaxed);
    println!(
        "{} deliveries in {elapsed:?}: executed {}, replayed {}, in progress {}, handler aborts {}, \
         self-kills {}, killer kills {}, unavailable {}",
        MESSAGES * DELIVERIES,
        s(&stats.executed),
        s(&stats.replayed),
        s(&stats.in_progress),
        s(&stats.aborted),
        s(&stats.self_killed),
        s(&stats.killer_kills),
        s(&stats.unavailable),
    );
    // The chaos really happened.
    assert!(s(&stats.aborted) > 0 && s(&stats.self_killed) > 0 && s(&stats.unavailable) > 0);

    // Exactly one effect per message.
    let dupes = admin
        .query(
            &format!("SELECT msg, count(*) FROM {effects} GROUP BY msg HAVING count(*) <> 1"),
            &[],
        )
        .await
        .unwrap();
    let dupes: Vec<(String, i64)> = dupes.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert!(
        dupes.is_empty(),
        "messages without exactly one effect: {dupes:?}"
    );
    let distinct: i64 = admin
        .query_one(&format!("SELECT count(DISTINCT msg) FROM {effects}"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(distinct, MESSAGES as i64);

    // Every message completed, and its effect was written by the completing acquisition.
    let completed: i64 = admin
        .query_one(
            &format!(
                "SELECT count(*) FROM {} WHERE namespace = $1 AND state = 'completed'",
                store.qualified_table()
            ),
            &[&ns.as_str()],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(completed, MESSAGES as i64);
    let mismatched: i64 = admin
        .query_one(
            &format!(
                "SELECT count(*) FROM {effects} e JOIN {} r ON r.namespace = $1 AND r.id = e.msg \
                 WHERE e.token <> r.token OR r.result <> convert_to(e.msg, 'UTF8')",
                store.qualified_table()
            ),
            &[&ns.as_str()],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        mismatched, 0,
        "effects written by a non-completing acquisition"
    );
    assert!(s(&stats.executed) <= MESSAGES as u64);
}

/// Store errors inside transactional mode keep their mapping: a store on a dead port answers
/// `Unavailable` and never runs the handler.
#[tokio::test]
async fn unreachable_store_never_runs_the_handler() {
    let store = PostgresStore::connect(
        idem_postgres::PostgresConfig::new("postgres://postgres@127.0.0.1:1/test")
            .unwrap()
            .with_connect_timeout(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    let req = AcquireRequest::new(ns().key("k").unwrap(), "w");
    let r = store
        .transactional(&req, RETENTION, |_, _| {
            Box::pin(async { panic!("must not run") })
        })
        .await;
    assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
}

/// The acquire's lock timeout applies to the acquire only: the handler's statements run with the
/// session's own `lock_timeout`, and the pooled connection keeps its `statement_timeout`.
#[tokio::test]
async fn lock_timeout_is_restored_for_business_statements() {
    let Some(store) = common::store_with(
        common::config(common::run_schema())
            .with_pool_size(1)
            .with_lock_timeout(Duration::from_millis(1234))
            .with_statement_timeout(Duration::from_secs(7)),
    )
    .await
    else {
        return;
    };
    let show = |name: &'static str| {
        let store = store.clone();
        async move {
            let client = store.pool().get().await.unwrap();
            let row = client
                .query_one(&format!("SHOW {name}"), &[])
                .await
                .unwrap();
            row.get::<_, String>(0)
        }
    };
    assert_eq!(show("statement_timeout").await, "7s");
    let key = ns().key("settings").unwrap();
    store.acquire(&AcquireRequest::new(key, "w")).await.unwrap();
    assert_eq!(
        show("lock_timeout").await,
        "0",
        "autocommit acquire leaves no trace"
    );

    let req = AcquireRequest::new(ns().key("settings-tx").unwrap(), "w");
    let outcome = store
        .transactional(&req, RETENTION, |tx, _| {
            Box::pin(async move {
                let row = tx.query_one("SHOW lock_timeout", &[]).await?;
                Ok(Bytes::from(row.get::<_, String>(0)))
            })
        })
        .await
        .unwrap();
    assert!(
        matches!(&outcome, TxOutcome::Executed { result, .. } if result == "0"),
        "the handler must see the session's lock_timeout: {outcome:?}"
    );

    // With a transaction the caller opened and its own lock_timeout.
    let mut client = store.pool().get().await.unwrap();
    let mut tx = client.transaction().await.unwrap();
    tx.batch_execute("SET LOCAL lock_timeout = '42s'")
        .await
        .unwrap();
    let req = AcquireRequest::new(ns().key("settings-ext").unwrap(), "w");
    let outcome = store
        .transactional_in(&mut tx, &req, RETENTION, |tx, _| {
            Box::pin(async move {
                let row = tx.query_one("SHOW lock_timeout", &[]).await?;
                Ok(Bytes::from(row.get::<_, String>(0)))
            })
        })
        .await
        .unwrap();
    assert!(
        matches!(&outcome, TxOutcome::Executed { result, .. } if result == "42s"),
        "{outcome:?}"
    );
    tx.commit().await.unwrap();
}

/// Recording a failed attempt waits at most the lock timeout on a key another transaction holds:
/// the attempt is then reported as not recorded (a definite outcome), not as `Unavailable` after
/// the statement timeout, and the holder's state stands.
#[tokio::test]
async fn record_failure_gives_up_after_the_lock_timeout() {
    let lock_timeout = Duration::from_millis(300);
    let Some(store) = common::store_with(
        common::config(common::run_schema())
            .with_lock_timeout(lock_timeout)
            .with_statement_timeout(Duration::from_secs(5)),
    )
    .await
    else {
        return;
    };
    let key = ns().key("locked-after-rollback").unwrap();
    let req = AcquireRequest::new(key.clone(), "w1");
    // An existing, acquirable record, so there is a row to lock.
    let AcquireOutcome::Acquired { lease, .. } = store.acquire(&req).await.unwrap() else {
        panic!("first acquire");
    };
    store.release(&lease).await.unwrap();

    // The caller's transaction locks the row before the savepoint, so the lock outlives the
    // handler's rollback and the failure is recorded (on another connection) while it is held.
    let mut client = store.pool().get().await.unwrap();
    let mut tx = client.transaction().await.unwrap();
    let lock_sql = format!(
        "SELECT 1 FROM \"{}\".\"records\" WHERE namespace = $1 AND id = $2 FOR UPDATE",
        common::run_schema()
    );
    let locked = tx
        .query(&lock_sql, &[&key.namespace().as_str(), &key.id()])
        .await
        .unwrap();
    assert_eq!(locked.len(), 1);

    let started = Instant::now();
    let outcome = store
        .transactional_in(&mut tx, &req, RETENTION, |_, _| {
            Box::pin(async { Err(HandlerError::retryable("downstream said no")) })
        })
        .await
        .unwrap();
    let waited = started.elapsed();
    assert_eq!(
        outcome,
        TxOutcome::HandlerFailed {
            error: "downstream said no".into(),
            retryable: true,
            recorded: false
        }
    );
    assert!(waited >= lock_timeout, "it waited for the lock: {waited:?}");
    assert!(waited < Duration::from_secs(4), "{waited:?}");

    tx.rollback().await.unwrap();
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Released);
    assert_eq!(record.attempts, 0, "the attempt was not counted");
    assert_eq!(record.token, lease.token, "the record was not touched");
}
