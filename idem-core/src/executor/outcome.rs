//! What one message came to, and what the broker should do with it.

use std::time::Duration;

use super::error::{ExecutorError, StoreStage};
use crate::error::Error;
use crate::key::IdempotencyKey;

/// What [`Executor::run`](super::Executor::run) did with one message.
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
        /// The recorded error (possibly truncated to the store's limit).
        error: String,
        /// Whether the handler panicked.
        panicked: bool,
        /// The configured [`retry_delay`](super::ExecutorConfig::retry_delay).
        retry_after: Duration,
    },
    /// The key failed or crashed `attempts` times, the maximum: a poison message. Returned for
    /// every delivery from then on. The dead-letter hook ran only if *this* call's failure used up
    /// the last attempt (see [the module docs](crate::executor#dead-letter-hook)).
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
    /// over the size limit ([`max_result_len`](super::ExecutorConfig::max_result_len)) or the
    /// codec failed to encode it. The key is recorded as a terminal failure whose error starts
    /// with `result not stored (the handler's effect was applied): `, so the handler never runs
    /// again; later deliveries get this outcome too (from that recorded error), with no value.
    ///
    /// Not a failure of the work: do not compensate or re-submit it as if it had failed. Its
    /// action is [`BrokerAction::DeadLetter`] with the reason `result_not_stored: <error>`, for
    /// an operator to look at.
    ResultNotStored {
        /// The recorded error (possibly truncated to the store's limit).
        error: String,
    },
    /// The lease was lost to a takeover while the handler ran (it was cancelled), the local lease
    /// deadline passed while the handler ran without a successful heartbeat (it was cancelled: the
    /// store may have let the lease expire), or the late completion or failure was refused:
    /// another worker may now own the key. Nothing was recorded by this call.
    LeaseLost {
        /// The configured [`retry_delay`](super::ExecutorConfig::retry_delay).
        retry_after: Duration,
    },
    /// The handler ran without deduplication: the message had no key and
    /// [`MissingKeyPolicy::PassThrough`](super::MissingKeyPolicy::PassThrough) is set, or the
    /// store failed and [`StoreErrorPolicy::FailOpen`](super::StoreErrorPolicy::FailOpen) is set.
    NotDeduplicated {
        /// The handler's value, or how it failed.
        result: Result<T, HandlerFailure>,
        /// Why deduplication was skipped.
        reason: PassThroughReason,
        /// The configured [`retry_delay`](super::ExecutorConfig::retry_delay), used when the
        /// handler failed retryably.
        retry_after: Duration,
    },
}

impl<T> Outcome<T> {
    /// A short name for logs and metrics: `executed`, `replayed`, `in_progress`, `conflict`,
    /// `retry`, `exhausted`, `failed`, `result_not_stored`, `lease_lost`, `not_deduplicated`.
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
    /// | `Retry`, `LeaseLost`, `NotDeduplicated` failed retryably | `Retry` after `retry_delay` |
    /// | `Conflict`, `Exhausted`, `Failed`, `NotDeduplicated` failed terminally | `DeadLetter` |
    /// | `ResultNotStored` | `DeadLetter` with the reason `result_not_stored: <error>` |
    ///
    /// `Exhausted`, `Failed` and `ResultNotStored` are returned to every later delivery too, so a consumer that
    /// crashes between dead-lettering and acknowledging dead-letters the message again:
    /// dead-letter consumers should deduplicate by key.
    pub fn action(&self) -> BrokerAction {
        match self {
            Self::Executed(_) | Self::Replayed(_) => BrokerAction::Ack,
            Self::NotDeduplicated {
                result,
                retry_after,
                ..
            } => match result {
                Ok(_) => BrokerAction::Ack,
                Err(f) if f.terminal => BrokerAction::DeadLetter {
                    reason: format!("terminal failure: {}", f.error),
                },
                Err(_) => BrokerAction::Retry {
                    after: *retry_after,
                },
            },
            Self::InProgress { retry_after, .. }
            | Self::Retry { retry_after, .. }
            | Self::LeaseLost { retry_after } => BrokerAction::Retry {
                after: *retry_after,
            },
            Self::Conflict => BrokerAction::DeadLetter {
                reason: "fingerprint conflict: the key was used before for a different payload"
                    .to_owned(),
            },
            Self::Exhausted {
                attempts,
                last_error,
            } => BrokerAction::DeadLetter {
                reason: match last_error {
                    Some(e) => format!("exhausted after {attempts} attempts: {e}"),
                    None => format!(
                        "exhausted after {attempts} attempts: the last attempt crashed or stalled"
                    ),
                },
            },
            Self::Failed { error } => BrokerAction::DeadLetter {
                reason: format!("terminal failure: {error}"),
            },
            Self::ResultNotStored { error } => BrokerAction::DeadLetter {
                reason: format!("result_not_stored: {error}"),
            },
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
        /// Why, for the dead-letter record.
        reason: String,
    },
}

impl BrokerAction {
    /// The action for the whole result of [`Executor::run`](super::Executor::run): the outcome's
    /// [`Outcome::action`] or the error's [`ExecutorError::action`].
    pub fn of<T>(result: &Result<Outcome<T>, ExecutorError>) -> Self {
        match result {
            Ok(outcome) => outcome.action(),
            Err(e) => e.action(),
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
    /// The message had no key and [`MissingKeyPolicy::PassThrough`](super::MissingKeyPolicy::PassThrough)
    /// is set.
    MissingKey,
    /// The store failed and [`StoreErrorPolicy::FailOpen`](super::StoreErrorPolicy::FailOpen) is
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

/// The event passed to the dead-letter hook.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The exhausted key.
    pub key: IdempotencyKey,
    /// Attempts made (the configured maximum).
    pub attempts: u32,
    /// The error of the last attempt.
    pub last_error: String,
    /// Whether the last attempt panicked.
    pub panicked: bool,
}
