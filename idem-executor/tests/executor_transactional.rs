//! The transactional executor: the handler returns its result plus the writes to commit with it
//! (`Commit`), recorded with `TransactionalStore::complete_with`. On `MemoryStore` +
//! `MemoryWrites`, with `FaultyStore` for lost replies and outages.

mod common;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use idem_conformance::faults::{FaultyStore, InjectedFault, Op};
use idem_core::{
    Bytes, FailureKind, IdempotencyStore, MAX_MEMORY_WRITES, ManualClock, MemoryStore,
    MemoryWrites, RecordState,
};
use idem_executor::{
    BrokerAction, Codec, Commit, CommitRefusal, DeadLetter, DeadLetterReason, EffectRefusedPolicy,
    Executor, ExecutorConfig, ExecutorError, Handler, HandlerContext, HandlerError, Message,
    MissingKeyPolicy, Outcome, RawMessage, Recorder, StoreErrorPolicy, StoreStage,
    TransactionalExecutor,
};
use tokio_util::sync::CancellationToken;

type Faulty = FaultyStore<MemoryStore>;

fn msg(key: &str) -> RawMessage {
    RawMessage::new(r#"{"amount": 10}"#).with_header("idempotency-key", key.to_owned())
}

fn manual_clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::new(
        SystemTime::UNIX_EPOCH + Duration::from_secs(1 << 30),
    ))
}

/// A transactional executor over a fault-injecting `MemoryStore`.
fn executor(store: &Arc<Faulty>, config: ExecutorConfig) -> TransactionalExecutor<Faulty> {
    Executor::transactional(store.clone(), config).unwrap()
}

async fn state(store: &Faulty, exec: &TransactionalExecutor<Faulty>, id: &str) -> RecordState {
    store
        .get_ref()
        .get(&exec.namespace().key(id).unwrap())
        .await
        .unwrap()
        .expect("record present")
        .state
}

/// Seeds an effect value through a committed transactional run of its own key.
async fn seed(exec: &TransactionalExecutor<Faulty>, key: &str, value: &'static str) {
    let r = exec
        .run(&msg(&format!("seed-{key}")), |_| async move {
            Ok::<_, HandlerError>(Commit::new((), MemoryWrites::new().put(key, value)))
        })
        .await
        .unwrap();
    assert!(matches!(r, Outcome::Executed(())), "{r:?}");
}

#[tokio::test]
async fn a_committed_run_shows_the_effect_and_the_completion_together_and_a_duplicate_replays() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let exec = executor(&store, ExecutorConfig::new("pay"));
    assert!(Arc::ptr_eq(exec.transactional_store(), &store));
    let runs = AtomicUsize::new(0);
    let charge = |ctx: HandlerContext| {
        runs.fetch_add(1, Ordering::SeqCst);
        async move {
            let token = ctx.token().unwrap().get();
            let writes = MemoryWrites::new()
                .expect("charge/tx-1", None)
                .put("charge/tx-1", format!("10 EUR by token {token}"));
            Ok::<_, HandlerError>(Commit::new(format!("receipt {token}"), writes))
        }
    };

    let r = exec.run(&msg("tx-1"), charge).await.unwrap();
    let Outcome::Executed(receipt) = r else {
        panic!("{r:?}")
    };
    let memory = store.get_ref();
    let token = receipt.trim_start_matches("receipt ");
    assert_eq!(
        memory.effect("charge/tx-1"),
        Some(Bytes::from(format!("10 EUR by token {token}"))),
        "the effect is committed"
    );
    assert_eq!(
        state(&store, &exec, "tx-1").await,
        RecordState::Completed {
            result: Bytes::from(format!("\"{receipt}\""))
        },
        "with the completion"
    );
    assert_eq!(
        store.sent(Op::CompleteWith),
        1,
        "one transactional completion"
    );
    assert_eq!(store.calls(Op::Complete), 0, "never the plain one");

    // A duplicate: the stored result, no handler, no second effect.
    let r = exec.run(&msg("tx-1"), charge).await.unwrap();
    assert!(
        matches!(&r, Outcome::Replayed(again) if *again == receipt),
        "{r:?}"
    );
    assert_eq!(r.action(), BrokerAction::Ack);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
    assert_eq!(memory.effects_with_prefix("charge/").len(), 1);
    assert_eq!(
        store.calls(Op::CompleteWith),
        1,
        "nothing sent for the duplicate"
    );
}

