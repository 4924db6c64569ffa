//! A fault-injecting store wrapper, for testing what runs on top of a store: lost replies,
//! outages, refused calls and delays, on any [`IdempotencyStore`], and on
//! [`TransactionalStore::complete_with`] too when the wrapped store offers it.
//!
//! [`FaultyStore`] forwards every call to the store it wraps, except where a fault was armed:
//!
//! | fault | armed with | the call | its answer |
//! |---|---|---|---|
//! | lost reply | [`lose_replies`](FaultyStore::lose_replies)`(op, n)` | sent, takes effect | [`Error::Unavailable`] (the real reply is dropped) |
//! | refused call | [`refuse`](FaultyStore::refuse)`(op, n)` | not sent | [`Error::Unavailable`] |
//! | outage | [`set_outage`](FaultyStore::set_outage)`(true)` until `false` | not sent, any operation | [`Error::Unavailable`] |
//! | delay | [`set_delay`](FaultyStore::set_delay)`(op, d)` | sent after `d` (on `tokio::time`, so a paused clock skips it) | the store's |
//!
//! The injected error's source is an [`InjectedFault`] (find it with [`InjectedFault::of`]), and
//! its `store` is the wrapped store's name. [`calls`](FaultyStore::calls) and
//! [`sent`](FaultyStore::sent) count, per [`Op`], the calls made to the wrapper and those that
//! reached the wrapped store.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use idem_conformance::faults::{FaultyStore, InjectedFault, Op};
//! use idem_core::{AcquireOutcome, AcquireRequest, Bytes, IdempotencyStore, MemoryStore, Namespace};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> idem_core::Result<()> {
//! let store = Arc::new(FaultyStore::new(MemoryStore::new()));
//! let key = Namespace::new("demo")?.key("k")?;
//! let AcquireOutcome::Acquired { lease, .. } =
//!     store.acquire(&AcquireRequest::new(key.clone(), "me")).await?
//! else {
//!     unreachable!()
//! };
//! // The completion lands, but its reply is lost on the way back.
//! store.lose_replies(Op::Complete, 1);
//! let day = Duration::from_secs(86_400);
//! let lost = store.complete(&lease, Bytes::from_static(b"ok"), day).await.unwrap_err();
//! assert!(InjectedFault::of(&lost).is_some_and(InjectedFault::took_effect));
//! // Sent again with the same token and result: the store answers Ok (the replay rule).
//! store.complete(&lease, Bytes::from_static(b"ok"), day).await?;
//! assert_eq!((store.calls(Op::Complete), store.sent(Op::Complete)), (2, 2));
//! # Ok(()) }
//! ```

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Error, FailureKind, IdempotencyKey, IdempotencyStore,
    Lease, Limits, Record, Result, TransactionalStore,
};

/// A store operation, to arm a fault for or to count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// [`IdempotencyStore::acquire`].
    Acquire,
    /// [`IdempotencyStore::extend`].
    Extend,
    /// [`IdempotencyStore::complete`].
    Complete,
    /// [`IdempotencyStore::fail`].
    Fail,
    /// [`IdempotencyStore::release`].
    Release,
    /// [`IdempotencyStore::get`].
    Get,
    /// [`IdempotencyStore::delete`].
    Delete,
    /// [`IdempotencyStore::purge_expired`].
    PurgeExpired,
    /// [`TransactionalStore::complete_with`] (counted and faulted apart from `complete`).
    CompleteWith,
}

impl Op {
    /// Every operation.
    pub const ALL: [Op; 9] = [
        Self::Acquire,
        Self::Extend,
        Self::Complete,
        Self::Fail,
        Self::Release,
        Self::Get,
        Self::Delete,
        Self::PurgeExpired,
        Self::CompleteWith,
    ];

