//! Pieces every broker runner is built from, so that each runner (SQS, RabbitMQ, NATS, ...)
//! writes only what is particular to its broker.
//!
//! - [`Execution`]: the executor and the handler of a runner, and [`Execution::try_once`], one
//!   executor call for a delivery with the handler wrapped for a *lost* delivery (its channel
//!   closed, its partition was revoked, or the drain timed out): a lease whose handler had not
//!   started is released (no attempt counted), a running handler is let finish for half the
//!   orphan timeout, then signalled, and its lease is never released; [`Execution::try_batch`]
//!   does the same for a batch of deliveries in one [`Executor::run_batch`] call.
//! - [`drain`]: waits for the delivery tasks at shutdown, marks the rest lost at the drain
//!   timeout and aborts what is still there one orphan timeout later.
//! - [`classify`] and the dead-letter header names ([`HEADER_REASON`], [`HEADER_ERROR`],
//!   [`HEADER_ATTEMPTS`], [`HEADER_KEY`]): what a dead letter says beside the original message.
//! - [`retry_delay`], [`reconnect_delay`], [`check_delays`], [`LostTimeouts::validate`]: the
//!   delay arithmetic and option checks every runner has.
//!
//! ```
//! use std::time::Duration;
//! use idem_executor::broker::{reconnect_delay, retry_delay};
//!
//! let (min, max) = (Duration::from_millis(100), Duration::from_secs(5));
//! assert_eq!(retry_delay(Duration::ZERO, min, max), min);
//! assert_eq!(retry_delay(Duration::from_secs(60), min, max), max);
//! assert_eq!(reconnect_delay(2, min, max), Duration::from_millis(400));
//! ```

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use futures::StreamExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::task::{JoinError, JoinSet};
use tokio_util::sync::CancellationToken;

use crate::{
    Codec, DeadLetterReason, Executor, ExecutorError, Handler, HandlerContext, HandlerError,
    Message, Outcome, Recorder, StoreStage,
};
use idem_core::DynStore;

/// Dead-letter header (or attribute) naming why the message was dead-lettered: a
/// [`DeadLetterReason`] code.
pub const HEADER_REASON: &str = "idem-dlq-reason";
/// Dead-letter header with the error text: the last recorded error, or what was wrong with the
/// message (as [`header_text`] writes it).
pub const HEADER_ERROR: &str = "idem-dlq-error";
/// Dead-letter header with the number of attempts the store counted for the key (decimal; `0`
/// when the handler never ran for this payload, as for a conflict or an unreadable message;
/// [`ATTEMPTS_UNKNOWN`] when the store could not be read).
pub const HEADER_ATTEMPTS: &str = "idem-dlq-attempts";
/// Dead-letter header with the idempotency key id, when the message had a readable one (as
/// [`header_text`] writes it: a key over the key limit is cut).
pub const HEADER_KEY: &str = "idem-dlq-key";
/// The value of [`HEADER_ATTEMPTS`] when the store could not be read.
pub const ATTEMPTS_UNKNOWN: &str = "unknown";
/// The longest text a runner writes into [`HEADER_ERROR`] or [`HEADER_KEY`], in bytes
/// ([`header_text`]; before a broker's own escaping, such as NATS's of line breaks).
pub const MAX_HEADER_TEXT: usize = 4096;

/// `text` as a runner writes it into [`HEADER_ERROR`] or [`HEADER_KEY`]: a NUL written as `\0`,
/// and a text longer than [`MAX_HEADER_TEXT`] bytes cut on a character boundary, ending with `…`.
///
/// A key that is over the key limit (and dead-lettered as
/// [`invalid_key`](DeadLetterReason::InvalidKey) for it) or a long error text would otherwise go
/// whole into the dead letter's headers, where a broker may refuse it (a header larger than
/// RabbitMQ's frame size, a message over NATS's or Kafka's size limit): then the dead letter is
/// never published and the message comes back again and again. A valid key (at most 512 bytes,
/// no NUL) is written as it is.
///
/// ```
/// use idem_executor::broker::{MAX_HEADER_TEXT, header_text};
///
/// assert_eq!(header_text("tx-1"), "tx-1");
/// let long = "k".repeat(100_000);
/// let cut = header_text(&long);
/// assert!(cut.len() <= MAX_HEADER_TEXT && cut.ends_with('…'));
/// ```
pub fn header_text(text: &str) -> std::borrow::Cow<'_, str> {
    idem_core::fit_text(text, MAX_HEADER_TEXT)
}

/// How long [`HEADER_ERROR`] and [`HEADER_KEY`] are at most in a dead letter's [`Fit::Compact`]
/// form, in bytes.
pub const COMPACT_TEXT: usize = 256;

/// How much a dead letter carries beside its body: less each time the broker refuses it as too
/// large (the headers or attributes count towards a broker's size limit, so a body near the
/// limit may leave no room for them).
///
/// A runner first sends the [`Whole`](Self::Whole) form (or
/// [`WithoutOriginals`](Self::WithoutOriginals) when the message had no headers of its own) and
/// steps down with [`smaller`](Self::smaller) on each refusal for size. A body too large on its
/// own is still refused in the smallest form; the runner then keeps trying it, as it does any
/// failed send.
///
/// ```
/// use idem_executor::broker::{COMPACT_TEXT, Fit, MAX_HEADER_TEXT};
///
/// assert_eq!(Fit::first(true), Fit::Whole);
/// assert_eq!(Fit::first(false), Fit::WithoutOriginals);
/// assert_eq!(Fit::Whole.smaller(), Some(Fit::WithoutOriginals));
/// assert_eq!(Fit::WithoutOriginals.smaller(), Some(Fit::Compact));
/// assert_eq!(Fit::Compact.smaller(), None);
/// let error = "e".repeat(10_000);
/// assert!(Fit::Whole.cut(&error).len() <= MAX_HEADER_TEXT);
/// assert!(Fit::Compact.cut(&error).len() <= COMPACT_TEXT);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fit {
    /// The message's own headers (or attributes) and the runner's.
    Whole,
    /// The runner's only; a header names the message's own that were left out.
    WithoutOriginals,
    /// The runner's only, with the error, the key and the names of those left out cut to
    /// [`COMPACT_TEXT`] bytes.
    Compact,
}

