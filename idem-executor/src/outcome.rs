//! What one message came to, and what the broker should do with it.

use std::time::Duration;

use crate::dead_letter::DeadLetterReason;
use crate::error::{ExecutorError, StoreStage};
use idem_core::{Error, FailureKind};

/// What [`Executor::run`](crate::Executor::run) did with one message.
///
/// Map it to a broker action with [`Outcome::action`] (or [`BrokerAction::of`] for the whole
/// `Result`).
#[derive(Debug)]
#[non_exhaustive]
pub enum Outcome<T> {
    /// The handler ran to completion in this call and its result is stored.
    Executed(T),
    /// The key completed before: the stored result, decoded. The handler did not run.
    Replayed(T),
    /// Another worker holds a live lease on the key (after the optional bounded wait). The
    /// handler did not run.
    InProgress {
        /// Who holds the key.
        owner: String,
        /// Time until that lease expires: retry after it.
        retry_after: Duration,
    },
    /// The key was seen before with a different fingerprint: the sender reused a key for a
    /// different request. Nothing ran and nothing changed.
    Conflict,
    /// The handler failed (or panicked) in this call with a retryable error, the failure is
    /// recorded and attempts remain: redeliver later.
    Retry {
        /// The attempt that failed (1 for the first).
        attempt: u32,
        /// The recorded error (made storable by
        /// [`Limits::fit_error`](idem_core::Limits::fit_error): cut to the store's limit, NUL
        /// written as `\0`).
        error: String,
        /// Whether the handler panicked.
        panicked: bool,
        /// How long to wait before the next attempt:
        /// [`retry_after`](crate::ExecutorConfig::retry_after) of this attempt (the configured
        /// [`retry_delay`](crate::ExecutorConfig::retry_delay), grown by
        /// [`retry_growth`](crate::ExecutorConfig::retry_growth) per attempt).
        retry_after: Duration,
    },
    /// The key failed or crashed `attempts` times, the maximum: a poison message. Returned for
    /// every delivery from then on. The dead-letter hook ran only if *this* call's failure used up
    /// the last attempt (see [the module docs](crate#dead-lettering)).
    Exhausted {
        /// Attempts made.
        attempts: u32,
        /// The last recorded error; `None` when the last attempt crashed or stalled.
        last_error: Option<String>,
    },
    /// The handler failed terminally (in this call or before; terminal failures are replayed and
    /// never re-run).
    Failed {
        /// The recorded error.
        error: String,
    },
    /// The handler succeeded (its effect was applied) but its result could not be stored: it is
    /// over the size limit ([`max_result_len`](crate::ExecutorConfig::max_result_len)) or the
    /// codec failed to encode it. The key is recorded as failed with the kind
    /// [`FailureKind::ResultNotStored`](idem_core::FailureKind::ResultNotStored) (terminal), so
    /// the handler never runs again; later deliveries get this outcome too (from that recorded
    /// kind), with no value.
    ///
    /// Not a failure of the work: do not compensate or re-submit it as if it had failed. Its
    /// action is [`BrokerAction::DeadLetter`] with [`DeadLetterReason::ResultNotStored`], for an
    /// operator to look at.
    ResultNotStored {
        /// Why the result was not stored, as recorded (made storable by
        /// [`Limits::fit_error`](idem_core::Limits::fit_error)).
        error: String,
    },
    /// A [`TransactionalExecutor`](crate::TransactionalExecutor) committed nothing: the handler
    /// succeeded, but its writes and result were refused as a whole (see [`CommitRefusal`]), so
    /// neither the writes nor the completion were applied. The failure is recorded (with
    /// [`fail`](idem_core::IdempotencyStore::fail)) as `kind`:
    ///
    /// - [`FailureKind::Retryable`] (a refused condition under the default
    ///   [`EffectRefusedPolicy::Retryable`](crate::EffectRefusedPolicy::Retryable)): a
    ///   redelivery runs the handler again. When this was the last attempt the outcome is
    ///   [`Exhausted`](Self::Exhausted) instead (and the dead-letter hook runs), as for any
    ///   retryable failure.
    /// - [`FailureKind::Terminal`] (invalid writes, a result that cannot be stored, or a refused
    ///   condition under [`EffectRefusedPolicy::Terminal`](crate::EffectRefusedPolicy::Terminal)):
    ///   the handler never runs again for the key; every later delivery gets
    ///   [`Failed`](Self::Failed) with the recorded error (the store keeps the kind, not the
    ///   refusal).
    NotCommitted {
        /// Why nothing was committed.
        refusal: CommitRefusal,
        /// The kind recorded: [`FailureKind::Retryable`] or [`FailureKind::Terminal`].
        kind: FailureKind,
        /// The attempt whose commit was refused (1 for the first).
        attempt: u32,
        /// The recorded error (`nothing committed: ` and why; made storable by
        /// [`Limits::fit_error`](idem_core::Limits::fit_error)).
        error: String,
        /// How long to wait before the next attempt, used when the kind is retryable:
        /// [`retry_after`](crate::ExecutorConfig::retry_after) of this attempt.
        retry_after: Duration,
    },
    /// The lease was lost to a takeover while the handler ran (it was cancelled), the local lease
    /// deadline passed while the handler ran without a successful heartbeat (it was cancelled: the
    /// store may have let the lease expire), or the late completion or failure was refused:
    /// another worker may now own the key. Nothing was recorded by this call.
    LeaseLost {
        /// The configured [`retry_delay`](crate::ExecutorConfig::retry_delay).
        retry_after: Duration,
    },
    /// The handler ran without deduplication: the message had no key and
    /// [`MissingKeyPolicy::PassThrough`](crate::MissingKeyPolicy::PassThrough) is set, or the
    /// store failed and [`StoreErrorPolicy::FailOpen`](crate::StoreErrorPolicy::FailOpen) is set.
    NotDeduplicated {
        /// The handler's value, or how it failed.
        result: Result<T, HandlerFailure>,
        /// Why deduplication was skipped.
        reason: PassThroughReason,
        /// The configured [`retry_delay`](crate::ExecutorConfig::retry_delay), used when the
        /// handler failed retryably.
        retry_after: Duration,
    },
}

