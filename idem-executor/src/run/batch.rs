//! Many messages at once: every key acquired in one store call, handlers run with bounded
//! concurrency, completions and failures grouped into batched store calls.
//!
//! Everything else is the single path's: the acquire outcome is acted on by the same code, each
//! handler runs under its lease exactly as in [`Executor::run`] (heartbeats, cancellation,
//! fencing), and each record is re-sent on `Unavailable` by the same loop; only where a record
//! goes differs ([`RecordQueue`] instead of the store).

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use futures::future::{self, Either, FutureExt};
use futures::stream::{FuturesUnordered, StreamExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{Semaphore, SemaphorePermit, mpsc, oneshot};
use tokio::time::Instant;
use tracing::{Instrument, Span};

use super::execute::Leased;
use crate::Executor;
use crate::codec::Codec;
use crate::context::{HandlerContext, HandlerError};
use crate::error::{BatchError, ExecutorError};
use crate::message::Message;
use crate::outcome::Outcome;
use crate::transactional::Recorder;
use idem_core::{
    AcquireOutcome, AcquireRequest, Completion, DynStore, Error, Failure, FailureKind,
    IdempotencyKey, Lease,
};

/// What one message of a batch came to.
type BatchResult<T> = Result<Outcome<T>, ExecutorError>;

/// A record waiting for its group, with where its answer goes.
enum Pending {
    Complete(Completion, oneshot::Sender<Result<(), Error>>),
    Fail(Failure, oneshot::Sender<Result<(), Error>>),
}

/// Where the leases of a batch send their completions and failures: they are grouped into
/// `complete_many` / `fail_many` calls, and each record gets its own answer back.
pub(super) struct RecordQueue {
    tx: mpsc::UnboundedSender<Pending>,
    store: &'static str,
}

impl RecordQueue {
    /// Sends a completion with the next group and waits for its answer.
    pub(super) async fn complete(&self, lease: &Lease, result: Bytes) -> Result<(), Error> {
        let (tx, rx) = oneshot::channel();
        let completion = Completion::new(lease.clone(), result);
        self.send(Pending::Complete(completion, tx), rx).await
    }

    /// Sends a failure with the next group and waits for its answer.
    pub(super) async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
    ) -> Result<(), Error> {
        let (tx, rx) = oneshot::channel();
        let failure = Failure::new(lease.clone(), error, kind);
        self.send(Pending::Fail(failure, tx), rx).await
    }

    async fn send(
        &self,
        pending: Pending,
        rx: oneshot::Receiver<Result<(), Error>>,
    ) -> Result<(), Error> {
        // The queue is read until every message of the batch has its outcome, so neither end
        // closes early; should one, the record is reported unsent (and is sent again while the
        // lease holds).
        let gone = || Error::unavailable(self.store, "the batch's record queue is closed");
        self.tx.send(pending).map_err(|_| gone())?;
        rx.await.unwrap_or_else(|_| Err(gone()))
    }
}

/// The first message of a key in a batch, and what the batch's acquire answered for it.
enum First<'a> {
    /// The key was acquired: its lease, ready to run the handler.
    Leased { leased: Leased<'a>, takeover: bool },
    /// Any other answer (or the acquire call's error), acted on as the single path does.
    Answered {
        req: AcquireRequest,
        answer: Result<AcquireOutcome, Error>,
    },
    /// No key (`Ok`): the missing-key policy; or the message's error.
    Unkeyed(Result<(), ExecutorError>),
}

/// A later message of a key already in the batch: run after the previous one of its key, as a
/// single call.
struct Later {
    index: usize,
    span: Span,
    key: IdempotencyKey,
    fingerprint: Option<idem_core::Fingerprint>,
}

/// The messages of one key (or one message without a key), run in order.
struct Chain<'a> {
    index: usize,
    span: Span,
    first: First<'a>,
    later: Vec<Later>,
}