impl Fit {
    /// The form a dead letter is first sent in: [`Whole`](Self::Whole) when the message has
    /// headers (or attributes) of its own, else [`WithoutOriginals`](Self::WithoutOriginals)
    /// (there is nothing to leave out).
    pub fn first(has_own_headers: bool) -> Self {
        if has_own_headers {
            Self::Whole
        } else {
            Self::WithoutOriginals
        }
    }

    /// The next smaller form, if any.
    pub fn smaller(self) -> Option<Self> {
        match self {
            Self::Whole => Some(Self::WithoutOriginals),
            Self::WithoutOriginals => Some(Self::Compact),
            Self::Compact => None,
        }
    }

    /// Whether this form carries the message's own headers.
    pub fn keeps_originals(self) -> bool {
        self == Self::Whole
    }

    /// How long, in bytes, this form lets [`HEADER_ERROR`] and [`HEADER_KEY`] be:
    /// [`MAX_HEADER_TEXT`], or [`COMPACT_TEXT`] in the compact form.
    pub fn limit(self) -> usize {
        match self {
            Self::Compact => COMPACT_TEXT,
            Self::Whole | Self::WithoutOriginals => MAX_HEADER_TEXT,
        }
    }

    /// `text` as this form writes it: [`header_text`], or cut to [`COMPACT_TEXT`] bytes (on a
    /// character boundary, ending with `…`) in the compact form.
    pub fn cut(self, text: &str) -> std::borrow::Cow<'_, str> {
        idem_core::fit_text(text, self.limit())
    }
}

/// The value of [`HEADER_ATTEMPTS`]: the count in decimal, or [`ATTEMPTS_UNKNOWN`].
pub fn attempts_value(attempts: Option<u32>) -> String {
    attempts.map_or_else(|| ATTEMPTS_UNKNOWN.to_owned(), |n| n.to_string())
}

/// What a runner writes beside a dead-lettered message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetterInfo {
    /// Why: the broker action's reason.
    pub reason: DeadLetterReason,
    /// The error text: the last recorded error, or what was wrong with the message.
    pub error: String,
    /// The attempts counted for the key; `None` when the count must be read from the store
    /// ([`Execution::stored_attempts`]).
    pub attempts: Option<u32>,
}

/// What to write for a result whose broker action is
/// [`BrokerAction::DeadLetter`](crate::BrokerAction::DeadLetter): the action's `reason` and
/// `error`, and the attempt count. `attempt` is the attempt of the handler run in this call (0
/// when the handler did not run; [`Step::Done`] carries it).
pub fn classify<T>(
    result: &Result<Outcome<T>, ExecutorError>,
    reason: DeadLetterReason,
    error: String,
    attempt: u32,
) -> DeadLetterInfo {
    let ran = (attempt > 0).then_some(attempt);
    let attempts = match result {
        // The handler never ran for this payload.
        Ok(Outcome::Conflict)
        | Err(
            ExecutorError::MissingKey
            | ExecutorError::InvalidKey(_)
            | ExecutorError::InvalidMessage { .. },
        ) => Some(0),
        Ok(Outcome::Exhausted { attempts, .. }) => Some(*attempts),
        Ok(Outcome::NotCommitted { attempt, .. }) => Some(*attempt),
        // Un-deduplicated: the one run of this call, counted nowhere else.
        Ok(Outcome::NotDeduplicated { .. }) => Some(1),
        // A replayed result that does not decode: the count is the store's.
        Err(ExecutorError::Decode { .. }) => None,
        // `Failed`, `ResultNotStored`: this call's run, or (replayed) the store's count.
        _ => ran,
    };
    DeadLetterInfo {
        reason,
        error,
        attempts,
    }
}

/// The outcome's name for logs and spans ([`Outcome::name`]), or `store_error` / `error`.
pub fn outcome_name<T>(result: &Result<Outcome<T>, ExecutorError>) -> &'static str {
    match result {
        Ok(outcome) => outcome.name(),
        Err(ExecutorError::Store { .. }) => "store_error",
        Err(_) => "error",
    }
}

/// The delay of a retry: the outcome's hint, clamped to `min..=max`.
///
/// # Panics
/// When `min > max` ([`check_delays`] refuses such options).
pub fn retry_delay(hint: Duration, min: Duration, max: Duration) -> Duration {
    hint.clamp(min, max)
}

/// The delay before reconnecting (or pulling again) after `failures` failures in a row: `min`
/// doubled per failure, at most `max`.
pub fn reconnect_delay(failures: u32, min: Duration, max: Duration) -> Duration {
    min.saturating_mul(2u32.saturating_pow(failures.min(16)))
        .min(max)
}

/// Store errors in a row among a runner's outcomes, to hold its intake back while the store
/// fails: every message taken in during an outage is retried (a nak, a retry copy), which is a
/// delivery the broker counts and a store call that cannot succeed. A runner [`note`](Self::note)s
/// each message's result and, before taking in more, waits the [`pause`](Self::pause).
#[derive(Debug, Default)]
pub struct StoreHealth {
    failures: AtomicU32,
}

impl StoreHealth {
    /// Notes what a message came to: a store error ([`ExecutorError::Store`]) adds one to the
    /// failures in a row; an outcome the store answered ends them; the rest (a message without
    /// a usable key, an un-deduplicated run: the store was not asked, or failed open) changes
    /// nothing.
    pub fn note<T>(&self, result: &Result<Outcome<T>, ExecutorError>) {
        match result {
            Err(ExecutorError::Store { .. }) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Outcome::NotDeduplicated { .. })
            | Err(
                ExecutorError::MissingKey
                | ExecutorError::InvalidKey(_)
                | ExecutorError::InvalidMessage { .. },
            ) => {}
            Ok(_) | Err(_) => self.failures.store(0, Ordering::Relaxed),
        }
    }

    /// The store errors in a row (0: the store answers).
    pub fn failures(&self) -> u32 {
        self.failures.load(Ordering::Relaxed)
    }

    /// How long to wait before taking in more messages: `None` while the store answers, else the
    /// [`reconnect_delay`] of the failures in a row (`min` doubled per failure, at most `max`).
    pub fn pause(&self, min: Duration, max: Duration) -> Option<Duration> {
        match self.failures() {
            0 => None,
            failures => Some(reconnect_delay(failures, min, max)),
        }
    }
}

