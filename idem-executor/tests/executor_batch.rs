//! Executor batches: `run_batch` gives exactly the outcomes of single calls, in far fewer store
//! calls, with every single-message guarantee (heartbeats, fencing, the batch size limit).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Completion, Failure, FailureKind, IdempotencyKey,
    IdempotencyStore, Lease, Limits, ListQuery, ManualClock, MemoryStore, Page, Record,
    RecordState,
};
use idem_executor::{
    BatchConfig, BatchError, Executor, ExecutorConfig, HandlerError, Message, MissingKeyPolicy,
    Outcome, RawMessage,
};
use tokio::sync::oneshot;

fn msg(key: &str, payload: &str) -> RawMessage {
    RawMessage::new(payload.to_owned()).with_header("idempotency-key", key.to_owned())
}

fn manual_store() -> (MemoryStore, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
    ));
    (MemoryStore::with_clock(clock.clone()), clock)
}

/// What each payload makes the handler do.
async fn behave(payload: &[u8], attempt: u32) -> Result<String, HandlerError> {
    match payload {
        b"retry" => Err(HandlerError::retryable(format!("flaky at {attempt}"))),
        b"terminal" => Err(HandlerError::terminal("bad request")),
        b"panic" => panic!("handler panicked at {attempt}"),
        b"yield" => {
            // Pending at its first poll: the heartbeat path.
            tokio::task::yield_now().await;
            Ok(format!("yielded at {attempt}"))
        }
        other => Ok(format!("{} at {attempt}", String::from_utf8_lossy(other))),
    }
}

const MAX_ATTEMPTS: u32 = 3;

fn config() -> ExecutorConfig {
    ExecutorConfig::new("batch")
        .with_owner("worker")
        .with_max_attempts(MAX_ATTEMPTS)
        .with_missing_key(MissingKeyPolicy::Reject)
}

/// The same history on a store, through its own API: keys busy, finished, failed, exhausted.
async fn seed(store: &MemoryStore) {
    let ns = idem_core::Namespace::new("batch").unwrap();
    let req = |key: &str, owner: &str| {
        AcquireRequest::new(ns.key(key).unwrap(), owner.to_owned())
            .with_lease_ttl(Duration::from_secs(30))
            .with_max_attempts(MAX_ATTEMPTS)
    };
    let retention = Duration::from_secs(3600);
    let lease = |outcome: AcquireOutcome| match outcome {
        AcquireOutcome::Acquired { lease, .. } => lease,
        other => panic!("{other:?}"),
    };
    // Held by another worker.
    store.acquire(&req("busy", "other")).await.unwrap();
    // Completed with a result the executor's codec reads.
    let l = lease(store.acquire(&req("done", "other")).await.unwrap());
    store
        .complete(&l, Bytes::from_static(b"\"stored\""), retention)
        .await
        .unwrap();
    // Completed with a result that does not decode as a String.
    let l = lease(store.acquire(&req("undecodable", "other")).await.unwrap());
    store
        .complete(&l, Bytes::from_static(b"17"), retention)
        .await
        .unwrap();
    // A terminal failure.
    let l = lease(store.acquire(&req("failed", "other")).await.unwrap());
    store
        .fail(&l, "no such account", FailureKind::Terminal, retention)
        .await
        .unwrap();
    // Every attempt used.
    for _ in 0..MAX_ATTEMPTS {
        let l = lease(store.acquire(&req("exhausted", "other")).await.unwrap());
        store
            .fail(&l, "down", FailureKind::Retryable, retention)
            .await
            .unwrap();
    }
    // One attempt used: the next is the second.
    let l = lease(store.acquire(&req("failed-once", "other")).await.unwrap());
    store
        .fail(&l, "down", FailureKind::Retryable, retention)
        .await
        .unwrap();
    // Completed for another payload: a conflict.
    let conflicting = req("conflict", "other").with_fingerprint(idem_core::Fingerprint::of(b"a"));
    let l = lease(store.acquire(&conflicting).await.unwrap());
    store
        .complete(&l, Bytes::from_static(b"\"a\""), retention)
        .await
        .unwrap();
}

/// Every kind of message, the same key more than once among them.
fn mixed() -> Vec<RawMessage> {
    vec![
        msg("fresh", "hello"),
        msg("done", "again"),
        msg("busy", "hello"),
        msg("conflict", "b"),
        msg("exhausted", "hello"),
        msg("failed", "hello"),
        msg("failed-once", "hello"),
        msg("undecodable", "hello"),
        msg(&"x".repeat(10_000), "too long a key"),
        RawMessage::new("no key".to_owned()),
        msg("retry", "retry"),
        msg("terminal", "terminal"),
        msg("panic", "panic"),
        msg("yield", "yield"),
        // The same keys again: after a completion, a retryable failure, a terminal one.
        msg("fresh", "hello"),
        msg("retry", "retry"),
        msg("retry", "retry"),
        msg("terminal", "terminal"),
        msg("twice", "first"),
        msg("twice", "first"),
    ]
}

fn keys() -> Vec<&'static str> {
    vec![
        "fresh",
        "done",
        "busy",
        "conflict",
        "exhausted",
        "failed",
        "failed-once",
        "undecodable",
        "retry",
        "terminal",
        "panic",
        "yield",
        "twice",
    ]
}