    /// The method's name: `acquire`, `extend`, `complete`, `fail`, `release`, `get`, `delete`,
    /// `purge_expired`, `complete_with`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Acquire => "acquire",
            Self::Extend => "extend",
            Self::Complete => "complete",
            Self::Fail => "fail",
            Self::Release => "release",
            Self::Get => "get",
            Self::Delete => "delete",
            Self::PurgeExpired => "purge_expired",
            Self::CompleteWith => "complete_with",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The source of an [`Error::Unavailable`] made up by a [`FaultyStore`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum InjectedFault {
    /// The call was not sent: the store is in an outage ([`FaultyStore::set_outage`]).
    Outage {
        /// The refused operation.
        op: Op,
    },
    /// The call was not sent: it was one of the calls armed by [`FaultyStore::refuse`].
    Refused {
        /// The refused operation.
        op: Op,
    },
    /// The call was sent and did whatever it does, but its reply was dropped
    /// ([`FaultyStore::lose_replies`]).
    ReplyLost {
        /// The operation whose reply was lost.
        op: Op,
    },
}

impl InjectedFault {
    /// The operation the fault hit.
    pub fn op(&self) -> Op {
        match *self {
            Self::Outage { op } | Self::Refused { op } | Self::ReplyLost { op } => op,
        }
    }

    /// Whether the call reached the wrapped store (only for [`ReplyLost`](Self::ReplyLost)).
    pub fn took_effect(&self) -> bool {
        matches!(self, Self::ReplyLost { .. })
    }

    /// The injected fault behind `error`, found in its source chain; `None` for a real error.
    pub fn of(error: &Error) -> Option<&InjectedFault> {
        let mut source = std::error::Error::source(error);
        while let Some(e) = source {
            if let Some(fault) = e.downcast_ref::<InjectedFault>() {
                return Some(fault);
            }
            source = e.source();
        }
        None
    }
}

impl fmt::Display for InjectedFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Outage { op } => write!(f, "injected outage: {op} not sent"),
            Self::Refused { op } => write!(f, "injected failure: {op} not sent"),
            Self::ReplyLost { op } => {
                write!(f, "injected lost reply: {op} was applied, its reply lost")
            }
        }
    }
}

impl std::error::Error for InjectedFault {}

/// The faults armed for one operation, and its counters.
#[derive(Debug, Default)]
struct OpFaults {
    calls: AtomicU64,
    sent: AtomicU64,
    refuse: AtomicU64,
    lose: AtomicU64,
    delay_nanos: AtomicU64,
}