impl<C: Codec, R: Recorder> Executor<C, R> {
    /// Processes a batch of messages: one [`Outcome`] (or [`ExecutorError`]) per message, in
    /// the order of `msgs`, each exactly what [`run`](Self::run) would have given for it.
    ///
    /// `handler` is called with the index of the message in `msgs` (the closure can capture
    /// `msgs` to read it) and its context, at most once per message, only when its key was
    /// acquired (or it passes through by policy).
    ///
    /// What differs from calling [`run`](Self::run) for each message is the number of store
    /// round trips:
    ///
    /// - every key is acquired in **one**
    ///   [`acquire_many`](idem_core::IdempotencyStore::acquire_many) call (one outcome per key:
    ///   the single path then acts on it, including the optional
    ///   [`in_progress_wait`](crate::ExecutorConfig::in_progress_wait));
    /// - handlers run at most [`batch.concurrency`](crate::BatchConfig::concurrency) at once,
    ///   within this call's task (nothing is spawned); a slot is taken for the handler alone,
    ///   and freed as soon as it returns, before its record is sent;
    /// - completions and failures go to the store in groups
    ///   ([`complete_many`](idem_core::IdempotencyStore::complete_many),
    ///   [`fail_many`](idem_core::IdempotencyStore::fail_many)) as described at
    ///   [`BatchConfig`](crate::BatchConfig). A transactional completion carries its own writes
    ///   and is sent on its own with
    ///   [`complete_with`](idem_core::TransactionalStore::complete_with).
    ///
    /// Every guarantee of a single call holds per message: each lease heartbeats while its
    /// handler is pending, and also while its message waits for a free handler slot; a handler
    /// whose lease is lost, or whose local lease deadline passes, is cancelled and reported
    /// [`Outcome::LeaseLost`] (a message whose lease ran out before a slot freed is reported so
    /// without running its handler); each record is fenced by its own lease (a superseded
    /// lease's completion is refused for that key alone, reported [`Outcome::LeaseLost`]); a
    /// record answered `Unavailable` is sent again while its lease holds; the store-error and
    /// missing-key policies apply per message.
    ///
    /// **The same key twice.** Only the first message of a key takes part in the batch's
    /// acquire; each later message with that key runs after the previous one has its outcome,
    /// exactly as a single call made then (so a duplicate of a message that completed is
    /// [`Outcome::Replayed`], and one after a retryable failure runs the handler again as the
    /// next attempt). The outcomes are thus those of calling [`run`](Self::run) for each
    /// message in order.
    ///
    /// Must be called within a Tokio runtime with timers enabled.
    ///
    /// # Errors
    /// [`BatchError::TooLarge`] when `msgs` holds more than the store's
    /// [`max_batch`](idem_core::Limits::max_batch) messages: nothing is sent and no handler
    /// runs. Everything else is per message.
    pub async fn run_batch<M, F, Fut, T>(
        &self,
        msgs: &[M],
        handler: F,
    ) -> Result<Vec<BatchResult<T>>, BatchError>
    where
        M: Message,
        F: Fn(usize, HandlerContext) -> Fut,
        Fut: Future<Output = Result<R::Returns<T>, HandlerError>>,
        T: Serialize + DeserializeOwned,
    {
        let mut results: Vec<Option<BatchResult<T>>> =
            std::iter::repeat_with(|| None).take(msgs.len()).collect();
        self.run_batch_each(msgs, handler, |index, result| results[index] = Some(result))
            .await?;
        Ok(results
            .into_iter()
            .map(|result| result.expect("run_batch_each answers every message once"))
            .collect())
    }

