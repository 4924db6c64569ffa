//! Errors of the executor.

use std::fmt;
use std::time::Duration;

use crate::dead_letter::DeadLetterReason;
use crate::outcome::BrokerAction;
use idem_core::{BoxError, Error, IdempotencyKey};

/// Which store operation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreStage {
    /// Acquiring the key (the handler did not run).
    Acquire,
    /// Recording the handler's result (the handler ran and succeeded).
    Complete,
    /// Recording the handler's failure (the handler ran and failed).
    Fail,
}

impl StoreStage {
    /// `acquire`, `complete` or `fail`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Acquire => "acquire",
            Self::Complete => "complete",
            Self::Fail => "fail",
        }
    }
}

impl fmt::Display for StoreStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why [`Executor::run`](crate::Executor::run) could not give an [`Outcome`](crate::Outcome).
///
/// Normal results (a duplicate, a busy key, a conflict, a handler failure, a lost lease) are
/// outcomes, not errors. [`ExecutorError::action`] maps every error to a broker action too.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExecutorError {
    /// The message carries no idempotency key, or an empty one, and the executor rejects such
    /// messages (the default [`MissingKeyPolicy::Reject`](crate::MissingKeyPolicy::Reject)). The
    /// handler did not run.
    #[error(
        "the message has no idempotency key (none where the key source looks, or an empty one)"
    )]
    MissingKey,

    /// The message's key is not a valid [`IdempotencyKey`] (too long, NUL), or the store refused
    /// it at acquire ([`Error::InvalidInput`] on the field `key`: a key its backend cannot hold,
    /// such as a character a PostgreSQL database's encoding lacks). The handler did not run.
    #[error("invalid idempotency key: {0}")]
    InvalidKey(#[source] Error),

    /// The message cannot be read as the configuration requires (a key header that is not UTF-8,
    /// a payload that is not JSON, ...). The handler did not run.
    #[error("unreadable message: {reason}")]
    InvalidMessage {
        /// What was wrong.
        reason: String,
    },

    /// The store failed and the executor fails closed (the default
    /// [`StoreErrorPolicy::FailClosed`](crate::StoreErrorPolicy::FailClosed)).
    ///
    /// At [`StoreStage::Acquire`] the handler did not run. At [`StoreStage::Complete`] or
    /// [`StoreStage::Fail`] it ran, but its outcome is not recorded: the key stays in progress
    /// until its lease expires, and a redelivery then takes it over and runs the handler again.
    /// On a [`TransactionalExecutor`](crate::TransactionalExecutor) a completion that was not
    /// recorded committed none of the handler's writes either, so that second run is the only
    /// one whose writes land.
    #[error("store error at {stage} (handler ran: {handler_ran}): {source}")]
    Store {
        /// Which operation failed.
        stage: StoreStage,
        /// Whether the handler ran before the failure.
        handler_ran: bool,
        /// The configured [`retry_delay`](crate::ExecutorConfig::retry_delay), for
        /// [`ExecutorError::action`].
        retry_after: Duration,
        /// The store's error ([`Error::Unavailable`] for an outage).
        #[source]
        source: Error,
    },

    /// A stored result does not decode as the handler's result type.
    #[error("the stored result of {key} does not decode: {source}")]
    Decode {
        /// The key whose result was replayed.
        key: IdempotencyKey,
        /// The codec's error.
        #[source]
        source: BoxError,
    },
}

impl ExecutorError {
    pub(crate) fn invalid_message(reason: impl Into<String>) -> Self {
        Self::InvalidMessage {
            reason: reason.into(),
        }
    }

    /// The broker action for this error: [`BrokerAction::Retry`] for store errors (the message
    /// is fine, the store may come back), [`BrokerAction::DeadLetter`] for everything else
    /// (retrying an unreadable message or an undecodable result does not help), with the
    /// [`dead_letter_reason`](Self::dead_letter_reason) and this error's text.
    pub fn action(&self) -> BrokerAction {
        match self.disposition() {
            Ok(reason) => BrokerAction::DeadLetter {
                reason,
                error: self.to_string(),
            },
            Err(after) => BrokerAction::Retry { after },
        }
    }

    /// The dead-letter reason of this error; `None` for [`Store`](Self::Store) errors, which are
    /// retried instead.
    pub fn dead_letter_reason(&self) -> Option<DeadLetterReason> {
        self.disposition().ok()
    }

    /// The dead-letter reason, or the delay before a retry.
    fn disposition(&self) -> Result<DeadLetterReason, Duration> {
        match self {
            Self::MissingKey => Ok(DeadLetterReason::MissingKey),
            Self::InvalidKey(_) => Ok(DeadLetterReason::InvalidKey),
            Self::InvalidMessage { .. } => Ok(DeadLetterReason::InvalidMessage),
            Self::Decode { .. } => Ok(DeadLetterReason::Decode),
            Self::Store { retry_after, .. } => Err(*retry_after),
        }
    }

    /// Whether the handler ran before the error.
    pub fn handler_ran(&self) -> bool {
        matches!(
            self,
            Self::Store {
                handler_ran: true,
                ..
            }
        )
    }
}

/// Why [`Executor::run_batch`](crate::Executor::run_batch) refused a whole batch. Nothing was
/// sent to the store and no handler ran.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BatchError {
    /// The batch holds more messages than the store takes in one call
    /// ([`Limits::max_batch`](idem_core::Limits::max_batch)): split it.
    #[error("a batch of {len} messages is over the store's limit of {max}")]
    TooLarge {
        /// Messages in the batch.
        len: usize,
        /// The store's [`max_batch`](idem_core::Limits::max_batch).
        max: usize,
    },
}
