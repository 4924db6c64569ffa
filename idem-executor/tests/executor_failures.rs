//! Executor: handler errors and panics, poison messages, store outages, metrics.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use idem_conformance::faults::{FaultyStore, InjectedFault, Op};
use idem_core::{
    Error, FailureKind, IdempotencyStore, ManualClock, MemoryStore, Record, RecordState,
};
use idem_executor::{
    BrokerAction, DeadLetter, DeadLetterReason, Executor, ExecutorConfig, ExecutorError,
    HandlerError, Outcome, PassThroughReason, RawMessage, StoreErrorPolicy, StoreStage,
    metric_names,
};
use tokio::sync::oneshot;

fn msg(key: &str) -> RawMessage {
    RawMessage::new("{}").with_header("idempotency-key", key.to_owned())
}

async fn record(store: &dyn IdempotencyStore, exec: &Executor, id: &str) -> Record {
    store
        .get(&exec.namespace().key(id).unwrap())
        .await
        .unwrap()
        .expect("record present")
}

#[tokio::test]
async fn erroring_and_panicking_handlers_leave_the_key_reacquirable_then_dead_letter_once() {
    let store = MemoryStore::new();
    let letters: Arc<Mutex<Vec<DeadLetter>>> = Arc::default();
    let exec = {
        let letters = letters.clone();
        Executor::builder(Arc::new(store.clone()))
            .config(
                ExecutorConfig::new("poison")
                    .with_max_attempts(3)
                    .with_retry_delay(Duration::from_millis(250)),
            )
            .on_dead_letter(move |dl| letters.lock().unwrap().push(dl.clone()))
            .build()
            .unwrap()
    };
    let runs = AtomicUsize::new(0);
    let m = msg("bad-1");

    // Attempt 1: an error (retryable by default, through `?`).
    let r = exec
        .run(&m, |ctx| {
            runs.fetch_add(1, Ordering::SeqCst);
            assert_eq!(ctx.attempt(), 1);
            async {
                "x".parse::<u32>()?;
                Ok(())
            }
        })
        .await
        .unwrap();
    match &r {
        Outcome::Retry {
            attempt: 1,
            error,
            panicked: false,
            retry_after,
        } => {
            assert!(error.contains("invalid digit"), "{error}");
            assert_eq!(*retry_after, Duration::from_millis(250));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        r.action(),
        BrokerAction::Retry {
            after: Duration::from_millis(250)
        }
    );
    let rec = record(&store, &exec, "bad-1").await;
    assert_eq!((rec.state.name(), rec.attempts), ("failed_retryable", 1));

    // Attempt 2: a panic. Re-acquirable, attempt counted, reported (not re-raised).
    let r = exec
        .run(&m, |ctx| async move {
            assert_eq!(ctx.attempt(), 2);
            if ctx.attempt() == 2 {
                panic!("kaboom {}", ctx.attempt());
            }
            Ok::<(), HandlerError>(())
        })
        .await
        .unwrap();
    match &r {
        Outcome::Retry {
            attempt: 2,
            error,
            panicked: true,
            ..
        } => assert_eq!(error, "handler panicked: kaboom 2"),
        other => panic!("{other:?}"),
    }
    let rec = record(&store, &exec, "bad-1").await;
    assert_eq!(rec.attempts, 2);
    assert_eq!(
        rec.state,
        RecordState::Failed {
            error: "handler panicked: kaboom 2".into(),
            kind: FailureKind::Retryable
        }
    );
    assert!(letters.lock().unwrap().is_empty());

    // Attempt 3 (the last): an error exhausts the key; the hook fires.
    let r = exec
        .run(&m, |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(HandlerError::retryable("still broken"))
        })
        .await
        .unwrap();
    match &r {
        Outcome::Exhausted {
            attempts: 3,
            last_error: Some(e),
        } => assert_eq!(e, "still broken"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        r.action(),
        BrokerAction::DeadLetter {
            reason: DeadLetterReason::Exhausted,
            error: "still broken".into()
        }
    );

    // Later deliveries: exhausted, handler not run, hook not called again.
    for _ in 0..3 {
        let r = exec
            .run(&m, |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<(), HandlerError>(())
            })
            .await
            .unwrap();
        assert!(
            matches!(&r, Outcome::Exhausted { attempts: 3, last_error: Some(e) } if e == "still broken"),
            "{r:?}"
        );
        assert!(matches!(r.action(), BrokerAction::DeadLetter { .. }));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let letters = letters.lock().unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].key.id(), "bad-1");
    assert_eq!(letters[0].attempts, 3);
    assert_eq!(letters[0].last_error, "still broken");
    assert!(!letters[0].panicked);
}