/// Takes one from `budget` if it is above zero.
fn take(budget: &AtomicU64) -> bool {
    budget
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

/// Wraps any [`IdempotencyStore`] and injects faults into its calls: see the
/// [module docs](self).
///
/// Faults are armed through `&self`, so a test keeps an `Arc<FaultyStore<S>>` and hands a clone
/// (as a [`DynStore`](idem_core::DynStore)) to the code under test. With nothing armed it is a
/// plain pass-through.
#[derive(Debug)]
pub struct FaultyStore<S> {
    inner: S,
    outage: AtomicBool,
    ops: [OpFaults; Op::ALL.len()],
}

impl<S: Default> Default for FaultyStore<S> {
    fn default() -> Self {
        Self::new(S::default())
    }
}

impl<S> FaultyStore<S> {
    /// Wraps `inner`, with no fault armed.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            outage: AtomicBool::new(false),
            ops: Default::default(),
        }
    }

    /// The wrapped store.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Unwraps the store.
    pub fn into_inner(self) -> S {
        self.inner
    }

    fn op(&self, op: Op) -> &OpFaults {
        &self.ops[op.index()]
    }

    /// Starts (`true`) or ends (`false`) an outage: meanwhile every call fails with
    /// [`Error::Unavailable`] ([`InjectedFault::Outage`]) without reaching the store.
    pub fn set_outage(&self, down: bool) {
        self.outage.store(down, Ordering::SeqCst);
    }

    /// Whether an outage is on.
    pub fn is_down(&self) -> bool {
        self.outage.load(Ordering::SeqCst)
    }

    /// The next `n` calls of `op` fail with [`Error::Unavailable`] ([`InjectedFault::Refused`])
    /// without reaching the store. Adds to what is armed already.
    pub fn refuse(&self, op: Op, n: u64) {
        self.op(op).refuse.fetch_add(n, Ordering::SeqCst);
    }

    /// The next `n` calls of `op` that reach the store take effect there, but answer
    /// [`Error::Unavailable`] ([`InjectedFault::ReplyLost`]) instead of the store's reply: what
    /// a client sees when the connection drops after the request was applied. Adds to what is
    /// armed already.
    pub fn lose_replies(&self, op: Op, n: u64) {
        self.op(op).lose.fetch_add(n, Ordering::SeqCst);
    }

    /// Every later call of `op` waits `delay` before it is sent (zero: no delay), with
    /// `tokio::time::sleep`.
    pub fn set_delay(&self, op: Op, delay: Duration) {
        let nanos = u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX);
        self.op(op).delay_nanos.store(nanos, Ordering::SeqCst);
    }

    /// Disarms every fault: no outage, no refused call, no lost reply, no delay. Counters stay.
    pub fn heal(&self) {
        self.set_outage(false);
        for faults in &self.ops {
            faults.refuse.store(0, Ordering::SeqCst);
            faults.lose.store(0, Ordering::SeqCst);
            faults.delay_nanos.store(0, Ordering::SeqCst);
        }
    }

    /// Refused calls of `op` still armed.
    pub fn refusals_left(&self, op: Op) -> u64 {
        self.op(op).refuse.load(Ordering::SeqCst)
    }

    /// Lost replies of `op` still armed.
    pub fn lost_replies_left(&self, op: Op) -> u64 {
        self.op(op).lose.load(Ordering::SeqCst)
    }

    /// Calls of `op` made to the wrapper, faulty or not.
    pub fn calls(&self, op: Op) -> u64 {
        self.op(op).calls.load(Ordering::SeqCst)
    }

    /// Calls of `op` that reached the wrapped store (lost replies included).
    pub fn sent(&self, op: Op) -> u64 {
        self.op(op).sent.load(Ordering::SeqCst)
    }

    /// Calls of every operation that reached the wrapped store: a round-trip counter for
    /// [`Harness::with_round_trips`](crate::Harness::with_round_trips) when the store sends one
    /// request per call.
    pub fn sent_total(&self) -> u64 {
        Op::ALL.into_iter().map(|op| self.sent(op)).sum()
    }
}

impl<S: IdempotencyStore> FaultyStore<S> {
    /// One call of `op`: counted, delayed, refused or sent, its reply kept or lost.
    async fn pass<R>(&self, op: Op, call: impl Future<Output = Result<R>>) -> Result<R> {
        let faults = self.op(op);
        faults.calls.fetch_add(1, Ordering::SeqCst);
        let delay = faults.delay_nanos.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_nanos(delay)).await;
        }
        if self.is_down() {
            return Err(self.injected(InjectedFault::Outage { op }));
        }
        if take(&faults.refuse) {
            return Err(self.injected(InjectedFault::Refused { op }));
        }
        faults.sent.fetch_add(1, Ordering::SeqCst);
        let reply = call.await;
        if take(&faults.lose) {
            drop(reply);
            return Err(self.injected(InjectedFault::ReplyLost { op }));
        }
        reply
    }

    fn injected(&self, fault: InjectedFault) -> Error {
        Error::unavailable(self.inner.name(), fault)
    }
}

