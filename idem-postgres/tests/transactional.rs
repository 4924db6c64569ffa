//! In-transaction mode: business writes and the idempotency record commit or roll back together,
//! driven by the executor's types (`HandlerError`, `Outcome`, codec, key source, fingerprint).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_core::{
    AcquireOutcome, AcquireRequest, FailureKind, IdempotencyKey, IdempotencyStore, RecordState,
};
use idem_executor::{
    BrokerAction, CommitRefusal, DeadLetterReason, ExecutorConfig, ExecutorError, HandlerError,
    Message, Outcome, RawMessage, StoreStage,
};
use idem_postgres::{InTransaction, PostgresConfig, PostgresStore, UNCOMMITTED_OWNER, tx_handler};
use rand::seq::SliceRandom;
use tokio::sync::oneshot;

fn namespace() -> String {
    format!("tx-{:08x}", rand::random::<u32>())
}

fn msg(id: &str) -> RawMessage {
    RawMessage::new(r#"{"amount": 1250}"#).with_header("idempotency-key", id.to_owned())
}

/// The in-transaction mode over `store` with a fresh namespace, configured by `configure`.
fn mode(
    store: &PostgresStore,
    configure: impl FnOnce(ExecutorConfig) -> ExecutorConfig,
) -> InTransaction {
    store
        .in_transaction(configure(ExecutorConfig::new(namespace())))
        .unwrap()
}

fn key(mode: &InTransaction, id: &str) -> IdempotencyKey {
    mode.executor().namespace().key(id).unwrap()
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
    let mode = mode(&store, |c| c);

    let sql = format!("INSERT INTO {effects} (msg, token) VALUES ($1, $2)");
    let outcome = mode
        .run(&msg("m1"), |tx, lease| {
            let sql = sql.clone();
            Box::pin(async move {
                tx.execute(&sql, &[&lease.key.id(), &(lease.token.get() as i64)])
                    .await?;
                Ok(format!("paid at attempt {}", lease.attempt))
            })
        })
        .await
        .unwrap();
    assert!(
        matches!(&outcome, Outcome::Executed(v) if v == "paid at attempt 1"),
        "{outcome:?}"
    );
    assert_eq!(effect_count(&admin, &effects, "m1").await, 1);
    let record = store.get(&key(&mode, "m1")).await.unwrap().unwrap();
    // Stored through the executor's codec (JSON).
    assert_eq!(
        record.state,
        RecordState::Completed {
            result: "\"paid at attempt 1\"".into()
        }
    );

    // A duplicate is replayed, decoded, without running the handler.
    let outcome = mode
        .run::<_, String, _>(&msg("m1"), |_, _| {
            Box::pin(async { panic!("the handler must not run for a duplicate") })
        })
        .await
        .unwrap();
    assert!(
        matches!(&outcome, Outcome::Replayed(v) if v == "paid at attempt 1"),
        "{outcome:?}"
    );
    assert_eq!(BrokerAction::of(&Ok(outcome)), BrokerAction::Ack);
    assert_eq!(effect_count(&admin, &effects, "m1").await, 1);
}

/// Keys and fingerprints come from the message as the executor's configuration says.
#[tokio::test]
async fn keys_and_fingerprints_come_from_the_message() {
    let Some(store) = common::store().await else {
        return;
    };
    let mode = mode(&store, |c| c);
    let outcome = mode
        .run(&msg("k"), |_, _| Box::pin(async { Ok(1u32) }))
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Executed(1)), "{outcome:?}");
    // Same key, another payload: the sender reused a key for a different request.
    let other = RawMessage::new(r#"{"amount": 9}"#).with_header("idempotency-key", "k");
    let outcome = mode
        .run(&other, |_, _| Box::pin(async { Ok(2u32) }))
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Conflict), "{outcome:?}");
    // No key (header names are case-sensitive): rejected, nothing run.
    let unkeyed = RawMessage::new("{}").with_header("Idempotency-Key", "k");
    let r = mode
        .run::<_, (), _>(&unkeyed, |_, _| Box::pin(async { panic!("must not run") }))
        .await;
    assert!(matches!(r, Err(ExecutorError::MissingKey)), "{r:?}");
    assert!(matches!(
        BrokerAction::of(&r),
        BrokerAction::DeadLetter {
            reason: DeadLetterReason::MissingKey,
            ..
        }
    ));
}

