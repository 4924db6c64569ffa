//! Running one message: acquire, handle with heartbeats, record, report.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use bytes::Bytes;
use futures::FutureExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, Span, field};

use super::Executor;
use super::codec::Codec;
use super::config::{MissingKeyPolicy, StoreErrorPolicy};
use super::context::{HandlerContext, HandlerError};
use super::error::{ExecutorError, StoreStage};
use super::heartbeat::{Heartbeats, LeaseDeadline, Registration};
use super::key_source::PayloadJson;
use super::message::Message;
use super::metric_names as m;
use super::outcome::{DeadLetter, HandlerFailure, Outcome, PassThroughReason};
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::record::{AcquireOutcome, AcquireRequest, Lease, RecordState};

/// First delay between the tries of a completion or failure record on `Unavailable`.
const RECORD_RETRY_DELAY: Duration = Duration::from_millis(10);
/// Longest delay between those tries (capped further at a tenth of the lease).
const RECORD_MAX_DELAY: Duration = Duration::from_secs(1);

/// How the error recorded for a result that could not be stored starts.
pub(crate) const RESULT_NOT_STORED_PREFIX: &str =
    "result not stored (the handler's effect was applied): ";

/// Why a handler was cancelled.
enum Cancelled {
    /// A heartbeat found the lease lost.
    LeaseLost,
    /// The local lease deadline passed without a successful heartbeat.
    Deadline,
}

/// A lease held by this call, with its local deadline and (once needed) its heartbeat.
struct Leased<'a> {
    heartbeats: &'a Arc<Heartbeats>,
    lease: Lease,
    cancel: CancellationToken,
    deadline: LeaseDeadline,
    registration: Option<Registration<'a>>,
}

impl Leased<'_> {
    /// Starts heartbeating, if not yet.
    fn heartbeat(&mut self) {
        if self.registration.is_none() {
            self.registration = Some(self.heartbeats.register(
                self.lease.clone(),
                self.cancel.clone(),
                self.deadline.clone(),
            ));
        }
    }
}

/// What one handler run came to.
enum Handled<T> {
    Value(T),
    Error(HandlerError),
    Panicked(String),
}