#[tokio::test]
async fn a_panic_on_the_last_attempt_dead_letters_once_too() {
    let store = MemoryStore::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let exec = {
        let calls = calls.clone();
        Executor::builder(Arc::new(store.clone()))
            .config(ExecutorConfig::new("p").with_max_attempts(1))
            .on_dead_letter(move |dl| {
                assert!(dl.panicked);
                calls.fetch_add(1, Ordering::SeqCst);
            })
            .build()
            .unwrap()
    };
    for _ in 0..3 {
        let r = exec
            .run(&msg("k"), |_| async {
                if true {
                    panic!("always");
                }
                Ok::<u8, HandlerError>(0)
            })
            .await
            .unwrap();
        assert!(matches!(r, Outcome::Exhausted { attempts: 1, .. }), "{r:?}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// The documented gap: when the last attempt crashes (no failure recorded), every delivery gets
/// `Exhausted` (and the dead-letter action) but the hook is not called.
#[tokio::test]
async fn a_crash_on_the_last_attempt_is_exhausted_without_the_hook() {
    let clock = Arc::new(ManualClock::new(
        SystemTime::UNIX_EPOCH + Duration::from_secs(1 << 30),
    ));
    let store = MemoryStore::with_clock(clock.clone());
    let calls = Arc::new(AtomicUsize::new(0));
    let exec = {
        let calls = calls.clone();
        Executor::builder(Arc::new(store.clone()))
            .config(
                ExecutorConfig::new("c")
                    .with_max_attempts(1)
                    .with_lease_ttl(Duration::from_secs(10)),
            )
            .on_dead_letter(move |_| {
                calls.fetch_add(1, Ordering::SeqCst);
            })
            .build()
            .unwrap()
    };
    // "Crash": the caller drops the run future while the handler is pending.
    let crashed = tokio::time::timeout(
        Duration::from_millis(20),
        exec.run(&msg("k"), |_| async {
            std::future::pending::<()>().await;
            Ok::<u8, HandlerError>(1)
        }),
    )
    .await;
    assert!(crashed.is_err());
    clock.advance(Duration::from_secs(11));
    let r = exec
        .run(&msg("k"), |_| async { Ok::<u8, HandlerError>(1) })
        .await
        .unwrap();
    assert!(
        matches!(
            r,
            Outcome::Exhausted {
                attempts: 1,
                last_error: None
            }
        ),
        "{r:?}"
    );
    assert!(
        matches!(
            r.action(),
            BrokerAction::DeadLetter { reason: DeadLetterReason::Exhausted, ref error }
                if error.contains("the last one crashed, stalled past its lease")
        ),
        "{r:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_store_that_is_down_fails_closed_by_default() {
    let store = MemoryStore::new();
    let exec = Executor::new(
        Arc::new(store.clone()),
        ExecutorConfig::new("down").with_retry_delay(Duration::from_millis(500)),
    )
    .unwrap();
    store.set_available(false);
    let runs = AtomicUsize::new(0);
    let r = exec
        .run(&msg("k"), |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<u8, HandlerError>(1)
        })
        .await;
    match &r {
        Err(ExecutorError::Store {
            stage: StoreStage::Acquire,
            handler_ran: false,
            source: Error::Unavailable {
                store: "memory", ..
            },
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(
        BrokerAction::of(&r),
        BrokerAction::Retry {
            after: Duration::from_millis(500)
        }
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "handler not run");

    // Back up: processed normally.
    store.set_available(true);
    let r = exec
        .run(&msg("k"), |_| async { Ok::<u8, HandlerError>(1) })
        .await
        .unwrap();
    assert!(matches!(r, Outcome::Executed(1)), "{r:?}");
}

#[tokio::test]
async fn fail_open_runs_the_handler_and_says_it_was_not_deduplicated() {
    let store = MemoryStore::new();
    let exec = Executor::new(
        Arc::new(store.clone()),
        ExecutorConfig::new("open").with_store_errors(StoreErrorPolicy::FailOpen),
    )
    .unwrap();
    store.set_available(false);
    let runs = AtomicUsize::new(0);
    for _ in 0..2 {
        let r = exec
            .run(&msg("k"), |ctx| async move {
                assert!(!ctx.is_deduplicated());
                assert_eq!(ctx.key().unwrap().id(), "k");
                assert!(ctx.token().is_none());
                Ok::<u8, HandlerError>(7)
            })
            .await
            .unwrap();
        runs.fetch_add(1, Ordering::SeqCst);
        match &r {
            Outcome::NotDeduplicated {
                result: Ok(7),
                reason:
                    PassThroughReason::StoreError {
                        stage: StoreStage::Acquire,
                        source: Error::Unavailable { .. },
                    },
                ..
            } => {}
            other => panic!("{other:?}"),
        }
        assert!(!r.is_deduplicated());
        assert_eq!(r.action(), BrokerAction::Ack);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    store.set_available(true);
    assert!(store.is_empty());
}

#[tokio::test]
async fn a_store_lost_while_the_handler_runs_is_reported_with_handler_ran() {
    for policy in [StoreErrorPolicy::FailClosed, StoreErrorPolicy::FailOpen] {
        let store = Arc::new(FaultyStore::new(MemoryStore::new()));
        // The completion is retried while the lease holds: keep the lease short.
        let exec = Executor::new(
            store.clone(),
            ExecutorConfig::new("mid")
                .with_store_errors(policy)
                .with_lease_ttl(Duration::from_millis(200)),
        )
        .unwrap();
        let down = store.clone();
        let r = exec
            .run(&msg("k"), |_| async move {
                down.set_outage(true);
                Ok::<u8, HandlerError>(3)
            })
            .await;
        let source = match (policy, &r) {
            (
                StoreErrorPolicy::FailClosed,
                Err(
                    e @ ExecutorError::Store {
                        stage: StoreStage::Complete,
                        handler_ran: true,
                        source,
                        ..
                    },
                ),
            ) => {
                assert!(e.handler_ran());
                source
            }
            (
                StoreErrorPolicy::FailOpen,
                Ok(Outcome::NotDeduplicated {
                    result: Ok(3),
                    reason:
                        PassThroughReason::StoreError {
                            stage: StoreStage::Complete,
                            source,
                        },
                    ..
                }),
            ) => source,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            InjectedFault::of(source),
            Some(&InjectedFault::Outage { op: Op::Complete }),
            "{source}"
        );
        assert!(
            store.calls(Op::Complete) > 1,
            "retried while the lease held"
        );
        assert_eq!(store.calls(Op::Fail), 0);
        // The key stays in progress (until its lease expires).
        store.set_outage(false);
        let rec = record(&*store, &exec, "k").await;
        assert_eq!(rec.state, RecordState::InProgress);
    }
}

/// The completion lands but its reply is lost: the executor sends it again, the store answers
/// `Ok` to the replay, and nothing is read back.
#[tokio::test]
async fn a_completion_whose_reply_was_lost_is_sent_again_without_a_read_back() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    store.lose_replies(Op::Complete, 1);
    let exec = Executor::new(store.clone(), ExecutorConfig::new("lost")).unwrap();
    let r = exec
        .run(&msg("k"), |_| async { Ok::<u8, HandlerError>(4) })
        .await
        .unwrap();
    assert!(matches!(r, Outcome::Executed(4)), "{r:?}");
    assert_eq!(store.lost_replies_left(Op::Complete), 0, "a reply was lost");
    assert_eq!(store.sent(Op::Complete), 2, "the completion was sent again");
    assert_eq!(store.calls(Op::Get), 0, "no read-back");
    let rec = record(store.get_ref(), &exec, "k").await;
    assert_eq!(
        rec.state,
        RecordState::Completed {
            result: idem_core::Bytes::from_static(b"4")
        }
    );
}

/// The same for failures of every kind: the failure is sent again with the same text and kind.
#[tokio::test]
async fn a_failure_whose_reply_was_lost_is_sent_again_without_a_read_back() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let exec = Executor::new(
        store.clone(),
        ExecutorConfig::new("lost").with_max_result_len(4),
    )
    .unwrap();
    store.lose_replies(Op::Fail, 1);
    let r = exec
        .run(&msg("retryable"), |_| async {
            Err::<u8, _>(HandlerError::retryable("flaky bank"))
        })
        .await
        .unwrap();
    assert!(
        matches!(&r, Outcome::Retry { attempt: 1, error, .. } if error == "flaky bank"),
        "{r:?}"
    );
    store.lose_replies(Op::Fail, 1);
    let r = exec
        .run(&msg("terminal"), |_| async {
            Err::<u8, _>(HandlerError::terminal("bad amount"))
        })
        .await
        .unwrap();
    assert!(
        matches!(&r, Outcome::Failed { error } if error == "bad amount"),
        "{r:?}"
    );
    store.lose_replies(Op::Fail, 1);
    let r = exec
        .run(&msg("too-big"), |_| async {
            Ok::<_, HandlerError>("a result over four bytes".to_owned())
        })
        .await
        .unwrap();
    assert!(matches!(r, Outcome::ResultNotStored { .. }), "{r:?}");
    assert_eq!(store.sent(Op::Fail), 6, "each failure sent twice");
    assert_eq!(store.calls(Op::Get), 0, "no read-back");
    for (id, kind) in [
        ("retryable", FailureKind::Retryable),
        ("terminal", FailureKind::Terminal),
        ("too-big", FailureKind::ResultNotStored),
    ] {
        let rec = record(store.get_ref(), &exec, id).await;
        assert!(
            matches!(rec.state, RecordState::Failed { kind: k, .. } if k == kind),
            "{id}: {rec:?}"
        );
    }
}

/// A record sent again after `Unavailable` and refused by fencing (another worker took the key
/// over meanwhile) is a lost lease: `LeaseLost` is final, nothing is read back to second-guess it.
#[tokio::test]
async fn a_retried_record_refused_by_fencing_is_a_lost_lease() {
    let clock = Arc::new(ManualClock::new(
        SystemTime::UNIX_EPOCH + Duration::from_secs(1 << 30),
    ));
    let store = Arc::new(FaultyStore::new(MemoryStore::with_clock(clock.clone())));
    let config = ExecutorConfig::new("fenced")
        .with_lease_ttl(Duration::from_secs(10))
        .with_heartbeat_interval(Duration::from_secs(5));
    let stalled = Executor::new(store.clone(), config.clone().with_owner("stalled")).unwrap();
    let rescuer = Executor::new(store.clone(), config.with_owner("rescuer")).unwrap();
    let (started_tx, started_rx) = oneshot::channel();
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        stalled
            .run(&msg("k"), |_| async move {
                started_tx.send(()).unwrap();
                go_rx.await.unwrap();
                Ok::<_, HandlerError>(1u8)
            })
            .await
    });
    started_rx.await.unwrap();
    clock.advance(Duration::from_secs(11));
    let r = rescuer
        .run(&msg("k"), |_| async { Ok::<_, HandlerError>(2u8) })
        .await
        .unwrap();
    assert!(matches!(r, Outcome::Executed(2)), "{r:?}");
    // The stalled worker's first completion is refused, the second reaches the store.
    store.refuse(Op::Complete, 1);
    go_tx.send(()).unwrap();
    let late = task.await.unwrap().unwrap();
    assert!(matches!(late, Outcome::LeaseLost { .. }), "{late:?}");
    assert_eq!(
        store.calls(Op::Complete),
        3,
        "the rescuer's, then two tries"
    );
    assert_eq!(store.calls(Op::Get), 0, "no read-back");
}

/// Counts increments per metric name.
#[derive(Default)]
struct Counting(Arc<Mutex<HashMap<String, u64>>>);

struct Count {
    name: String,
    counts: Arc<Mutex<HashMap<String, u64>>>,
}

impl metrics::CounterFn for Count {
    fn increment(&self, value: u64) {
        *self
            .counts
            .lock()
            .unwrap()
            .entry(self.name.clone())
            .or_default() += value;
    }
    fn absolute(&self, _: u64) {}
}

impl metrics::Recorder for Counting {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        assert!(key.name().starts_with("idem_"), "{key:?}");
        assert!(
            key.labels()
                .any(|l| l.key() == "namespace" && l.value() == "metered"),
            "{key:?}"
        );
        metrics::Counter::from_arc(Arc::new(Count {
            name: key.name().to_owned(),
            counts: self.0.clone(),
        }))
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

#[test]
fn outcomes_are_counted() {
    let recorder = Counting::default();
    let counts = recorder.0.clone();
    let clock = Arc::new(ManualClock::new(
        SystemTime::UNIX_EPOCH + Duration::from_secs(1 << 30),
    ));
    let store = MemoryStore::with_clock(clock.clone());
    let exec = Executor::new(
        Arc::new(store.clone()),
        ExecutorConfig::new("metered")
            .with_max_attempts(2)
            .with_lease_ttl(Duration::from_secs(10)),
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let token = Arc::new(AtomicU64::new(0));
    metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let ok = |_| async { Ok::<u8, HandlerError>(1) };
            exec.run(&msg("a"), ok).await.unwrap(); // executed
            exec.run(&msg("a"), ok).await.unwrap(); // replayed
            let conflict = RawMessage::new("other").with_header("idempotency-key", "a");
            exec.run(&conflict, ok).await.unwrap(); // conflict
            let fail = |_| async { Err::<u8, _>(HandlerError::retryable("e")) };
            exec.run(&msg("b"), fail).await.unwrap(); // retryable failure
            exec.run(&msg("b"), fail).await.unwrap(); // exhausted
            // in progress, then a takeover
            let t = token.clone();
            let c = msg("c");
            let held = exec.run(&c, move |ctx| async move {
                t.store(ctx.token().unwrap().get(), Ordering::SeqCst);
                std::future::pending::<()>().await;
                Ok::<u8, HandlerError>(1)
            });
            let _ = tokio::time::timeout(Duration::from_millis(5), held).await;
            exec.run(&msg("c"), ok).await.unwrap(); // in progress
            clock.advance(Duration::from_secs(11));
            exec.run(&msg("c"), ok).await.unwrap(); // takeover + executed
            store.set_available(false);
            let _ = exec.run(&msg("d"), ok).await; // store error
            store.set_available(true);
        });
    });
    let counts = counts.lock().unwrap();
    let get = |name: &str| counts.get(name).copied().unwrap_or(0);
    assert_eq!(get(metric_names::EXECUTED), 2, "{counts:?}");
    assert_eq!(get(metric_names::REPLAYED), 1, "{counts:?}");
    assert_eq!(get(metric_names::CONFLICTS), 1, "{counts:?}");
    assert_eq!(get(metric_names::RETRYABLE_FAILURES), 1, "{counts:?}");
    assert_eq!(get(metric_names::EXHAUSTED), 1, "{counts:?}");
    assert_eq!(get(metric_names::IN_PROGRESS), 1, "{counts:?}");
    assert_eq!(get(metric_names::TAKEOVERS), 1, "{counts:?}");
    assert_eq!(get(metric_names::STORE_ERRORS), 1, "{counts:?}");
    assert!(token.load(Ordering::SeqCst) > 0);
}

#[tokio::test(start_paused = true)]
async fn a_store_outage_longer_than_the_lease_cancels_the_handler_before_the_lease_expires() {
    let store = MemoryStore::new();
    let lease = Duration::from_secs(10);
    let exec = Executor::new(
        Arc::new(store.clone()),
        ExecutorConfig::new("outage").with_lease_ttl(lease),
    )
    .unwrap();
    let down = store.clone();
    let start = tokio::time::Instant::now();
    let seen_deadline = Arc::new(Mutex::new(None));
    let dropped_at = Arc::new(Mutex::new(None));
    let (seen, dropped) = (seen_deadline.clone(), dropped_at.clone());
    let r = exec
        .run(&msg("k"), move |ctx| async move {
            *seen.lock().unwrap() = ctx.lease_deadline();
            /// Records when the handler's future is dropped.
            struct OnDrop(Arc<Mutex<Option<tokio::time::Instant>>>);
            impl Drop for OnDrop {
                fn drop(&mut self) {
                    *self.0.lock().unwrap() = Some(tokio::time::Instant::now());
                }
            }
            let _guard = OnDrop(dropped);
            down.set_available(false);
            // Longer than the lease; heartbeats fail meanwhile.
            tokio::time::sleep(lease * 3).await;
            Ok::<u8, HandlerError>(1)
        })
        .await
        .unwrap();
    assert!(matches!(r, Outcome::LeaseLost { .. }), "{r:?}");
    // The local deadline: the acquire's send time + the lease - a tenth of it.
    let deadline = seen_deadline
        .lock()
        .unwrap()
        .expect("a leased handler has a deadline");
    assert_eq!(deadline, start + lease - lease / 10);
    let dropped = dropped_at.lock().unwrap().expect("the handler was dropped");
    assert!(dropped >= deadline, "{:?}", dropped - start);
    assert!(
        dropped < start + lease,
        "cancelled at {:?}",
        dropped - start
    );
    // Nothing recorded: the key is still in progress under the first attempt.
    store.set_available(true);
    let rec = record(&store, &exec, "k").await;
    assert_eq!(rec.state, RecordState::InProgress);
    assert_eq!(rec.attempts, 1);
}

#[tokio::test(start_paused = true)]
async fn successful_heartbeats_move_the_local_deadline_on() {
    let store = MemoryStore::new();
    let lease = Duration::from_secs(10);
    let exec = Executor::new(
        Arc::new(store.clone()),
        ExecutorConfig::new("beats").with_lease_ttl(lease),
    )
    .unwrap();
    let start = tokio::time::Instant::now();
    let r = exec
        .run(&msg("k"), move |ctx| async move {
            let first = ctx.lease_deadline().unwrap();
            // Three leases long: the heartbeats keep the handler alive.
            tokio::time::sleep(lease * 3).await;
            let later = ctx.lease_deadline().unwrap();
            assert!(later > first + lease, "{first:?} -> {later:?}");
            assert!(!ctx.is_cancelled());
            Ok::<u8, HandlerError>(1)
        })
        .await
        .unwrap();
    assert!(matches!(r, Outcome::Executed(1)), "{r:?}");
    assert!(start.elapsed() >= lease * 3);
}

#[tokio::test]
async fn a_short_store_blip_after_the_handler_is_retried_while_the_lease_holds() {
    // Six failures take at least 10 + 20 + 40 + 80 + 160 ms of backoff: a blip of over 100 ms.
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    store.refuse(Op::Complete, 6);
    let exec = Executor::new(
        store.clone(),
        ExecutorConfig::new("blip").with_lease_ttl(Duration::from_secs(10)),
    )
    .unwrap();
    let start = std::time::Instant::now();
    let r = exec
        .run(&msg("k"), |_| async { Ok::<u8, HandlerError>(7) })
        .await
        .unwrap();
    assert!(matches!(r, Outcome::Executed(7)), "{r:?}");
    assert!(
        start.elapsed() >= Duration::from_millis(100),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(store.calls(Op::Complete), 7);
    assert_eq!(store.sent(Op::Complete), 1);
    let rec = record(&*store, &exec, "k").await;
    assert!(
        matches!(rec.state, RecordState::Completed { .. }),
        "{rec:?}"
    );
}

#[tokio::test]
async fn a_panicking_dead_letter_hook_is_caught() {
    let store = MemoryStore::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let exec = Executor::builder(Arc::new(store.clone()))
        .config(ExecutorConfig::new("hook").with_max_attempts(1))
        .on_dead_letter(move |_| {
            c.fetch_add(1, Ordering::SeqCst);
            panic!("hook bug");
        })
        .build()
        .unwrap();
    let r = exec
        .run(&msg("k"), |_| async {
            Err::<u8, _>(HandlerError::retryable(std::io::Error::other("boom")))
        })
        .await
        .unwrap();
    assert!(matches!(r, Outcome::Exhausted { attempts: 1, .. }), "{r:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn each_retry_of_a_failing_handler_waits_retry_growth_times_longer() {
    let store = MemoryStore::new();
    let exec = Executor::builder(Arc::new(store.clone()))
        .config(
            ExecutorConfig::new("growth")
                .with_max_attempts(4)
                .with_retry_delay(Duration::from_millis(100))
                .with_retry_growth(3),
        )
        .build()
        .unwrap();
    let m = msg("flaky");
    for (attempt, wait) in [(1, 100), (2, 300), (3, 900)] {
        let r = exec
            .run(&m, |_| async {
                Err::<(), _>(HandlerError::retryable("down"))
            })
            .await
            .unwrap();
        let wait = Duration::from_millis(wait);
        match &r {
            Outcome::Retry {
                attempt: a,
                retry_after,
                ..
            } if *a == attempt => assert_eq!(*retry_after, wait, "attempt {attempt}"),
            other => panic!("attempt {attempt}: {other:?}"),
        }
        assert_eq!(r.action(), BrokerAction::Retry { after: wait });
    }
    // The fourth attempt is the last: exhausted, not retried.
    let r = exec
        .run(&m, |_| async {
            Err::<(), _>(HandlerError::retryable("down"))
        })
        .await
        .unwrap();
    assert!(matches!(r, Outcome::Exhausted { attempts: 4, .. }), "{r:?}");

    // The growth saturates instead of overflowing.
    let config = ExecutorConfig::new("growth").with_retry_growth(u32::MAX);
    assert!(config.retry_after(u32::MAX) >= config.retry_after(3));
    assert_eq!(
        ExecutorConfig::new("growth").retry_after(7),
        Duration::from_secs(1),
        "the default keeps every retry at retry_delay"
    );

    // 0 would make every retry after the first immediate: refused.
    let e = Executor::builder(Arc::new(store))
        .config(ExecutorConfig::new("growth").with_retry_growth(0))
        .build()
        .unwrap_err();
    assert_eq!(e.field, "retry_growth", "{e}");
}

#[tokio::test(start_paused = true)]
async fn a_store_error_while_waiting_on_a_key_in_progress_answers_in_progress_even_failing_open() {
    use idem_core::{AcquireOutcome, AcquireRequest};
    use idem_executor::InProgressWait;

    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    // Another worker holds the key and is running its handler.
    let key = idem_core::Namespace::new("pay")
        .unwrap()
        .key("charge-1")
        .unwrap();
    let holder = AcquireRequest::new(key, "worker-a").with_lease_ttl(Duration::from_secs(30));
    assert!(matches!(
        store.acquire(&holder).await.unwrap(),
        AcquireOutcome::Acquired { .. }
    ));
    let exec = Executor::builder(store.clone())
        .config(
            ExecutorConfig::new("pay")
                .with_owner("worker-b")
                .with_store_errors(StoreErrorPolicy::FailOpen)
                .with_in_progress_wait(
                    InProgressWait::default().with_min_delay(Duration::from_millis(50)),
                ),
        )
        .build()
        .unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let run = {
        let ran = ran.clone();
        tokio::spawn(async move {
            exec.run(&msg("charge-1"), |_| async move {
                ran.fetch_add(1, Ordering::SeqCst);
                Ok::<_, HandlerError>(())
            })
            .await
        })
    };
    // The first acquire answered in progress; one of the polls after it fails.
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        store.calls(Op::Acquire),
        2,
        "the holder's and the first poll"
    );
    store.refuse(Op::Acquire, 1);
    let outcome = run.await.unwrap().unwrap();
    assert!(
        matches!(&outcome, Outcome::InProgress { owner, .. } if owner == "worker-a"),
        "{outcome:?}"
    );
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "the handler ran beside its holder"
    );
}

#[tokio::test(start_paused = true)]
async fn one_failed_heartbeat_at_the_largest_interval_is_tried_again_before_the_deadline() {
    // A 10 s lease beaten every 5 s (the largest interval the configuration takes), a handler
    // of 12 s, and the first extend refused: the retry must come before the local deadline
    // (9 s after the acquire), not a whole interval later.
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let exec = Executor::builder(store.clone())
        .config(
            ExecutorConfig::new("beat")
                .with_lease_ttl(Duration::from_secs(10))
                .with_heartbeat_interval(Duration::from_secs(5)),
        )
        .build()
        .unwrap();
    store.refuse(Op::Extend, 1);
    let outcome = exec
        .run(&msg("slow"), |_| async {
            tokio::time::sleep(Duration::from_secs(12)).await;
            Ok::<_, HandlerError>(())
        })
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Executed(())), "{outcome:?}");
    assert_eq!(
        store.calls(Op::Extend),
        2,
        "the refused one at 5 s and its retry at 7.5 s"
    );
}