/// A runner option that is not usable: which, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct OptionError {
    /// The option's name.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

impl OptionError {
    /// An error naming `field`.
    pub fn new(field: &'static str, reason: impl Into<String>) -> Self {
        Self {
            field,
            reason: reason.into(),
        }
    }
}

/// Checks a pair of delays named `field`: `min` above zero and at most `max`.
///
/// # Errors
/// [`OptionError`] naming `field`.
pub fn check_delays(field: &'static str, min: Duration, max: Duration) -> Result<(), OptionError> {
    if min.is_zero() || min > max {
        return Err(OptionError::new(
            field,
            format!("min {min:?} must be above zero and at most max {max:?}"),
        ));
    }
    Ok(())
}

/// The most messages a runner may hold at once (its `max_in_flight`): the bound of the semaphore
/// and of the buffers sized by it.
pub const MAX_IN_FLIGHT: usize = 65_536;

/// Checks a count named `field`: from 1 to `max`.
///
/// # Errors
/// [`OptionError`] naming `field`.
pub fn check_count(field: &'static str, count: usize, max: usize) -> Result<(), OptionError> {
    if count == 0 || count > max {
        return Err(OptionError::new(
            field,
            format!("{count} is not within 1 and {max}"),
        ));
    }
    Ok(())
}

/// Checks that every named duration is from `min` to `max`; `why` says where the bounds come
/// from (the broker's unit, its wire format).
///
/// # Errors
/// [`OptionError`] naming the first out of bounds.
pub fn check_within<'a>(
    durations: impl IntoIterator<Item = (&'static str, &'a Duration)>,
    min: Duration,
    max: Duration,
    why: &str,
) -> Result<(), OptionError> {
    match durations.into_iter().find(|(_, d)| **d < min || **d > max) {
        Some((field, d)) => Err(OptionError::new(
            field,
            format!("{d:?} is not within {min:?} and {max:?} ({why})"),
        )),
        None => Ok(()),
    }
}

/// Checks that every named duration is above zero.
///
/// # Errors
/// [`OptionError`] naming the first that is zero.
pub fn check_nonzero<'a>(
    durations: impl IntoIterator<Item = (&'static str, &'a Duration)>,
) -> Result<(), OptionError> {
    match durations.into_iter().find(|(_, d)| d.is_zero()) {
        Some((field, _)) => Err(OptionError::new(field, "must be above zero")),
        None => Ok(()),
    }
}

/// The timeouts of a lost delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LostTimeouts {
    /// Twice how long a started handler may go on after the loss: half-way its cancellation
    /// token is cancelled, which the executor reads as a lost lease (the handler is dropped
    /// unless it returns in that same poll, nothing recorded, its lease left to expire); an
    /// executor call that still has not ended at 90% of it is dropped.
    pub orphan: Duration,
    /// Longest wait for the release of a lease whose handler had not started.
    pub release: Duration,
}

impl LostTimeouts {
    /// Checks both above zero, and `release` below `orphan` (a release runs within it).
    ///
    /// # Errors
    /// [`OptionError`] naming `orphan_timeout` or `release_timeout`.
    pub fn validate(&self) -> Result<(), OptionError> {
        check_nonzero([
            ("orphan_timeout", &self.orphan),
            ("release_timeout", &self.release),
        ])?;
        if self.release >= self.orphan {
            return Err(OptionError::new(
                "release_timeout",
                format!(
                    "{:?} must be below orphan_timeout {:?}: a release runs within it",
                    self.release, self.orphan
                ),
            ));
        }
        Ok(())
    }
}

/// Runs a handler's call for a delivery that was not lost when it was called. Lost while it
/// runs: it is let finish for half the orphan timeout, then signalled through `cancel` (its
/// context's cancellation token, taken before the call). The executor watching the handler
/// reads that token as a lost lease: it drops the handler then, unless it returns in that same
/// poll, and records nothing. Its lease is never released.
async fn watch_handler<T>(
    call: impl Future<Output = Result<T, HandlerError>>,
    cancel: CancellationToken,
    lost: &CancellationToken,
    orphan: Duration,
) -> Result<T, HandlerError> {
    let mut run = std::pin::pin!(call);
    tokio::select! {
        biased;
        result = &mut run => return result,
        () = lost.cancelled() => {}
    }
    if let Ok(result) = tokio::time::timeout(orphan / 2, &mut run).await {
        return result;
    }
    tracing::warn!(
        "delivery lost: the handler is still running; signalling its cancellation token"
    );
    cancel.cancel();
    run.await
}

/// Releases the lease of a delivery lost before its handler was called (no attempt counted);
/// `true` when released. A failed or timed-out release is logged with `otherwise`, what
/// happens instead.
async fn release_unstarted(
    store: &DynStore,
    ctx: &HandlerContext,
    timeout: Duration,
    otherwise: &str,
) -> bool {
    let Some(lease) = ctx.lease() else {
        return false;
    };
    crate::lease::release_unstarted_lease(store, lease, timeout, otherwise).await
}

/// How one executor call for a delivery ended ([`Execution::try_once`]).
#[derive(Debug)]
pub enum Step<T> {
    /// The executor call returned.
    Done {
        /// What it returned.
        result: Result<Outcome<T>, ExecutorError>,
        /// The attempt of the handler run in this call; 0 when the handler did not run.
        attempt: u32,
    },
    /// The delivery was lost and the call dropped: before the handler started (the lease was
    /// released, or its release tried), or past the orphan timeout (the lease is left to expire).
    /// The broker should deliver the message again (nothing was recorded for this call).
    Abandoned {
        /// Whether a lease was released (the key is free at once, no attempt counted).
        lease_released: bool,
    },
}

/// The executor and the handler of a runner, shared by its delivery tasks. Cheap to clone.
pub struct Execution<H, C, R> {
    executor: Executor<C, R>,
    handler: Arc<H>,
}

impl<H, C, R> Clone for Execution<H, C, R> {
    fn clone(&self) -> Self {
        Self {
            executor: self.executor.clone(),
            handler: Arc::clone(&self.handler),
        }
    }
}

