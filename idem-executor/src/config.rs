//! Executor configuration and its validation.

use std::time::Duration;

use crate::fingerprint_policy::FingerprintPolicy;
use crate::key_source::KeySource;
use idem_core::Error;
use idem_core::FailureKind;
use idem_core::Namespace;
use idem_core::{Limits, check_lease_ttl, check_owner, check_retention};

/// Default lease: 30 s.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(30);
/// Default retention of finished records: 24 h. Keep it longer than the longest redelivery window
/// of the broker (for Kafka, how far back a consumer group may rewind).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 3600);
/// Default maximum attempts: 5.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// Default delay before a redelivery after a retryable failure, a lost lease or a store error: 1 s.
pub const DEFAULT_RETRY_DELAY: Duration = Duration::from_secs(1);

/// What to do with a message that has no idempotency key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKeyPolicy {
    /// Refuse it with [`ExecutorError::MissingKey`](crate::ExecutorError::MissingKey); the handler
    /// does not run (the default).
    #[default]
    Reject,
    /// Run the handler without deduplication, log a warning and report
    /// [`Outcome::NotDeduplicated`](crate::Outcome::NotDeduplicated). Refused by a
    /// [`TransactionalExecutor`](crate::TransactionalExecutor), whose writes commit only with a
    /// key's completion.
    PassThrough,
}

/// What to do when the store fails.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorPolicy {
    /// Fail closed: the handler does not run (or, after it ran, the error is reported) and the
    /// call returns [`ExecutorError::Store`](crate::ExecutorError::Store) (the default). For
    /// anything that moves money.
    #[default]
    FailClosed,
    /// Fail open: run the handler anyway, log a warning and report
    /// [`Outcome::NotDeduplicated`](crate::Outcome::NotDeduplicated). For non-critical consumers
    /// that prefer a duplicate effect to a stall. Refused by a
    /// [`TransactionalExecutor`](crate::TransactionalExecutor), whose writes commit only through
    /// the store.
    FailOpen,
}

/// What a [`TransactionalExecutor`](crate::TransactionalExecutor) records when the store refuses
/// the handler's writes because a condition of one of them failed
/// ([`Error::EffectRefused`](idem_core::Error::EffectRefused): nothing was written, the lease is
/// still held). The outcome is [`Outcome::NotCommitted`](crate::Outcome::NotCommitted) with
/// [`CommitRefusal::EffectRefused`](crate::CommitRefusal::EffectRefused).
///
/// A condition is either a check on what others may have changed meanwhile (a version, a
/// balance read before the handler ran: running the handler again on fresh data may well
/// succeed) or a business rule (insufficient funds: it will fail the same way every time). The
/// executor cannot tell them apart, so the choice is yours; the default retries, bounded by
/// [`max_attempts`](ExecutorConfig::max_attempts), so that a lost race never dead-letters a
/// message at once, and a rule that always fails ends
/// [`Exhausted`](crate::Outcome::Exhausted) after the last attempt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum EffectRefusedPolicy {
    /// Record a retryable failure: the key is acquired again by a redelivery (which runs the
    /// handler again) until the attempts run out (the default).
    #[default]
    Retryable,
    /// Record a terminal failure: the handler never runs again for the key, every later delivery
    /// gets [`Outcome::Failed`](crate::Outcome::Failed).
    Terminal,
}

impl EffectRefusedPolicy {
    /// The failure kind recorded: [`FailureKind::Retryable`] or [`FailureKind::Terminal`].
    pub fn kind(self) -> FailureKind {
        match self {
            Self::Retryable => FailureKind::Retryable,
            Self::Terminal => FailureKind::Terminal,
        }
    }
}

/// Optional bounded wait when another worker holds the key: poll the store with exponential
/// backoff (from the `backon` crate, with jitter) until the holder finishes or `max_wait` runs
/// out, instead of returning [`Outcome::InProgress`](crate::Outcome::InProgress) at once.
///
/// A poll never sleeps past the holder's lease expiry, so a crashed holder is taken over as soon
/// as possible.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct InProgressWait {
    /// Longest total wait (default 5 s; `Duration::MAX`: as long as the key is in progress).
    pub max_wait: Duration,
    /// First delay between polls (default 10 ms).
    pub min_delay: Duration,
    /// Longest delay between polls (default 500 ms).
    pub max_delay: Duration,
}

impl Default for InProgressWait {
    fn default() -> Self {
        Self {
            max_wait: Duration::from_secs(5),
            min_delay: Duration::from_millis(10),
            max_delay: Duration::from_millis(500),
        }
    }
}

