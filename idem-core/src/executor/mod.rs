//! The executor: the middleware a consumer wraps its message handler with.
//!
//! Per message, [`Executor::run`] extracts the key ([`KeySource`]), fingerprints the payload
//! ([`FingerprintPolicy`]), acquires the key, runs the handler with a [`HandlerContext`] (key,
//! attempt, fencing token) while heartbeating in the background, and completes or fails the key.
//! It reports an [`Outcome`] that [`Outcome::action`] maps to a [`BrokerAction`]:
//!
//! ```no_run
//! use std::sync::Arc;
//! use idem_core::MemoryStore;
//! use idem_core::executor::{BrokerAction, Executor, ExecutorConfig, HandlerError, RawMessage};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let executor = Executor::builder(Arc::new(MemoryStore::new()))
//!     .config(ExecutorConfig::new("payments"))
//!     .on_dead_letter(|dl| eprintln!("poison {}: {}", dl.key, dl.last_error))
//!     .build()?;
//!
//! let msg = RawMessage::new(r#"{"amount": 10}"#).with_header("idempotency-key", "tx-1");
//! let result = executor
//!     .run(&msg, |ctx| async move {
//!         // fence downstream writes with ctx.token()
//!         Ok::<_, HandlerError>(format!("charged with token {:?}", ctx.token()))
//!     })
//!     .await;
//! match BrokerAction::of(&result) {
//!     BrokerAction::Ack => { /* commit / ack / delete */ }
//!     BrokerAction::Retry { after } => { /* redeliver after `after` */ let _ = after; }
//!     BrokerAction::DeadLetter { reason } => { /* publish to the DLQ, then ack */ let _ = reason; }
//!     _ => {}
//! }
//! # Ok(()) }
//! ```
//!
//! # Decisions
//!
//! **Heartbeats.** A handler that finishes at its first poll never needs a heartbeat. Otherwise
//! its lease is registered with the executor's heartbeat task, which extends it every heartbeat
//! interval until the handler finishes. That task is shared by all the messages in flight of one
//! executor (a task and a timer per message would cost about a microsecond each); it is spawned
//! on the Tokio runtime of the first handler that needs it, runs apart from the handlers (so on a
//! multi-threaded runtime it keeps beating while a handler blocks its worker thread), extends
//! due leases concurrently, and ends when the executor is dropped. A round of extensions waits
//! for all of them, so a store call that hangs until the store's own timeout delays the other
//! heartbeats by as much: keep the interval well below the lease (the default is a third; the
//! configuration refuses more than half, so that a failed heartbeat is tried again before the
//! lease runs out). A heartbeat that fails with a store error is logged, counted and retried at
//! the next interval. The lease stays registered until the completion or failure is recorded
//! (see [store errors](#store-errors)).
//!
//! **Local lease deadline.** Each lease in flight has a local deadline: the instant the acquire,
//! or the last *successful* heartbeat, was *sent*, plus the lease TTL, minus a safety margin of a
//! tenth of the lease (for clock drift between this process and the store, and the time a
//! request takes to reach it). While the store is unreachable the heartbeats fail and the
//! deadline stays put; when it passes, the store may have let the lease expire and another
//! consumer may have taken the key over, so the handler is cancelled exactly as for a lost lease
//! (below). Handlers read it with [`HandlerContext::lease_deadline`], to check before an
//! irreversible action that enough of the lease is left.
//!
//! **Lost lease.** When a heartbeat reports [`LeaseLost`](crate::Error::LeaseLost), or the local
//! lease deadline passes while the handler runs, the handler's
//! [`CancellationToken`](tokio_util::sync::CancellationToken) is cancelled and its future
//! dropped; nothing is recorded and the outcome is [`Outcome::LeaseLost`]. A completion or
//! failure refused by the store's fencing gives the same outcome.
//!
//! **Panics.** A panic in the handler is caught (`catch_unwind` on its future), recorded as a
//! *retryable* failure (`handler panicked: <message>`, so the key is acquirable again and the
//! attempt is counted) and *reported*, not re-raised: the outcome is [`Outcome::Retry`] with
//! `panicked: true` (or [`Outcome::Exhausted`] on the last attempt). A consumer loop therefore
//! survives a poison message that panics; the panic still goes through the panic hook (it is
//! printed as usual) and the `idem_panics` counter. Resume it yourself if you prefer to crash.
//!
//! **Error messages** longer than the store's
//! [`max_error_len`](crate::Limits::max_error_len) are truncated to it, on a UTF-8 character
//! boundary, rather than failing the record.
//!
//! **Results** are encoded by the [`Codec`] ([`JsonCodec`] by default) and stored on
//! completion; a replayed result that does not decode is [`ExecutorError::Decode`]. A result
//! over the size limit, or one that does not encode, is recorded as a *terminal* failure (the
//! handler's effect happened, and running it again would repeat it) whose error starts with
//! `result not stored (the handler's effect was applied): `, and reported as
//! [`Outcome::ResultNotStored`], not [`Outcome::Failed`]: the work did *not* fail. Later
//! deliveries get [`Outcome::ResultNotStored`] too (recognized by that error text). Its broker
//! action is [`BrokerAction::DeadLetter`] with the reason `result_not_stored: <error>`.
//!
//! # Dead-letter hook
//!
//! The hook set with [`ExecutorBuilder::on_dead_letter`] is called by the one call whose
//! recorded failure (or panic) used the last attempt: after the store accepted that failure,
//! which it does for the current token only, so at most one call in the whole fleet runs it per
//! key. Every later delivery gets [`Outcome::Exhausted`] without the hook. Two cases never call
//! it: the process dies between recording the failure and calling the hook, and the last attempt
//! *crashes* (its lease expires with no failure recorded; the store then answers `Exhausted` with
//! no error to every delivery, and no call can tell it is the first). Both still get
//! [`Outcome::Exhausted`], whose action is [`BrokerAction::DeadLetter`], at every delivery: use
//! the broker action for the dead-letter queue itself, and the hook for alerting. A panic in the
//! hook is caught and logged (at error level); the call carries on and returns its outcome.
//!
//! # Store errors
//!
//! By default ([`StoreErrorPolicy::FailClosed`]) a store error at acquire means the handler does
//! not run and the call returns [`ExecutorError::Store`]. Completion and failure records are
//! retried on [`Unavailable`](crate::Error::Unavailable) with exponential backoff (from 10 ms, at
//! most 1 s or a tenth of the lease) while the lease holds, heartbeating meanwhile: until the next
//! try would come after the local lease deadline, or after a whole lease TTL of retries. Then the
//! call gives up with the store error; the key stays in progress until its lease expires and a
//! redelivery takes it over. A record refused as `LeaseLost` after a retry is read back (the
//! earlier try may have taken effect with its reply lost); if that read fails, the outcome is its
//! store error (with `handler_ran`), not `LeaseLost`. With [`StoreErrorPolicy::FailOpen`] the
//! handler runs anyway and the outcome is [`Outcome::NotDeduplicated`].
//!
//! # Cancellation by the caller
//!
//! Dropping the future of [`Executor::run`] drops the handler and stops the heartbeat; the key
//! stays in progress until its lease expires (a crash, as far as the store knows).