#[tokio::test]
async fn a_mixed_batch_gives_exactly_the_outcomes_of_single_calls() {
    let (single_store, _c1) = manual_store();
    let (batch_store, _c2) = manual_store();
    seed(&single_store).await;
    seed(&batch_store).await;
    let single = Executor::new(Arc::new(single_store.clone()), config()).unwrap();
    // Small groups and few slots, so that records go in several groups.
    let batched = Executor::new(
        Arc::new(batch_store.clone()),
        config().with_batch(
            BatchConfig::default()
                .with_concurrency(4)
                .with_record_batch(3),
        ),
    )
    .unwrap();
    let msgs = mixed();

    let mut expected = Vec::new();
    for m in &msgs {
        let payload = m.payload().to_vec();
        let r = single
            .run(
                m,
                |ctx| async move { behave(&payload, ctx.attempt()).await },
            )
            .await;
        expected.push(format!("{r:?}"));
    }
    let got = batched
        .run_batch(&msgs, |i, ctx| {
            let payload = msgs[i].payload().to_vec();
            async move { behave(&payload, ctx.attempt()).await }
        })
        .await
        .unwrap();
    let got: Vec<String> = got.iter().map(|r| format!("{r:?}")).collect();
    assert_eq!(got.len(), msgs.len());
    for (i, (got, expected)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(got, expected, "message {i}");
    }
    // And the stores hold the same records.
    let ns = idem_core::Namespace::new("batch").unwrap();
    for key in keys() {
        let key = ns.key(key).unwrap();
        let a = single_store.get(&key).await.unwrap().unwrap();
        let b = batch_store.get(&key).await.unwrap().unwrap();
        // Tokens are issued in another order across keys (the batch acquires its keys first).
        let fields = |r: &Record| {
            format!(
                "{:?} {} {} {:?} {:?} {:?}",
                r.state, r.attempts, r.owner, r.fingerprint, r.lease_expires_at, r.expires_at
            )
        };
        assert_eq!(fields(&a), fields(&b), "record of {key}");
    }
    // The outcomes the comparison covers, spelled out.
    assert!(expected[0].contains("Executed"), "{}", expected[0]);
    assert!(expected[1].contains("Replayed"), "{}", expected[1]);
    assert!(expected[2].contains("InProgress"), "{}", expected[2]);
    assert!(expected[3].contains("Conflict"), "{}", expected[3]);
    assert!(expected[4].contains("Exhausted"), "{}", expected[4]);
    assert!(expected[5].contains("Failed"), "{}", expected[5]);
    assert!(expected[6].contains("hello at 2"), "{}", expected[6]);
    assert!(expected[7].contains("Decode"), "{}", expected[7]);
    assert!(expected[8].contains("InvalidKey"), "{}", expected[8]);
    assert!(expected[9].contains("MissingKey"), "{}", expected[9]);
    assert!(expected[10].contains("Retry"), "{}", expected[10]);
    assert!(expected[11].contains("Failed"), "{}", expected[11]);
    assert!(expected[12].contains("panicked: true"), "{}", expected[12]);
    assert!(expected[13].contains("Executed"), "{}", expected[13]);
    assert!(expected[14].contains("Replayed"), "{}", expected[14]);
    assert!(expected[15].contains("attempt: 2"), "{}", expected[15]);
    assert!(expected[16].contains("Exhausted"), "{}", expected[16]);
    assert!(expected[17].contains("Failed"), "{}", expected[17]);
    assert!(expected[18].contains("Executed"), "{}", expected[18]);
    assert!(expected[19].contains("Replayed"), "{}", expected[19]);
}

/// A store that counts the calls it is given, around a `MemoryStore`.
#[derive(Debug, Default)]
struct Counting {
    inner: MemoryStore,
    singles: AtomicUsize,
    acquire_many: AtomicUsize,
    complete_many: AtomicUsize,
    fail_many: AtomicUsize,
    /// Whether every acquire fails, a batch as one call (a server that cannot be reached).
    down: AtomicBool,
    /// Whether `complete_many` waits (until [`Counting::open`]) before it answers.
    held: AtomicBool,
    opened: tokio::sync::Notify,
}

impl Counting {
    /// Lets every `complete_many`, waiting or to come, answer.
    fn open(&self) {
        self.held.store(false, Ordering::SeqCst);
        self.opened.notify_waiters();
    }

    async fn wait_open(&self) {
        loop {
            // Created before the check, so an `open` after it wakes it.
            let opened = self.opened.notified();
            if !self.held.load(Ordering::SeqCst) {
                return;
            }
            opened.await;
        }
    }

    fn outage(&self) -> idem_core::Result<()> {
        if self.down.load(Ordering::SeqCst) {
            return Err(idem_core::Error::unavailable(
                "counting",
                "connection refused",
            ));
        }
        Ok(())
    }
}