/// Default handlers run at once by [`Executor::run_batch`](crate::Executor::run_batch): 64.
pub const DEFAULT_BATCH_CONCURRENCY: usize = 64;

/// How [`Executor::run_batch`](crate::Executor::run_batch) runs a batch: how many handlers run at
/// once, and how completions and failures are grouped into
/// [`complete_many`](idem_core::IdempotencyStore::complete_many) and
/// [`fail_many`](idem_core::IdempotencyStore::fail_many) calls.
///
/// Records are grouped as commits are in a database log: a record is sent with whatever else
/// is waiting as soon as the previous group came back, up to `record_batch` records per call;
/// with no `record_window` the group first takes in what the batch's handlers that are ready
/// to finish add (they run in the caller's task: a few polls, no timer), so a batch of quick
/// handlers is recorded in one call; a non-zero `record_window` first waits that long for more
/// before sending a group smaller than `record_batch` (larger groups, later answers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchConfig {
    /// Handlers running at once, at least 1 (default [`DEFAULT_BATCH_CONCURRENCY`], 64). A
    /// handler's slot is free again as soon as it returns: the next message's handler starts
    /// while the record of the one before is sent. What follows a handler is not counted
    /// against the slots: a transactional completion, sent on its own, or a dead letter, may
    /// be in flight for every message of the batch at once.
    pub concurrency: usize,
    /// Largest group of records in one store call, from 1 to the store's
    /// [`max_batch`](idem_core::Limits::max_batch) (default `None`: the store's `max_batch`).
    pub record_batch: Option<usize>,
    /// How long a group smaller than `record_batch` waits for more (default zero: sent as soon
    /// as the previous group came back); shorter than the lease.
    pub record_window: Duration,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self {
            concurrency: DEFAULT_BATCH_CONCURRENCY,
            record_batch: None,
            record_window: Duration::ZERO,
        }
    }
}

impl BatchConfig {
    /// Sets how many handlers run at once.
    pub fn with_concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// Sets the largest group of records in one store call.
    pub fn with_record_batch(mut self, len: usize) -> Self {
        self.record_batch = Some(len);
        self
    }

    /// Sets how long a small group waits for more records.
    pub fn with_record_window(mut self, window: Duration) -> Self {
        self.record_window = window;
        self
    }
}

impl InProgressWait {
    /// Sets the longest total wait.
    pub fn with_max_wait(mut self, max_wait: Duration) -> Self {
        self.max_wait = max_wait;
        self
    }

    /// Sets the first delay between polls.
    pub fn with_min_delay(mut self, delay: Duration) -> Self {
        self.min_delay = delay;
        self
    }

    /// Sets the longest delay between polls.
    pub fn with_max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }
}