impl<H, C, R> std::fmt::Debug for Execution<H, C, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Execution")
            .field("namespace", self.executor.namespace())
            .finish_non_exhaustive()
    }
}

impl<H, C: Codec, R: Recorder> Execution<H, C, R> {
    /// The executor and the handler.
    pub fn new(executor: Executor<C, R>, handler: H) -> Self {
        Self {
            executor,
            handler: Arc::new(handler),
        }
    }

    /// The executor.
    pub fn executor(&self) -> &Executor<C, R> {
        &self.executor
    }

    /// One executor call for `msg`, with the handler wrapped for a loss of the delivery
    /// (`lost` cancelled: its channel closed, its partition was revoked, or the drain timed
    /// out):
    ///
    /// - lost before the handler was called: the lease is released (no attempt counted) and the
    ///   call abandoned, so the redelivery acquires the key at once;
    /// - lost while the handler runs: it is let finish for half the orphan timeout (its result is
    ///   recorded, and the redelivery replays it), then signalled through
    ///   [`HandlerContext::cancellation_token`](crate::HandlerContext::cancellation_token),
    ///   which the executor reads as a lost lease: it drops the handler then (unless it returns
    ///   in that same poll) and records nothing. The lease is **never** released once the
    ///   handler started: it expires and the next owner sees a takeover. (Should the executor
    ///   call itself not end, a store call hanging, it is dropped at 90% of the orphan timeout.)
    pub async fn try_once<M, T>(
        &self,
        msg: &M,
        lost: &CancellationToken,
        timeouts: LostTimeouts,
    ) -> Step<T>
    where
        M: Message + Clone + Send + Sync + 'static,
        H: Handler<M, R::Returns<T>>,
        T: Serialize + DeserializeOwned + Send + 'static,
    {
        let attempt = Arc::new(AtomicU32::new(0));
        let lease_released = Arc::new(AtomicBool::new(false));
        let released = CancellationToken::new();
        let handler = Arc::clone(&self.handler);
        let store = self.executor.store().clone();
        let record = msg.clone();
        let signal = released.clone();
        let ran = Arc::clone(&attempt);
        let freed = Arc::clone(&lease_released);
        let watched = lost.clone();
        let call = self.executor.run(msg, move |ctx| async move {
            ran.store(ctx.attempt(), Ordering::Relaxed);
            if !watched.is_cancelled() {
                let cancel = ctx.cancellation_token().clone();
                return watch_handler(handler.call(record, ctx), cancel, &watched, timeouts.orphan)
                    .await;
            }
            // Lost before the handler was called: give the key back without counting an
            // attempt, then never return, so the executor records nothing (the caller drops this
            // call).
            if release_unstarted(
                &store,
                &ctx,
                timeouts.release,
                "the key stays held until its lease expires",
            )
            .await
            {
                freed.store(true, Ordering::Relaxed);
            }
            signal.cancel();
            std::future::pending().await
        });
        // Once lost, the call gets most of the orphan timeout, then it is dropped and its lease
        // left to expire.
        let lost = lost.clone();
        let deadline = async move {
            lost.cancelled().await;
            tokio::time::sleep(timeouts.orphan.mul_f64(0.9)).await;
        };
        let abandoned = || Step::Abandoned {
            lease_released: lease_released.load(Ordering::Relaxed),
        };
        tokio::select! {
            biased;
            result = call => Step::Done { result, attempt: attempt.load(Ordering::Relaxed) },
            () = released.cancelled() => abandoned(),
            () = deadline => {
                tracing::warn!(
                    "delivery lost: the executor call did not end in time and is dropped; its lease (not released) expires and the next owner takes it over"
                );
                abandoned()
            }
        }
    }

    /// One executor batch ([`Executor::run_batch`]) for `msgs`: one [`Step`] per message, in
    /// order, each handler wrapped for a lost delivery as in [`try_once`](Self::try_once), with
    /// one difference where the lease of a handler that had not started cannot be released (the
    /// release failed or timed out): a single call is dropped and its lease left to expire, but
    /// the other messages of a batch must still be recorded, so that message's handler reports a
    /// retryable failure instead ([`Step::Done`]: one attempt counted, as a takeover after the
    /// lease expired would count it, and the key is free at once).
    ///
    /// Once `lost` is cancelled the whole call gets most of the orphan timeout; then it is
    /// dropped and every message without a result yet is [`Step::Abandoned`] (the leases not
    /// released left to expire); those whose results were recorded before keep them.
    ///
    /// `msgs` holds at most [`max_batch`](Self::max_batch) messages; a larger slice gets a
    /// [`ExecutorError::Store`] per message (stage acquire, handler not run).
    pub async fn try_batch<M, T>(
        &self,
        msgs: &[M],
        lost: &CancellationToken,
        timeouts: LostTimeouts,
    ) -> Vec<Step<T>>
    where
        M: Message + Clone + Send + Sync + 'static,
        H: Handler<M, R::Returns<T>>,
        T: Serialize + DeserializeOwned + Send + 'static,
    {
        let mut steps: Vec<Option<Step<T>>> =
            std::iter::repeat_with(|| None).take(msgs.len()).collect();
        self.try_batch_each(msgs, lost, timeouts, |index, step| {
            steps[index] = Some(step)
        })
        .await;
        steps
            .into_iter()
            .map(|step| step.expect("try_batch_each gives every message one step"))
            .collect()
    }