#[async_trait]
impl IdempotencyStore for Counting {
    fn name(&self) -> &'static str {
        "counting"
    }
    fn limits(&self) -> Limits {
        self.inner.limits()
    }
    async fn acquire(&self, req: &AcquireRequest) -> idem_core::Result<AcquireOutcome> {
        self.singles.fetch_add(1, Ordering::SeqCst);
        self.outage()?;
        self.inner.acquire(req).await
    }
    async fn extend(&self, lease: &Lease, ttl: Duration) -> idem_core::Result<Lease> {
        self.inner.extend(lease, ttl).await
    }
    async fn complete(
        &self,
        lease: &Lease,
        result: Bytes,
        retention: Duration,
    ) -> idem_core::Result<()> {
        self.singles.fetch_add(1, Ordering::SeqCst);
        self.inner.complete(lease, result, retention).await
    }
    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> idem_core::Result<()> {
        self.singles.fetch_add(1, Ordering::SeqCst);
        self.inner.fail(lease, error, kind, retention).await
    }
    async fn release(&self, lease: &Lease) -> idem_core::Result<()> {
        self.inner.release(lease).await
    }
    async fn acquire_many(
        &self,
        reqs: &[AcquireRequest],
    ) -> idem_core::Result<Vec<idem_core::Result<AcquireOutcome>>> {
        self.acquire_many.fetch_add(1, Ordering::SeqCst);
        self.outage()?;
        self.inner.acquire_many(reqs).await
    }
    async fn complete_many(
        &self,
        items: &[Completion],
        retention: Duration,
    ) -> idem_core::Result<Vec<idem_core::Result<()>>> {
        self.complete_many.fetch_add(1, Ordering::SeqCst);
        self.wait_open().await;
        self.inner.complete_many(items, retention).await
    }
    async fn fail_many(
        &self,
        items: &[Failure],
        retention: Duration,
    ) -> idem_core::Result<Vec<idem_core::Result<()>>> {
        self.fail_many.fetch_add(1, Ordering::SeqCst);
        self.inner.fail_many(items, retention).await
    }
    async fn get(&self, key: &IdempotencyKey) -> idem_core::Result<Option<Record>> {
        self.inner.get(key).await
    }
    async fn delete(&self, key: &IdempotencyKey) -> idem_core::Result<bool> {
        self.inner.delete(key).await
    }
    async fn list(&self, query: &ListQuery) -> idem_core::Result<Page> {
        self.inner.list(query).await
    }
    async fn purge_expired(&self, limit: usize) -> idem_core::Result<u64> {
        self.inner.purge_expired(limit).await
    }
}

#[tokio::test]
async fn a_batch_acquires_in_one_call_and_records_in_groups() {
    let store = Arc::new(Counting::default());
    let exec = Executor::new(store.clone(), config()).unwrap();
    let msgs: Vec<RawMessage> = (0..100)
        .map(|i| msg(&format!("k{i}"), if i % 10 == 0 { "retry" } else { "ok" }))
        .collect();
    let out = exec
        .run_batch(&msgs, |i, ctx| {
            let payload = msgs[i].payload().to_vec();
            async move { behave(&payload, ctx.attempt()).await }
        })
        .await
        .unwrap();
    for (i, r) in out.iter().enumerate() {
        match r {
            Ok(Outcome::Retry { attempt: 1, .. }) if i % 10 == 0 => {}
            Ok(Outcome::Executed(s)) if i % 10 != 0 => assert_eq!(s, "ok at 1"),
            other => panic!("message {i}: {other:?}"),
        }
    }
    assert_eq!(store.acquire_many.load(Ordering::SeqCst), 1);
    assert_eq!(store.singles.load(Ordering::SeqCst), 0, "no single calls");
    let completes = store.complete_many.load(Ordering::SeqCst);
    let fails = store.fail_many.load(Ordering::SeqCst);
    // 64 handlers at once (the default), all finishing at their first poll: the other 36 run
    // as the first ones free their slots, before the group is sent, so one group each.
    assert_eq!(completes, 1, "complete_many calls");
    assert_eq!(fails, 1, "fail_many calls");
}

/// A handler slot is taken for the handler, not for the record: with one slot, the second
/// message's handler starts while the first one's completion is still unanswered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_slot_is_free_while_its_record_is_sent() {
    let store = Arc::new(Counting::default());
    store.held.store(true, Ordering::SeqCst);
    let exec = Executor::new(
        store.clone(),
        config().with_batch(BatchConfig::default().with_concurrency(1)),
    )
    .unwrap();
    let msgs = [msg("first", "x"), msg("second", "y")];
    let (started_tx, started_rx) = oneshot::channel();
    let started_tx = std::sync::Mutex::new(Some(started_tx));
    let batch = exec.run_batch(&msgs, |i, _ctx| {
        if i == 1 {
            let _ = started_tx.lock().unwrap().take().map(|tx| tx.send(()));
        }
        async move { Ok::<_, HandlerError>(i) }
    });
    let opener = async {
        tokio::time::timeout(Duration::from_secs(10), started_rx)
            .await
            .expect("the second handler waited for the first one's record to be answered")
            .unwrap();
        assert!(
            store.held.load(Ordering::SeqCst),
            "no completion answered yet"
        );
        store.open();
    };
    let (out, ()) = tokio::join!(batch, opener);
    let out = out.unwrap();
    assert!(matches!(out[0], Ok(Outcome::Executed(0))), "{:?}", out[0]);
    assert!(matches!(out[1], Ok(Outcome::Executed(1))), "{:?}", out[1]);
}

