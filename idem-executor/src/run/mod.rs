//! Running one message, split by concern:
//!
//! - this module: the entry points ([`Executor::run`], [`Executor::run_with_key`],
//!   [`Executor::handle`]), key and fingerprint, the acquire outcome, pass-through;
//! - [`batch`]: many messages at once ([`Executor::run_batch`]): one acquire call, bounded
//!   concurrency, records grouped into batched store calls;
//! - [`wait`]: the acquire with the optional bounded wait while another worker holds the key;
//! - [`execute`]: the handler under its lease, with panics caught, heartbeats and cancellation;
//! - [`record`]: completion and failure records, re-sent while the lease holds, and the
//!   dead-letter hook; the completion itself is the executor's [`Recorder`]'s (plain or
//!   transactional), the only step that differs between the two;
//! - [`store_errors`]: the fail-closed / fail-open policy;
//! - [`observe`]: the tracing span and the metrics.

mod batch;
mod execute;
mod observe;
mod record;
mod store_errors;
mod wait;

use std::future::Future;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::time::Instant;
use tracing::{Instrument, Span};

use crate::Executor;
use crate::codec::Codec;
use crate::config::MissingKeyPolicy;
use crate::context::{HandlerContext, HandlerError};
use crate::error::{ExecutorError, StoreStage};
use crate::handler::Handler;
use crate::key_source::PayloadJson;
use crate::message::Message;
use crate::metric_names::Counter;
use crate::outcome::{HandlerFailure, Outcome, PassThroughReason};
use crate::transactional::Recorder;
use execute::Handled;
use idem_core::{AcquireOutcome, AcquireRequest, FailureKind, Fingerprint, IdempotencyKey};

/// A message's key and fingerprint, or `None` when it has no key.
type Prepared = Result<Option<(IdempotencyKey, Option<Fingerprint>)>, ExecutorError>;

impl<C: Codec, R: Recorder> Executor<C, R> {
    /// Processes one message: see the [crate docs](crate).
    ///
    /// `handler` runs at most once per call, and only when this call acquired the key (or the
    /// message passes through un-deduplicated by policy). Its `Ok` value is stored through the
    /// codec and returned as [`Outcome::Executed`]; duplicates get it back decoded as
    /// [`Outcome::Replayed`]. The handler returns [`R::Returns<T>`](Recorder::Returns): the
    /// result `T` itself on a plain executor, a [`Commit`](crate::Commit) of the result and its
    /// writes on a [`TransactionalExecutor`](crate::TransactionalExecutor) (which stores the
    /// result and applies the writes in one atomic operation).
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
        Fut: Future<Output = Result<R::Returns<T>, HandlerError>>,
        T: Serialize + DeserializeOwned,
    {
        let span = self.span();
        let prepared = {
            let _entered = span.enter();
            self.prepare(msg)
        };
        self.process(prepared, handler, span).await
    }