    /// [`try_batch`](Self::try_batch), handing each message's [`Step`] to `each` (with its
    /// index in `msgs`) as soon as it is known ([`Executor::run_batch_each`]) rather than all at
    /// the end, so that a runner can settle each message with its broker (and free its slot)
    /// while the slower handlers of the batch still run. `each` is called exactly once per
    /// message before this returns; the steps are those `try_batch` gives (the messages without
    /// a result when the executor call is dropped, most of the orphan timeout after `lost`, are
    /// [`Step::Abandoned`] then). If the caller drops this future itself, the messages not
    /// handed over yet get no step at all: the broker's redelivery is theirs.
    ///
    /// `each` runs inside the batch's poll, between the handlers' steps: it must return at once
    /// (hand the step to a channel, as the NATS and RabbitMQ runners do) and must not panic.
    pub async fn try_batch_each<M, T, E>(
        &self,
        msgs: &[M],
        lost: &CancellationToken,
        timeouts: LostTimeouts,
        mut each: E,
    ) where
        M: Message + Clone + Send + Sync + 'static,
        H: Handler<M, R::Returns<T>>,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: FnMut(usize, Step<T>),
    {
        let attempts: Vec<AtomicU32> = msgs.iter().map(|_| AtomicU32::new(0)).collect();
        let released: Vec<AtomicBool> = msgs.iter().map(|_| AtomicBool::new(false)).collect();
        let mut answered = vec![false; msgs.len()];
        let (attempts_ref, released_ref) = (&attempts, &released);
        let step_of = |index: usize, result| {
            if released_ref[index].load(Ordering::Relaxed) {
                Step::Abandoned {
                    lease_released: true,
                }
            } else {
                Step::Done {
                    result,
                    attempt: attempts_ref[index].load(Ordering::Relaxed),
                }
            }
        };
        let answered_ref = &mut answered;
        let each_ref = &mut each;
        let call = self.executor.run_batch_each(
            msgs,
            |i, ctx| {
                attempts_ref[i].store(ctx.attempt(), Ordering::Relaxed);
                let handler = Arc::clone(&self.handler);
                let store = self.executor.store().clone();
                let record = msgs[i].clone();
                let watched = lost.clone();
                async move {
                    if !watched.is_cancelled() {
                        let cancel = ctx.cancellation_token().clone();
                        return watch_handler(
                            handler.call(record, ctx),
                            cancel,
                            &watched,
                            timeouts.orphan,
                        )
                        .await;
                    }
                    // Lost before the handler was called: give the key back without counting an
                    // attempt; the failure reported next is refused on the released lease.
                    if release_unstarted(
                        &store,
                        &ctx,
                        timeouts.release,
                        "recording a retryable failure instead",
                    )
                    .await
                    {
                        released_ref[i].store(true, Ordering::Relaxed);
                    }
                    Err(HandlerError::retryable(
                        "the delivery was lost before the handler started",
                    ))
                }
            },
            |index, result| {
                answered_ref[index] = true;
                each_ref(index, step_of(index, result));
            },
        );
        let lost = lost.clone();
        let deadline = async move {
            lost.cancelled().await;
            tokio::time::sleep(timeouts.orphan.mul_f64(0.9)).await;
        };
        let ended = tokio::select! {
            biased;
            ended = call => Some(ended),
            () = deadline => None,
        };
        match ended {
            Some(Ok(())) => {}
            Some(Err(e)) => {
                let retry_after = self.executor.config().retry_delay;
                for index in 0..msgs.len() {
                    let result = Err(ExecutorError::Store {
                        stage: StoreStage::Acquire,
                        handler_ran: false,
                        retry_after,
                        source: idem_core::Error::invalid("batch", e.to_string()),
                    });
                    each(index, step_of(index, result));
                }
            }
            None => {
                let left = answered.iter().filter(|done| !**done).count();
                tracing::warn!(
                    messages = left,
                    "delivery lost: the executor batch did not end in time and is dropped; its leases not released expire and the next owners take them over"
                );
                for (index, done) in answered.iter().enumerate() {
                    if !done {
                        each(
                            index,
                            Step::Abandoned {
                                lease_released: released[index].load(Ordering::Relaxed),
                            },
                        );
                    }
                }
            }
        }
    }

    /// [`try_batch_each`](Self::try_batch_each), settling each message with its broker as its
    /// step arrives: `settle(index, step)` runs for every message, concurrently with the batch
    /// and with each other, while the slower handlers still run. Ends once every message is
    /// settled. The shared loop of the runners that settle one message at a time (NATS,
    /// RabbitMQ).
    pub async fn try_batch_settling<M, T, S, Fut>(
        &self,
        msgs: &[M],
        lost: &CancellationToken,
        timeouts: LostTimeouts,
        mut settle: S,
    ) where
        M: Message + Clone + Send + Sync + 'static,
        H: Handler<M, R::Returns<T>>,
        T: Serialize + DeserializeOwned + Send + 'static,
        S: FnMut(usize, Step<T>) -> Fut,
        Fut: Future<Output = ()>,
    {
        let (steps, mut known) = futures::channel::mpsc::unbounded();
        let batch = self.try_batch_each(msgs, lost, timeouts, move |index, step| {
            // The receiver lives until every step is settled.
            let _ = steps.unbounded_send((index, step));
        });
        let settling = async {
            let mut running = futures::stream::FuturesUnordered::new();
            loop {
                tokio::select! {
                    next = known.next() => match next {
                        Some((index, step)) => running.push(settle(index, step)),
                        // The batch is done: every step was sent.
                        None => break,
                    },
                    Some(()) = running.next(), if !running.is_empty() => {}
                }
            }
            while running.next().await.is_some() {}
        };
        futures::future::join(batch, settling).await;
    }

    /// The largest batch [`try_batch`](Self::try_batch) takes: the store's
    /// [`max_batch`](idem_core::Limits::max_batch).
    pub fn max_batch(&self) -> usize {
        self.executor.store().limits().max_batch
    }

    /// The message's idempotency key id, when it has a readable one (for the dead-letter
    /// [`HEADER_KEY`]).
    pub fn key_id<M: Message>(&self, msg: &M) -> Option<String> {
        self.executor
            .config()
            .key_source
            .extract(msg)
            .ok()
            .flatten()
    }

    /// The attempt count the store holds for the key (best effort, for the dead-letter
    /// [`HEADER_ATTEMPTS`]); `None` when there is no key or the store cannot be read.
    pub async fn stored_attempts(&self, key_id: Option<&str>) -> Option<u32> {
        let key = self.executor.namespace().key(key_id?).ok()?;
        match self.executor.store().get(&key).await {
            Ok(Some(record)) => Some(record.attempts),
            _ => None,
        }
    }

    /// The attempt count to write for `info`: its own, or the store's ([`Self::stored_attempts`]).
    pub async fn dead_letter_attempts(
        &self,
        info: &DeadLetterInfo,
        key_id: Option<&str>,
    ) -> Option<u32> {
        match info.attempts {
            Some(n) => Some(n),
            None => self.stored_attempts(key_id).await,
        }
    }
}