/// No more than `concurrency` handlers run at once, and that many do, the later messages of a
/// key included (the first ten keys fail at first, so their second messages run again).
#[tokio::test]
async fn handlers_run_at_most_concurrency_at_once() {
    let exec = Executor::new(
        Arc::new(MemoryStore::new()),
        config().with_batch(BatchConfig::default().with_concurrency(3)),
    )
    .unwrap();
    let msgs: Vec<RawMessage> = (0..30).map(|i| msg(&format!("k{}", i % 20), "p")).collect();
    let (running, most) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let out = exec
        .run_batch(&msgs, |i, _ctx| {
            let (running, most) = (&running, &most);
            async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                running.fetch_sub(1, Ordering::SeqCst);
                if i < 10 {
                    return Err(HandlerError::retryable("not yet"));
                }
                Ok::<_, HandlerError>(i)
            }
        })
        .await
        .unwrap();
    for (i, r) in out.iter().enumerate() {
        match r {
            Ok(Outcome::Retry { attempt: 1, .. }) if i < 10 => {}
            Ok(Outcome::Executed(n)) if i >= 10 => assert_eq!(*n, i),
            other => panic!("message {i}: {other:?}"),
        }
    }
    assert_eq!(most.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn handlers_start_in_message_order_whatever_their_lengths() {
    let exec = Executor::new(
        Arc::new(MemoryStore::new()),
        config().with_batch(BatchConfig::default().with_concurrency(2)),
    )
    .unwrap();
    let msgs: Vec<RawMessage> = (0..40).map(|i| msg(&format!("k{i}"), "p")).collect();
    let started = Mutex::new(Vec::new());
    let out = exec
        .run_batch(&msgs, |i, _ctx| {
            let started = &started;
            async move {
                started.lock().unwrap().push(i);
                // Handlers of different lengths free their slots out of order.
                for _ in 0..(i * 7) % 5 {
                    tokio::task::yield_now().await;
                }
                Ok::<_, HandlerError>(i)
            }
        })
        .await
        .unwrap();
    assert!(out.iter().all(|r| matches!(r, Ok(Outcome::Executed(_)))));
    assert_eq!(
        started.into_inner().unwrap(),
        (0..40).collect::<Vec<_>>(),
        "each handler starts after every earlier message's"
    );
}

#[tokio::test]
async fn a_batch_over_the_store_limit_is_refused_whole() {
    let (clock_store, clock) = manual_store();
    drop(clock_store);
    let store = MemoryStore::with_options(clock, Limits::default().with_max_batch(3));
    let exec = Executor::new(Arc::new(store.clone()), config()).unwrap();
    let msgs: Vec<RawMessage> = (0..4).map(|i| msg(&format!("k{i}"), "x")).collect();
    let ran = AtomicUsize::new(0);
    let r = exec
        .run_batch(&msgs, |_, _| {
            ran.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, HandlerError>(1u8) }
        })
        .await;
    assert_eq!(r.unwrap_err(), BatchError::TooLarge { len: 4, max: 3 });
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    assert!(store.is_empty(), "nothing written");
    // At the limit it runs.
    let r = exec
        .run_batch(&msgs[..3], |_, _| async { Ok::<_, HandlerError>(1u8) })
        .await
        .unwrap();
    assert!(r.iter().all(|r| matches!(r, Ok(Outcome::Executed(1)))));
}

#[tokio::test]
async fn a_record_batch_over_the_store_limit_is_a_config_error() {
    let store = MemoryStore::new();
    let e = Executor::new(
        Arc::new(store),
        config().with_batch(BatchConfig::default().with_record_batch(101)),
    )
    .unwrap_err();
    assert_eq!(e.field, "batch");
    let e = Executor::new(
        Arc::new(MemoryStore::new()),
        config().with_batch(BatchConfig::default().with_concurrency(0)),
    )
    .unwrap_err();
    assert_eq!(e.field, "batch");
    // A record window as long as the lease, or with no end.
    for window in [config().lease_ttl, Duration::MAX] {
        let e = Executor::new(
            Arc::new(MemoryStore::new()),
            config().with_batch(BatchConfig::default().with_record_window(window)),
        )
        .unwrap_err();
        assert_eq!(e.field, "batch", "{window:?}");
    }
    // A store that takes no batch: every batch call would fail, so every runner's would too.
    let (_, clock) = manual_store();
    let e = Executor::new(
        Arc::new(MemoryStore::with_options(
            clock,
            Limits::default().with_max_batch(0),
        )),
        config(),
    )
    .unwrap_err();
    assert_eq!(e.field, "store");
}