    /// [`run_batch`](Self::run_batch), handing each message's result to `each` (with the
    /// message's index in `msgs`) as soon as it is known, its completion or failure recorded,
    /// instead of all of them at the end: a caller that settles messages with a broker (an
    /// acknowledgement) need not hold the fast ones until the slowest handler of the batch is
    /// done. A message that shares its key with an earlier one of the batch runs after it, so
    /// its result comes after that one's. `each` is called exactly once per message, before this
    /// returns `Ok`; the results are those `run_batch` gives.
    ///
    /// `each` runs inside the batch's poll, between the handlers' steps: it must return at once
    /// (hand the result to a channel) and must not panic, or the batch's other handlers are
    /// held, or dropped mid-effect.
    ///
    /// # Errors
    /// As [`run_batch`](Self::run_batch): [`BatchError::TooLarge`], and then `each` is never
    /// called.
    pub async fn run_batch_each<M, F, Fut, T, E>(
        &self,
        msgs: &[M],
        handler: F,
        each: E,
    ) -> Result<(), BatchError>
    where
        M: Message,
        F: Fn(usize, HandlerContext) -> Fut,
        Fut: Future<Output = Result<R::Returns<T>, HandlerError>>,
        T: Serialize + DeserializeOwned,
        E: FnMut(usize, BatchResult<T>),
    {
        let inner = &self.inner;
        let max = inner.store.limits().max_batch;
        if msgs.len() > max {
            return Err(BatchError::TooLarge {
                len: msgs.len(),
                max,
            });
        }
        if msgs.is_empty() {
            return Ok(());
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let queue = RecordQueue {
            tx,
            store: inner.store.name(),
        };
        let chains = self.chains(msgs, &queue).await;
        let handler = &handler;
        // The futures are built before the stream (not by a closure it holds across awaits), so
        // that the whole call is `Send` whenever the handler's futures are.
        let each = Mutex::new(each);
        let each = &each;
        // A handler slot is held from a chain's turn until its handler returns, not while its
        // record is sent: the next chain's handler starts meanwhile. The semaphore is fair, and
        // the set below first polls the chains in the order pushed, so they ask for a slot, and
        // start, in order. Each chain's future goes straight to its own place in the set, with
        // no list of them all first: a chain's future takes kilobytes, and moving each one
        // twice showed in profiles of quick handlers.
        let slots = Semaphore::new(inner.config.batch.concurrency);
        let slots = &slots;
        let mut runs: FuturesUnordered<_> = chains
            .into_iter()
            .map(|chain| self.run_chain(chain, handler, each, slots))
            .collect();
        let work = async move { while runs.next().await.is_some() {} };
        let flush = async {
            flush_records(
                &inner.store,
                inner.config.retention,
                inner.record_batch,
                inner.config.batch.record_window,
                rx,
            )
            .await;
            future::pending::<Infallible>().await
        };
        // Every record is answered before its message's outcome is known, so the flusher has
        // nothing left to send once the work is done.
        match future::select(pin!(work), pin!(flush)).await {
            Either::Left((_, _)) => Ok(()),
            Either::Right((never, _)) => match never {},
        }
    }

    /// Reads every message's key, acquires the first message of each key in one call, and
    /// groups the messages into chains (one per key, in the order of their first message).
    async fn chains<'a, M: Message>(
        &'a self,
        msgs: &[M],
        queue: &'a RecordQueue,
    ) -> Vec<Chain<'a>> {
        let inner = &self.inner;
        let mut chains: Vec<Chain<'a>> = Vec::with_capacity(msgs.len());
        let mut by_key: HashMap<IdempotencyKey, usize> = HashMap::new();
        // The chain of each request, in order.
        let mut reqs = Vec::new();
        let mut of_req = Vec::new();
        for (index, msg) in msgs.iter().enumerate() {
            let span = self.span();
            let prepared = {
                let _entered = span.enter();
                self.prepare(msg)
            };
            match prepared {
                Ok(Some((key, fingerprint))) => {
                    if let Some(&chain) = by_key.get(&key) {
                        chains[chain].later.push(Later {
                            index,
                            span,
                            key,
                            fingerprint,
                        });
                        continue;
                    }
                    span.record("key", key.id());
                    by_key.insert(key.clone(), chains.len());
                    of_req.push(chains.len());
                    reqs.push(self.request(key, fingerprint));
                    chains.push(Chain {
                        index,
                        span,
                        // Replaced below by the acquire's answer (one per request).
                        first: First::Unkeyed(Ok(())),
                        later: Vec::new(),
                    });
                }
                other => chains.push(Chain {
                    index,
                    span,
                    first: First::Unkeyed(other.map(|_| ())),
                    later: Vec::new(),
                }),
            }
        }
        if reqs.is_empty() {
            return chains;
        }
        let sent = Instant::now();
        let answers = match inner.store.acquire_many(&reqs).await {
            Ok(answers) if answers.len() == reqs.len() => answers,
            Ok(answers) => {
                let e = Error::backend(
                    inner.store.name(),
                    format!(
                        "acquire_many answered {} outcomes for {} requests",
                        answers.len(),
                        reqs.len()
                    ),
                );
                shared(e, reqs.len())
            }
            // One request the store cannot take, refusing the whole call (a custom store may
            // check its inputs so; the contract asks for an error per item): each is asked
            // alone, at most `concurrency` at once, so that only that item is refused. Had the
            // store acquired some keys before refusing, they answer `InProgress` under this
            // owner until their lease ends: a delay, never a second run.
            Err(e @ Error::InvalidInput { .. }) if reqs.len() == 1 => vec![Err(e)],
            Err(Error::InvalidInput { .. }) => {
                let mut answers = Vec::with_capacity(reqs.len());
                for group in reqs.chunks(inner.config.batch.concurrency) {
                    answers.extend(
                        future::join_all(group.iter().map(|req| inner.store.acquire(req))).await,
                    );
                }
                answers
            }
            Err(e) => shared(e, reqs.len()),
        };
        let concurrency = inner.config.batch.concurrency;
        for ((req, answer), chain) in reqs.into_iter().zip(answers).zip(of_req) {
            chains[chain].first = match answer {
                Ok(AcquireOutcome::Acquired { lease, takeover }) => {
                    let leased = Leased::new(
                        &inner.heartbeats,
                        lease,
                        sent,
                        inner.config.lease_ttl,
                        Some(queue),
                    );
                    // Chains start in order, `concurrency` at once: a later one waits for a
                    // slot, so its lease heartbeats meanwhile.
                    if chain >= concurrency {
                        leased.heartbeat();
                    }
                    First::Leased { leased, takeover }
                }
                answer => First::Answered { req, answer },
            };
        }
        chains
    }

    /// Runs the messages of one chain in order, handing each one's result to `each` as soon as
    /// it is known (recorded), before the next message of its key runs.
    ///
    /// Each message waits for one of the batch's handler `slots` and frees it as soon as its
    /// handler returns (or when it turns out its handler will not run), before its record is
    /// sent.
    async fn run_chain<F, Fut, T, E>(
        &self,
        chain: Chain<'_>,
        handler: &F,
        each: &Mutex<E>,
        slots: &Semaphore,
    ) where
        F: Fn(usize, HandlerContext) -> Fut,
        Fut: Future<Output = Result<R::Returns<T>, HandlerError>>,
        T: Serialize + DeserializeOwned,
        E: FnMut(usize, BatchResult<T>),
    {
        // Called between awaits, never across one: the lock is held only for the call.
        let hand_over = |index: usize, result: BatchResult<T>| {
            let mut each = each.lock().unwrap_or_else(PoisonError::into_inner);
            (*each)(index, result);
        };
        let Chain {
            index,
            span,
            first,
            later,
        } = chain;
        let slot = slots
            .acquire()
            .await
            .expect("the batch never closes its slots");
        let call = move |ctx| in_slot(handler(index, ctx), slot);
        let result = self
            .run_first(first, call, &span)
            .instrument(span.clone())
            .await;
        self.observe(&result, &span);
        hand_over(index, result);
        for Later {
            index,
            span,
            key,
            fingerprint,
        } in later
        {
            let slot = slots
                .acquire()
                .await
                .expect("the batch never closes its slots");
            let call = move |ctx| in_slot(handler(index, ctx), slot);
            // Boxed: most chains have no later message, and its future would be in each.
            let result = Box::pin(self.process(Ok(Some((key, fingerprint))), call, span)).await;
            hand_over(index, result);
        }
    }

    /// The first message of a chain, from what the batch's acquire answered.
    async fn run_first<F, Fut, T>(
        &self,
        first: First<'_>,
        handler: F,
        span: &Span,
    ) -> BatchResult<T>
    where
        F: FnOnce(HandlerContext) -> Fut,
        Fut: Future<Output = Result<R::Returns<T>, HandlerError>>,
        T: Serialize + DeserializeOwned,
    {
        match first {
            First::Leased {
                mut leased,
                takeover,
            } => {
                let state = &leased.state;
                if state.is_cancelled() || state.deadline() <= Instant::now() {
                    // Lost: there is nothing to give back.
                    leased.handled();
                    tracing::warn!(
                        "the lease ran out while the message waited for a handler slot: handler not run"
                    );
                    return Ok(self.lease_lost());
                }
                self.started(leased.lease(), takeover, span);
                self.execute_leased(leased, takeover, handler).await
            }
            First::Answered { req, answer } => {
                let answered = match answer {
                    Ok(outcome) => Box::pin(self.waited(&req, outcome, Instant::now())).await,
                    Err(e) => Err(e),
                };
                // Boxed, as the wait above: a first message the acquire did not lease (a
                // duplicate, a busy key) is the rarer case, and the larger future would
                // otherwise be in every chain.
                Box::pin(self.acquired(req, answered, handler, span)).await
            }
            First::Unkeyed(Ok(())) => self.unkeyed(handler).await,
            First::Unkeyed(Err(e)) => Err(e),
        }
    }
}