/// The configuration of an [`Executor`](crate::Executor), validated by
/// [`ExecutorBuilder::build`](crate::ExecutorBuilder::build). Every field states its default
/// ([`ExecutorConfig::default`], or [`ExecutorConfig::new`] with a namespace).
///
/// ```
/// use std::time::Duration;
/// use idem_executor::{ExecutorConfig, FingerprintPolicy, KeySource};
///
/// let config = ExecutorConfig::new("payments")
///     .with_lease_ttl(Duration::from_secs(10))
///     .with_max_attempts(3)
///     .with_key_source(KeySource::json_pointer("/payment_id"))
///     .with_fingerprint(FingerprintPolicy::json_fields(["/amount", "/currency"]));
/// # let _ = config;
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ExecutorConfig {
    /// The namespace of the keys: usually the consumer group or handler name. Required: the
    /// default is empty, which [`build`](crate::ExecutorBuilder::build) refuses.
    pub namespace: String,
    /// The owner id reported to other workers (default `None`: `idem-<host>-<pid>-<n>`, from the
    /// `HOSTNAME` variable, the process id and a counter).
    pub owner: Option<String>,
    /// How long a lease lasts without a heartbeat (default [`DEFAULT_LEASE_TTL`], 30 s).
    pub lease_ttl: Duration,
    /// Time between heartbeats, at most half the lease (default `None`: a third of the lease).
    pub heartbeat_interval: Option<Duration>,
    /// How long finished records are kept (default [`DEFAULT_RETENTION`], 24 h).
    pub retention: Duration,
    /// Attempts (failures, panics and crashes) before a key is exhausted, at least 1 (default
    /// [`DEFAULT_MAX_ATTEMPTS`], 5).
    ///
    /// A crash is counted against every key whose lease the process held, not only the one
    /// whose handler brought it down: each lease left to expire is taken over as the next
    /// attempt, since nothing tells a handler that crashed its process from one that ran beside
    /// it. A message that kills its process (an abort, an out-of-memory kill) thus spends the
    /// attempts of the messages in flight with it, and after `max_attempts` such crashes those
    /// are exhausted too, their handlers never having failed. Keep it above the number of
    /// crashes in a row a deployment can see, and re-drive exhausted keys as the CLI's README
    /// says.
    pub max_attempts: u32,
    /// Largest encoded result stored (default `None`: the store's own
    /// [`max_result_len`](idem_core::Limits::max_result_len)). A larger result is recorded as a
    /// terminal failure: [`Outcome::ResultNotStored`](crate::Outcome::ResultNotStored) on a plain
    /// executor (running the handler again would repeat its effect), and
    /// [`Outcome::NotCommitted`](crate::Outcome::NotCommitted) with nothing committed on a
    /// transactional one.
    pub max_result_len: Option<usize>,
    /// The delay put in retry actions after a retryable failure, a lost lease or a store error
    /// (default [`DEFAULT_RETRY_DELAY`], 1 s).
    pub retry_delay: Duration,
    /// How much longer each retry of a failing handler waits than the one before, at least 1
    /// (default 1: every retry waits [`retry_delay`](Self::retry_delay)). After the handler's
    /// `n`-th attempt failed retryably (or its commit was refused), the retry waits
    /// `retry_delay × retry_growth^(n-1)` ([`retry_after`](Self::retry_after)): with 2 and the
    /// defaults, 1 s, 2 s, 4 s, 8 s, so that the default five attempts outlast a 15-second outage
    /// of what the handler calls, where a constant delay spends them in 4 seconds. A runner
    /// keeps the delay within its own `min_retry_delay..=max_retry_delay` (5 s at most by
    /// default on RabbitMQ and NATS: raise it with the growth). A lost lease and a store error
    /// still wait `retry_delay`: no attempt of the handler failed.
    ///
    /// The delay is the redelivery's, not the key's: the store lets any copy of the message
    /// take a failed key again at once. Copies in flight together (a producer's retries, the
    /// copies a broker redelivers) each run the next attempt without waiting, so a burst of
    /// duplicates meeting a failing dependency spends the attempts in milliseconds (in one
    /// batch, a key's copies run one after the other, as single calls would).
    pub retry_growth: u32,
    /// Where keys come from (default: the header [`DEFAULT_KEY_HEADER`](crate::DEFAULT_KEY_HEADER),
    /// `idempotency-key`, matched case-sensitively).
    pub key_source: KeySource,
    /// What the fingerprint covers (default [`FingerprintPolicy::Payload`]: the whole payload).
    pub fingerprint: FingerprintPolicy,
    /// Messages without a key (default [`MissingKeyPolicy::Reject`]).
    pub missing_key: MissingKeyPolicy,
    /// Store failures (default [`StoreErrorPolicy::FailClosed`]).
    pub store_errors: StoreErrorPolicy,
    /// Optional bounded wait on a key in progress (default `None`: report
    /// [`Outcome::InProgress`](crate::Outcome::InProgress) at once).
    pub in_progress_wait: Option<InProgressWait>,
    /// Transactional executors only: the failure recorded when a condition of one of the
    /// handler's writes fails (default [`EffectRefusedPolicy::Retryable`]). Plain executors send
    /// no writes and ignore it.
    pub effect_refused: EffectRefusedPolicy,
    /// How [`Executor::run_batch`](crate::Executor::run_batch) runs a batch (default
    /// [`BatchConfig::default`]).
    pub batch: BatchConfig,
}

impl Default for ExecutorConfig {
    /// Defaults with an empty namespace, which [`build`](crate::ExecutorBuilder::build) rejects:
    /// set one with [`with_namespace`](Self::with_namespace) or use [`ExecutorConfig::new`].
    fn default() -> Self {
        Self {
            namespace: String::new(),
            owner: None,
            lease_ttl: DEFAULT_LEASE_TTL,
            heartbeat_interval: None,
            retention: DEFAULT_RETENTION,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            max_result_len: None,
            retry_delay: DEFAULT_RETRY_DELAY,
            retry_growth: 1,
            key_source: KeySource::default(),
            fingerprint: FingerprintPolicy::default(),
            missing_key: MissingKeyPolicy::default(),
            store_errors: StoreErrorPolicy::default(),
            in_progress_wait: None,
            effect_refused: EffectRefusedPolicy::default(),
            batch: BatchConfig::default(),
        }
    }
}