/// The handler of a worker whose lease was taken over while it ran returns its writes; the store
/// refuses the late `complete_with` and commits none of them.
#[tokio::test]
async fn a_zombie_commits_nothing() {
    let clock = manual_clock();
    let store = Arc::new(FaultyStore::new(MemoryStore::with_clock(clock.clone())));
    let config = ExecutorConfig::new("zombie")
        .with_lease_ttl(Duration::from_secs(10))
        .with_heartbeat_interval(Duration::from_secs(5));
    let zombie = executor(&store, config.clone().with_owner("zombie"));
    let rescuer = executor(&store, config.with_owner("rescuer"));
    let m = msg("k");
    let r = zombie
        .run(&m, |_| async {
            // Stalled past the lease: another worker takes the key over and commits.
            clock.advance(Duration::from_secs(11));
            let rescued = rescuer
                .run(&m, |ctx| async move {
                    assert!(ctx.is_takeover());
                    let writes = MemoryWrites::new().put("charge/k", "rescuer");
                    Ok::<_, HandlerError>(Commit::new(2u8, writes))
                })
                .await
                .unwrap();
            assert!(matches!(rescued, Outcome::Executed(2)), "{rescued:?}");
            // The zombie comes back and hands in its own writes.
            let writes = MemoryWrites::new()
                .put("charge/k", "zombie")
                .put("zombie-was-here", "yes");
            Ok::<_, HandlerError>(Commit::new(1u8, writes))
        })
        .await
        .unwrap();
    assert!(matches!(r, Outcome::LeaseLost { .. }), "{r:?}");
    let memory = store.get_ref();
    assert_eq!(memory.effect("charge/k").as_deref(), Some(&b"rescuer"[..]));
    assert_eq!(memory.effect("zombie-was-here"), None, "no zombie write");
    assert_eq!(
        state(&store, &zombie, "k").await,
        RecordState::Completed {
            result: Bytes::from_static(b"2")
        }
    );
    assert_eq!(
        store.sent(Op::CompleteWith),
        2,
        "the rescuer's and the refused one"
    );
}