/// Runs a handler's future, then frees its handler slot (before its record is sent); dropped
/// unfinished, it frees the slot too. A combinator rather than an `async fn`, which would keep
/// the handler's future twice over (as its argument and as what it awaits) in every chain.
fn in_slot<Fut: Future>(run: Fut, slot: SemaphorePermit<'_>) -> impl Future<Output = Fut::Output> {
    run.map(move |returned| {
        drop(slot);
        returned
    })
}

/// One error of a whole store call, given to each of `n` items: kept retryable when it was.
fn shared(e: Error, n: usize) -> Vec<Result<AcquireOutcome, Error>> {
    let e = Arc::new(e);
    (0..n).map(|_| Err(share(&e))).collect()
}

/// A copy of a whole call's error for one item: of the same kind and store, with the call's
/// cause; an error of another kind is a `Backend` error around the whole call's.
fn share(e: &Arc<Error>) -> Error {
    match &**e {
        Error::Unavailable { store, .. } => Error::unavailable(store, SharedCause(Arc::clone(e))),
        Error::Backend { store, .. } => Error::backend(store, SharedCause(Arc::clone(e))),
        Error::NotSetUp { store, .. } => Error::backend(store, Arc::clone(e)),
        _ => Error::backend("batch", Arc::clone(e)),
    }
}