// A real clock and short leases: a slow handler keeps its lease by heartbeats, and so does a
// message waiting behind it for the only handler slot. A lease of 500 ms heartbeated every
// 50 ms: a stall of the test's threads (a loaded machine) shorter than about 400 ms keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_heartbeat_through_a_slow_handler_and_while_waiting_for_a_slot() {
    let store = MemoryStore::new();
    let lease = Duration::from_millis(500);
    let config = ExecutorConfig::new("slow")
        .with_lease_ttl(lease)
        .with_heartbeat_interval(Duration::from_millis(50));
    let batched = Executor::new(
        Arc::new(store.clone()),
        config
            .clone()
            .with_owner("batch")
            .with_batch(BatchConfig::default().with_concurrency(1)),
    )
    .unwrap();
    let other = Executor::new(Arc::new(store.clone()), config.with_owner("other")).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let runs = Arc::new(AtomicUsize::new(0));
    let (started_tx, started_rx) = oneshot::channel::<()>();
    let task = {
        let (done, runs) = (done.clone(), runs.clone());
        let started_tx = std::sync::Mutex::new(Some(started_tx));
        tokio::spawn(async move {
            let msgs = vec![msg("slow", "slow"), msg("queued", "queued")];
            let out = batched
                .run_batch(&msgs, |i, ctx| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    if let Some(started) = started_tx.lock().unwrap().take() {
                        started.send(()).unwrap();
                    }
                    async move {
                        if i == 0 {
                            tokio::time::sleep(lease * 3).await;
                        }
                        assert!(!ctx.is_cancelled());
                        assert!(!ctx.is_takeover());
                        Ok::<_, HandlerError>(i)
                    }
                })
                .await
                .unwrap();
            done.store(true, Ordering::SeqCst);
            out
        })
    };
    started_rx.await.unwrap();
    let mut busy = 0;
    while !done.load(Ordering::SeqCst) {
        for key in ["slow", "queued"] {
            let r = other
                .run(&msg(key, key), |_| async {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, HandlerError>(99usize)
                })
                .await
                .unwrap();
            match r {
                Outcome::InProgress { ref owner, .. } => {
                    assert_eq!(owner, "batch");
                    busy += 1;
                }
                Outcome::Replayed(_) => {}
                other => panic!("{key}: {other:?}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    let out = task.await.unwrap();
    assert!(matches!(out[0], Ok(Outcome::Executed(0))), "{:?}", out[0]);
    assert!(matches!(out[1], Ok(Outcome::Executed(1))), "{:?}", out[1]);
    assert_eq!(runs.load(Ordering::SeqCst), 2, "nobody else ran them");
    assert!(
        busy >= 10,
        "the other worker kept finding them busy: {busy}"
    );
    for key in ["slow", "queued"] {
        let record = store
            .get(&other.namespace().key(key).unwrap())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(record.attempts, 1, "{key}");
        assert!(matches!(record.state, RecordState::Completed { .. }));
    }
}

// Current-thread runtime and a manual store clock: the takeover happens exactly while the
// batch's handler waits.
#[tokio::test]
async fn a_superseded_lease_in_a_batch_is_refused_for_its_key_alone() {
    let (store, clock) = manual_store();
    let batched = Executor::new(Arc::new(store.clone()), config()).unwrap();
    let rescuer = Executor::new(Arc::new(store.clone()), config().with_owner("rescuer")).unwrap();
    let (started_tx, started_rx) = oneshot::channel::<()>();
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let started_tx = std::sync::Mutex::new(Some(started_tx));
    let go_rx = std::sync::Mutex::new(Some(go_rx));
    let msgs = vec![msg("stalled", "a"), msg("quick", "b")];
    let batch = batched.run_batch(&msgs, |i, _ctx| {
        let started = started_tx.lock().unwrap().take().filter(|_| i == 0);
        let go = go_rx.lock().unwrap().take().filter(|_| i == 0);
        async move {
            if let (Some(started), Some(go)) = (started, go) {
                started.send(()).unwrap();
                go.await.unwrap();
            }
            Ok::<_, HandlerError>(format!("batch {i}"))
        }
    });
    let takeover = async {
        started_rx.await.unwrap();
        clock.advance(Duration::from_secs(31));
        let r = rescuer
            .run(&msg("stalled", "a"), |ctx| async move {
                assert!(ctx.is_takeover());
                Ok::<_, HandlerError>("rescued".to_owned())
            })
            .await
            .unwrap();
        assert!(matches!(r, Outcome::Executed(_)), "{r:?}");
        go_tx.send(()).unwrap();
    };
    let (out, ()) = tokio::join!(batch, takeover);
    let out = out.unwrap();
    assert!(
        matches!(out[0], Ok(Outcome::LeaseLost { .. })),
        "{:?}",
        out[0]
    );
    assert!(
        matches!(&out[1], Ok(Outcome::Executed(s)) if s == "batch 1"),
        "{:?}",
        out[1]
    );
    let record = store
        .get(&batched.namespace().key("stalled").unwrap())
        .await
        .unwrap()
        .unwrap();
    match record.state {
        RecordState::Completed { result, .. } => assert_eq!(&result[..], b"\"rescued\""),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_store_outage_fails_each_message_as_a_single_call_would() {
    let (single_store, _c1) = manual_store();
    let (batch_store, _c2) = manual_store();
    single_store.set_available(false);
    batch_store.set_available(false);
    let single = Executor::new(Arc::new(single_store), config()).unwrap();
    let batched = Executor::new(Arc::new(batch_store), config()).unwrap();
    let msgs = vec![
        msg("a", "x"),
        msg("b", "y"),
        RawMessage::new("no key".to_owned()),
    ];
    let mut expected = Vec::new();
    let mut expected_text = Vec::new();
    for m in &msgs {
        let r = single
            .run(m, |_| async { Ok::<_, HandlerError>(1u8) })
            .await;
        expected.push(format!("{r:?}"));
        expected_text.push(r.err().map(|e| e.to_string()));
    }
    let ran = AtomicUsize::new(0);
    let got = batched
        .run_batch(&msgs, |_, _| {
            ran.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, HandlerError>(1u8) }
        })
        .await
        .unwrap();
    assert_eq!(ran.load(Ordering::SeqCst), 0, "fail closed: no handler ran");
    for (i, r) in got.iter().enumerate() {
        assert!(
            matches!(
                r,
                Err(idem_executor::ExecutorError::Store {
                    handler_ran: false,
                    ..
                }) | Err(idem_executor::ExecutorError::MissingKey)
            ),
            "{r:?}"
        );
        // The same kind of error; the batch's wraps the one error of its single store call.
        assert_eq!(
            expected[i].split_once('{').map(|(kind, _)| kind.to_owned()),
            format!("{r:?}")
                .split_once('{')
                .map(|(kind, _)| kind.to_owned()),
        );
        // And it reads the same: the store and the kind said once, then the cause.
        assert_eq!(
            r.as_ref().err().map(|e| e.to_string()),
            expected_text[i],
            "message {i}"
        );
    }
}

#[tokio::test]
async fn a_batch_call_that_failed_whole_reads_as_a_single_call_failure() {
    let store = Arc::new(Counting::default());
    store.down.store(true, Ordering::SeqCst);
    let exec = Executor::new(store.clone(), config()).unwrap();
    let msgs = vec![msg("a", "x"), msg("b", "y")];
    let single = exec
        .run(&msgs[0], |_| async { Ok::<_, HandlerError>(1u8) })
        .await
        .expect_err("the store is down")
        .to_string();
    assert_eq!(
        single,
        "store error at acquire (handler ran: false): counting store unavailable: connection refused"
    );
    let got = exec
        .run_batch(&msgs, |_, _| async { Ok::<_, HandlerError>(1u8) })
        .await
        .unwrap();
    assert_eq!(store.acquire_many.load(Ordering::SeqCst), 1);
    for r in &got {
        let e = r.as_ref().expect_err("the store is down");
        assert!(
            matches!(e, idem_executor::ExecutorError::Store { source, .. } if source.is_retryable()),
            "{e:?}"
        );
        // The store and the kind said once, then the cause, as for a single call.
        assert_eq!(e.to_string(), single);
    }
}

/// A store that cannot hold keys whose id holds `支` (as a PostgreSQL database in LATIN1
/// encoding): a single acquire of one is refused with `InvalidInput` on `key`, and a batch
/// holding one is refused whole, as one SQL statement would be.
#[derive(Debug, Default)]
struct RefusesSomeKeys {
    inner: Counting,
}

impl RefusesSomeKeys {
    fn refused(req: &AcquireRequest) -> bool {
        req.key.id().contains('支')
    }
    fn refusal() -> idem_core::Error {
        idem_core::Error::invalid("key", "the database's encoding cannot hold it")
    }
}

#[async_trait]
impl IdempotencyStore for RefusesSomeKeys {
    fn name(&self) -> &'static str {
        "refuses-some-keys"
    }
    fn limits(&self) -> Limits {
        self.inner.limits()
    }
    async fn acquire(&self, req: &AcquireRequest) -> idem_core::Result<AcquireOutcome> {
        if Self::refused(req) {
            return Err(Self::refusal());
        }
        self.inner.acquire(req).await
    }
    async fn extend(&self, lease: &Lease, ttl: Duration) -> idem_core::Result<Lease> {
        self.inner.extend(lease, ttl).await
    }
    async fn complete(
        &self,
        lease: &Lease,
        result: Bytes,
        retention: Duration,
    ) -> idem_core::Result<()> {
        self.inner.complete(lease, result, retention).await
    }
    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> idem_core::Result<()> {
        if !error.is_ascii() {
            return Err(idem_core::Error::invalid(
                "error",
                "the database's encoding cannot hold it",
            ));
        }
        self.inner.fail(lease, error, kind, retention).await
    }
    async fn release(&self, lease: &Lease) -> idem_core::Result<()> {
        self.inner.release(lease).await
    }
    async fn acquire_many(
        &self,
        reqs: &[AcquireRequest],
    ) -> idem_core::Result<Vec<idem_core::Result<AcquireOutcome>>> {
        if reqs.iter().any(Self::refused) {
            return Err(Self::refusal());
        }
        self.inner.acquire_many(reqs).await
    }
    async fn get(&self, key: &IdempotencyKey) -> idem_core::Result<Option<Record>> {
        self.inner.get(key).await
    }
    async fn delete(&self, key: &IdempotencyKey) -> idem_core::Result<bool> {
        self.inner.delete(key).await
    }
    async fn purge_expired(&self, limit: usize) -> idem_core::Result<u64> {
        self.inner.purge_expired(limit).await
    }
}

/// A failure whose text the store cannot hold is recorded in ASCII, not retried for ever with
/// the handler run again each time; alone and in a batch (whose failures go in groups).
#[tokio::test]
async fn a_failure_text_the_store_refuses_is_recorded_in_ascii() {
    let store = Arc::new(RefusesSomeKeys::default());
    let exec = Executor::new(store.clone(), config()).unwrap();
    let escaped = "payment refused: \\u{652f}\\u{6255} (card)".to_owned();
    let single = exec
        .run(&msg("fails-1", "x"), |_| async {
            Err::<u8, _>(HandlerError::terminal("payment refused: 支払 (card)"))
        })
        .await;
    assert!(
        matches!(&single, Ok(Outcome::Failed { error }) if *error == escaped),
        "{single:?}"
    );
    let ran = AtomicUsize::new(0);
    let msgs = vec![msg("fails-2", "a"), msg("fine", "b")];
    let got = exec
        .run_batch(&msgs, |i, _| {
            ran.fetch_add(1, Ordering::SeqCst);
            async move {
                match i {
                    0 => Err(HandlerError::terminal("payment refused: 支払 (card)")),
                    _ => Ok(1u8),
                }
            }
        })
        .await
        .unwrap();
    assert!(
        matches!(&got[0], Ok(Outcome::Failed { error }) if *error == escaped),
        "{:?}",
        got[0]
    );
    assert!(matches!(got[1], Ok(Outcome::Executed(1))), "{:?}", got[1]);
    let ns = idem_core::Namespace::new("batch").unwrap();
    for id in ["fails-1", "fails-2"] {
        let record = store.get(&ns.key(id).unwrap()).await.unwrap().unwrap();
        assert!(
            matches!(&record.state, RecordState::Failed { error, .. } if *error == escaped),
            "{id}: {:?}",
            record.state
        );
    }
    // The handler ran once for each message: the refusal did not send them round again.
    assert_eq!(ran.load(Ordering::SeqCst), 2);
}

/// A key the store refuses is an invalid key, dead-lettered at once, not a store error retried
/// for ever; in a batch the store refused whole, the other messages still run.
#[tokio::test]
async fn a_key_the_store_refuses_is_an_invalid_key_alone() {
    let store = Arc::new(RefusesSomeKeys::default());
    let exec = Executor::new(store.clone(), config()).unwrap();
    let single = exec
        .run(&msg("支付-1", "x"), |_| async {
            Ok::<_, HandlerError>(1u8)
        })
        .await;
    assert!(
        matches!(single, Err(idem_executor::ExecutorError::InvalidKey(_))),
        "{single:?}"
    );
    let action = single.unwrap_err().action();
    assert!(
        matches!(
            action,
            idem_executor::BrokerAction::DeadLetter {
                reason: idem_executor::DeadLetterReason::InvalidKey,
                ..
            }
        ),
        "{action:?}"
    );

    let msgs = vec![msg("ok-1", "a"), msg("支付-2", "b"), msg("ok-2", "c")];
    let ran = AtomicUsize::new(0);
    let got = exec
        .run_batch(&msgs, |_, _| {
            ran.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, HandlerError>(1u8) }
        })
        .await
        .unwrap();
    assert!(matches!(got[0], Ok(Outcome::Executed(1))), "{:?}", got[0]);
    assert!(
        matches!(got[1], Err(idem_executor::ExecutorError::InvalidKey(_))),
        "{:?}",
        got[1]
    );
    assert!(matches!(got[2], Ok(Outcome::Executed(1))), "{:?}", got[2]);
    assert_eq!(
        ran.load(Ordering::SeqCst),
        2,
        "the refused key's handler never ran"
    );
    // A batch of that message alone, or of it twice: one request, refused the same way.
    for msgs in [
        vec![msg("支付-3", "d")],
        vec![msg("支付-4", "e"), msg("支付-4", "e")],
    ] {
        let got = exec
            .run_batch(&msgs, |_, _| async { Ok::<_, HandlerError>(1u8) })
            .await
            .unwrap();
        for r in &got {
            assert!(
                matches!(r, Err(idem_executor::ExecutorError::InvalidKey(_))),
                "{got:?}"
            );
        }
    }
    let ns = idem_core::Namespace::new("batch").unwrap();
    for id in ["ok-1", "ok-2"] {
        let record = store.get(&ns.key(id).unwrap()).await.unwrap().unwrap();
        assert!(
            matches!(record.state, RecordState::Completed { .. }),
            "{id}: {:?}",
            record.state
        );
    }
}

#[test]
fn run_batch_future_is_send_for_send_handlers() {
    fn assert_send<T: Send>(_: &T) {}
    let exec = Executor::new(Arc::new(MemoryStore::new()), config()).unwrap();
    let msgs = vec![msg("a", "x")];
    let fut = exec.run_batch(&msgs, |i, _| async move { Ok::<_, HandlerError>(i) });
    assert_send(&fut);
}

/// A batch dropped while a message waits for a handler slot (a runner giving up on a batch whose
/// running handler ignores its cancellation) gives that message's key back: the next owner runs
/// it at once as the same attempt, rather than waiting out the lease and counting a takeover for
/// a handler that never ran. The key whose handler did run stays in progress under its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_dropped_before_a_handler_ran_gives_its_key_back() {
    let store = MemoryStore::new();
    let exec = Executor::new(
        Arc::new(store.clone()),
        config().with_batch(BatchConfig::default().with_concurrency(1)),
    )
    .unwrap();
    let msgs = [msg("stuck", "x"), msg("waiting", "y")];
    let (running_tx, running_rx) = oneshot::channel();
    let running_tx = std::sync::Mutex::new(Some(running_tx));
    let call = exec.run_batch(&msgs, |i, _ctx| {
        if let Some(tx) = running_tx.lock().unwrap().take() {
            let _ = tx.send(i);
        }
        async move {
            // The first handler never returns, cancellation or not.
            if i == 0 {
                std::future::pending::<()>().await;
            }
            Ok::<_, HandlerError>(())
        }
    });
    let dropped = async {
        tokio::select! {
            _ = call => panic!("the first handler never returns"),
            first = running_rx => assert_eq!(first.unwrap(), 0),
        }
    };
    dropped.await;
    let ns = idem_core::Namespace::new("batch").unwrap();
    let state = |id: &'static str| {
        let (store, key) = (store.clone(), ns.key(id).unwrap());
        async move { store.get(&key).await.unwrap().unwrap().state }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !matches!(state("waiting").await, RecordState::Released) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the waiting key was not given back: {:?}",
            state("waiting").await
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        matches!(state("stuck").await, RecordState::InProgress),
        "{:?}",
        state("stuck").await
    );
    let again = exec
        .run(&msgs[1], |_ctx| async { Ok::<_, HandlerError>(()) })
        .await;
    match again.unwrap() {
        Outcome::Executed(_) => {}
        other => panic!("{other:?}"),
    }
    let record = store
        .get(&ns.key("waiting").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        record.attempts, 1,
        "no attempt counted for the handler that never ran"
    );
}