/// The store goes down between the handler and its completion and stays down past the local
/// lease deadline: the completion is re-sent while the lease holds, then given up; nothing is
/// committed. The next owner's retry commits exactly once. An effect written outside the store
/// happens twice in the same run: the honest bound the transactional path removes.
#[tokio::test(start_paused = true)]
async fn an_outage_past_the_lease_commits_nothing_and_the_next_owner_commits_once() {
    let clock = manual_clock();
    let store = Arc::new(FaultyStore::new(MemoryStore::with_clock(clock.clone())));
    let config = ExecutorConfig::new("outage").with_lease_ttl(Duration::from_secs(1));
    let first = executor(&store, config.clone().with_owner("first"));
    let next = executor(&store, config.with_owner("next"));
    let outside_effects = AtomicUsize::new(0);
    let handler = |ctx: HandlerContext| {
        let outside_effects = &outside_effects;
        let down = store.clone();
        async move {
            outside_effects.fetch_add(1, Ordering::SeqCst);
            let token = ctx.token().unwrap().get();
            if ctx.attempt() == 1 {
                // The store dies after the handler's work, before its completion.
                down.set_outage(true);
            }
            let writes = MemoryWrites::new().put(format!("effect/k/{token}"), "applied");
            Ok::<_, HandlerError>(Commit::new(token, writes))
        }
    };
    let m = msg("k");

    let r = first.run(&m, handler).await;
    match &r {
        Err(
            e @ ExecutorError::Store {
                stage: StoreStage::Complete,
                handler_ran: true,
                source,
                ..
            },
        ) => {
            assert_eq!(
                InjectedFault::of(source),
                Some(&InjectedFault::Outage {
                    op: Op::CompleteWith
                }),
                "{e}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(
        store.calls(Op::CompleteWith) > 1,
        "re-sent while the lease held"
    );
    assert_eq!(store.sent(Op::CompleteWith), 0);
    let memory = store.get_ref();
    assert!(
        memory.effects_with_prefix("effect/k/").is_empty(),
        "nothing committed"
    );

    // The store comes back after the lease ran out; a redelivery takes the key over.
    store.set_outage(false);
    clock.advance(Duration::from_secs(2));
    let r = next.run(&m, handler).await.unwrap();
    let Outcome::Executed(token) = r else {
        panic!("{r:?}")
    };
    let r = next.run(&m, handler).await.unwrap();
    assert!(matches!(r, Outcome::Replayed(t) if t == token), "{r:?}");

    let committed = memory.effects_with_prefix("effect/k/");
    assert_eq!(
        committed,
        vec![(format!("effect/k/{token}"), Bytes::from_static(b"applied"))],
        "exactly one effect, by the token that completed"
    );
    assert_eq!(
        outside_effects.load(Ordering::SeqCst),
        2,
        "an effect outside the store ran twice"
    );
}

/// `complete_with` lands but its reply is lost: the executor sends it again with the same result
/// and writes, the store answers `Ok` to the replay and applies nothing again.
#[tokio::test]
async fn a_lost_reply_is_sent_again_and_the_effect_applies_once() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let exec = executor(&store, ExecutorConfig::new("lost"));
    seed(&exec, "balance/alice", "100").await;
    store.lose_replies(Op::CompleteWith, 1);
    let sent = store.sent(Op::CompleteWith);
    let r = exec
        .run(&msg("debit-1"), |_| async {
            // Applied twice, the condition would refuse the second time.
            let writes = MemoryWrites::new()
                .expect("balance/alice", Some(Bytes::from_static(b"100")))
                .put("balance/alice", "90");
            Ok::<_, HandlerError>(Commit::new("debited".to_owned(), writes))
        })
        .await
        .unwrap();
    assert!(
        matches!(&r, Outcome::Executed(s) if s == "debited"),
        "{r:?}"
    );
    assert_eq!(
        store.lost_replies_left(Op::CompleteWith),
        0,
        "a reply was lost"
    );
    assert_eq!(store.sent(Op::CompleteWith) - sent, 2, "sent again");
    assert_eq!(store.calls(Op::Get), 0, "no read-back");
    assert_eq!(
        store.get_ref().effect("balance/alice").as_deref(),
        Some(&b"90"[..])
    );
    assert!(matches!(
        state(&store, &exec, "debit-1").await,
        RecordState::Completed { .. }
    ));
}

/// A write whose condition fails: nothing is committed, the failure is recorded as the
/// configured kind. Retryable by default (bounded by the attempts), terminal on request.
#[tokio::test]
async fn a_refused_effect_is_a_typed_failure_of_the_chosen_kind() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let letters: Arc<Mutex<Vec<DeadLetter>>> = Arc::default();
    let retrying = {
        let letters = letters.clone();
        Executor::transactional_builder(store.clone())
            .config(
                ExecutorConfig::new("refused")
                    .with_max_attempts(2)
                    .with_retry_delay(Duration::from_millis(300)),
            )
            .on_dead_letter(move |dl| letters.lock().unwrap().push(dl.clone()))
            .build()
            .unwrap()
    };
    assert_eq!(
        retrying.config().effect_refused,
        EffectRefusedPolicy::Retryable,
        "the default"
    );
    seed(&retrying, "balance/bob", "10").await;
    let runs = AtomicUsize::new(0);
    let overdraw = |_: HandlerContext| {
        runs.fetch_add(1, Ordering::SeqCst);
        async {
            let writes = MemoryWrites::new()
                .put("audit/overdraw", "tried")
                .expect("balance/bob", Some(Bytes::from_static(b"50")))
                .put("balance/bob", "0");
            Ok::<_, HandlerError>(Commit::new(50u32, writes))
        }
    };
    let m = msg("overdraw");

    let r = retrying.run(&m, overdraw).await.unwrap();
    match &r {
        Outcome::NotCommitted {
            refusal: CommitRefusal::EffectRefused { index: 1, reason },
            kind: FailureKind::Retryable,
            attempt: 1,
            error,
            ..
        } => {
            assert!(reason.contains("balance/bob"), "{reason}");
            assert!(error.starts_with("nothing committed: write 1 "), "{error}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        r.action(),
        BrokerAction::Retry {
            after: Duration::from_millis(300)
        }
    );
    let memory = store.get_ref();
    assert_eq!(memory.effect("audit/overdraw"), None, "nothing committed");
    assert_eq!(memory.effect("balance/bob").as_deref(), Some(&b"10"[..]));
    assert!(
        matches!(
            state(&store, &retrying, "overdraw").await,
            RecordState::Failed {
                kind: FailureKind::Retryable,
                ..
            }
        ),
        "recorded with fail"
    );

    // The redelivery runs the handler again; it was the last attempt: exhausted, hook once.
    let r = retrying.run(&m, overdraw).await.unwrap();
    assert!(
        matches!(&r, Outcome::Exhausted { attempts: 2, last_error: Some(e) } if e.starts_with("nothing committed")),
        "{r:?}"
    );
    assert!(matches!(
        r.action(),
        BrokerAction::DeadLetter {
            reason: DeadLetterReason::Exhausted,
            ..
        }
    ));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(letters.lock().unwrap().len(), 1, "the hook ran once");
    assert_eq!(memory.effect("audit/overdraw"), None);

    // Terminal on request: dead-lettered as `failed`, never re-run.
    let terminal = executor(
        &store,
        ExecutorConfig::new("refused-terminal").with_effect_refused(EffectRefusedPolicy::Terminal),
    );
    let r = terminal.run(&m, overdraw).await.unwrap();
    let Outcome::NotCommitted {
        refusal: CommitRefusal::EffectRefused { index: 1, .. },
        kind: FailureKind::Terminal,
        ref error,
        ..
    } = r
    else {
        panic!("{r:?}")
    };
    assert_eq!(
        r.action(),
        BrokerAction::DeadLetter {
            reason: DeadLetterReason::Failed,
            error: error.clone()
        }
    );
    let again = terminal.run(&m, overdraw).await.unwrap();
    assert!(
        matches!(&again, Outcome::Failed { error: e } if e == error),
        "{again:?}"
    );
    assert_eq!(
        runs.load(Ordering::SeqCst),
        3,
        "not re-run after a terminal refusal"
    );
    assert_eq!(memory.effect("audit/overdraw"), None);
}

/// Writes the store cannot take, and a result that cannot be stored: typed terminal failures,
/// nothing committed. Unlike the plain executor's `ResultNotStored`, the effect did not happen.
#[tokio::test]
async fn bad_writes_and_unstorable_results_commit_nothing() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let exec = executor(&store, ExecutorConfig::new("bad").with_max_result_len(8));
    let memory = store.get_ref();

    let r = exec
        .run(&msg("too-many"), |_| async {
            let writes = (0..=MAX_MEMORY_WRITES)
                .fold(MemoryWrites::new(), |w, i| w.put(format!("many/{i}"), "x"));
            Ok::<_, HandlerError>(Commit::new(1u8, writes))
        })
        .await
        .unwrap();
    match &r {
        Outcome::NotCommitted {
            refusal: CommitRefusal::InvalidWrites { reason },
            kind: FailureKind::Terminal,
            ..
        } => assert!(reason.contains(&MAX_MEMORY_WRITES.to_string()), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        r.action(),
        BrokerAction::DeadLetter {
            reason: DeadLetterReason::Failed,
            ..
        }
    ));
    assert!(memory.effects_with_prefix("many/").is_empty());
    assert!(matches!(
        state(&store, &exec, "too-many").await,
        RecordState::Failed {
            kind: FailureKind::Terminal,
            ..
        }
    ));

    let sent = store.calls(Op::CompleteWith);
    let r = exec
        .run(&msg("too-big"), |_| async {
            let writes = MemoryWrites::new().put("big/effect", "x");
            Ok::<_, HandlerError>(Commit::new("a result over eight bytes".to_owned(), writes))
        })
        .await
        .unwrap();
    match &r {
        Outcome::NotCommitted {
            refusal: CommitRefusal::ResultNotStorable { reason },
            kind: FailureKind::Terminal,
            error,
            ..
        } => {
            assert!(reason.contains("over the limit of 8 bytes"), "{reason}");
            assert!(
                error.starts_with("nothing committed: the result of"),
                "{error}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        store.calls(Op::CompleteWith),
        sent,
        "the writes were not sent"
    );
    assert_eq!(memory.effect("big/effect"), None);
    let recorded = state(&store, &exec, "too-big").await;
    assert!(
        matches!(
            recorded,
            RecordState::Failed {
                kind: FailureKind::Terminal,
                ..
            }
        ),
        "terminal, not ResultNotStored (the effect did not happen): {recorded:?}"
    );
    let again = exec
        .run(&msg("too-big"), |_| async {
            Ok::<_, HandlerError>(Commit::result_only(String::new()))
        })
        .await
        .unwrap();
    assert!(matches!(again, Outcome::Failed { .. }), "{again:?}");
}

#[tokio::test]
async fn a_panicking_handler_is_a_retryable_failure_and_commits_nothing() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let exec = executor(&store, ExecutorConfig::new("panics").with_max_attempts(2));
    let panicking = |_: HandlerContext| async {
        if true {
            panic!("bank client bug");
        }
        Ok::<_, HandlerError>(Commit::new(0u8, MemoryWrites::new().put("p/effect", "x")))
    };
    let r = exec.run(&msg("p"), panicking).await.unwrap();
    assert!(
        matches!(&r, Outcome::Retry { attempt: 1, panicked: true, error, .. } if error == "handler panicked: bank client bug"),
        "{r:?}"
    );
    let r = exec.run(&msg("p"), panicking).await.unwrap();
    assert!(matches!(r, Outcome::Exhausted { attempts: 2, .. }), "{r:?}");
    assert_eq!(store.get_ref().effect("p/effect"), None);
    assert_eq!(store.calls(Op::CompleteWith), 0);
}

/// A handler error in a transactional handler is recorded exactly as in the plain path.
#[tokio::test]
async fn handler_errors_are_recorded_as_in_the_plain_path() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let exec = executor(&store, ExecutorConfig::new("errors"));
    let r = exec
        .run(&msg("e"), |_| async {
            Err::<Commit<u8, MemoryWrites>, _>(HandlerError::terminal("bad amount"))
        })
        .await
        .unwrap();
    assert!(
        matches!(&r, Outcome::Failed { error } if error == "bad amount"),
        "{r:?}"
    );
    assert_eq!(store.calls(Op::CompleteWith), 0);
}

#[test]
fn policies_that_would_drop_the_writes_are_refused() {
    let store = Arc::new(MemoryStore::new());
    let e = Executor::transactional(
        store.clone(),
        ExecutorConfig::new("x").with_missing_key(MissingKeyPolicy::PassThrough),
    )
    .unwrap_err();
    assert_eq!(e.field, "missing_key", "{e}");
    let e = Executor::transactional(
        store.clone(),
        ExecutorConfig::new("x").with_store_errors(StoreErrorPolicy::FailOpen),
    )
    .unwrap_err();
    assert_eq!(e.field, "store_errors", "{e}");
    // The plain executor takes both.
    Executor::new(
        store,
        ExecutorConfig::new("x")
            .with_missing_key(MissingKeyPolicy::PassThrough)
            .with_store_errors(StoreErrorPolicy::FailOpen),
    )
    .unwrap();
}

/// Lost lease while the completion is re-sent: `LeaseLost` from `complete_with` is final.
#[tokio::test]
async fn a_fenced_transactional_completion_is_a_lost_lease() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let exec = executor(&store, ExecutorConfig::new("fenced"));
    let r = exec
        .run(&msg("k"), |ctx| {
            let store = store.clone();
            async move {
                // An operator deletes the record while the handler runs.
                let key = ctx.key().unwrap().clone();
                assert!(store.delete(&key).await.unwrap());
                Ok::<_, HandlerError>(Commit::new(1u8, MemoryWrites::new().put("f/x", "1")))
            }
        })
        .await
        .unwrap();
    assert!(matches!(r, Outcome::LeaseLost { .. }), "{r:?}");
    assert_eq!(store.get_ref().effect("f/x"), None);
    let e = store
        .get_ref()
        .get(&exec.namespace().key("k").unwrap())
        .await
        .unwrap();
    assert!(e.is_none(), "{e:?}");
}