/// The cause of a whole call's `Unavailable` or `Backend` error, shared by its items (whose
/// errors say the store and the kind themselves): shown as that cause, and leading to it, so
/// that a walk of the chain still finds the cause's own type.
#[derive(Debug)]
struct SharedCause(Arc<Error>);

impl std::fmt::Display for SharedCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match std::error::Error::source(&*self.0) {
            Some(cause) => std::fmt::Display::fmt(cause, f),
            None => std::fmt::Display::fmt(&self.0, f),
        }
    }
}

impl std::error::Error for SharedCause {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&*self.0)
    }
}

/// Sends the queued records in groups until the queue closes: a group is whatever waits when
/// the previous one came back (up to `max` records, after up to `window` for more), sent as one
/// `complete_many` and one `fail_many` call at once.
async fn flush_records(
    store: &DynStore,
    retention: Duration,
    max: usize,
    window: Duration,
    mut rx: mpsc::UnboundedReceiver<Pending>,
) {
    while let Some(first) = rx.recv().await {
        let mut group = vec![first];
        gather(&mut rx, &mut group, max, window).await;
        let mut completions = Vec::new();
        let mut completed = Vec::new();
        let mut failures = Vec::new();
        let mut failed = Vec::new();
        for pending in group {
            match pending {
                Pending::Complete(item, tx) => {
                    completions.push(item);
                    completed.push(tx);
                }
                Pending::Fail(item, tx) => {
                    failures.push(item);
                    failed.push(tx);
                }
            }
        }
        let complete = async {
            if !completions.is_empty() {
                let answers = store.complete_many(&completions, retention).await;
                answer(store.name(), answers, completed);
            }
        };
        let fail = async {
            if !failures.is_empty() {
                let answers = store.fail_many(&failures, retention).await;
                answer(store.name(), answers, failed);
            }
        };
        futures::join!(complete, fail);
    }
}

/// Adds to `group` what waits in the queue, up to `max`, waiting up to `window` for more; with
/// no window, for as long as the batch's ready handlers add more.
async fn gather(
    rx: &mut mpsc::UnboundedReceiver<Pending>,
    group: &mut Vec<Pending>,
    max: usize,
    window: Duration,
) {
    drain(rx, group, max);
    if window.is_zero() {
        // The batch's handlers run in this task: give those that are ready (the slots just
        // freed let more start) a turn to queue theirs, for as long as the group grows, so
        // that a batch of quick handlers goes in one call rather than two.
        while group.len() < max {
            let before = group.len();
            tokio::task::yield_now().await;
            drain(rx, group, max);
            if group.len() == before {
                break;
            }
        }
        return;
    }
    let deadline = Instant::now() + window;
    while group.len() < max {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(pending)) => {
                group.push(pending);
                drain(rx, group, max);
            }
            Ok(None) | Err(_) => return,
        }
    }
}

/// Adds to `group` what waits in the queue now, up to `max`.
fn drain(rx: &mut mpsc::UnboundedReceiver<Pending>, group: &mut Vec<Pending>, max: usize) {
    while group.len() < max {
        match rx.try_recv() {
            Ok(pending) => group.push(pending),
            Err(_) => break,
        }
    }
}

/// Gives each waiting record its answer from a batched call.
fn answer(
    store: &'static str,
    answers: Result<Vec<Result<(), Error>>, Error>,
    waiting: Vec<oneshot::Sender<Result<(), Error>>>,
) {
    let answers = match answers {
        Ok(answers) if answers.len() == waiting.len() => answers,
        Ok(answers) => {
            let e = Arc::new(Error::backend(
                store,
                format!(
                    "answered {} results for {} records",
                    answers.len(),
                    waiting.len()
                ),
            ));
            waiting.iter().map(|_| Err(share(&e))).collect()
        }
        Err(e) => {
            let e = Arc::new(e);
            waiting.iter().map(|_| Err(share(&e))).collect()
        }
    };
    for (tx, answer) in waiting.into_iter().zip(answers) {
        // A record whose caller is gone has no one to tell.
        let _ = tx.send(answer);
    }
}