/// The runner's entry point: a registered handler, message in, outcome out.
#[tokio::test]
async fn handle_runs_a_registered_handler_with_the_message() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let effects = effects_table(&admin).await;
    let mode = mode(&store, |c| c);
    let insert = Arc::new(format!(
        "INSERT INTO {effects} (msg, token) VALUES ($1, $2)"
    ));
    let handler = tx_handler(move |msg: RawMessage, tx, lease| {
        let insert = insert.clone();
        Box::pin(async move {
            let body = String::from_utf8(msg.payload().to_vec()).map_err(HandlerError::terminal)?;
            tx.execute(&*insert, &[&body, &(lease.token.get() as i64)])
                .await?;
            Ok::<_, HandlerError>(body.len())
        })
    });
    for delivery in 1..=2 {
        let result = mode.handle(msg("h"), &handler).await;
        match (delivery, &result) {
            (1, Ok(Outcome::Executed(16))) | (2, Ok(Outcome::Replayed(16))) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(BrokerAction::of(&result), BrokerAction::Ack);
    }
    assert_eq!(
        effect_count(&admin, &effects, r#"{"amount": 1250}"#).await,
        1
    );
}

#[tokio::test]
async fn handler_error_rolls_back_business_writes_but_counts_the_attempt() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let effects = effects_table(&admin).await;
    let mode = mode(&store, |c| c.with_max_attempts(2));
    let sql = format!("INSERT INTO {effects} (msg, token) VALUES ($1, $2)");

    for attempt in 1..=2u32 {
        let sql = sql.clone();
        let outcome = mode
            .run(&msg("poison"), move |tx, lease| {
                Box::pin(async move {
                    assert_eq!(lease.attempt, attempt);
                    tx.execute(&sql, &[&lease.key.id(), &(lease.token.get() as i64)])
                        .await?;
                    Err::<(), _>(HandlerError::retryable(format!(
                        "downstream said no ({attempt})"
                    )))
                })
            })
            .await
            .unwrap();
        let error = format!("downstream said no ({attempt})");
        match (attempt, &outcome) {
            (
                1,
                Outcome::Retry {
                    attempt: 1,
                    error: e,
                    panicked: false,
                    ..
                },
            ) if *e == error => {}
            (
                2,
                Outcome::Exhausted {
                    attempts: 2,
                    last_error: Some(e),
                },
            ) if *e == error => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(
            effect_count(&admin, &effects, "poison").await,
            0,
            "rolled back"
        );
        let record = store.get(&key(&mode, "poison")).await.unwrap().unwrap();
        assert_eq!(record.attempts, attempt);
        assert_eq!(
            record.state,
            RecordState::Failed {
                error,
                kind: FailureKind::Retryable
            }
        );
    }
    let outcome = mode
        .run(&msg("poison"), |_, _| {
            Box::pin(async { panic!("an exhausted key must not run") })
        })
        .await
        .unwrap();
    assert!(
        matches!(&outcome, Outcome::<()>::Exhausted { attempts: 2, last_error: Some(e) } if e == "downstream said no (2)"),
        "{outcome:?}"
    );
}

#[tokio::test]
async fn terminal_handler_error_is_replayed() {
    let Some(store) = common::store().await else {
        return;
    };
    let mode = mode(&store, |c| c);
    let outcome = mode
        .run(&msg("bad-request"), |_, _| {
            Box::pin(async { Err::<(), _>(HandlerError::terminal("invalid amount")) })
        })
        .await
        .unwrap();
    assert!(
        matches!(&outcome, Outcome::Failed { error } if error == "invalid amount"),
        "{outcome:?}"
    );
    let result = mode
        .run(&msg("bad-request"), |_, _| {
            Box::pin(async { panic!("never re-run") })
        })
        .await;
    assert!(
        matches!(&result, Ok(Outcome::<()>::Failed { error }) if error == "invalid amount"),
        "{result:?}"
    );
    assert!(matches!(
        BrokerAction::of(&result),
        BrokerAction::DeadLetter {
            reason: DeadLetterReason::Failed,
            ..
        }
    ));
}

/// Issue 19 item 4: a panic is caught, rolled back and recorded as a retryable failure, as the
/// executor does; a handler that always panics ends `Exhausted` after `max_attempts`.
#[tokio::test]
async fn a_handler_that_always_panics_ends_exhausted() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let effects = effects_table(&admin).await;
    let mode = mode(&store, |c| c.with_max_attempts(3));
    let sql = format!("INSERT INTO {effects} (msg, token) VALUES ($1, $2)");
    for attempt in 1..=3u32 {
        let sql = sql.clone();
        let outcome = mode
            .run(&msg("boom"), move |tx, lease| {
                Box::pin(async move {
                    tx.execute(&sql, &[&lease.key.id(), &(lease.token.get() as i64)])
                        .await?;
                    if lease.attempt > 0 {
                        panic!("boom at attempt {}", lease.attempt);
                    }
                    Ok(())
                })
            })
            .await
            .unwrap();
        let error = format!("handler panicked: boom at attempt {attempt}");
        match (attempt, &outcome) {
            (
                1 | 2,
                Outcome::Retry {
                    attempt: a,
                    error: e,
                    panicked: true,
                    ..
                },
            ) if *a == attempt && *e == error => {}
            (
                3,
                Outcome::Exhausted {
                    attempts: 3,
                    last_error: Some(e),
                },
            ) if *e == error => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(
            effect_count(&admin, &effects, "boom").await,
            0,
            "rolled back"
        );
    }
    let result = mode
        .run(&msg("boom"), |_, _| {
            Box::pin(async { panic!("must not run") })
        })
        .await;
    assert!(
        matches!(&result, Ok(Outcome::<()>::Exhausted { attempts: 3, .. })),
        "{result:?}"
    );
    assert!(matches!(
        BrokerAction::of(&result),
        BrokerAction::DeadLetter {
            reason: DeadLetterReason::Exhausted,
            ..
        }
    ));
}

/// A result that cannot be stored commits nothing: the effect did not happen, the failure is
/// terminal (as on the executor's transactional path).
#[tokio::test]
async fn a_result_that_cannot_be_stored_commits_nothing() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let effects = effects_table(&admin).await;
    let mode = mode(&store, |c| c.with_max_result_len(8));
    let sql = format!("INSERT INTO {effects} (msg, token) VALUES ($1, $2)");
    let outcome = mode
        .run(&msg("big"), move |tx, lease| {
            Box::pin(async move {
                tx.execute(&sql, &[&lease.key.id(), &(lease.token.get() as i64)])
                    .await?;
                Ok("a result far over eight bytes".to_owned())
            })
        })
        .await
        .unwrap();
    match &outcome {
        Outcome::NotCommitted {
            refusal: CommitRefusal::ResultNotStorable { reason },
            kind: FailureKind::Terminal,
            attempt: 1,
            error,
            ..
        } => {
            assert!(reason.contains("over the limit of 8 bytes"), "{reason}");
            assert!(error.starts_with("nothing committed: "), "{error}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(effect_count(&admin, &effects, "big").await, 0);
    let again = mode
        .run(&msg("big"), |_, _| {
            Box::pin(async { panic!("must not run") })
        })
        .await
        .unwrap();
    assert!(
        matches!(again, Outcome::<String>::Failed { .. }),
        "{again:?}"
    );
}

/// While one transaction holds the key, a concurrent duplicate (in this mode or plain) waits at
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
    let mode = mode(&store, |c| c);

    let (entered_tx, entered) = oneshot::channel::<()>();
    let (release_tx, release) = oneshot::channel::<()>();
    let holder = {
        let mode = mode.clone();
        tokio::spawn(async move {
            mode.run(&msg("dup"), move |_, _| {
                Box::pin(async move {
                    entered_tx.send(()).unwrap();
                    release.await.unwrap();
                    Ok("first".to_owned())
                })
            })
            .await
        })
    };
    entered.await.unwrap();

    let started = Instant::now();
    let outcome = mode
        .run(&msg("dup"), |_, _| {
            Box::pin(async { panic!("the duplicate must not run") })
        })
        .await
        .unwrap();
    let waited = started.elapsed();
    assert!(
        matches!(&outcome, Outcome::<String>::InProgress { owner, retry_after } if owner == UNCOMMITTED_OWNER && *retry_after == lock_timeout),
        "{outcome:?}"
    );
    // It waited for the lock (not answered from a stale snapshot), and not much longer.
    assert!(waited >= lock_timeout, "{waited:?}");
    assert!(waited < lock_timeout + Duration::from_secs(3), "{waited:?}");

    // A plain acquire is bounded the same way.
    let dup = AcquireRequest::new(key(&mode, "dup"), "duplicate");
    let started = Instant::now();
    let plain = store.acquire(&dup).await.unwrap();
    assert!(
        matches!(plain, AcquireOutcome::InProgress { .. }),
        "{plain:?}"
    );
    assert!(started.elapsed() < lock_timeout + Duration::from_secs(3));

    release_tx.send(()).unwrap();
    let first = holder.await.unwrap().unwrap();
    assert!(matches!(first, Outcome::Executed(_)), "{first:?}");
    let again = store.acquire(&dup).await.unwrap();
    assert_eq!(
        again,
        AcquireOutcome::Replayed {
            result: "\"first\"".into()
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
    let mode = mode(&store, |c| c);
    let sql = format!("INSERT INTO {effects} (msg, token) VALUES ($1, $2)");
    let (inserted_tx, inserted) = oneshot::channel::<()>();
    let task = {
        let mode = mode.clone();
        tokio::spawn(async move {
            mode.run(&msg("crash"), move |tx, lease| {
                Box::pin(async move {
                    tx.execute(&sql, &[&lease.key.id(), &(lease.token.get() as i64)])
                        .await?;
                    inserted_tx.send(()).unwrap();
                    std::future::pending::<()>().await;
                    Ok(())
                })
            })
            .await
        })
    };
    inserted.await.unwrap();
    task.abort();
    let _ = task.await;

    // Everything is as before: no effect, no record, and the key is acquirable at once.
    let key = key(&mode, "crash");
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
    let outcome = mode
        .run(&msg("crash"), |_, lease| {
            let attempt = lease.attempt;
            Box::pin(async move { Ok(attempt) })
        })
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Executed(1)), "{outcome:?}");
}

/// Issue 19 item 5: a transaction left idle (the handler awaits something forever) is ended by
/// the server within `transaction_idle_timeout`, which frees the key, and the call itself ends
/// at `transaction_timeout`.
#[tokio::test]
async fn an_idle_transaction_is_ended_within_the_idle_timeout() {
    let idle = Duration::from_millis(300);
    let bound = Duration::from_secs(3);
    let Some(store) = common::store_with(
        common::config(common::run_schema())
            .with_lock_timeout(Duration::from_millis(100))
            .with_transaction_idle_timeout(idle)
            .with_transaction_timeout(bound),
    )
    .await
    else {
        return;
    };
    let admin = common::admin().await;
    let effects = effects_table(&admin).await;
    let mode = mode(&store, |c| c);
    let sql = format!("INSERT INTO {effects} (msg, token) VALUES ($1, $2)");
    let (entered_tx, entered) = oneshot::channel::<()>();
    let call = {
        let mode = mode.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let outcome = mode
                .run(&msg("idle"), move |tx, lease| {
                    Box::pin(async move {
                        tx.execute(&sql, &[&lease.key.id(), &(lease.token.get() as i64)])
                            .await?;
                        entered_tx.send(()).unwrap();
                        // Awaits something that never comes, the transaction open and idle.
                        std::future::pending::<()>().await;
                        Ok(())
                    })
                })
                .await;
            (outcome, started.elapsed())
        })
    };
    entered.await.unwrap();
    let entered_at = Instant::now();
    // The key becomes acquirable (the row lock is gone) long before the call's own bound.
    let req = AcquireRequest::new(key(&mode, "idle"), "next");
    let lease = loop {
        match store.acquire(&req).await {
            Ok(AcquireOutcome::Acquired { lease, .. }) => break lease,
            Ok(AcquireOutcome::InProgress { .. }) | Err(_) => {
                assert!(
                    entered_at.elapsed() < bound,
                    "the key is still held {:?} after the handler went idle",
                    entered_at.elapsed()
                );
            }
            Ok(other) => panic!("{other:?}"),
        }
    };
    let freed = entered_at.elapsed();
    assert!(
        freed < idle + Duration::from_secs(1),
        "freed after {freed:?}"
    );
    assert_eq!(lease.attempt, 1, "the ended transaction counted no attempt");
    assert_eq!(effect_count(&admin, &effects, "idle").await, 0);

    // The call ends at its bound; the key is held by `next` now, so nothing is recorded.
    let (outcome, took) = call.await.unwrap();
    assert!(
        matches!(outcome, Ok(Outcome::<()>::LeaseLost { .. })),
        "{outcome:?}"
    );
    assert!(
        took >= bound && took < bound + Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!(
        store.get(&lease.key).await.unwrap().unwrap().token,
        lease.token
    );
}

/// Issue 19 item 5: a handler busy past `transaction_timeout` (a slow statement, so the idle
/// timeout does not fire) is cut at the bound: its statement is cancelled, the transaction rolled
/// back, the key free at once, and the attempt recorded as a retryable failure.
#[tokio::test]
async fn a_busy_transaction_is_ended_at_the_transaction_timeout() {
    let bound = Duration::from_millis(500);
    let Some(store) = common::store_with(
        common::config(common::run_schema())
            .with_statement_timeout(Duration::from_secs(20))
            .with_transaction_idle_timeout(Duration::from_secs(60))
            .with_transaction_timeout(bound),
    )
    .await
    else {
        return;
    };
    let mode = mode(&store, |c| c);
    let started = Instant::now();
    let outcome = mode
        .run(&msg("busy"), |tx, _| {
            Box::pin(async move {
                tx.execute("SELECT pg_sleep(15)", &[]).await?;
                Ok(())
            })
        })
        .await
        .unwrap();
    let took = started.elapsed();
    match &outcome {
        Outcome::Retry {
            attempt: 1,
            error,
            panicked: false,
            ..
        } => assert!(error.contains("transaction deadline passed"), "{error}"),
        other => panic!("{other:?}"),
    }
    assert!(
        took >= bound && took < bound + Duration::from_secs(4),
        "{took:?}"
    );
    let record = store.get(&key(&mode, "busy")).await.unwrap().unwrap();
    assert!(
        matches!(
            record.state,
            RecordState::Failed {
                kind: FailureKind::Retryable,
                ..
            }
        ),
        "{record:?}"
    );
    // The key is free at once, and the next attempt is the second.
    let started = Instant::now();
    let next = mode
        .run(&msg("busy"), |_, lease| {
            let attempt = lease.attempt;
            Box::pin(async move { Ok(attempt) })
        })
        .await
        .unwrap();
    assert!(matches!(next, Outcome::Executed(2)), "{next:?}");
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn inside_a_transaction_the_caller_opened() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let effects = effects_table(&admin).await;
    let mode = mode(&store, |c| c);
    let sql = format!("INSERT INTO {effects} (msg, token) VALUES ($1, $2)");
    let mut client = store.pool().get().await.unwrap();

    // Commit: the caller's own statement, the handler's and the completion land together.
    let mut tx = client.transaction().await.unwrap();
    tx.execute(&sql, &[&"before", &0i64]).await.unwrap();
    let s = sql.clone();
    let outcome = mode
        .run_in(&mut tx, &msg("ext-commit"), move |tx, lease| {
            Box::pin(async move {
                tx.execute(&s, &[&lease.key.id(), &(lease.token.get() as i64)])
                    .await?;
                Ok("ok".to_owned())
            })
        })
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Executed(_)), "{outcome:?}");
    assert_eq!(
        store.get(&key(&mode, "ext-commit")).await.unwrap(),
        None,
        "not visible before the commit"
    );
    tx.commit().await.unwrap();
    assert_eq!(effect_count(&admin, &effects, "before").await, 1);
    assert_eq!(effect_count(&admin, &effects, "ext-commit").await, 1);
    assert!(matches!(
        store
            .get(&key(&mode, "ext-commit"))
            .await
            .unwrap()
            .unwrap()
            .state,
        RecordState::Completed { .. }
    ));

    // Handler failure: rolled back to the savepoint, the caller's transaction stays usable, and
    // the failed attempt is recorded outside it (so it stays even if the caller rolls back).
    let mut tx = client.transaction().await.unwrap();
    tx.execute(&sql, &[&"kept", &0i64]).await.unwrap();
    let s = sql.clone();
    let outcome = mode
        .run_in(&mut tx, &msg("ext-fail"), move |tx, lease| {
            Box::pin(async move {
                tx.execute(&s, &[&lease.key.id(), &(lease.token.get() as i64)])
                    .await?;
                Err::<(), _>(HandlerError::retryable("nope"))
            })
        })
        .await
        .unwrap();
    assert!(
        matches!(outcome, Outcome::Retry { attempt: 1, .. }),
        "{outcome:?}"
    );
    tx.execute(&sql, &[&"after", &0i64]).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(effect_count(&admin, &effects, "kept").await, 1);
    assert_eq!(effect_count(&admin, &effects, "after").await, 1);
    assert_eq!(effect_count(&admin, &effects, "ext-fail").await, 0);
    let record = store.get(&key(&mode, "ext-fail")).await.unwrap().unwrap();
    assert_eq!(record.attempts, 1);
    assert!(matches!(
        record.state,
        RecordState::Failed {
            kind: FailureKind::Retryable,
            ..
        }
    ));

    // A panic in the caller's transaction: rolled back to the savepoint, recorded, the
    // transaction still usable.
    let mut tx = client.transaction().await.unwrap();
    let outcome = mode
        .run_in(&mut tx, &msg("ext-panic"), |_, _| {
            Box::pin(async { panic!("inside") })
        })
        .await
        .unwrap();
    assert!(
        matches!(outcome, Outcome::<()>::Retry { panicked: true, .. }),
        "{outcome:?}"
    );
    tx.execute(&sql, &[&"after-panic", &0i64]).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(effect_count(&admin, &effects, "after-panic").await, 1);

    // The caller rolls back after success: nothing happened, the key is free.
    let mut tx = client.transaction().await.unwrap();
    let outcome = mode
        .run_in(&mut tx, &msg("ext-rollback"), |_, _| {
            Box::pin(async { Ok(1u8) })
        })
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Executed(1)), "{outcome:?}");
    tx.rollback().await.unwrap();
    assert_eq!(store.get(&key(&mode, "ext-rollback")).await.unwrap(), None);
}