/// `run_batch_each` hands each message's result over as soon as it is recorded: the fast
/// messages' results (their completions in the store) arrive while the slow handler still runs,
/// and every message gets exactly one result, the one `run_batch` gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_batch_each_hands_over_each_result_once_it_is_recorded() {
    let store = MemoryStore::new();
    let exec = Executor::new(Arc::new(store.clone()), config()).unwrap();
    let msgs = vec![
        msg("slow", "slow"),
        msg("a", "a"),
        msg("b", "b"),
        msg("c", "c"),
    ];
    let (release, released) = oneshot::channel::<()>();
    let released = futures::future::FutureExt::shared(async move {
        let _ = released.await;
    });
    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let handler = |i: usize, _ctx| {
        let released = released.clone();
        async move {
            if i == 0 {
                released.await;
            }
            Ok::<_, HandlerError>(i)
        }
    };
    let run = exec.run_batch_each(&msgs, handler, move |i, result| {
        seen_tx.send((i, result)).unwrap();
    });
    let watch = async {
        let mut fast = Vec::new();
        while fast.len() < 3 {
            let next = tokio::time::timeout(Duration::from_secs(10), seen.recv()).await;
            let (i, result) = next
                .expect("the fast results are handed over while the slow handler runs")
                .unwrap();
            assert!(
                matches!(result, Ok(Outcome::Executed(n)) if n == i),
                "{i}: {result:?}"
            );
            fast.push(i);
        }
        fast.sort_unstable();
        assert_eq!(
            fast,
            [1, 2, 3],
            "the fast ones first, the slow one still running"
        );
        let ns = idem_core::Namespace::new("batch").unwrap();
        for key in ["a", "b", "c"] {
            let record = store.get(&ns.key(key).unwrap()).await.unwrap().unwrap();
            assert!(
                matches!(record.state, RecordState::Completed { .. }),
                "{key} is recorded before its result is handed over: {record:?}"
            );
        }
        release.send(()).unwrap();
        let (i, result) = seen.recv().await.unwrap();
        assert_eq!(i, 0);
        assert!(matches!(result, Ok(Outcome::Executed(0))), "{result:?}");
        seen
    };
    let (ran, mut seen) = tokio::join!(run, watch);
    ran.unwrap();
    assert!(seen.recv().await.is_none(), "one result per message");
}