mod codec;
mod config;
mod context;
mod error;
mod fingerprint_policy;
mod heartbeat;
mod key_source;
mod message;
pub mod metric_names;
mod outcome;
mod run;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use metrics::SharedString;

pub use codec::{Codec, JsonCodec};
pub use config::{
    ConfigError, DEFAULT_LEASE_TTL, DEFAULT_MAX_ATTEMPTS, DEFAULT_RETENTION, DEFAULT_RETRY_DELAY,
    ExecutorConfig, InProgressWait, MissingKeyPolicy, StoreErrorPolicy,
};
pub use context::{HandlerContext, HandlerError};
pub use error::{ExecutorError, StoreStage};
pub use fingerprint_policy::FingerprintPolicy;
pub use key_source::{COMPOSITE_SEPARATOR, DEFAULT_KEY_HEADER, KeySource};
pub use message::{Message, RawMessage};
pub use outcome::{BrokerAction, DeadLetter, HandlerFailure, Outcome, PassThroughReason};

use crate::key::Namespace;
use crate::store::DynStore;

type DeadLetterHook = Arc<dyn Fn(&DeadLetter) + Send + Sync>;

/// The middleware around a message handler. Cheap to clone (shared state behind an `Arc`).
///
/// Build it with [`Executor::builder`] (or [`Executor::new`]); run messages with
/// [`Executor::run`]. See the [module docs](self) for the semantics.
pub struct Executor<C = JsonCodec> {
    inner: Arc<Inner<C>>,
}

struct Inner<C> {
    store: DynStore,
    config: ExecutorConfig,
    namespace: Namespace,
    owner: String,
    heartbeat: Duration,
    max_result_len: usize,
    max_error_len: usize,
    codec: C,
    dead_letter: Option<DeadLetterHook>,
    ns_label: SharedString,
    heartbeats: Arc<heartbeat::Heartbeats>,
}