    /// Like [`run`](Self::run) with a registered [`Handler`], which is given the message itself
    /// (moved in once its key and fingerprint are read) besides the context.
    ///
    /// # Errors
    /// As [`run`](Self::run).
    pub async fn handle<M, H, T>(&self, msg: M, handler: &H) -> Result<Outcome<T>, ExecutorError>
    where
        M: Message,
        H: Handler<M, R::Returns<T>>,
        T: Serialize + DeserializeOwned,
    {
        let span = self.span();
        let prepared = {
            let _entered = span.enter();
            self.prepare(&msg)
        };
        self.process(prepared, move |ctx| handler.call(msg, ctx), span)
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
        Fut: Future<Output = Result<R::Returns<T>, HandlerError>>,
        T: Serialize + DeserializeOwned,
    {
        let span = self.span();
        let prepared = self
            .inner
            .namespace
            .key(id)
            .map(|key| Some((key, fingerprint)))
            .map_err(ExecutorError::InvalidKey);
        self.process(prepared, handler, span).await
    }

    /// Key and fingerprint, synchronously (the message is not held across an await).
    fn prepare<M: Message>(&self, msg: &M) -> Prepared {
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

    /// Runs a prepared message inside `span`, then records the outcome on it.
    fn process<F, Fut, T>(
        &self,
        prepared: Prepared,
        handler: F,
        span: Span,
    ) -> impl Future<Output = Result<Outcome<T>, ExecutorError>>
    where
        F: FnOnce(HandlerContext) -> Fut,
        Fut: Future<Output = Result<R::Returns<T>, HandlerError>>,
        T: Serialize + DeserializeOwned,
    {
        let current = span.clone();
        self.process_in(prepared, handler, current).instrument(span)
    }

    async fn process_in<F, Fut, T>(
        &self,
        prepared: Prepared,
        handler: F,
        span: Span,
    ) -> Result<Outcome<T>, ExecutorError>
    where
        F: FnOnce(HandlerContext) -> Fut,
        Fut: Future<Output = Result<R::Returns<T>, HandlerError>>,
        T: Serialize + DeserializeOwned,
    {
        let result = match prepared {
            Ok(Some((key, fingerprint))) => self.run_keyed(key, fingerprint, handler, &span).await,
            Ok(None) => self.unkeyed(handler).await,
            Err(e) => Err(e),
        };
        self.observe(&result, &span);
        result
    }

    /// A message without a key: the missing-key policy.
    async fn unkeyed<F, Fut, T>(&self, handler: F) -> Result<Outcome<T>, ExecutorError>
    where
        F: FnOnce(HandlerContext) -> Fut,
        Fut: Future<Output = Result<R::Returns<T>, HandlerError>>,
    {
        match self.inner.config.missing_key {
            MissingKeyPolicy::PassThrough => {
                tracing::warn!("message without an idempotency key passed through un-deduplicated");
                Ok(Box::pin(self.pass_through(None, PassThroughReason::MissingKey, handler)).await)
            }
            MissingKeyPolicy::Reject => Err(ExecutorError::MissingKey),
        }
    }

    /// The acquire request of a key.
    fn request(&self, key: IdempotencyKey, fingerprint: Option<Fingerprint>) -> AcquireRequest {
        let inner = &self.inner;
        AcquireRequest::new(key, inner.owner.clone())
            .with_fingerprint(fingerprint)
            .with_lease_ttl(inner.config.lease_ttl)
            .with_max_attempts(inner.config.max_attempts)
    }

    /// Acquires the key and acts on what the store answered.
    async fn run_keyed<F, Fut, T>(
        &self,
        key: IdempotencyKey,
        fingerprint: Option<Fingerprint>,
        handler: F,
        span: &Span,
    ) -> Result<Outcome<T>, ExecutorError>
    where
        F: FnOnce(HandlerContext) -> Fut,
        Fut: Future<Output = Result<R::Returns<T>, HandlerError>>,
        T: Serialize + DeserializeOwned,
    {
        span.record("key", key.id());
        let req = self.request(key, fingerprint);
        let acquired = self.acquire(&req).await;
        self.acquired(req, acquired, handler, span).await
    }

    /// Acts on what the store answered to `req` (after the optional in-progress wait): runs the
    /// handler on a lease, or reports why not.
    async fn acquired<F, Fut, T>(
        &self,
        req: AcquireRequest,
        acquired: Result<(AcquireOutcome, Instant), idem_core::Error>,
        handler: F,
        span: &Span,
    ) -> Result<Outcome<T>, ExecutorError>
    where
        F: FnOnce(HandlerContext) -> Fut,
        Fut: Future<Output = Result<R::Returns<T>, HandlerError>>,
        T: Serialize + DeserializeOwned,
    {
        let inner = &self.inner;
        let (acquired, sent) = match acquired {
            Ok(acquired) => acquired,
            // The store cannot hold this key (a PostgreSQL database whose encoding lacks one
            // of its characters, ...): every retry would be refused the same way, so it is an
            // invalid key whatever the store-error policy, as one the namespace refused.
            Err(e @ idem_core::Error::InvalidInput { field: "key", .. }) => {
                tracing::warn!(error = %e, key = req.key.id(), "the store refused the key");
                return Err(ExecutorError::InvalidKey(e));
            }
            Err(e) => {
                let key = req.key.clone();
                // Boxed: it holds a second copy of the handler's future.
                return Box::pin(
                    self.store_error(StoreStage::Acquire, e, &req.key, |reason| {
                        self.pass_through(Some(key), reason, handler)
                    }),
                )
                .await;
            }
        };
        match acquired {
            AcquireOutcome::Acquired { lease, takeover } => {
                drop(req);
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
            AcquireOutcome::Failed {
                error,
                kind: FailureKind::ResultNotStored,
            } => Ok(Outcome::ResultNotStored { error }),
            // `Terminal`, or a kind this version does not know: every failure replayed by the
            // store is final.
            AcquireOutcome::Failed { error, .. } => Ok(Outcome::Failed { error }),
            // An outcome this version does not know: nothing ran and nothing is held, so the
            // message is not lost by a retry.
            other => Err(ExecutorError::Store {
                stage: StoreStage::Acquire,
                handler_ran: false,
                retry_after: inner.config.retry_delay,
                source: idem_core::Error::backend(
                    inner.store.name(),
                    format!("unknown acquire outcome {:?}", other.name()),
                ),
            }),
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
        Fut: Future<Output = Result<R::Returns<T>, HandlerError>>,
    {
        let result = match execute::catching(handler, HandlerContext::pass_through(key)).await {
            Handled::Value(returned) => {
                // Only a plain executor passes messages through (a transactional one refuses the
                // policies that would), so there are no writes to drop here.
                debug_assert!(!R::TRANSACTIONAL, "a transactional executor passed through");
                Ok(R::split(returned).0)
            }
            Handled::Error(e) => Err(HandlerFailure {
                error: e.message(),
                terminal: e.is_terminal(),
                panicked: false,
            }),
            Handled::Panicked(message) => {
                self.count(Counter::Panics);
                Err(HandlerFailure {
                    error: execute::panicked(&message),
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
}