/// Within one key the results come one by one too: the first copy's result (a retryable failure,
/// recorded) is handed over before the second copy's handler, the next attempt, ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_batch_each_hands_over_a_keys_first_copy_before_its_second_ends() {
    let exec = Executor::new(Arc::new(MemoryStore::new()), config()).unwrap();
    let msgs = vec![msg("k", "same"), msg("k", "same")];
    let (release, released) = oneshot::channel::<()>();
    let released = futures::future::FutureExt::shared(async move {
        let _ = released.await;
    });
    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let handler = |i: usize, _ctx| {
        let released = released.clone();
        async move {
            if i == 0 {
                return Err(HandlerError::retryable("flaky"));
            }
            released.await;
            Ok::<_, HandlerError>(i)
        }
    };
    let run = exec.run_batch_each(&msgs, handler, move |i, result| {
        seen_tx.send((i, result)).unwrap();
    });
    let watch = async {
        let first = tokio::time::timeout(Duration::from_secs(10), seen.recv()).await;
        let (i, result) = first
            .expect("the first copy's result is handed over while the second runs")
            .unwrap();
        assert_eq!(i, 0);
        assert!(matches!(result, Ok(Outcome::Retry { .. })), "{result:?}");
        release.send(()).unwrap();
        let (i, result) = seen.recv().await.unwrap();
        assert_eq!(i, 1);
        assert!(matches!(result, Ok(Outcome::Executed(1))), "{result:?}");
    };
    let (ran, ()) = tokio::join!(run, watch);
    ran.unwrap();
}