/// The issue's acceptance test: 20 workers deliver each of 2,000 messages three times, with
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
    let mode = mode(&store, |c| c.with_max_attempts(10_000));
    let ns = mode.executor().namespace().clone();

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
        lease_lost: AtomicU64,
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
        .map(|_| {
            let (mode, queue, stats, admin, insert) = (
                mode.clone(),
                queue.clone(),
                stats.clone(),
                admin.clone(),
                insert.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let Some(m) = queue.lock().unwrap().pop() else {
                        break;
                    };
                    let id = format!("msg-{m}");
                    // Deliver until the consumer would ack: executed or replayed.
                    for round in 0.. {
                        assert!(round < 1_000, "{id} never finished");
                        let (insert, admin, stats2) =
                            (insert.clone(), admin.clone(), stats.clone());
                        let outcome = mode
                            .run(&msg(&id), move |tx, lease| {
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
                                    Ok(lease.key.id().to_owned())
                                })
                            })
                            .await;
                        match outcome {
                            Ok(Outcome::Executed(_)) => {
                                stats.executed.fetch_add(1, Ordering::Relaxed);
                                break;
                            }
                            Ok(Outcome::Replayed(result)) => {
                                assert_eq!(result, id);
                                stats.replayed.fetch_add(1, Ordering::Relaxed);
                                break;
                            }
                            Ok(Outcome::InProgress { .. }) => {
                                stats.in_progress.fetch_add(1, Ordering::Relaxed);
                                tokio::time::sleep(Duration::from_millis(10)).await;
                            }
                            Ok(Outcome::Retry { .. }) => {
                                stats.aborted.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(Outcome::LeaseLost { .. }) => {
                                stats.lease_lost.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(other) => panic!("{id}: unexpected {other:?}"),
                            Err(ExecutorError::Store { .. }) => {
                                stats.unavailable.fetch_add(1, Ordering::Relaxed);
                                tokio::time::sleep(Duration::from_millis(5)).await;
                            }
                            Err(e) => panic!("{id}: unexpected error {e:?}"),
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
         not recorded {}, self-kills {}, killer kills {}, store errors {}",
        MESSAGES * DELIVERIES,
        s(&stats.executed),
        s(&stats.replayed),
        s(&stats.in_progress),
        s(&stats.aborted),
        s(&stats.lease_lost),
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
                 WHERE e.token <> r.token OR r.result <> convert_to(to_json(e.msg)::text, 'UTF8')",
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

/// Store errors keep their mapping: a store on a dead port is an `ExecutorError::Store` at
/// acquire, and the handler never runs.
#[tokio::test]
async fn unreachable_store_never_runs_the_handler() {
    let store = PostgresStore::connect(
        PostgresConfig::new("postgres://postgres@127.0.0.1:1/test")
            .unwrap()
            .with_connect_timeout(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    let mode = mode(&store, |c| c);
    let r = mode
        .run(&msg("k"), |_, _| Box::pin(async { panic!("must not run") }))
        .await;
    assert!(
        matches!(
            r,
            Err::<Outcome<()>, _>(ExecutorError::Store {
                stage: StoreStage::Acquire,
                handler_ran: false,
                source: idem_core::Error::Unavailable { .. },
                ..
            })
        ),
        "{r:?}"
    );
    assert!(matches!(BrokerAction::of(&r), BrokerAction::Retry { .. }));
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
    let mode = mode(&store, |c| c);
    store
        .acquire(&AcquireRequest::new(key(&mode, "settings"), "w"))
        .await
        .unwrap();
    assert_eq!(
        show("lock_timeout").await,
        "0",
        "autocommit acquire leaves no trace"
    );

    let outcome = mode
        .run(&msg("settings-tx"), |tx, _| {
            Box::pin(async move {
                let lock = tx.query_one("SHOW lock_timeout", &[]).await?;
                let idle = tx
                    .query_one("SHOW idle_in_transaction_session_timeout", &[])
                    .await?;
                Ok((lock.get::<_, String>(0), idle.get::<_, String>(0)))
            })
        })
        .await
        .unwrap();
    assert!(
        matches!(&outcome, Outcome::Executed((lock, idle)) if lock == "0" && idle == "10s"),
        "the handler sees the session's lock_timeout and the mode's idle timeout: {outcome:?}"
    );
    assert_eq!(
        show("idle_in_transaction_session_timeout").await,
        "0",
        "the idle timeout was the transaction's only"
    );

    // With a transaction the caller opened and its own lock_timeout.
    let mut client = store.pool().get().await.unwrap();
    let mut tx = client.transaction().await.unwrap();
    tx.batch_execute("SET LOCAL lock_timeout = '42s'")
        .await
        .unwrap();
    let outcome = mode
        .run_in(&mut tx, &msg("settings-ext"), |tx, _| {
            Box::pin(async move {
                let row = tx.query_one("SHOW lock_timeout", &[]).await?;
                Ok(row.get::<_, String>(0))
            })
        })
        .await
        .unwrap();
    assert!(
        matches!(&outcome, Outcome::Executed(v) if v == "42s"),
        "{outcome:?}"
    );
    tx.commit().await.unwrap();
}

/// Recording a failed attempt waits at most the lock timeout on a key another transaction holds:
/// the attempt is then not recorded (the outcome is `LeaseLost`, a definite answer), not
/// `Unavailable` after the statement timeout, and the holder's state stands.
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
    let mode = mode(&store, |c| c);
    let key = key(&mode, "locked-after-rollback");
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
    let outcome = mode
        .run_in(&mut tx, &msg("locked-after-rollback"), |_, _| {
            Box::pin(async { Err::<(), _>(HandlerError::retryable("downstream said no")) })
        })
        .await
        .unwrap();
    let waited = started.elapsed();
    assert!(matches!(outcome, Outcome::LeaseLost { .. }), "{outcome:?}");
    assert!(waited >= lock_timeout, "it waited for the lock: {waited:?}");
    assert!(waited < Duration::from_secs(4), "{waited:?}");

    tx.rollback().await.unwrap();
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Released);
    assert_eq!(record.attempts, 0, "the attempt was not counted");
    assert_eq!(record.token, lease.token, "the record was not touched");
}

/// A runner spawns its deliveries: the futures of `handle` and `run` must be `Send`.
#[test]
fn the_entry_points_are_send() {
    fn send<F: std::future::Future + Send>(_: F) {}
    #[allow(dead_code)]
    fn check(mode: &InTransaction, handler: &impl idem_postgres::TxHandler<RawMessage, String>) {
        send(mode.handle(msg("k"), handler));
        send(mode.run(&msg("k"), |_, _| Box::pin(async { Ok(1u8) })));
    }
}