// --- One runner, both executors -------------------------------------------------------------

/// What a broker runner does with one message, written once for both executors: generic over
/// the executor's `Recorder`, it asks its handler for `R::Returns<T>` (the result `T` on a plain
/// executor, a `Commit<T, W>` on a transactional one) and wraps each call as the Kafka runner
/// does (here: a revocation token, and a pending future once revoked before the handler ran).
async fn deliver<C, R, H, T>(
    executor: &Executor<C, R>,
    handler: &Arc<H>,
    msg: RawMessage,
    revoked: &CancellationToken,
) -> BrokerAction
where
    C: Codec,
    R: Recorder,
    H: Handler<RawMessage, R::Returns<T>>,
    T: serde::Serialize + serde::de::DeserializeOwned + Send + 'static,
{
    let handler = Arc::clone(handler);
    let revoke = revoked.clone();
    let record = msg.clone();
    let result = executor
        .run(&msg, move |ctx| async move {
            if !revoke.is_cancelled() {
                let mut run = std::pin::pin!(handler.call(record, ctx));
                tokio::select! {
                    biased;
                    result = &mut run => return result,
                    () = revoke.cancelled() => {}
                }
                return run.await;
            }
            std::future::pending().await
        })
        .await;
    // The store the runner reads (dead-letter headers, releases) is there for both.
    let _ = executor.store().name();
    BrokerAction::of(&result)
}