/// A result whose `Serialize` panics (its `Deserialize` is never reached: nothing is stored).
#[derive(Debug, serde::Deserialize)]
struct PanicsWhenSerialized;

impl serde::Serialize for PanicsWhenSerialized {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        panic!("no serializing this")
    }
}

#[tokio::test]
async fn a_result_whose_serialize_panics_is_not_stored_and_the_executor_goes_on() {
    let store = MemoryStore::new();
    let exec = Executor::builder(Arc::new(store.clone()))
        .config(ExecutorConfig::new("bomb"))
        .build()
        .unwrap();
    let outcome = exec
        .run(&msg("bomb"), |_| async {
            Ok::<_, HandlerError>(PanicsWhenSerialized)
        })
        .await
        .unwrap();
    match &outcome {
        Outcome::ResultNotStored { error } => {
            assert!(error.contains("panicked: no serializing this"), "{error}")
        }
        other => panic!("{other:?}"),
    }
    let record = record(&store, &exec, "bomb").await;
    assert_eq!(record.state.name(), "failed_result_not_stored");
    // The executor still works.
    let next = exec
        .run(&msg("next"), |_| async { Ok::<_, HandlerError>(1u8) })
        .await
        .unwrap();
    assert!(matches!(next, Outcome::Executed(1)), "{next:?}");
}