impl ExecutorConfig {
    /// Defaults in this namespace.
    pub fn new(namespace: impl Into<String>) -> Self {
        Self::default().with_namespace(namespace)
    }

    /// Sets the namespace.
    pub fn with_namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// Sets the owner id.
    pub fn with_owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = Some(owner.into());
        self
    }

    /// Sets the lease length.
    pub fn with_lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// Sets the heartbeat interval (at most half the lease).
    pub fn with_heartbeat_interval(mut self, interval: Duration) -> Self {
        self.heartbeat_interval = Some(interval);
        self
    }

    /// Sets the retention of finished records.
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Sets the maximum number of attempts.
    pub fn with_max_attempts(mut self, max: u32) -> Self {
        self.max_attempts = max;
        self
    }

    /// Sets the largest encoded result stored.
    pub fn with_max_result_len(mut self, len: usize) -> Self {
        self.max_result_len = Some(len);
        self
    }

    /// Sets the retry delay.
    pub fn with_retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = delay;
        self
    }

    /// Sets how much longer each retry of a failing handler waits than the one before.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_executor::ExecutorConfig;
    ///
    /// let config = ExecutorConfig::new("payments").with_retry_growth(2);
    /// let waits: Vec<_> = (1..=4).map(|attempt| config.retry_after(attempt)).collect();
    /// assert_eq!(waits, [1, 2, 4, 8].map(Duration::from_secs));
    /// ```
    pub fn with_retry_growth(mut self, growth: u32) -> Self {
        self.retry_growth = growth;
        self
    }

    /// The delay before retrying a message whose handler's attempt `attempt` (1 for the first)
    /// failed retryably: `retry_delay × retry_growth^(attempt-1)`, at most about 30 years
    /// (it saturates; a runner caps it at its `max_retry_delay`).
    pub fn retry_after(&self, attempt: u32) -> Duration {
        let growth = self
            .retry_growth
            .max(1)
            .saturating_pow(attempt.saturating_sub(1));
        self.retry_delay
            .saturating_mul(growth)
            .min(Duration::from_secs(1 << 30))
    }

    /// Sets the key source.
    pub fn with_key_source(mut self, source: KeySource) -> Self {
        self.key_source = source;
        self
    }

    /// Sets the fingerprint policy.
    pub fn with_fingerprint(mut self, policy: FingerprintPolicy) -> Self {
        self.fingerprint = policy;
        self
    }

    /// Sets the missing-key policy.
    pub fn with_missing_key(mut self, policy: MissingKeyPolicy) -> Self {
        self.missing_key = policy;
        self
    }

    /// Sets the store-error policy.
    pub fn with_store_errors(mut self, policy: StoreErrorPolicy) -> Self {
        self.store_errors = policy;
        self
    }

    /// Sets how [`Executor::run_batch`](crate::Executor::run_batch) runs a batch.
    pub fn with_batch(mut self, batch: BatchConfig) -> Self {
        self.batch = batch;
        self
    }

    /// Turns the bounded in-progress wait on.
    pub fn with_in_progress_wait(mut self, wait: InProgressWait) -> Self {
        self.in_progress_wait = Some(wait);
        self
    }

    /// Sets what a transactional executor records when a condition of the handler's writes
    /// fails.
    pub fn with_effect_refused(mut self, policy: EffectRefusedPolicy) -> Self {
        self.effect_refused = policy;
        self
    }

    /// The heartbeat interval in force: the configured one or a third of the lease.
    pub fn effective_heartbeat_interval(&self) -> Duration {
        self.heartbeat_interval.unwrap_or(self.lease_ttl / 3)
    }

    /// Checks every field against the store's limits.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first bad field.
    pub fn validate(&self, limits: &Limits) -> Result<(), ConfigError> {
        self.validated(limits).map(drop)
    }

    pub(crate) fn validated(&self, limits: &Limits) -> Result<Validated, ConfigError> {
        let namespace =
            Namespace::new(&self.namespace).map_err(|e| ConfigError::from_core("namespace", e))?;
        let owner = match &self.owner {
            Some(owner) => {
                check_owner(owner).map_err(|e| ConfigError::from_core("owner", e))?;
                owner.clone()
            }
            None => default_owner(),
        };
        check_lease_ttl(self.lease_ttl).map_err(|e| ConfigError::from_core("lease_ttl", e))?;
        let heartbeat = self.effective_heartbeat_interval();
        if heartbeat.is_zero() || heartbeat > self.lease_ttl / 2 {
            return Err(ConfigError::new(
                "heartbeat_interval",
                format!(
                    "is {heartbeat:?}; it must be above zero and at most half the lease ({:?}), \
                     so that a failed heartbeat is retried before the lease expires",
                    self.lease_ttl
                ),
            ));
        }
        check_retention(self.retention).map_err(|e| ConfigError::from_core("retention", e))?;
        if self.max_attempts == 0 {
            return Err(ConfigError::new("max_attempts", "must be at least 1"));
        }
        let max_result_len = match self.max_result_len {
            None => limits.max_result_len,
            Some(0) => return Err(ConfigError::new("max_result_len", "must be above zero")),
            Some(len) if len > limits.max_result_len => {
                return Err(ConfigError::new(
                    "max_result_len",
                    format!(
                        "is {len} bytes, above the store's limit of {} bytes",
                        limits.max_result_len
                    ),
                ));
            }
            Some(len) => len,
        };
        self.key_source.validate()?;
        self.fingerprint.validate()?;
        if let Some(wait) = &self.in_progress_wait
            && (wait.max_wait.is_zero()
                || wait.min_delay.is_zero()
                || wait.min_delay > wait.max_delay)
        {
            return Err(ConfigError::new(
                "in_progress_wait",
                format!(
                    "{wait:?}: max_wait and min_delay must be above zero and min_delay at most max_delay"
                ),
            ));
        }
        if self.retry_growth == 0 {
            return Err(ConfigError::new(
                "retry_growth",
                "0: it must be at least 1 (1 keeps every retry at retry_delay)",
            ));
        }
        if self.batch.concurrency == 0 {
            return Err(ConfigError::new("batch", "concurrency must be at least 1"));
        }
        if self.batch.record_window >= self.lease_ttl {
            return Err(ConfigError::new(
                "batch",
                format!(
                    "record_window is {:?}; it must be shorter than the lease ({:?}): a record \
                     waiting that long for others would hold its message past a lease",
                    self.batch.record_window, self.lease_ttl
                ),
            ));
        }
        if limits.max_batch == 0 {
            return Err(ConfigError::new(
                "store",
                "the store's max_batch is 0: it takes no batch, and every message of a batch \
                 (a runner's poll, pull or group) would fail with a store error, forever",
            ));
        }
        let record_batch = match self.batch.record_batch {
            None => limits.max_batch,
            Some(len) if len == 0 || len > limits.max_batch => {
                return Err(ConfigError::new(
                    "batch",
                    format!(
                        "record_batch is {len}; it must be from 1 to the store's max_batch ({})",
                        limits.max_batch
                    ),
                ));
            }
            Some(len) => len,
        };
        Ok(Validated {
            record_batch,
            namespace,
            owner,
            heartbeat,
            max_result_len,
            max_error_len: limits.max_error_len,
        })
    }
}