// Written out as `async_trait` expands it (boxed `Send` futures), so that this crate needs no
// proc-macro dependency for it.
impl<S: IdempotencyStore> IdempotencyStore for FaultyStore<S> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn limits(&self) -> Limits {
        self.inner.limits()
    }

    fn acquire<'life0, 'life1, 'async_trait>(
        &'life0 self,
        req: &'life1 AcquireRequest,
    ) -> BoxFuture<'async_trait, Result<AcquireOutcome>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.pass(Op::Acquire, self.inner.acquire(req)))
    }

    fn extend<'life0, 'life1, 'async_trait>(
        &'life0 self,
        lease: &'life1 Lease,
        ttl: Duration,
    ) -> BoxFuture<'async_trait, Result<Lease>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.pass(Op::Extend, self.inner.extend(lease, ttl)))
    }

    fn complete<'life0, 'life1, 'async_trait>(
        &'life0 self,
        lease: &'life1 Lease,
        result: Bytes,
        retention: Duration,
    ) -> BoxFuture<'async_trait, Result<()>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.pass(Op::Complete, self.inner.complete(lease, result, retention)))
    }

    fn fail<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        lease: &'life1 Lease,
        error: &'life2 str,
        kind: FailureKind,
        retention: Duration,
    ) -> BoxFuture<'async_trait, Result<()>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.pass(Op::Fail, self.inner.fail(lease, error, kind, retention)))
    }

    fn release<'life0, 'life1, 'async_trait>(
        &'life0 self,
        lease: &'life1 Lease,
    ) -> BoxFuture<'async_trait, Result<()>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.pass(Op::Release, self.inner.release(lease)))
    }

    fn get<'life0, 'life1, 'async_trait>(
        &'life0 self,
        key: &'life1 IdempotencyKey,
    ) -> BoxFuture<'async_trait, Result<Option<Record>>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.pass(Op::Get, self.inner.get(key)))
    }

    fn delete<'life0, 'life1, 'async_trait>(
        &'life0 self,
        key: &'life1 IdempotencyKey,
    ) -> BoxFuture<'async_trait, Result<bool>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.pass(Op::Delete, self.inner.delete(key)))
    }

    fn purge_expired<'life0, 'async_trait>(
        &'life0 self,
        limit: usize,
    ) -> BoxFuture<'async_trait, Result<u64>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.pass(Op::PurgeExpired, self.inner.purge_expired(limit)))
    }
}

/// `complete_with` goes through the same faults as every other call, armed and counted as
/// [`Op::CompleteWith`]: a lost reply means the writes and the completion were applied (a
/// re-send is then answered `Ok` by the replay rule, applying nothing again); an outage or a
/// refused call means nothing reached the store.
impl<S: TransactionalStore> TransactionalStore for FaultyStore<S> {
    type Writes = S::Writes;