impl<C> Clone for Executor<C> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<C> fmt::Debug for Executor<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Executor")
            .field("store", &self.inner.store.name())
            .field("namespace", &self.inner.namespace)
            .field("owner", &self.inner.owner)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Executor<JsonCodec> {
    /// A builder over `store` with the default configuration (which needs a namespace).
    pub fn builder(store: DynStore) -> ExecutorBuilder<JsonCodec> {
        ExecutorBuilder {
            store,
            config: ExecutorConfig::default(),
            codec: JsonCodec,
            dead_letter: None,
        }
    }

    /// An executor with this configuration, the JSON codec and no dead-letter hook.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the bad field.
    pub fn new(store: DynStore, config: ExecutorConfig) -> Result<Self, ConfigError> {
        Self::builder(store).config(config).build()
    }
}

impl<C> Executor<C> {
    /// The configuration.
    pub fn config(&self) -> &ExecutorConfig {
        &self.inner.config
    }

    /// The validated namespace.
    pub fn namespace(&self) -> &Namespace {
        &self.inner.namespace
    }

    /// The owner id presented to the store.
    pub fn owner(&self) -> &str {
        &self.inner.owner
    }

    /// The heartbeat interval in force.
    pub fn heartbeat_interval(&self) -> Duration {
        self.inner.heartbeat
    }

    /// The largest encoded result stored.
    pub fn max_result_len(&self) -> usize {
        self.inner.max_result_len
    }

    /// The store.
    pub fn store(&self) -> &DynStore {
        &self.inner.store
    }

    /// The codec.
    pub fn codec(&self) -> &C {
        &self.inner.codec
    }
}

/// Builds an [`Executor`]; [`build`](Self::build) validates the configuration.
#[must_use]
pub struct ExecutorBuilder<C = JsonCodec> {
    store: DynStore,
    config: ExecutorConfig,
    codec: C,
    dead_letter: Option<DeadLetterHook>,
}

impl<C: fmt::Debug> fmt::Debug for ExecutorBuilder<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecutorBuilder")
            .field("store", &self.store.name())
            .field("config", &self.config)
            .field("codec", &self.codec)
            .field("dead_letter", &self.dead_letter.is_some())
            .finish()
    }
}

impl<C: Codec> ExecutorBuilder<C> {
    /// Replaces the whole configuration.
    pub fn config(mut self, config: ExecutorConfig) -> Self {
        self.config = config;
        self
    }

    /// Changes the configuration in place, e.g. `.configure(|c| c.with_max_attempts(3))`.
    pub fn configure(mut self, f: impl FnOnce(ExecutorConfig) -> ExecutorConfig) -> Self {
        self.config = f(self.config);
        self
    }

    /// Sets the codec of stored results.
    pub fn codec<C2: Codec>(self, codec: C2) -> ExecutorBuilder<C2> {
        ExecutorBuilder {
            store: self.store,
            config: self.config,
            codec,
            dead_letter: self.dead_letter,
        }
    }

    /// Sets the dead-letter hook: called once per key, by the call whose recorded failure used
    /// the last attempt (see [the module docs](crate::executor#dead-letter-hook)). It runs inline:
    /// keep it short and non-blocking.
    pub fn on_dead_letter(mut self, hook: impl Fn(&DeadLetter) + Send + Sync + 'static) -> Self {
        self.dead_letter = Some(Arc::new(hook));
        self
    }

    /// Validates the configuration against the store's limits and builds the executor.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first bad field.
    pub fn build(self) -> Result<Executor<C>, ConfigError> {
        let v = self.config.validated(&self.store.limits())?;
        let ns_label = SharedString::from(Arc::<str>::from(v.namespace.as_str()));
        let heartbeats = Arc::new(heartbeat::Heartbeats::new(
            self.store.clone(),
            self.config.lease_ttl,
            v.heartbeat,
            ns_label.clone(),
        ));
        Ok(Executor {
            inner: Arc::new(Inner {
                store: self.store,
                config: self.config,
                namespace: v.namespace,
                owner: v.owner,
                heartbeat: v.heartbeat,
                max_result_len: v.max_result_len,
                max_error_len: v.max_error_len,
                codec: self.codec,
                dead_letter: self.dead_letter,
                ns_label,
                heartbeats,
            }),
        })
    }
}
