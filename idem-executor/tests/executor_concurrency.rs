//! Executor: concurrent deliveries, heartbeats, takeovers, the bounded in-progress wait.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use idem_core::{IdempotencyStore, ManualClock, MemoryStore, RecordState};
use idem_executor::{
    BrokerAction, Executor, ExecutorConfig, HandlerError, InProgressWait, Outcome, RawMessage,
};
use tokio::sync::{Barrier, oneshot};

fn msg(key: &str) -> RawMessage {
    RawMessage::new(format!(r#"{{"order": "{key}"}}"#))
        .with_header("idempotency-key", key.to_owned())
}

fn executor(store: &MemoryStore, config: ExecutorConfig) -> Executor {
    Executor::new(Arc::new(store.clone()), config).expect("valid config")
}

/// Sets its flag when dropped: tells whether a handler future was dropped (cancelled).
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

async fn concurrent_deliveries(config: ExecutorConfig) -> (usize, Vec<Outcome<u64>>) {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(Barrier::new(32));
    let mut tasks = Vec::new();
    for worker in 0..32u64 {
        let exec = executor(
            &store,
            config.clone().with_owner(format!("worker-{worker}")),
        );
        let runs = runs.clone();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            exec.run(&msg("pay-1"), |_| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(30)).await;
                Ok::<_, HandlerError>(worker)
            })
            .await
            .unwrap()
        }));
    }
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.unwrap());
    }
    (runs.load(Ordering::SeqCst), outcomes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_concurrent_deliveries_run_the_handler_once() {
    let (runs, outcomes) = concurrent_deliveries(ExecutorConfig::new("pay")).await;
    assert_eq!(runs, 1);
    let executed: Vec<u64> = outcomes
        .iter()
        .filter_map(|o| match o {
            Outcome::Executed(w) => Some(*w),
            _ => None,
        })
        .collect();
    assert_eq!(executed.len(), 1, "{outcomes:?}");
    for o in &outcomes {
        match o {
            Outcome::Executed(_) => {}
            Outcome::Replayed(w) => assert_eq!(*w, executed[0]),
            Outcome::InProgress { owner, retry_after } => {
                assert_eq!(*owner, format!("worker-{}", executed[0]));
                assert!(
                    matches!(o.action(), BrokerAction::Retry { after } if after == *retry_after)
                );
            }
            other => panic!("{other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_the_bounded_wait_every_duplicate_gets_the_result() {
    let config = ExecutorConfig::new("pay").with_in_progress_wait(
        InProgressWait::default()
            .with_max_wait(Duration::from_secs(5))
            .with_min_delay(Duration::from_millis(5))
            .with_max_delay(Duration::from_millis(20)),
    );
    let (runs, outcomes) = concurrent_deliveries(config).await;
    assert_eq!(runs, 1);
    let executed = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Executed(_)))
        .count();
    let replayed = outcomes
        .iter()
        .filter(|o| matches!(o, Outcome::Replayed(_)))
        .count();
    assert_eq!((executed, replayed), (1, 31), "{outcomes:?}");
}

/// Key `k` held by the owner `holder` (its handler runs until `go` is sent; the task returns its
/// outcome), and an executor of the owner `waiter` that waits up to `max_wait` for it.
async fn held_while_a_waiter_polls(
    max_wait: Duration,
) -> (
    Executor,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<Outcome<i32>>,
) {
    let store = MemoryStore::new();
    let holder = executor(&store, ExecutorConfig::new("n").with_owner("holder"));
    let waiter = executor(
        &store,
        ExecutorConfig::new("n")
            .with_owner("waiter")
            .with_in_progress_wait(
                InProgressWait::default()
                    .with_max_wait(max_wait)
                    .with_min_delay(Duration::from_millis(5))
                    .with_max_delay(Duration::from_millis(20)),
            ),
    );
    let (started_tx, started_rx) = oneshot::channel();
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let held = tokio::spawn(async move {
        holder
            .run(&msg("k"), |_| async move {
                started_tx.send(()).unwrap();
                go_rx.await.unwrap();
                Ok::<_, HandlerError>(1)
            })
            .await
            .unwrap()
    });
    started_rx.await.unwrap();
    (waiter, go_tx, held)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_wait_gives_up_after_max_wait() {
    let (waiter, go_tx, held) = held_while_a_waiter_polls(Duration::from_millis(80)).await;
    let start = tokio::time::Instant::now();
    let r = waiter
        .run(&msg("k"), |_| async { Ok::<_, HandlerError>(2) })
        .await
        .unwrap();
    let waited = start.elapsed();
    assert!(
        matches!(&r, Outcome::InProgress { owner, .. } if owner == "holder"),
        "{r:?}"
    );
    assert!(waited >= Duration::from_millis(80), "{waited:?}");
    assert!(waited < Duration::from_secs(2), "{waited:?}");
    go_tx.send(()).unwrap();
    assert!(matches!(held.await.unwrap(), Outcome::Executed(1)));
}

/// `max_wait` of `Duration::MAX` waits as long as the key is in progress (Tokio's paused clock:
/// the waiter polls through a minute of virtual time before the holder finishes).
#[tokio::test(start_paused = true)]
async fn an_unbounded_wait_lasts_until_the_holder_finishes() {
    let (waiter, go_tx, held) = held_while_a_waiter_polls(Duration::MAX).await;
    let waiting = tokio::spawn(async move {
        waiter
            .run(&msg("k"), |_| async { Ok::<_, HandlerError>(2) })
            .await
            .unwrap()
    });
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(
        !waiting.is_finished(),
        "still waiting while the key is held"
    );
    go_tx.send(()).unwrap();
    assert!(matches!(held.await.unwrap(), Outcome::Executed(1)));
    let r = waiting.await.expect("the waiter ran to its end");
    assert!(matches!(r, Outcome::Replayed(1)), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_three_times_longer_than_the_lease_keeps_it_through_heartbeats() {
    let store = MemoryStore::new(); // real clock: real short leases
    // Heartbeats every 50 ms: a stall of the test's threads (a loaded machine) shorter than
    // about 400 ms keeps the lease.
    let lease = Duration::from_millis(500);
    let config = ExecutorConfig::new("slow")
        .with_lease_ttl(lease)
        .with_heartbeat_interval(Duration::from_millis(50));
    let slow = executor(&store, config.clone().with_owner("slow"));
    let other = executor(&store, config.with_owner("other"));
    let runs = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));

    let task = {
        let (runs, done) = (runs.clone(), done.clone());
        tokio::spawn(async move {
            let r = slow
                .run(&msg("long"), |ctx| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(lease * 3).await;
                    assert!(!ctx.is_cancelled());
                    Ok::<_, HandlerError>("slow".to_owned())
                })
                .await
                .unwrap();
            done.store(true, Ordering::SeqCst);
            r
        })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    let mut busy = 0;
    while !done.load(Ordering::SeqCst) {
        let r = other
            .run(&msg("long"), |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, HandlerError>("other".to_owned())
            })
            .await
            .unwrap();
        match r {
            Outcome::InProgress { ref owner, .. } => {
                assert_eq!(owner, "slow");
                busy += 1;
            }
            Outcome::Replayed(ref s) if s == "slow" => break,
            other => panic!("{other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    assert!(matches!(task.await.unwrap(), Outcome::Executed(s) if s == "slow"));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "nobody else ran it");
    assert!(busy >= 10, "the other worker kept finding it busy: {busy}");
    let record = store
        .get(&other.namespace().key("long").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.attempts, 1);
    assert!(matches!(record.state, RecordState::Completed { .. }));
}

fn manual_store() -> (MemoryStore, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
    ));
    (MemoryStore::with_clock(clock.clone()), clock)
}

// Current-thread runtime: between `clock.advance` and the takeover's acquire no other task
// (in particular no heartbeat) runs, so the takeover is deterministic.
#[tokio::test]
async fn a_taken_over_handler_is_cancelled_by_its_heartbeat() {
    let (store, clock) = manual_store();
    let config = ExecutorConfig::new("t")
        .with_lease_ttl(Duration::from_secs(10))
        .with_heartbeat_interval(Duration::from_millis(20));
    let stalled = executor(&store, config.clone().with_owner("stalled"));
    let rescuer = executor(&store, config.with_owner("rescuer"));
    let dropped = Arc::new(AtomicBool::new(false));
    let finished = Arc::new(AtomicBool::new(false));
    let cancel_seen = Arc::new(AtomicBool::new(false));
    let (started_tx, started_rx) = oneshot::channel();

    let task = {
        let (dropped, finished, cancel_seen) =
            (dropped.clone(), finished.clone(), cancel_seen.clone());
        tokio::spawn(async move {
            stalled
                .run(&msg("k"), |ctx| async move {
                    let _flag = DropFlag(dropped);
                    let token = ctx.cancellation_token().clone();
                    tokio::spawn(async move {
                        token.cancelled().await;
                        cancel_seen.store(true, Ordering::SeqCst);
                    });
                    started_tx.send(ctx.token().unwrap()).unwrap();
                    std::future::pending::<()>().await;
                    finished.store(true, Ordering::SeqCst);
                    Ok::<_, HandlerError>(1u32)
                })
                .await
                .unwrap()
        })
    };
    let stalled_token = started_rx.await.unwrap();
    clock.advance(Duration::from_secs(11));
    let r = rescuer
        .run(&msg("k"), |ctx| async move {
            assert!(ctx.is_takeover());
            assert_eq!(ctx.attempt(), 2);
            assert!(ctx.token().unwrap() > stalled_token);
            Ok::<_, HandlerError>(2u32)
        })
        .await
        .unwrap();
    assert!(matches!(r, Outcome::Executed(2)), "{r:?}");

    let out = tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the stalled handler was cancelled")
        .unwrap();
    assert!(matches!(out, Outcome::LeaseLost { .. }), "{out:?}");
    assert!(matches!(out.action(), BrokerAction::Retry { .. }));
    assert!(dropped.load(Ordering::SeqCst), "handler future dropped");
    assert!(!finished.load(Ordering::SeqCst));
    tokio::task::yield_now().await;
    assert!(
        cancel_seen.load(Ordering::SeqCst),
        "context token cancelled"
    );

    // The rescuer's result stands.
    let again = rescuer
        .run(&msg("k"), |_| async { Ok::<_, HandlerError>(3u32) })
        .await
        .unwrap();
    assert!(matches!(again, Outcome::Replayed(2)), "{again:?}");
}

#[tokio::test]
async fn a_late_completion_after_a_takeover_is_refused() {
    let (store, clock) = manual_store();
    let config = ExecutorConfig::new("t")
        .with_lease_ttl(Duration::from_secs(10))
        .with_heartbeat_interval(Duration::from_secs(5)); // never fires within the test
    let stalled = executor(&store, config.clone().with_owner("stalled"));
    let rescuer = executor(&store, config.with_owner("rescuer"));
    let (started_tx, started_rx) = oneshot::channel();
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        stalled
            .run(&msg("k"), |_| async move {
                started_tx.send(()).unwrap();
                go_rx.await.unwrap();
                Ok::<_, HandlerError>("late".to_owned())
            })
            .await
            .unwrap()
    });
    started_rx.await.unwrap();
    clock.advance(Duration::from_secs(11));
    let r = rescuer
        .run(&msg("k"), |_| async {
            Ok::<_, HandlerError>("rescuer".to_owned())
        })
        .await
        .unwrap();
    assert!(
        matches!(&r, Outcome::Executed(s) if s == "rescuer"),
        "{r:?}"
    );
    go_tx.send(()).unwrap();
    let late = task.await.unwrap();
    assert!(matches!(late, Outcome::LeaseLost { .. }), "{late:?}");
    let record = store
        .get(&rescuer.namespace().key("k").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        record.state,
        RecordState::Completed {
            result: idem_core::Bytes::from_static(br#""rescuer""#)
        }
    );
    assert_eq!(record.owner, "rescuer");
}

#[tokio::test]
async fn a_late_failure_after_a_takeover_is_refused_too() {
    let (store, clock) = manual_store();
    let config = ExecutorConfig::new("t")
        .with_lease_ttl(Duration::from_secs(10))
        .with_heartbeat_interval(Duration::from_secs(5));
    let stalled = executor(&store, config.clone());
    let rescuer = executor(&store, config);
    let (started_tx, started_rx) = oneshot::channel();
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        stalled
            .run(&msg("k"), |_| async move {
                started_tx.send(()).unwrap();
                go_rx.await.unwrap();
                Err::<u8, _>(HandlerError::retryable("late failure"))
            })
            .await
            .unwrap()
    });
    started_rx.await.unwrap();
    clock.advance(Duration::from_secs(11));
    let r = rescuer
        .run(&msg("k"), |_| async { Ok::<_, HandlerError>(1u8) })
        .await
        .unwrap();
    assert!(matches!(r, Outcome::Executed(1)), "{r:?}");
    go_tx.send(()).unwrap();
    assert!(matches!(task.await.unwrap(), Outcome::LeaseLost { .. }));
}