impl<C: Codec> Executor<C> {
    /// Processes one message: see the [module docs](crate::executor).
    ///
    /// `handler` runs at most once per call, and only when this call acquired the key (or the
    /// message passes through un-deduplicated by policy). Its `Ok` value is stored through the
    /// codec and returned as [`Outcome::Executed`]; duplicates get it back decoded as
    /// [`Outcome::Replayed`].
    ///
    /// Must be called within a Tokio runtime with timers enabled (heartbeats and the optional
    /// in-progress wait use `tokio::time`).
    ///
    /// # Errors
    /// [`ExecutorError`]: a message without a usable key (by default), a store failure (fail
    /// closed, by default), or a stored result that does not decode.
    pub async fn run<M, F, Fut, T>(&self, msg: &M, handler: F) -> Result<Outcome<T>, ExecutorError>
    where
        M: Message,
        F: FnOnce(HandlerContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError>>,
        T: Serialize + DeserializeOwned,
    {
        let span = self.span();
        let prepared = {
            let _entered = span.enter();
            self.prepare(msg)
        };
        let this = self;
        let current = span.clone();
        async move {
            let result = match prepared {
                Ok(Some((key, fingerprint))) => {
                    this.run_keyed(key, fingerprint, handler, &current).await
                }
                Ok(None) => match this.inner.config.missing_key {
                    MissingKeyPolicy::PassThrough => {
                        tracing::warn!(
                            "message without an idempotency key passed through un-deduplicated"
                        );
                        Ok(this
                            .pass_through(None, PassThroughReason::MissingKey, handler)
                            .await)
                    }
                    MissingKeyPolicy::Reject => Err(ExecutorError::MissingKey),
                },
                Err(e) => Err(e),
            };
            this.observe(&result, &current);
            result
        }
        .instrument(span)
        .await
    }

    /// Like [`run`](Self::run) for a caller that extracted the key id and computed the
    /// fingerprint itself (`None`: no conflict detection); the key source, fingerprint policy and
    /// missing-key policy are not used.
    ///
    /// # Errors
    /// As [`run`](Self::run); [`ExecutorError::InvalidKey`] when `id` is not a valid key id.
    pub async fn run_with_key<F, Fut, T>(
        &self,
        id: &str,
        fingerprint: Option<Fingerprint>,
        handler: F,
    ) -> Result<Outcome<T>, ExecutorError>
    where
        F: FnOnce(HandlerContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError>>,
        T: Serialize + DeserializeOwned,
    {
        let span = self.span();
        let key = self
            .inner
            .namespace
            .key(id)
            .map_err(ExecutorError::InvalidKey);
        let this = self;
        let current = span.clone();
        async move {
            let result = match key {
                Ok(key) => this.run_keyed(key, fingerprint, handler, &current).await,
                Err(e) => Err(e),
            };
            this.observe(&result, &current);
            result
        }
        .instrument(span)
        .await
    }

    fn span(&self) -> Span {
        tracing::info_span!(
            "idem",
            namespace = %self.inner.namespace,
            key = field::Empty,
            attempt = field::Empty,
            token = field::Empty,
            outcome = field::Empty,
        )
    }

    /// Key and fingerprint, synchronously (the message is not held across an await).
    fn prepare<M: Message>(
        &self,
        msg: &M,
    ) -> Result<Option<(IdempotencyKey, Option<Fingerprint>)>, ExecutorError> {
        let msg: &dyn Message = msg;
        let json = PayloadJson::new(msg.payload());
        let config = &self.inner.config;
        let Some(id) = config.key_source.extract_with(msg, &json)? else {
            return Ok(None);
        };
        let key = self
            .inner
            .namespace
            .key(id)
            .map_err(ExecutorError::InvalidKey)?;
        let fingerprint = config.fingerprint.compute_with(msg, &json)?;
        Ok(Some((key, fingerprint)))
    }

    async fn run_keyed<F, Fut, T>(
        &self,
        key: IdempotencyKey,
        fingerprint: Option<Fingerprint>,
        handler: F,
        span: &Span,
    ) -> Result<Outcome<T>, ExecutorError>
    where
        F: FnOnce(HandlerContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError>>,
        T: Serialize + DeserializeOwned,
    {
        let inner = &self.inner;
        span.record("key", key.id());
        let req = AcquireRequest::new(key, inner.owner.clone())
            .with_fingerprint(fingerprint)
            .with_lease_ttl(inner.config.lease_ttl)
            .with_max_attempts(inner.config.max_attempts);
        let (acquired, sent) = match self.acquire(&req).await {
            Ok(acquired) => acquired,
            Err(e) => {
                let key = req.key.clone();
                return self
                    .store_error(StoreStage::Acquire, e, &req.key, |reason| {
                        self.pass_through(Some(key), reason, handler)
                    })
                    .await;
            }
        };
        match acquired {
            AcquireOutcome::Acquired { lease, takeover } => {
                self.execute(lease, sent, takeover, handler, span).await
            }
            AcquireOutcome::InProgress { owner, retry_after } => {
                Ok(Outcome::InProgress { owner, retry_after })
            }
            AcquireOutcome::Replayed { result } => inner
                .codec
                .decode(&result)
                .map(Outcome::Replayed)
                .map_err(|source| ExecutorError::Decode {
                    key: req.key,
                    source,
                }),
            AcquireOutcome::Conflict => Ok(Outcome::Conflict),
            AcquireOutcome::Exhausted {
                attempts,
                last_error,
            } => Ok(Outcome::Exhausted {
                attempts,
                last_error,
            }),
            AcquireOutcome::Failed { error } if error.starts_with(RESULT_NOT_STORED_PREFIX) => {
                Ok(Outcome::ResultNotStored { error })
            }
            AcquireOutcome::Failed { error } => Ok(Outcome::Failed { error }),
        }
    }

    /// Acquire, with the optional bounded wait while another worker holds the key. Also gives
    /// the instant the last acquire was sent (a lease it grants starts after it).
    async fn acquire(&self, req: &AcquireRequest) -> Result<(AcquireOutcome, Instant), Error> {
        let store = &self.inner.store;
        let mut sent = Instant::now();
        let mut outcome = store.acquire(req).await?;
        let Some(wait) = self.inner.config.in_progress_wait else {
            return Ok((outcome, sent));
        };
        if !matches!(outcome, AcquireOutcome::InProgress { .. }) {
            return Ok((outcome, sent));
        }
        let deadline = Instant::now() + wait.max_wait;
        let mut delays = ExponentialBuilder::new()
            .with_min_delay(wait.min_delay)
            .with_max_delay(wait.max_delay)
            .with_jitter()
            .without_max_times()
            .build();
        while let AcquireOutcome::InProgress { retry_after, .. } = &outcome {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            // Never sleep past the holder's lease: a crashed holder is taken over at once.
            let delay = delays
                .next()
                .unwrap_or(wait.max_delay)
                .min(wait.max_delay)
                .min(*retry_after + Duration::from_millis(1))
                .min(deadline - now);
            tokio::time::sleep(delay).await;
            sent = Instant::now();
            outcome = store.acquire(req).await?;
        }
        Ok((outcome, sent))
    }

    /// Runs the handler under the lease, heartbeating, then records the result.
    async fn execute<F, Fut, T>(
        &self,
        lease: Lease,
        sent: Instant,
        takeover: bool,
        handler: F,
        span: &Span,
    ) -> Result<Outcome<T>, ExecutorError>
    where
        F: FnOnce(HandlerContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError>>,
        T: Serialize + DeserializeOwned,
    {
        let inner = &self.inner;
        span.record("attempt", lease.attempt);
        span.record("token", lease.token.get());
        if takeover {
            self.count(m::TAKEOVERS);
            tracing::info!(attempt = lease.attempt, "took over an expired lease");
        }
        let cancel = CancellationToken::new();
        let deadline = LeaseDeadline::new(sent, inner.config.lease_ttl);
        let mut leased = Leased {
            heartbeats: &inner.heartbeats,
            lease: lease.clone(),
            cancel: cancel.clone(),
            deadline: deadline.clone(),
            registration: None,
        };
        let ctx = HandlerContext::leased(lease, takeover, cancel.clone(), deadline.clone());
        let handled = {
            let mut run = pin!(handle(handler, ctx));
            match futures::poll!(run.as_mut()) {
                Poll::Ready(handled) => Ok(handled),
                Poll::Pending => {
                    leased.heartbeat();
                    loop {
                        let at = deadline.get();
                        tokio::select! {
                            biased;
                            handled = run.as_mut() => break Ok(handled),
                            () = cancel.cancelled() => break Err(Cancelled::LeaseLost),
                            () = tokio::time::sleep_until(at) => {
                                // A heartbeat may have moved the deadline on meanwhile.
                                if deadline.get() <= Instant::now() {
                                    cancel.cancel();
                                    break Err(Cancelled::Deadline);
                                }
                            }
                        }
                    }
                }
            }
            // The handler's future is dropped here, before anything is recorded.
        };
        match handled {
            Err(Cancelled::LeaseLost) => {
                tracing::warn!("lease lost while the handler ran: handler cancelled");
                Ok(self.lease_lost())
            }
            Err(Cancelled::Deadline) => {
                tracing::warn!(
                    "local lease deadline passed without a successful heartbeat: handler cancelled"
                );
                Ok(self.lease_lost())
            }
            Ok(Handled::Value(value)) => self.complete(&mut leased, value).await,
            Ok(Handled::Error(e)) => {
                let terminal = e.is_terminal();
                self.record_failure(&mut leased, e.message(), terminal, false)
                    .await
            }
            Ok(Handled::Panicked(message)) => {
                self.count(m::PANICS);
                self.record_failure(
                    &mut leased,
                    format!("handler panicked: {message}"),
                    false,
                    true,
                )
                .await
            }
        }
        // `leased` (and its heartbeat) lives until the record is settled.
    }

    async fn complete<T: Serialize>(
        &self,
        leased: &mut Leased<'_>,
        value: T,
    ) -> Result<Outcome<T>, ExecutorError> {
        let inner = &self.inner;
        let bytes = match inner.codec.encode(&value) {
            Ok(bytes) if bytes.len() <= inner.max_result_len => Bytes::from(bytes),
            Ok(bytes) => {
                let detail = format!(
                    "the result of {} bytes is over the limit of {} bytes",
                    bytes.len(),
                    inner.max_result_len
                );
                return self.result_not_stored(leased, detail, value).await;
            }
            Err(e) => {
                let detail = format!("the result does not encode: {e}");
                return self.result_not_stored(leased, detail, value).await;
            }
        };
        let lease = leased.lease.clone();
        let (recorded, tries) = self
            .record_with_retry(leased, || {
                inner
                    .store
                    .complete(&lease, bytes.clone(), inner.config.retention)
            })
            .await;
        match self.settle(recorded, tries, &lease).await {
            Ok(()) => Ok(Outcome::Executed(value)),
            Err(e) if e.is_lease_lost() => {
                tracing::warn!("completion refused: the lease was lost");
                Ok(self.lease_lost())
            }
            Err(e) => {
                self.store_error(StoreStage::Complete, e, &lease.key, |reason| async move {
                    Outcome::NotDeduplicated {
                        result: Ok(value),
                        reason,
                        retry_after: inner.config.retry_delay,
                    }
                })
                .await
            }
        }
    }

    /// The handler succeeded but its result cannot be stored: records a terminal failure (the
    /// handler must never run again) and reports [`Outcome::ResultNotStored`].
    async fn result_not_stored<T>(
        &self,
        leased: &mut Leased<'_>,
        detail: String,
        value: T,
    ) -> Result<Outcome<T>, ExecutorError> {
        let error = format!("{RESULT_NOT_STORED_PREFIX}{detail}");
        tracing::error!(%error, "the handler succeeded but its result cannot be stored: recording a terminal failure");
        Ok(
            match self.record_failure(leased, error, true, false).await? {
                Outcome::Failed { error } => Outcome::ResultNotStored { error },
                // Failing open: the handler did succeed.
                Outcome::NotDeduplicated {
                    result: Err(_),
                    reason,
                    retry_after,
                } => Outcome::NotDeduplicated {
                    result: Ok(value),
                    reason,
                    retry_after,
                },
                other => other,
            },
        )
    }

    async fn record_failure<T>(
        &self,
        leased: &mut Leased<'_>,
        error: String,
        terminal: bool,
        panicked: bool,
    ) -> Result<Outcome<T>, ExecutorError> {
        let inner = &self.inner;
        let error = truncate_on_char_boundary(error, inner.max_error_len);
        let lease = leased.lease.clone();
        let (recorded, tries) = self
            .record_with_retry(leased, || {
                inner
                    .store
                    .fail(&lease, &error, !terminal, inner.config.retention)
            })
            .await;
        match self.settle(recorded, tries, &lease).await {
            Ok(()) if terminal => Ok(Outcome::Failed { error }),
            Ok(()) if lease.attempt >= inner.config.max_attempts => {
                if let Some(hook) = &inner.dead_letter {
                    self.count(m::DEAD_LETTERED);
                    let event = DeadLetter {
                        key: lease.key,
                        attempts: lease.attempt,
                        last_error: error.clone(),
                        panicked,
                    };
                    // A panicking hook must not take the caller's task (and consumer loop) down.
                    if let Err(payload) =
                        std::panic::catch_unwind(AssertUnwindSafe(|| hook(&event)))
                    {
                        tracing::error!(
                            key = event.key.id(),
                            panic = %panic_message(&*payload),
                            "the dead-letter hook panicked; carrying on"
                        );
                    }
                }
                Ok(Outcome::Exhausted {
                    attempts: lease.attempt,
                    last_error: Some(error),
                })
            }
            Ok(()) => {
                self.count(m::RETRYABLE_FAILURES);
                Ok(Outcome::Retry {
                    attempt: lease.attempt,
                    error,
                    panicked,
                    retry_after: inner.config.retry_delay,
                })
            }
            Err(e) if e.is_lease_lost() => {
                tracing::warn!("failure record refused: the lease was lost");
                Ok(self.lease_lost())
            }
            Err(e) => {
                self.store_error(StoreStage::Fail, e, &lease.key, |reason| async move {
                    Outcome::NotDeduplicated {
                        result: Err(HandlerFailure {
                            error,
                            terminal,
                            panicked,
                        }),
                        reason,
                        retry_after: inner.config.retry_delay,
                    }
                })
                .await
            }
        }
    }

    /// A record that was retried after `Unavailable` may have taken effect before its answer was
    /// lost: the retry then finds the key no longer in progress and gets `LeaseLost`. Read the
    /// record to tell that apart from a real takeover.
    ///
    /// If that read fails, its store error is the answer: the record may well have taken effect,
    /// so `LeaseLost` would be a guess.
    async fn settle(
        &self,
        recorded: Result<(), Error>,
        tries: u32,
        lease: &Lease,
    ) -> Result<(), Error> {
        match recorded {
            Err(e) if e.is_lease_lost() && tries > 1 => {
                match self.inner.store.get(&lease.key).await {
                    Ok(Some(record))
                        if record.token == lease.token
                            && !matches!(
                                record.state,
                                RecordState::InProgress | RecordState::Released
                            ) =>
                    {
                        Ok(())
                    }
                    Ok(_) => Err(e),
                    Err(read) => {
                        tracing::warn!(
                            error = %read,
                            "could not read back a record refused after a retry"
                        );
                        Err(read)
                    }
                }
            }
            other => other,
        }
    }

    /// Tries a completion or failure record, retrying on `Unavailable` with backoff while the
    /// lease holds: until the next try would come after the local lease deadline (or after a
    /// whole lease TTL spent retrying, when heartbeats keep moving that deadline on). The lease
    /// heartbeats meanwhile. Gives the last result and the number of tries.
    async fn record_with_retry<FutureFn, Fut>(
        &self,
        leased: &mut Leased<'_>,
        mut op: FutureFn,
    ) -> (Result<(), Error>, u32)
    where
        FutureFn: FnMut() -> Fut,
        Fut: Future<Output = Result<(), Error>>,
    {
        let ttl = self.inner.config.lease_ttl;
        let budget = Instant::now() + ttl;
        let max_delay = RECORD_MAX_DELAY.min(ttl / 10);
        let mut delays = ExponentialBuilder::new()
            .with_min_delay(RECORD_RETRY_DELAY.min(max_delay))
            .with_max_delay(max_delay)
            .with_jitter()
            .without_max_times()
            .build();
        let mut tries = 0;
        loop {
            tries += 1;
            match op().await {
                Err(e) if e.is_retryable() => {
                    leased.heartbeat();
                    let delay = delays.next().unwrap_or(max_delay).min(max_delay);
                    if Instant::now() + delay >= leased.deadline.get().min(budget) {
                        tracing::warn!(
                            tries,
                            error = %e,
                            "giving up recording: the lease is about to expire"
                        );
                        return (Err(e), tries);
                    }
                    tracing::debug!(tries, error = %e, ?delay, "record failed; retrying");
                    tokio::time::sleep(delay).await;
                }
                other => return (other, tries),
            }
        }
    }

    /// Applies the store-error policy. `fail_open` builds the outcome when failing open.
    async fn store_error<T, G, GFut>(
        &self,
        stage: StoreStage,
        error: Error,
        key: &IdempotencyKey,
        fail_open: G,
    ) -> Result<Outcome<T>, ExecutorError>
    where
        G: FnOnce(PassThroughReason) -> GFut,
        GFut: Future<Output = Outcome<T>>,
    {
        self.count(m::STORE_ERRORS);
        let handler_ran = stage != StoreStage::Acquire;
        match self.inner.config.store_errors {
            StoreErrorPolicy::FailOpen => {
                tracing::warn!(
                    %stage,
                    error = %error,
                    key = key.id(),
                    "store error: failing open, the message is not deduplicated"
                );
                Ok(fail_open(PassThroughReason::StoreError {
                    stage,
                    source: error,
                })
                .await)
            }
            StoreErrorPolicy::FailClosed => {
                tracing::warn!(
                    %stage,
                    error = %error,
                    key = key.id(),
                    handler_ran,
                    "store error: failing closed"
                );
                Err(ExecutorError::Store {
                    stage,
                    handler_ran,
                    retry_after: self.inner.config.retry_delay,
                    source: error,
                })
            }
        }
    }

    /// Runs the handler without the store.
    async fn pass_through<F, Fut, T>(
        &self,
        key: Option<IdempotencyKey>,
        reason: PassThroughReason,
        handler: F,
    ) -> Outcome<T>
    where
        F: FnOnce(HandlerContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError>>,
    {
        let result = match handle(handler, HandlerContext::pass_through(key)).await {
            Handled::Value(value) => Ok(value),
            Handled::Error(e) => Err(HandlerFailure {
                error: e.message(),
                terminal: e.is_terminal(),
                panicked: false,
            }),
            Handled::Panicked(message) => {
                self.count(m::PANICS);
                Err(HandlerFailure {
                    error: format!("handler panicked: {message}"),
                    terminal: false,
                    panicked: true,
                })
            }
        };
        Outcome::NotDeduplicated {
            result,
            reason,
            retry_after: self.inner.config.retry_delay,
        }
    }

    fn lease_lost<T>(&self) -> Outcome<T> {
        Outcome::LeaseLost {
            retry_after: self.inner.config.retry_delay,
        }
    }

    fn count(&self, name: &'static str) {
        metrics::counter!(name, "namespace" => self.inner.ns_label.clone()).increment(1);
    }

    /// Records the outcome on the span, counts it and logs it.
    fn observe<T>(&self, result: &Result<Outcome<T>, ExecutorError>, span: &Span) {
        match result {
            Ok(outcome) => {
                let name = outcome.name();
                span.record("outcome", name);
                let counter = match outcome {
                    Outcome::Executed(_) => Some(m::EXECUTED),
                    Outcome::Replayed(_) => Some(m::REPLAYED),
                    Outcome::InProgress { .. } => Some(m::IN_PROGRESS),
                    Outcome::Conflict => Some(m::CONFLICTS),
                    Outcome::Exhausted { .. } => Some(m::EXHAUSTED),
                    Outcome::Failed { .. } => Some(m::FAILED),
                    Outcome::ResultNotStored { .. } => Some(m::RESULT_NOT_STORED),
                    Outcome::LeaseLost { .. } => Some(m::LEASE_LOST),
                    Outcome::NotDeduplicated { .. } => Some(m::NOT_DEDUPLICATED),
                    Outcome::Retry { .. } => None,
                };
                if let Some(counter) = counter {
                    self.count(counter);
                }
                match outcome {
                    Outcome::Executed(_) | Outcome::Replayed(_) | Outcome::InProgress { .. } => {
                        tracing::debug!(outcome = name, "message processed");
                    }
                    Outcome::Retry { error, .. } => {
                        tracing::warn!(outcome = name, %error, "handler failed, will retry");
                    }
                    Outcome::Exhausted { last_error, .. } => {
                        tracing::warn!(
                            outcome = name,
                            last_error,
                            "poison message: attempts exhausted"
                        );
                    }
                    Outcome::Failed { error } => {
                        tracing::warn!(outcome = name, %error, "terminal failure");
                    }
                    Outcome::ResultNotStored { error } => {
                        tracing::error!(
                            outcome = name,
                            %error,
                            "the handler's effect was applied but its result is not stored"
                        );
                    }
                    _ => tracing::warn!(outcome = name, "message processed"),
                }
            }
            Err(e) => {
                span.record("outcome", "error");
                tracing::warn!(error = %e, "message not processed");
            }
        }
    }
}

/// Runs the handler, catching a panic in its construction or in its future.
async fn handle<F, Fut, T>(handler: F, ctx: HandlerContext) -> Handled<T>
where
    F: FnOnce(HandlerContext) -> Fut,
    Fut: Future<Output = Result<T, HandlerError>>,
{
    match AssertUnwindSafe(async move { handler(ctx).await })
        .catch_unwind()
        .await
    {
        Ok(Ok(value)) => Handled::Value(value),
        Ok(Err(e)) => Handled::Error(e),
        Err(payload) => Handled::Panicked(panic_message(&*payload)),
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_owned()
    }
}

/// Truncates `s` to at most `max` bytes, on a UTF-8 character boundary.
pub(crate) fn truncate_on_char_boundary(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_keeps_char_boundaries() {
        assert_eq!(truncate_on_char_boundary("héllo".into(), 2), "h");
        assert_eq!(truncate_on_char_boundary("héllo".into(), 3), "hé");
        assert_eq!(truncate_on_char_boundary("abc".into(), 10), "abc");
        assert_eq!(truncate_on_char_boundary("€€".into(), 5), "€");
    }
}