/// Values derived from a valid configuration.
#[derive(Debug)]
pub(crate) struct Validated {
    pub(crate) namespace: Namespace,
    pub(crate) owner: String,
    pub(crate) heartbeat: Duration,
    pub(crate) max_result_len: usize,
    pub(crate) max_error_len: usize,
    pub(crate) record_batch: usize,
}

fn default_owner() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let host = std::env::var("HOSTNAME").unwrap_or_default();
    let host: String = host.chars().filter(|c| !c.is_control()).take(64).collect();
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    if host.is_empty() {
        format!("idem-{}-{n}", std::process::id())
    } else {
        format!("idem-{host}-{}-{n}", std::process::id())
    }
}

/// An invalid executor configuration, naming the bad field.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid executor configuration: {field} {reason}")]
#[non_exhaustive]
pub struct ConfigError {
    /// The field of [`ExecutorConfig`] that was rejected (`namespace`, `lease_ttl`,
    /// `heartbeat_interval`, ...).
    pub field: &'static str,
    /// Why.
    pub reason: String,
}

impl ConfigError {
    /// A rejection of `field`, for components that take an [`ExecutorConfig`] and refuse parts
    /// of it that do not apply to them.
    pub fn new(field: &'static str, reason: impl Into<String>) -> Self {
        Self {
            field,
            reason: reason.into(),
        }
    }

    fn from_core(field: &'static str, error: Error) -> Self {
        match error {
            Error::InvalidInput { reason, .. } => Self::new(field, reason),
            other => Self::new(field, other.to_string()),
        }
    }
}
