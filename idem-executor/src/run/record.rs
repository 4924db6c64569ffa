//! Recording what the handler came to: the completion, or a failure of its kind, re-sent on
//! `Unavailable` while the lease holds; then the dead-letter hook.
//!
//! The completion is the executor's [`Recorder`]'s: `complete` for a plain executor,
//! `complete_with` and the handler's writes for a transactional one. Only what follows from
//! that differs: a transactional completion can be refused as a whole (a write's condition, bad
//! writes), and a result that cannot be stored there means nothing happened yet.
//!
//! Re-sending is all it takes after an ambiguous reply: a store answers `Ok` to a finishing
//! transition repeated with the same token and the same arguments after it took effect
//! ([`machine::finish`](idem_core::machine::finish)), so a retry whose first
//! try did land is accepted, and `LeaseLost` really means another worker owns the key now.

use std::borrow::Cow;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use bytes::Bytes;
use futures::future::Either;
use serde::Serialize;
use tokio::time::Instant;

use super::execute::{Leased, panic_message};
use crate::Executor;
use crate::codec::Codec;
use crate::dead_letter::DeadLetter;
use crate::error::{ExecutorError, StoreStage};
use crate::metric_names::Counter;
use crate::outcome::{CommitRefusal, HandlerFailure, Outcome};
use crate::transactional::Recorder;
use idem_core::{Error, FailureKind, fit_text};

/// How long the release of a lease whose transactional completion found the store not set up
/// may take.
const NOT_SET_UP_RELEASE: Duration = Duration::from_secs(5);

/// First delay between the tries of a completion or failure record on `Unavailable`.
const RECORD_RETRY_DELAY: Duration = Duration::from_millis(10);
/// Longest delay between those tries (capped further at a tenth of the lease).
const RECORD_MAX_DELAY: Duration = Duration::from_secs(1);

/// A failure to record.
pub(super) struct Failure<T> {
    /// The error text, not yet made storable.
    error: String,
    kind: FailureKind,
    panicked: bool,
    /// The handler's value, for [`FailureKind::ResultNotStored`]: what an un-deduplicated
    /// outcome reports when the store fails open.
    value: Option<T>,
    /// Why a transactional commit was refused, reported as [`Outcome::NotCommitted`].
    refusal: Option<CommitRefusal>,
}

impl<T> Failure<T> {
    /// The handler returned an error of this kind.
    pub(super) fn handler(error: String, kind: FailureKind) -> Self {
        Self {
            error,
            kind,
            panicked: false,
            value: None,
            refusal: None,
        }
    }

    /// The handler panicked (recorded as retryable).
    pub(super) fn panicked(error: String) -> Self {
        Self {
            error,
            kind: FailureKind::Retryable,
            panicked: true,
            value: None,
            refusal: None,
        }
    }

    /// The handler succeeded with `value` but its result cannot be stored, for `detail`.
    fn not_stored(detail: String, value: T) -> Self {
        Self {
            error: detail,
            kind: FailureKind::ResultNotStored,
            panicked: false,
            value: Some(value),
            refusal: None,
        }
    }

    /// A transactional commit refused as a whole, recorded as `kind`.
    fn not_committed(refusal: CommitRefusal, kind: FailureKind) -> Self {
        Self {
            error: format!("nothing committed: {refusal}"),
            kind,
            panicked: false,
            value: None,
            refusal: Some(refusal),
        }
    }
}