impl<T> Outcome<T> {
    /// A short name for logs and metrics: `executed`, `replayed`, `in_progress`, `conflict`,
    /// `retry`, `exhausted`, `failed`, `result_not_stored`, `not_committed`, `lease_lost`,
    /// `not_deduplicated`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Executed(_) => "executed",
            Self::Replayed(_) => "replayed",
            Self::InProgress { .. } => "in_progress",
            Self::Conflict => "conflict",
            Self::Retry { .. } => "retry",
            Self::Exhausted { .. } => "exhausted",
            Self::Failed { .. } => "failed",
            Self::ResultNotStored { .. } => "result_not_stored",
            Self::NotCommitted { .. } => "not_committed",
            Self::LeaseLost { .. } => "lease_lost",
            Self::NotDeduplicated { .. } => "not_deduplicated",
        }
    }

    /// The result value, for [`Executed`](Self::Executed), [`Replayed`](Self::Replayed) and a
    /// successful [`NotDeduplicated`](Self::NotDeduplicated).
    pub fn value(&self) -> Option<&T> {
        match self {
            Self::Executed(v) | Self::Replayed(v) | Self::NotDeduplicated { result: Ok(v), .. } => {
                Some(v)
            }
            _ => None,
        }
    }

    /// Like [`value`](Self::value), by value.
    pub fn into_value(self) -> Option<T> {
        match self {
            Self::Executed(v) | Self::Replayed(v) | Self::NotDeduplicated { result: Ok(v), .. } => {
                Some(v)
            }
            _ => None,
        }
    }

    /// The broker action:
    ///
    /// | outcome | action |
    /// |---|---|
    /// | `Executed`, `Replayed`, `NotDeduplicated` that succeeded | `Ack` |
    /// | `InProgress` | `Retry` after the holder's lease |
    /// | `Retry` | `Retry` after its `retry_after` (`retry_delay`, grown per attempt by `retry_growth`) |
    /// | `LeaseLost`, `NotDeduplicated` failed retryably | `Retry` after `retry_delay` |
    /// | `Conflict` | `DeadLetter` with [`DeadLetterReason::Conflict`] |
    /// | `Exhausted` | `DeadLetter` with [`DeadLetterReason::Exhausted`] and the last error |
    /// | `Failed`, `NotDeduplicated` failed terminally | `DeadLetter` with [`DeadLetterReason::Failed`] and the error |
    /// | `ResultNotStored` | `DeadLetter` with [`DeadLetterReason::ResultNotStored`] and why |
    /// | `NotCommitted` retryable | `Retry` after its `retry_after`, as `Retry` |
    /// | `NotCommitted` terminal | `DeadLetter` with [`DeadLetterReason::Failed`] and the recorded error |
    ///
    /// A terminal `NotCommitted` dead-letters as `failed`, the code every later delivery of the
    /// key gets too (the store records a terminal failure), so a dead-letter consumer sees one
    /// code per key; the error text says what was refused.
    ///
    /// `Exhausted`, `Failed` and `ResultNotStored` are returned to every later delivery too, so a
    /// consumer that crashes between dead-lettering and acknowledging dead-letters the message
    /// again: dead-letter consumers should deduplicate by key.
    pub fn action(&self) -> BrokerAction {
        let dead_letter = |reason, error: &str| BrokerAction::DeadLetter {
            reason,
            error: error.to_owned(),
        };
        match self {
            Self::Executed(_) | Self::Replayed(_) => BrokerAction::Ack,
            Self::NotDeduplicated {
                result,
                retry_after,
                ..
            } => match result {
                Ok(_) => BrokerAction::Ack,
                Err(f) if f.terminal => dead_letter(DeadLetterReason::Failed, &f.error),
                Err(_) => BrokerAction::Retry {
                    after: *retry_after,
                },
            },
            Self::InProgress { retry_after, .. }
            | Self::Retry { retry_after, .. }
            | Self::LeaseLost { retry_after } => BrokerAction::Retry {
                after: *retry_after,
            },
            Self::Conflict => dead_letter(
                DeadLetterReason::Conflict,
                "fingerprint conflict: the key was used before for a different payload",
            ),
            Self::Exhausted { last_error, .. } => dead_letter(
                DeadLetterReason::Exhausted,
                last_error.as_deref().unwrap_or(
                    "no attempt recorded an outcome: the last one crashed, stalled past its \
                         lease, or its acquire took effect after the reply was lost (a store \
                         timeout)",
                ),
            ),
            Self::Failed { error } => dead_letter(DeadLetterReason::Failed, error),
            Self::ResultNotStored { error } => {
                dead_letter(DeadLetterReason::ResultNotStored, error)
            }
            Self::NotCommitted {
                kind,
                error,
                retry_after,
                ..
            } => {
                if kind.is_retryable() {
                    BrokerAction::Retry {
                        after: *retry_after,
                    }
                } else {
                    dead_letter(DeadLetterReason::Failed, error)
                }
            }
        }
    }

    /// Whether the message went through the idempotency store (everything but
    /// [`NotDeduplicated`](Self::NotDeduplicated)).
    pub fn is_deduplicated(&self) -> bool {
        !matches!(self, Self::NotDeduplicated { .. })
    }
}