/// Runners spawn their calls: the futures must be `Send`.
fn spawnable<F: Future + Send>(f: F) -> F {
    f
}

#[test]
fn transactional_run_futures_are_send() {
    let store = Arc::new(MemoryStore::new());
    let exec = Executor::transactional(store, ExecutorConfig::new("send")).unwrap();
    let m = msg("k");
    let fut = spawnable(exec.run(&m, |_| async {
        Ok::<_, HandlerError>(Commit::new(1u8, MemoryWrites::new()))
    }));
    drop(fut);
}

#[tokio::test]
async fn one_runner_serves_both_executors() {
    let revoked = CancellationToken::new();
    let memory = MemoryStore::new();

    let plain = Executor::new(Arc::new(memory.clone()), ExecutorConfig::new("plain")).unwrap();
    let plain_handler = Arc::new(|m: RawMessage, _: HandlerContext| async move {
        Ok::<_, HandlerError>(m.payload().len())
    });
    let action = spawnable(deliver::<_, _, _, usize>(
        &plain,
        &plain_handler,
        msg("a"),
        &revoked,
    ))
    .await;
    assert_eq!(action, BrokerAction::Ack);

    let transactional = Executor::transactional(
        Arc::new(memory.clone()),
        ExecutorConfig::new("transactional"),
    )
    .unwrap();
    let tx_handler = Arc::new(|m: RawMessage, _: HandlerContext| async move {
        let writes = MemoryWrites::new().put("runner/a", m.payload().to_vec());
        Ok::<_, HandlerError>(Commit::new(m.payload().len(), writes))
    });
    let action = spawnable(deliver::<_, _, _, usize>(
        &transactional,
        &tx_handler,
        msg("a"),
        &revoked,
    ))
    .await;
    assert_eq!(action, BrokerAction::Ack);
    assert_eq!(
        memory.effect("runner/a").as_deref(),
        Some(&br#"{"amount": 10}"#[..])
    );

    // `Executor::handle` takes the same registered handlers.
    let r = transactional.handle(msg("b"), &*tx_handler).await.unwrap();
    assert!(matches!(r, Outcome::Executed(14)), "{r:?}");
    let r = plain.handle(msg("b"), &*plain_handler).await.unwrap();
    assert!(matches!(r, Outcome::Executed(14)), "{r:?}");
}

/// A completion whose writes need a table the store does not have (`NotSetUp`: nothing
/// written) gives its lease back, not counted: each redelivery before the table exists runs
/// again as the same attempt (never `InProgress` behind its own lease, never exhausted), and
/// the first one after commits once.
#[tokio::test]
async fn a_completion_refused_as_not_set_up_gives_its_lease_back_uncounted() {
    let store = Arc::new(common::Hooked::default());
    store.missing_table.store(true, Ordering::SeqCst);
    let exec = Executor::transactional(
        store.clone(),
        ExecutorConfig::new("pay").with_max_attempts(2),
    )
    .unwrap();
    let charge = |_ctx: HandlerContext| async {
        Ok::<_, HandlerError>(Commit::new(
            (),
            MemoryWrites::new().put("charge/tx-9", "10 EUR"),
        ))
    };
    for delivery in 0..4 {
        let r = exec.run(&msg("tx-9"), charge).await;
        assert!(
            matches!(
                r,
                Err(ExecutorError::Store {
                    stage: StoreStage::Complete,
                    handler_ran: true,
                    ..
                })
            ),
            "delivery {delivery}: {r:?}"
        );
        let record = store
            .inner
            .get(&exec.namespace().key("tx-9").unwrap())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(record.state, RecordState::Released, "delivery {delivery}");
        assert_eq!(record.attempts, 0, "not counted: delivery {delivery}");
    }
    store.missing_table.store(false, Ordering::SeqCst);
    let r = exec.run(&msg("tx-9"), charge).await.unwrap();
    assert!(matches!(r, Outcome::Executed(())), "{r:?}");
    assert_eq!(
        store.inner.effect("charge/tx-9").as_deref(),
        Some(&b"10 EUR"[..])
    );
}