impl<C: Codec, R: Recorder> Executor<C, R> {
    /// Encodes and records what the handler returned: its result (and, on a transactional
    /// executor, its writes in the same atomic operation).
    pub(super) async fn complete<T: Serialize>(
        &self,
        leased: &Leased<'_>,
        returned: R::Returns<T>,
    ) -> Result<Outcome<T>, ExecutorError> {
        let inner = &self.inner;
        let (value, writes) = R::split(returned);
        // A `Serialize` that panics is the handler's code too: caught as the handler's own
        // panics are, it is a result that does not encode (in a batch, unwinding would drop
        // the other messages' handlers mid-effect).
        let encoded =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.codec.encode(&value)))
                .unwrap_or_else(|panic| {
                    Err(format!(
                        "serializing the result panicked: {}",
                        panic_message(&*panic)
                    )
                    .into())
                });
        let bytes = match encoded {
            Ok(bytes) if bytes.len() <= inner.max_result_len => Bytes::from(bytes),
            Ok(bytes) => {
                let detail = format!(
                    "the result of {} bytes is over the limit of {} bytes",
                    bytes.len(),
                    inner.max_result_len
                );
                return Box::pin(self.result_not_stored(leased, detail, value)).await;
            }
            Err(e) => {
                let detail = format!("the result does not encode: {e}");
                return Box::pin(self.result_not_stored(leased, detail, value)).await;
            }
        };
        let retention = inner.config.retention;
        let recorded = self
            .record_with_retry(leased, || match leased.records {
                // A transactional completion carries its writes: it has no batched form.
                Some(queue) if !R::TRANSACTIONAL => {
                    Either::Left(queue.complete(leased.lease(), bytes.clone()))
                }
                _ => Either::Right(inner.recorder.complete(
                    &inner.store,
                    leased.lease(),
                    bytes.clone(),
                    retention,
                    writes.clone(),
                )),
            })
            .await;
        match recorded {
            Ok(()) => Ok(Outcome::Executed(value)),
            Err(e) if e.is_lease_lost() => {
                tracing::warn!(error = %e, "completion refused: the lease was lost");
                Ok(self.lease_lost())
            }
            // Transactional only: refused as a whole, nothing written, the lease still held.
            Err(Error::EffectRefused { index, reason, .. }) => {
                let refusal = CommitRefusal::EffectRefused { index, reason };
                let kind = inner.config.effect_refused.kind();
                Box::pin(self.not_committed(leased, refusal, kind)).await
            }
            Err(Error::InvalidInput {
                field: "writes",
                reason,
            }) => {
                let refusal = CommitRefusal::InvalidWrites { reason };
                Box::pin(self.not_committed(leased, refusal, FailureKind::Terminal)).await
            }
            Err(e) => {
                if R::TRANSACTIONAL && matches!(e, Error::NotSetUp { .. }) {
                    self.give_back_not_set_up(leased, &e).await;
                }
                let key = leased.lease().key.clone();
                Box::pin(
                    self.store_error(StoreStage::Complete, e, &key, |reason| async move {
                        Outcome::NotDeduplicated {
                            result: Ok(value),
                            reason,
                            retry_after: inner.config.retry_delay,
                        }
                    }),
                )
                .await
            }
        }
    }

    /// A transactional completion refused because the store is not set up for it (a table its
    /// writes name is missing) wrote nothing, which is what `NotSetUp` promises, and the lease
    /// is still held: it is given back, not counted, so that a redelivery once the table exists
    /// runs the handler again as this same attempt. Left to expire, the lease counted a crash
    /// at each redelivery, until the key was dead-lettered as exhausted with the cause lost.
    async fn give_back_not_set_up(&self, leased: &Leased<'_>, e: &Error) {
        let lease = leased.lease();
        let release = tokio::time::timeout(NOT_SET_UP_RELEASE, self.inner.store.release(lease));
        let why =
            "the completion's writes need what the store does not have set up: nothing committed";
        match release.await {
            Ok(Ok(())) => {
                tracing::warn!(key = %lease.key, error = %e, "{why}, lease released (not counted)");
            }
            Ok(Err(release)) => {
                tracing::warn!(key = %lease.key, error = %e, %release, "{why}; the release failed, so the lease expires and the next attempt counts it as a crash");
            }
            Err(_) => {
                tracing::warn!(key = %lease.key, error = %e, "{why}; the release timed out, so the lease expires and the next attempt counts it as a crash");
            }
        }
    }

    /// A transactional commit was refused as a whole: nothing is written and the lease is still
    /// held, so the failure is recorded as `kind` and reported as [`Outcome::NotCommitted`] (or
    /// [`Outcome::Exhausted`] when it was the last attempt of a retryable kind).
    async fn not_committed<T>(
        &self,
        leased: &Leased<'_>,
        refusal: CommitRefusal,
        kind: FailureKind,
    ) -> Result<Outcome<T>, ExecutorError> {
        tracing::warn!(
            refusal = refusal.name(),
            %refusal,
            kind = kind.name(),
            "the store refused the handler's writes: nothing committed, recording the failure"
        );
        self.record_failure(leased, Failure::not_committed(refusal, kind))
            .await
    }

    /// The handler succeeded but its result cannot be stored.
    ///
    /// Plain executor: the handler's effect happened (outside the store), so the key is recorded
    /// with the failure kind [`FailureKind::ResultNotStored`] (terminal: the handler must never
    /// run again) and the outcome is [`Outcome::ResultNotStored`].
    ///
    /// Transactional executor: the effect is the writes, which commit only with the result, so
    /// nothing has happened yet: the writes are not sent, the key is recorded as a terminal
    /// failure and the outcome is [`Outcome::NotCommitted`] with
    /// [`CommitRefusal::ResultNotStorable`].
    async fn result_not_stored<T>(
        &self,
        leased: &Leased<'_>,
        detail: String,
        value: T,
    ) -> Result<Outcome<T>, ExecutorError> {
        if R::TRANSACTIONAL {
            let refusal = CommitRefusal::ResultNotStorable { reason: detail };
            return self
                .not_committed(leased, refusal, FailureKind::Terminal)
                .await;
        }
        tracing::error!(
            %detail,
            "the handler succeeded but its result cannot be stored: recording it as not stored"
        );
        self.record_failure(leased, Failure::not_stored(detail, value))
            .await
    }

    /// Records a failure and reports it: [`Outcome::Retry`], [`Outcome::Exhausted`] (calling the
    /// dead-letter hook), [`Outcome::Failed`], [`Outcome::ResultNotStored`] or
    /// [`Outcome::NotCommitted`].
    pub(super) async fn record_failure<T>(
        &self,
        leased: &Leased<'_>,
        failure: Failure<T>,
    ) -> Result<Outcome<T>, ExecutorError> {
        let inner = &self.inner;
        let Failure {
            error,
            kind,
            panicked,
            value,
            refusal,
        } = failure;
        // Whatever the handler said, the failure must be storable: NUL escaped, cut to the limit.
        let error = match fit_text(&error, inner.max_error_len) {
            Cow::Borrowed(_) => error,
            Cow::Owned(fitted) => fitted,
        };
        let retention = inner.config.retention;
        let record = |error: &str| {
            let error = error.to_owned();
            async move {
                self.record_with_retry(leased, || match leased.records {
                    Some(queue) => Either::Left(queue.fail(leased.lease(), &error, kind)),
                    None => {
                        Either::Right(inner.store.fail(leased.lease(), &error, kind, retention))
                    }
                })
                .await
            }
        };
        let mut recorded = record(&error).await;
        let mut error = error;
        if let Err(Error::InvalidInput { field: "error", .. }) = &recorded {
            // The store cannot hold a character of the text (a PostgreSQL database whose
            // encoding lacks it): every retry would be refused the same way, and the failure
            // must be recorded, so it is written again in ASCII.
            error = idem_core::fit_text_ascii(&error, inner.max_error_len);
            tracing::warn!(%error, "the store refused the failure's text: recorded in ASCII");
            recorded = record(&error).await;
        }
        let lease = leased.lease();
        match recorded {
            Ok(()) => Ok(match (kind, refusal) {
                (FailureKind::Retryable, _) if lease.attempt >= inner.config.max_attempts => {
                    self.dead_letter(lease, &error, panicked);
                    Outcome::Exhausted {
                        attempts: lease.attempt,
                        last_error: Some(error),
                    }
                }
                (kind, Some(refusal)) => Outcome::NotCommitted {
                    refusal,
                    kind,
                    attempt: lease.attempt,
                    error,
                    retry_after: inner.config.retry_after(lease.attempt),
                },
                (FailureKind::Retryable, None) => {
                    self.count(Counter::RetryableFailures);
                    Outcome::Retry {
                        attempt: lease.attempt,
                        error,
                        panicked,
                        retry_after: inner.config.retry_after(lease.attempt),
                    }
                }
                (FailureKind::ResultNotStored, None) => Outcome::ResultNotStored { error },
                // `Terminal` (and any later terminal kind).
                (_, None) => Outcome::Failed { error },
            }),
            Err(e) if e.is_lease_lost() => {
                tracing::warn!(error = %e, "failure record refused: the lease was lost");
                Ok(self.lease_lost())
            }
            Err(e) => {
                let key = lease.key.clone();
                self.store_error(StoreStage::Fail, e, &key, |reason| async move {
                    Outcome::NotDeduplicated {
                        // Failing open: a result that was not stored still succeeded.
                        result: value.ok_or(HandlerFailure {
                            error,
                            terminal: !kind.is_retryable(),
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

    /// Calls the dead-letter hook, if any, for a failure that used the last attempt of `lease`
    /// and counts it (`idem_dead_lettered`); a panicking hook is caught and logged.
    ///
    /// The executor calls it itself; a component that records failures outside this
    /// executor's run loop on its configuration (the PostgreSQL in-transaction mode, say)
    /// calls it so that the hook fires there too.
    pub fn notify_dead_letter(&self, lease: &idem_core::Lease, error: &str, panicked: bool) {
        self.dead_letter(lease, error, panicked);
    }

    /// Calls the dead-letter hook, if any, for the failure that used the last attempt.
    fn dead_letter(&self, lease: &idem_core::Lease, error: &str, panicked: bool) {
        let Some(hook) = &self.inner.dead_letter else {
            return;
        };
        self.count(Counter::DeadLettered);
        let event = DeadLetter {
            key: lease.key.clone(),
            attempts: lease.attempt,
            last_error: error.to_owned(),
            panicked,
        };
        // A panicking hook must not take the caller's task (and consumer loop) down.
        if let Err(payload) = std::panic::catch_unwind(AssertUnwindSafe(|| hook(&event))) {
            tracing::error!(
                key = event.key.id(),
                panic = %panic_message(&*payload),
                "the dead-letter hook panicked; carrying on"
            );
        }
    }

    /// Sends a completion or failure record, and sends it again on `Unavailable` with backoff
    /// while the lease holds: until the next try would come after the local lease deadline (or
    /// after a whole lease TTL spent retrying, when heartbeats keep moving that deadline on).
    /// The lease heartbeats meanwhile. Gives the last answer.
    ///
    /// No read-back: a try that took effect with its reply lost is answered `Ok` when sent
    /// again (the replay rule), and `LeaseLost` is final.
    async fn record_with_retry<Op, Fut>(&self, leased: &Leased<'_>, mut op: Op) -> Result<(), Error>
    where
        Op: FnMut() -> Fut,
        Fut: Future<Output = Result<(), Error>>,
    {
        match op().await {
            // Boxed: the retry loop stays out of the state of every call that needs none.
            Err(e) if e.is_retryable() => Box::pin(self.record_again(leased, op, e)).await,
            other => other,
        }
    }

    /// The retries of [`record_with_retry`](Self::record_with_retry) after a first `Unavailable`.
    async fn record_again<Op, Fut>(
        &self,
        leased: &Leased<'_>,
        mut op: Op,
        first: Error,
    ) -> Result<(), Error>
    where
        Op: FnMut() -> Fut,
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
        let mut tries = 1;
        let mut last = first;
        loop {
            // Keep the lease while the store is away.
            leased.heartbeat();
            let delay = delays.next().unwrap_or(max_delay).min(max_delay);
            if Instant::now() + delay >= leased.state.deadline().min(budget) {
                tracing::warn!(
                    tries,
                    error = %last,
                    "giving up recording: the lease is about to expire"
                );
                return Err(last);
            }
            tracing::debug!(tries, error = %last, ?delay, "record failed; sending it again");
            tokio::time::sleep(delay).await;
            tries += 1;
            match op().await {
                Err(e) if e.is_retryable() => last = e,
                other => return other,
            }
        }
    }
}