    fn complete_with<'life0, 'life1, 'async_trait>(
        &'life0 self,
        lease: &'life1 Lease,
        result: Bytes,
        retention: Duration,
        writes: Self::Writes,
    ) -> BoxFuture<'async_trait, Result<()>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(self.pass(
            Op::CompleteWith,
            self.inner.complete_with(lease, result, retention, writes),
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use idem_core::{DynStore, MemoryStore, Namespace, RecordState};

    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    async fn acquired(store: &dyn IdempotencyStore, id: &str) -> Lease {
        let key = Namespace::new("faults").unwrap().key(id).unwrap();
        match store
            .acquire(&AcquireRequest::new(key, "tester"))
            .await
            .unwrap()
        {
            AcquireOutcome::Acquired { lease, .. } => lease,
            other => panic!("{other:?}"),
        }
    }

    fn fault(result: &Result<impl fmt::Debug>) -> InjectedFault {
        match result {
            Err(e @ Error::Unavailable { store, .. }) => {
                assert_eq!(*store, "memory", "the wrapped store's name");
                *InjectedFault::of(e).expect("an injected fault")
            }
            other => panic!("not an injected Unavailable: {other:?}"),
        }
    }

    #[tokio::test]
    async fn with_nothing_armed_it_passes_everything_through() {
        let store = FaultyStore::new(MemoryStore::new());
        let lease = acquired(&store, "k").await;
        store.extend(&lease, DAY).await.unwrap();
        store
            .complete(&lease, Bytes::from_static(b"r"), DAY)
            .await
            .unwrap();
        let record = store.get(&lease.key).await.unwrap().unwrap();
        assert!(matches!(record.state, RecordState::Completed { .. }));
        assert!(store.delete(&lease.key).await.unwrap());
        assert_eq!(store.purge_expired(10).await.unwrap(), 0);
        for op in [
            Op::Acquire,
            Op::Extend,
            Op::Complete,
            Op::Get,
            Op::Delete,
            Op::PurgeExpired,
        ] {
            assert_eq!((store.calls(op), store.sent(op)), (1, 1), "{op}");
        }
        assert_eq!(store.calls(Op::Fail) + store.calls(Op::Release), 0);
        assert_eq!(store.sent_total(), 6);
        assert_eq!(store.name(), "memory");
    }

    #[tokio::test]
    async fn a_lost_reply_hides_a_transition_that_took_effect() {
        let store = FaultyStore::new(MemoryStore::new());
        let lease = acquired(&store, "k").await;
        store.lose_replies(Op::Fail, 1);
        let r = store.fail(&lease, "boom", FailureKind::Terminal, DAY).await;
        let injected = fault(&r);
        assert_eq!(injected, InjectedFault::ReplyLost { op: Op::Fail });
        assert!(injected.took_effect());
        assert_eq!(store.lost_replies_left(Op::Fail), 0);
        let record = store.get(&lease.key).await.unwrap().unwrap();
        assert_eq!(
            record.state,
            RecordState::Failed {
                error: "boom".into(),
                kind: FailureKind::Terminal
            },
            "the failure was applied"
        );
        // Only the armed call lost its reply.
        store
            .fail(&lease, "boom", FailureKind::Terminal, DAY)
            .await
            .unwrap();
        assert_eq!((store.calls(Op::Fail), store.sent(Op::Fail)), (2, 2));
    }

    #[tokio::test]
    async fn a_refused_call_never_reaches_the_store() {
        let store = FaultyStore::new(MemoryStore::new());
        let lease = acquired(&store, "k").await;
        store.refuse(Op::Complete, 2);
        for left in [1, 0] {
            let r = store.complete(&lease, Bytes::from_static(b"r"), DAY).await;
            let injected = fault(&r);
            assert_eq!(injected, InjectedFault::Refused { op: Op::Complete });
            assert!(!injected.took_effect());
            assert_eq!(store.refusals_left(Op::Complete), left);
        }
        let record = store.get(&lease.key).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::InProgress, "nothing applied");
        // Other operations are not affected.
        store.extend(&lease, DAY).await.unwrap();
        store
            .complete(&lease, Bytes::from_static(b"r"), DAY)
            .await
            .unwrap();
        assert_eq!(
            (store.calls(Op::Complete), store.sent(Op::Complete)),
            (3, 1)
        );
    }

    #[tokio::test]
    async fn an_outage_refuses_every_operation_until_it_ends() {
        let store = Arc::new(FaultyStore::new(MemoryStore::new()));
        let lease = acquired(&*store, "k").await;
        let sent = store.sent_total();
        store.set_outage(true);
        assert!(store.is_down());
        let dynamic: DynStore = store.clone();
        assert_eq!(
            fault(
                &dynamic
                    .acquire(&AcquireRequest::new(lease.key.clone(), "x"))
                    .await
            ),
            InjectedFault::Outage { op: Op::Acquire }
        );
        assert_eq!(fault(&dynamic.extend(&lease, DAY).await).op(), Op::Extend);
        assert_eq!(fault(&dynamic.release(&lease).await).op(), Op::Release);
        assert_eq!(fault(&dynamic.get(&lease.key).await).op(), Op::Get);
        assert_eq!(fault(&dynamic.delete(&lease.key).await).op(), Op::Delete);
        assert_eq!(
            fault(&dynamic.purge_expired(1).await).op(),
            Op::PurgeExpired
        );
        assert_eq!(store.sent_total(), sent, "nothing reached the store");
        store.set_outage(false);
        dynamic.release(&lease).await.unwrap();
        let record = dynamic.get(&lease.key).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Released);
    }

    #[tokio::test(start_paused = true)]
    async fn a_delay_holds_each_call_back() {
        let store = FaultyStore::new(MemoryStore::new());
        store.set_delay(Op::Acquire, Duration::from_millis(250));
        let start = tokio::time::Instant::now();
        let lease = acquired(&store, "k").await;
        assert_eq!(start.elapsed(), Duration::from_millis(250));
        // Only the delayed operation waits.
        store.extend(&lease, DAY).await.unwrap();
        assert_eq!(start.elapsed(), Duration::from_millis(250));
        store.heal();
        acquired(&store, "k2").await;
        assert_eq!(start.elapsed(), Duration::from_millis(250), "healed");
    }

    #[tokio::test(start_paused = true)]
    async fn complete_with_goes_through_the_same_faults() {
        use idem_core::MemoryWrites;

        let store = FaultyStore::new(MemoryStore::new());
        let memory = store.get_ref().clone();
        // A write applied twice would be refused by its own condition.
        let debit = || {
            MemoryWrites::new()
                .expect("balance", None)
                .put("balance", "90")
        };

        // Outage: nothing reaches the store.
        let lease = acquired(&store, "k").await;
        store.set_outage(true);
        let r = store
            .complete_with(&lease, Bytes::from_static(b"r"), DAY, debit())
            .await;
        assert_eq!(
            fault(&r),
            InjectedFault::Outage {
                op: Op::CompleteWith
            }
        );
        store.set_outage(false);
        assert_eq!(memory.effect("balance"), None, "nothing applied");
        assert_eq!(store.sent(Op::CompleteWith), 0);

        // Lost reply: applied, then the re-send is answered Ok without applying again.
        store.lose_replies(Op::CompleteWith, 1);
        let r = store
            .complete_with(&lease, Bytes::from_static(b"r"), DAY, debit())
            .await;
        let injected = fault(&r);
        assert_eq!(
            injected,
            InjectedFault::ReplyLost {
                op: Op::CompleteWith
            }
        );
        assert!(injected.took_effect());
        assert_eq!(memory.effect("balance").as_deref(), Some(&b"90"[..]));
        store
            .complete_with(&lease, Bytes::from_static(b"r"), DAY, debit())
            .await
            .expect("the replay is Ok");
        assert_eq!(memory.effect("balance").as_deref(), Some(&b"90"[..]));
        let record = store.get(&lease.key).await.unwrap().unwrap();
        assert!(
            matches!(record.state, RecordState::Completed { .. }),
            "{record:?}"
        );

        // Refused and delayed calls, counted apart from `complete`.
        let lease = acquired(&store, "k2").await;
        store.refuse(Op::CompleteWith, 1);
        let r = store
            .complete_with(&lease, Bytes::from_static(b"r"), DAY, MemoryWrites::new())
            .await;
        assert_eq!(
            fault(&r),
            InjectedFault::Refused {
                op: Op::CompleteWith
            }
        );
        store.set_delay(Op::CompleteWith, Duration::from_millis(40));
        let start = tokio::time::Instant::now();
        store
            .complete_with(&lease, Bytes::from_static(b"r"), DAY, MemoryWrites::new())
            .await
            .unwrap();
        assert_eq!(start.elapsed(), Duration::from_millis(40));
        assert_eq!(
            (store.calls(Op::CompleteWith), store.sent(Op::CompleteWith)),
            (5, 3)
        );
        assert_eq!(store.calls(Op::Complete), 0);
        assert_eq!(Op::CompleteWith.name(), "complete_with");
        assert_eq!(Op::ALL[Op::CompleteWith as usize], Op::CompleteWith);
    }

    #[test]
    fn a_real_error_has_no_injected_fault() {
        let error = Error::unavailable("memory", idem_core::SimulatedOutage);
        assert!(InjectedFault::of(&error).is_none());
        let shown = Error::unavailable("memory", InjectedFault::Refused { op: Op::Get });
        assert!(
            shown.to_string().contains("injected failure: get not sent"),
            "{shown}"
        );
    }
}
