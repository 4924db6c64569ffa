#![doc = include_str!("../README.md")]

pub mod broker;
mod codec;
mod config;
mod context;
mod dead_letter;
mod error;
mod exact_json;
mod fingerprint_policy;
mod handler;
mod heartbeat;
mod key_source;
mod lease;
mod message;
pub mod metric_names;
mod outcome;
mod run;
mod transactional;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use metrics::SharedString;

pub use codec::{Codec, JsonCodec};
pub use config::{
    BatchConfig, ConfigError, DEFAULT_BATCH_CONCURRENCY, DEFAULT_LEASE_TTL, DEFAULT_MAX_ATTEMPTS,
    DEFAULT_RETENTION, DEFAULT_RETRY_DELAY, EffectRefusedPolicy, ExecutorConfig, InProgressWait,
    MissingKeyPolicy, StoreErrorPolicy,
};
pub use context::{HandlerContext, HandlerError};
pub use dead_letter::{DeadLetter, DeadLetterReason};
pub use error::{BatchError, ExecutorError, StoreStage};
pub use fingerprint_policy::FingerprintPolicy;
pub use handler::Handler;
pub use key_source::{COMPOSITE_SEPARATOR, DEFAULT_KEY_HEADER, KeySource};
pub use message::{Message, RawMessage};
pub use outcome::{BrokerAction, CommitRefusal, HandlerFailure, Outcome, PassThroughReason};
pub use transactional::{Commit, Plain, Recorder, Transactional};

use idem_core::{DynStore, Namespace, TransactionalStore};

type DeadLetterHook = Arc<dyn Fn(&DeadLetter) + Send + Sync>;

/// The middleware around a message handler. Cheap to clone (shared state behind an `Arc`).
///
/// Build it with [`Executor::builder`] (or [`Executor::new`]); run messages with
/// [`Executor::run`]. See the [crate docs](crate) for the semantics.
///
/// `R` is how a success is recorded: [`Plain`] (the default: the handler returns its result `T`)
/// or [`Transactional<S>`] (the handler returns a [`Commit`] of its result and the writes to
/// commit with it): see [`TransactionalExecutor`].
pub struct Executor<C = JsonCodec, R = Plain> {
    inner: Arc<Inner<C, R>>,
}

/// An [`Executor`] whose handlers return a [`Commit`] (their result plus the writes to commit
/// with it), recorded with [`TransactionalStore::complete_with`] on the store `S`: the effect
/// and the completion commit together or not at all. Build it with
/// [`Executor::transactional`] or [`Executor::transactional_builder`]; see
/// [the crate docs](crate#transactional-effects).
pub type TransactionalExecutor<S, C = JsonCodec> = Executor<C, Transactional<S>>;

struct Inner<C, R> {
    store: DynStore,
    recorder: R,
    config: ExecutorConfig,
    namespace: Namespace,
    owner: String,
    heartbeat: Duration,
    max_result_len: usize,
    max_error_len: usize,
    record_batch: usize,
    codec: C,
    dead_letter: Option<DeadLetterHook>,
    counters: metric_names::Counters,
    heartbeats: Arc<heartbeat::Heartbeats>,
}

impl<C, R> Clone for Executor<C, R> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<C, R: Recorder> fmt::Debug for Executor<C, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Executor")
            .field("store", &self.inner.store.name())
            .field("transactional", &R::TRANSACTIONAL)
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
            recorder: Plain,
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

impl<S> Executor<JsonCodec, Transactional<S>>
where
    S: TransactionalStore,
    S::Writes: Clone,
{
    /// A builder of a [`TransactionalExecutor`] over `store`, with the default configuration
    /// (which needs a namespace). The store is given once: the records and the handler's writes
    /// go to the same store.
    pub fn transactional_builder(store: Arc<S>) -> ExecutorBuilder<JsonCodec, Transactional<S>> {
        ExecutorBuilder {
            store: store.clone(),
            recorder: Transactional::new(store),
            config: ExecutorConfig::default(),
            codec: JsonCodec,
            dead_letter: None,
        }
    }

    /// A [`TransactionalExecutor`] with this configuration, the JSON codec and no dead-letter
    /// hook.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the bad field; besides the checks of [`Executor::new`], a
    /// transactional executor refuses [`MissingKeyPolicy::PassThrough`] and
    /// [`StoreErrorPolicy::FailOpen`] (running the handler without the store would drop its
    /// writes).
    pub fn transactional(store: Arc<S>, config: ExecutorConfig) -> Result<Self, ConfigError> {
        Self::transactional_builder(store).config(config).build()
    }
}

impl<C, S: TransactionalStore> Executor<C, Transactional<S>> {
    /// The transactional store, with its own type (the same store as [`store`](Self::store)).
    pub fn transactional_store(&self) -> &Arc<S> {
        self.inner.recorder.store()
    }
}

impl<C, R> Executor<C, R> {
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

    /// The store (records, heartbeats; for a [`TransactionalExecutor`], also the handler's
    /// writes).
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
pub struct ExecutorBuilder<C = JsonCodec, R = Plain> {
    store: DynStore,
    recorder: R,
    config: ExecutorConfig,
    codec: C,
    dead_letter: Option<DeadLetterHook>,
}

impl<C: fmt::Debug, R: Recorder> fmt::Debug for ExecutorBuilder<C, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecutorBuilder")
            .field("store", &self.store.name())
            .field("transactional", &R::TRANSACTIONAL)
            .field("config", &self.config)
            .field("codec", &self.codec)
            .field("dead_letter", &self.dead_letter.is_some())
            .finish()
    }
}

impl<C: Codec, R: Recorder> ExecutorBuilder<C, R> {
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
    pub fn codec<C2: Codec>(self, codec: C2) -> ExecutorBuilder<C2, R> {
        ExecutorBuilder {
            store: self.store,
            recorder: self.recorder,
            config: self.config,
            codec,
            dead_letter: self.dead_letter,
        }
    }

    /// Sets the dead-letter hook: called once per key, by the call whose recorded failure used
    /// the last attempt (see [the module docs](crate#dead-lettering)). It runs inline:
    /// keep it short and non-blocking.
    pub fn on_dead_letter(mut self, hook: impl Fn(&DeadLetter) + Send + Sync + 'static) -> Self {
        self.dead_letter = Some(Arc::new(hook));
        self
    }

    /// Validates the configuration against the store's limits and builds the executor.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first bad field. A transactional builder also refuses
    /// [`MissingKeyPolicy::PassThrough`] and [`StoreErrorPolicy::FailOpen`]: running the handler
    /// without the store would drop its writes.
    pub fn build(self) -> Result<Executor<C, R>, ConfigError> {
        let v = self.config.validated(&self.store.limits())?;
        R::check_config(&self.config)?;
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
                recorder: self.recorder,
                config: self.config,
                namespace: v.namespace,
                owner: v.owner,
                heartbeat: v.heartbeat,
                max_result_len: v.max_result_len,
                max_error_len: v.max_error_len,
                record_batch: v.record_batch,
                codec: self.codec,
                dead_letter: self.dead_letter,
                counters: metric_names::Counters::new(&ns_label),
                heartbeats,
            }),
        })
    }
}