/// Holds `key` for three leases on `exec` while `other` keeps trying it; returns how often
/// `other` found it busy. Panics if `other` ever runs it.
async fn hold_three_leases(exec: &Executor, other: &Executor, key: &str, lease: Duration) -> usize {
    let holder = {
        let exec = exec.clone();
        let key = key.to_owned();
        tokio::spawn(async move {
            exec.run(&msg(&key), |_| async move {
                tokio::time::sleep(lease * 3).await;
                Ok::<_, HandlerError>(1u8)
            })
            .await
            .unwrap()
        })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    let mut busy = 0;
    while !holder.is_finished() {
        let r = other
            .run(&msg(key), |_| async { Ok::<_, HandlerError>(2u8) })
            .await
            .unwrap();
        match r {
            Outcome::InProgress { .. } => busy += 1,
            Outcome::Replayed(1) => break,
            other => panic!("{key}: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(matches!(holder.await.unwrap(), Outcome::Executed(1)));
    busy
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_heartbeat_task_keeps_many_leases() {
    let store = MemoryStore::new();
    let lease = Duration::from_millis(500);
    let config = ExecutorConfig::new("many")
        .with_lease_ttl(lease)
        .with_heartbeat_interval(Duration::from_millis(50));
    let exec = executor(&store, config.clone().with_owner("holder"));
    let other = executor(&store, config.with_owner("other"));
    let mut tasks = Vec::new();
    for i in 0..16 {
        let (exec, other) = (exec.clone(), other.clone());
        tasks.push(tokio::spawn(async move {
            // Staggered starts, so the leases fall due at different times.
            tokio::time::sleep(Duration::from_millis(7 * i)).await;
            hold_three_leases(&exec, &other, &format!("k{i}"), lease).await
        }));
    }
    for task in tasks {
        assert!(task.await.unwrap() >= 5);
    }
}

#[test]
fn the_heartbeat_task_follows_the_executor_to_a_new_runtime() {
    let store = MemoryStore::new();
    let lease = Duration::from_millis(500);
    let config = ExecutorConfig::new("rt")
        .with_lease_ttl(lease)
        .with_heartbeat_interval(Duration::from_millis(50));
    let exec = executor(&store, config.clone().with_owner("holder"));
    let other = executor(&store, config.with_owner("other"));
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    };
    let first = runtime();
    assert!(first.block_on(hold_three_leases(&exec, &other, "a", lease)) >= 5);
    drop(first); // the heartbeat task dies with its runtime
    let second = runtime();
    assert!(second.block_on(hold_three_leases(&exec, &other, "b", lease)) >= 5);
}

/// Issue 19 item 6: after a stall (a blocked runtime) past the local lease deadline, the
/// handler's "may I still act?" check says stop at once, before the executor's watch or the
/// heartbeat task could run. On a current-thread runtime, a blocking sleep in the handler stops
/// every other task, exactly like a stalled process.
#[tokio::test(flavor = "current_thread")]
async fn after_a_stall_past_the_deadline_is_cancelled_says_stop() {
    let store = MemoryStore::new();
    let lease = Duration::from_millis(200);
    let exec = executor(&store, ExecutorConfig::new("stall").with_lease_ttl(lease));
    for yield_first in [true, false] {
        let key = format!("stall-{yield_first}");
        let r = exec
            .run(&msg(&key), |ctx| async move {
                if yield_first {
                    // Past the first poll: the lease is registered with the heartbeat task and
                    // the executor watches the deadline, but neither runs during the stall.
                    tokio::task::yield_now().await;
                }
                assert!(!ctx.is_cancelled(), "a fresh lease may act");
                let deadline = ctx.lease_deadline().expect("deduplicated");
                // The stall: the runtime's only thread is blocked past the deadline.
                std::thread::sleep(lease);
                assert!(tokio::time::Instant::now() > deadline);
                let stop = ctx.is_cancelled();
                let token_agrees = ctx.cancellation_token().is_cancelled();
                Ok::<_, HandlerError>((stop, token_agrees))
            })
            .await
            .unwrap();
        assert!(
            matches!(r, Outcome::Executed((true, true))),
            "yield first: {yield_first}: {r:?}"
        );
    }
}