/// The timeouts of [`drain`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrainTimeouts {
    /// How long the delivery tasks get to end by themselves.
    pub drain: Duration,
    /// How long they get after they were marked lost; then they are aborted.
    pub orphan: Duration,
}

/// How far away [`instant_after`] puts a deadline that no instant can hold: 100 years.
const FAR_AWAY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The instant `after` from now; 100 years from now when `after` reaches past the last instant
/// there is (a timeout of `Duration::MAX`, meaning no bound), where `Instant + Duration` would
/// panic.
pub fn instant_after(after: Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_add(after).unwrap_or_else(|| now + FAR_AWAY)
}

/// How a [`drain`] ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Drained {
    /// The drain timeout passed and the tasks left were marked lost.
    pub timed_out: bool,
    /// Tasks still there one orphan timeout later, aborted.
    pub aborted: usize,
}

/// Waits for every task of `tasks` (each ended one goes to `report`, which logs a panic), while
/// `meanwhile` runs beside (e.g. giving back what the broker still sends after a cancel; it may
/// end first). At the drain timeout it cancels `lost`, so the deliveries in process are treated
/// as lost ([`Execution::try_once`]: handlers not started release their leases, running ones are
/// signalled, then dropped with their leases left to expire); what is still there one orphan
/// timeout later is aborted.
pub async fn drain<F>(
    tasks: &mut JoinSet<()>,
    lost: &CancellationToken,
    timeouts: DrainTimeouts,
    mut report: impl FnMut(Result<(), JoinError>),
    meanwhile: F,
) -> Drained
where
    F: Future<Output = ()>,
{
    let mut drained = Drained::default();
    let deadline = tokio::time::sleep(timeouts.drain);
    tokio::pin!(deadline);
    let mut meanwhile = std::pin::pin!(meanwhile);
    let mut beside = true;
    loop {
        tokio::select! {
            biased;
            joined = tasks.join_next() => match joined {
                Some(joined) => report(joined),
                None => break,
            },
            () = &mut meanwhile, if beside => beside = false,
            () = &mut deadline, if drained.aborted == 0 => {
                if drained.timed_out {
                    drained.aborted = tasks.len();
                    tracing::error!(left = tasks.len(), "delivery tasks did not end within the orphan timeout: aborted");
                    tasks.abort_all();
                } else {
                    tracing::warn!(
                        left = tasks.len(),
                        "drain timeout: the deliveries still in process are treated as lost (handlers not started release their leases; running ones are signalled, then dropped with their leases left to expire)"
                    );
                    drained.timed_out = true;
                    lost.cancel();
                    // On Tokio's clock, which a test may have paused and advanced.
                    let now = tokio::time::Instant::now();
                    deadline.as_mut().reset(
                        now.checked_add(timeouts.orphan)
                            .unwrap_or_else(|| now + FAR_AWAY),
                    );
                }
            }
        }
    }
    drained
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use idem_core::{IdempotencyStore, MemoryStore, Namespace, RecordState};

    use super::*;
    use crate::{
        BrokerAction, ExecutorConfig, HandlerContext, HandlerError, JsonCodec, Plain, RawMessage,
    };

    type BoxedHandler = Box<
        dyn Fn(
                RawMessage,
                HandlerContext,
            ) -> futures::future::BoxFuture<'static, Result<u32, HandlerError>>
            + Send
            + Sync,
    >;

    fn execution(
        store: Arc<MemoryStore>,
        handler: impl Fn(
            RawMessage,
            HandlerContext,
        ) -> futures::future::BoxFuture<'static, Result<u32, HandlerError>>
        + Send
        + Sync
        + 'static,
    ) -> Execution<BoxedHandler, JsonCodec, Plain> {
        let executor = Executor::new(store, ExecutorConfig::new("t")).unwrap();
        Execution::new(executor, Box::new(handler) as BoxedHandler)
    }

    const TIMEOUTS: LostTimeouts = LostTimeouts {
        orphan: Duration::from_millis(400),
        release: Duration::from_millis(200),
    };

    fn msg() -> RawMessage {
        RawMessage::new("{}").with_header("idempotency-key", "k")
    }

    async fn state(store: &MemoryStore) -> (RecordState, u32) {
        let key = Namespace::new("t").unwrap().key("k").unwrap();
        let record = store.get(&key).await.unwrap().unwrap();
        (record.state, record.attempts)
    }

    /// An execution whose handler runs `body` (once), and a `lost` token cancelled as soon as
    /// the handler has started.
    fn lost_once_started(
        store: Arc<MemoryStore>,
        body: impl Future<Output = Result<u32, HandlerError>> + Send + 'static,
    ) -> (Execution<BoxedHandler, JsonCodec, Plain>, CancellationToken) {
        let lost = CancellationToken::new();
        let on_start = lost.clone();
        let body = std::sync::Mutex::new(Some(Box::pin(body)));
        let exec = execution(store, move |_, _| {
            let body = body.lock().unwrap().take().expect("called once");
            let on_start = on_start.clone();
            Box::pin(async move {
                on_start.cancel();
                body.await
            })
        });
        (exec, lost)
    }

    #[tokio::test]
    async fn lost_before_the_handler_starts_releases_without_counting() {
        let store = Arc::new(MemoryStore::new());
        let exec = execution(store.clone(), |_, ctx| {
            Box::pin(async move { Ok(ctx.attempt()) })
        });
        let lost = CancellationToken::new();
        lost.cancel();
        let step = exec.try_once::<_, u32>(&msg(), &lost, TIMEOUTS).await;
        assert!(matches!(
            step,
            Step::Abandoned {
                lease_released: true
            }
        ));
        assert!(matches!(state(&store).await.0, RecordState::Released));
        // The next delivery runs at once, as the same first attempt.
        let step = exec
            .try_once::<_, u32>(&msg(), &CancellationToken::new(), TIMEOUTS)
            .await;
        match step {
            Step::Done {
                result: Ok(Outcome::Executed(attempt)),
                attempt: ran,
            } => assert_eq!((attempt, ran), (1, 1)),
            other => panic!("not executed: {other:?}"),
        }
    }

    #[tokio::test]
    async fn lost_while_running_lets_the_handler_finish_and_record() {
        let store = Arc::new(MemoryStore::new());
        let (exec, lost) = lost_once_started(store.clone(), async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok(7)
        });
        let step = exec.try_once::<_, u32>(&msg(), &lost, TIMEOUTS).await;
        assert!(matches!(
            step,
            Step::Done {
                result: Ok(Outcome::Executed(7)),
                attempt: 1,
            }
        ));
        assert!(matches!(
            state(&store).await.0,
            RecordState::Completed { .. }
        ));
    }

    #[tokio::test]
    async fn a_handler_still_running_past_the_orphan_timeout_is_dropped_not_released() {
        let store = Arc::new(MemoryStore::new());
        // Ignores its cancellation token.
        let (exec, lost) = lost_once_started(store.clone(), std::future::pending());
        let step = exec.try_once::<_, u32>(&msg(), &lost, TIMEOUTS).await;
        assert!(
            matches!(
                step,
                Step::Abandoned {
                    lease_released: false
                } | Step::Done {
                    result: Ok(Outcome::LeaseLost { .. }),
                    ..
                }
            ),
            "{step:?}"
        );
        assert!(
            matches!(state(&store).await, (RecordState::InProgress, _)),
            "left to expire"
        );
    }

    fn keyed(id: &str) -> RawMessage {
        RawMessage::new("{}").with_header("idempotency-key", id.to_owned())
    }

    #[tokio::test]
    async fn a_batch_gives_each_message_its_step_and_releases_what_had_not_started() {
        let store = Arc::new(MemoryStore::new());
        // One handler slot: "a" runs first and marks the batch lost; "b" then finds it lost
        // before its handler starts.
        let lost = CancellationToken::new();
        let on_start = lost.clone();
        let executor = Executor::new(
            store.clone(),
            ExecutorConfig::new("t").with_batch(crate::BatchConfig::default().with_concurrency(1)),
        )
        .unwrap();
        let exec = Execution::new(
            executor,
            Box::new(move |_: RawMessage, ctx: HandlerContext| {
                let on_start = on_start.clone();
                Box::pin(async move {
                    on_start.cancel();
                    Ok(ctx.attempt())
                }) as futures::future::BoxFuture<'static, Result<u32, HandlerError>>
            }) as BoxedHandler,
        );
        let msgs = [keyed("a"), keyed("b")];
        let steps = exec.try_batch::<_, u32>(&msgs, &lost, TIMEOUTS).await;
        assert!(
            matches!(
                steps[0],
                Step::Done {
                    result: Ok(Outcome::Executed(1)),
                    attempt: 1
                }
            ),
            "{:?}",
            steps[0]
        );
        assert!(
            matches!(
                steps[1],
                Step::Abandoned {
                    lease_released: true
                }
            ),
            "{:?}",
            steps[1]
        );
        let ns = Namespace::new("t").unwrap();
        let b = store.get(&ns.key("b").unwrap()).await.unwrap().unwrap();
        assert_eq!(
            (b.state, b.attempts),
            (RecordState::Released, 0),
            "released, its attempt not counted"
        );
        // The next delivery of "b" acquires it at once.
        let again = exec
            .try_batch::<_, u32>(&[keyed("b")], &CancellationToken::new(), TIMEOUTS)
            .await;
        assert!(matches!(
            again[0],
            Step::Done {
                result: Ok(Outcome::Executed(_)),
                ..
            }
        ));
    }

    #[tokio::test]
    async fn a_batch_past_the_orphan_timeout_is_abandoned_whole() {
        let store = Arc::new(MemoryStore::new());
        let (exec, lost) = lost_once_started(store.clone(), std::future::pending());
        let steps = exec.try_batch::<_, u32>(&[msg()], &lost, TIMEOUTS).await;
        assert!(
            matches!(
                steps[..],
                [Step::Abandoned {
                    lease_released: false
                }] | [Step::Done {
                    result: Ok(Outcome::LeaseLost { .. }),
                    ..
                }]
            ),
            "{steps:?}"
        );
        assert!(
            matches!(state(&store).await, (RecordState::InProgress, _)),
            "left to expire"
        );
    }

    #[tokio::test]
    async fn a_batch_over_the_store_limit_answers_each_message_with_a_store_error() {
        let store = Arc::new(MemoryStore::new());
        let exec = execution(store.clone(), |_, ctx| {
            Box::pin(async move { Ok(ctx.attempt()) })
        });
        let msgs: Vec<_> = (0..=exec.max_batch())
            .map(|i| keyed(&format!("k{i}")))
            .collect();
        let steps = exec
            .try_batch::<_, u32>(&msgs, &CancellationToken::new(), TIMEOUTS)
            .await;
        assert_eq!(steps.len(), msgs.len());
        assert!(steps.iter().all(|s| matches!(
            s,
            Step::Done {
                result: Err(ExecutorError::Store {
                    handler_ran: false,
                    ..
                }),
                attempt: 0
            }
        )));
        assert!(
            store
                .get(&Namespace::new("t").unwrap().key("k0").unwrap())
                .await
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn classification_counts_the_runs_of_the_payload() {
        let info = |r: &Result<Outcome<()>, ExecutorError>, attempt| {
            let BrokerAction::DeadLetter { reason, error } = BrokerAction::of(r) else {
                panic!("not a dead letter: {r:?}")
            };
            classify(r, reason, error, attempt)
        };
        let conflict = info(&Ok(Outcome::Conflict), 0);
        assert_eq!(
            (conflict.reason, conflict.attempts),
            (DeadLetterReason::Conflict, Some(0))
        );
        assert_eq!(info(&Err(ExecutorError::MissingKey), 0).attempts, Some(0));
        let exhausted = Ok(Outcome::Exhausted {
            attempts: 3,
            last_error: Some("boom".into()),
        });
        assert_eq!(
            info(&exhausted, 3),
            DeadLetterInfo {
                reason: DeadLetterReason::Exhausted,
                error: "boom".into(),
                attempts: Some(3)
            }
        );
        let failed = Ok(Outcome::Failed {
            error: "bad".into(),
        });
        assert_eq!(info(&failed, 2).attempts, Some(2));
        assert_eq!(info(&failed, 0).attempts, None, "read from the store");
        assert_eq!(attempts_value(Some(3)), "3");
        assert_eq!(attempts_value(None), ATTEMPTS_UNKNOWN);
    }

    #[test]
    fn delays_are_clamped_and_checked() {
        let (min, max) = (Duration::from_millis(100), Duration::from_secs(5));
        assert_eq!(
            retry_delay(Duration::from_secs(1), min, max),
            Duration::from_secs(1)
        );
        assert_eq!(reconnect_delay(0, min, max), min);
        assert_eq!(reconnect_delay(u32::MAX, min, max), max);
        assert!(check_delays("retry_delay", min, max).is_ok());
        assert_eq!(
            check_delays("retry_delay", max, min).unwrap_err().field,
            "retry_delay"
        );
        assert_eq!(
            check_delays("retry_delay", Duration::ZERO, max)
                .unwrap_err()
                .field,
            "retry_delay"
        );
        assert_eq!(
            check_nonzero([("a", &min), ("b", &Duration::ZERO)])
                .unwrap_err()
                .field,
            "b"
        );
        assert!(TIMEOUTS.validate().is_ok());
        let inverted = LostTimeouts {
            orphan: Duration::from_millis(100),
            release: Duration::from_millis(100),
        };
        assert_eq!(inverted.validate().unwrap_err().field, "release_timeout");
    }

    #[test]
    fn store_health_pauses_while_store_errors_run_and_not_after_an_answer() {
        let (min, max) = (Duration::from_millis(100), Duration::from_secs(5));
        let health = StoreHealth::default();
        assert_eq!(health.pause(min, max), None);
        let down: Result<Outcome<()>, ExecutorError> = Err(ExecutorError::Store {
            stage: StoreStage::Acquire,
            handler_ran: false,
            retry_after: Duration::from_secs(1),
            source: idem_core::Error::unavailable("test", "connection refused"),
        });
        health.note(&down);
        assert_eq!(health.pause(min, max), Some(Duration::from_millis(200)));
        health.note(&down);
        assert_eq!(health.pause(min, max), Some(Duration::from_millis(400)));
        // Any outcome the store answered ends the run, a failed handler's too.
        health.note(&Ok(Outcome::<()>::Failed { error: "no".into() }));
        assert_eq!((health.failures(), health.pause(min, max)), (0, None));
        // A message the store was not asked about neither counts nor ends the run.
        health.note(&down);
        health.note::<()>(&Err(ExecutorError::MissingKey));
        assert_eq!(health.failures(), 1);
        health.note(&Ok(Outcome::<()>::Replayed(())));
        assert_eq!(health.pause(min, max), None);
    }

    #[tokio::test]
    async fn drain_marks_the_rest_lost_then_aborts() {
        let mut tasks = JoinSet::new();
        let lost = CancellationToken::new();
        // Ends at once; ends when lost; never ends.
        tasks.spawn(async {});
        let watched = lost.clone();
        tasks.spawn(async move { watched.cancelled().await });
        tasks.spawn(std::future::pending());
        let mut joined = 0;
        let drained = drain(
            &mut tasks,
            &lost,
            DrainTimeouts {
                drain: Duration::from_millis(50),
                orphan: Duration::from_millis(50),
            },
            |_| joined += 1,
            async {},
        )
        .await;
        assert_eq!(
            drained,
            Drained {
                timed_out: true,
                aborted: 1
            }
        );
        assert!(lost.is_cancelled());
        assert_eq!(joined, 3);
        assert!(tasks.is_empty());
    }

    /// An orphan timeout of `Duration::MAX` (no bound) waits for the lost tasks to end.
    #[tokio::test]
    async fn an_unbounded_orphan_timeout_waits_for_the_lost_tasks() {
        let mut tasks = JoinSet::new();
        let lost = CancellationToken::new();
        let watched = lost.clone();
        // Outlives the drain timeout by far more than an orphan timeout of a few milliseconds.
        let ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let end = Arc::clone(&ended);
        tasks.spawn(async move {
            watched.cancelled().await;
            tokio::time::sleep(Duration::from_millis(200)).await;
            end.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        let drained = drain(
            &mut tasks,
            &lost,
            DrainTimeouts {
                drain: Duration::from_millis(20),
                orphan: Duration::MAX,
            },
            |joined| assert!(joined.is_ok(), "not aborted: {joined:?}"),
            async {},
        )
        .await;
        assert!(
            ended.load(std::sync::atomic::Ordering::SeqCst),
            "the task ran to its end"
        );
        assert_eq!(
            drained,
            Drained {
                timed_out: true,
                aborted: 0
            }
        );
        assert!(tasks.is_empty());
    }

    #[test]
    fn counts_and_durations_out_of_bounds_name_their_option() {
        assert!(check_count("n", 1, 4).is_ok() && check_count("n", 4, 4).is_ok());
        for n in [0, 5, usize::MAX] {
            assert_eq!(check_count("n", n, 4).unwrap_err().field, "n");
        }
        let (ms, s) = (Duration::from_millis(1), Duration::from_secs(1));
        assert!(check_within([("a", &ms), ("b", &s)], ms, s, "test").is_ok());
        let short = Duration::from_micros(999);
        let e = check_within([("a", &ms), ("b", &short)], ms, s, "the unit").unwrap_err();
        assert_eq!(e.field, "b");
        assert!(e.reason.contains("the unit"), "{e}");
        let e = check_within([("a", &Duration::MAX)], ms, s, "x").unwrap_err();
        assert_eq!(e.field, "a");
    }

    #[test]
    fn an_instant_past_the_last_one_is_far_away() {
        let far = instant_after(Duration::MAX);
        assert!(far > std::time::Instant::now() + Duration::from_secs(50 * 365 * 24 * 3600));
        let near = instant_after(Duration::from_secs(1));
        assert!(near <= std::time::Instant::now() + Duration::from_secs(1));
    }

    #[tokio::test]
    async fn a_drain_whose_tasks_end_in_time_marks_nothing_lost() {
        let mut tasks = JoinSet::new();
        tasks.spawn(async {});
        let lost = CancellationToken::new();
        let drained = drain(
            &mut tasks,
            &lost,
            DrainTimeouts {
                drain: Duration::from_secs(30),
                orphan: Duration::from_secs(30),
            },
            |joined| assert!(joined.is_ok()),
            std::future::pending(),
        )
        .await;
        assert_eq!(drained, Drained::default());
        assert!(!lost.is_cancelled());
    }
}