/// What a consumer loop does with a message.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BrokerAction {
    /// Acknowledge (Kafka: commit the offset; RabbitMQ: `basic.ack`; SQS: delete the message).
    Ack,
    /// Redeliver later (Kafka: seek back and pause the partition for `after`; RabbitMQ: nack with
    /// requeue, or a delay queue; SQS: change the visibility timeout to `after`).
    Retry {
        /// How long to wait before the redelivery.
        after: Duration,
    },
    /// Move to a dead-letter destination, then acknowledge.
    DeadLetter {
        /// Why, as a typed code shared by every runner.
        reason: DeadLetterReason,
        /// The text for the dead-letter record: the recorded error (the last one, for
        /// [`Outcome::Exhausted`]), or what was wrong with the message.
        error: String,
    },
}

impl BrokerAction {
    /// The action for the whole result of [`Executor::run`](crate::Executor::run): the outcome's
    /// [`Outcome::action`] or the error's [`ExecutorError::action`].
    pub fn of<T>(result: &Result<Outcome<T>, ExecutorError>) -> Self {
        match result {
            Ok(outcome) => outcome.action(),
            Err(e) => e.action(),
        }
    }
}

/// Why a [`TransactionalExecutor`](crate::TransactionalExecutor) committed nothing, in
/// [`Outcome::NotCommitted`]. In every case neither the handler's writes nor its result were
/// applied: the effect has not happened, so the key is failed rather than recorded as done.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CommitRefusal {
    /// A condition of one of the writes failed
    /// ([`Error::EffectRefused`](idem_core::Error::EffectRefused)); recorded as the configured
    /// [`EffectRefusedPolicy`](crate::EffectRefusedPolicy) (retryable by default).
    EffectRefused {
        /// The position of the refused write in the handler's writes, from 0.
        index: usize,
        /// What the store said.
        reason: String,
    },
    /// The store cannot take these writes (too many, a command outside its documented set, a
    /// key the operation cannot reach atomically such as a Redis Cluster key outside the
    /// record's slot): [`Error::InvalidInput`](idem_core::Error::InvalidInput) on the field
    /// `writes`, refused before anything was sent. Terminal: the handler built writes the store
    /// will never take.
    InvalidWrites {
        /// Why the store refused them.
        reason: String,
    },
    /// The result cannot be stored (over
    /// [`max_result_len`](crate::ExecutorConfig::max_result_len), or the codec failed to encode
    /// it), so the completion, and the writes with it, were not sent. Terminal. Unlike the plain
    /// executor's [`Outcome::ResultNotStored`], the effect did *not* happen.
    ResultNotStorable {
        /// Why.
        reason: String,
    },
}

impl CommitRefusal {
    /// `effect_refused`, `invalid_writes` or `result_not_storable`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::EffectRefused { .. } => "effect_refused",
            Self::InvalidWrites { .. } => "invalid_writes",
            Self::ResultNotStorable { .. } => "result_not_storable",
        }
    }
}

impl std::fmt::Display for CommitRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::EffectRefused { index, reason } => {
                write!(
                    f,
                    "write {index} of the handler's effect was refused: {reason}"
                )
            }
            Self::InvalidWrites { reason } => {
                write!(f, "the store cannot take the handler's writes: {reason}")
            }
            Self::ResultNotStorable { reason } => f.write_str(reason),
        }
    }
}

/// How a handler failed, in [`Outcome::NotDeduplicated`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HandlerFailure {
    /// The error message (or the panic message).
    pub error: String,
    /// Whether the handler marked the error terminal.
    pub terminal: bool,
    /// Whether the handler panicked.
    pub panicked: bool,
}

/// Why a message was processed without deduplication.
#[derive(Debug)]
#[non_exhaustive]
pub enum PassThroughReason {
    /// The message had no key and [`MissingKeyPolicy::PassThrough`](crate::MissingKeyPolicy::PassThrough)
    /// is set.
    MissingKey,
    /// The store failed and [`StoreErrorPolicy::FailOpen`](crate::StoreErrorPolicy::FailOpen) is
    /// set.
    StoreError {
        /// Which operation failed. At [`StoreStage::Complete`] or [`StoreStage::Fail`] the key
        /// was acquired but the outcome is not recorded: the key stays in progress until its
        /// lease expires.
        stage: StoreStage,
        /// The store's error.
        source: Error,
    },
}
