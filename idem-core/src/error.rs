//! The one error type of idem stores.

use std::fmt;
use std::time::Duration;

use crate::key::IdempotencyKey;
use crate::record::{FencingToken, StateKind};

/// A boxed error kept as the `source` of infrastructure errors.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of store operations.
///
/// Normal outcomes (a duplicate, a busy key, a fingerprint conflict) are not errors: they are
/// [`AcquireOutcome`](crate::AcquireOutcome) values. Errors are fencing violations, bad input
/// and infrastructure failures.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A fenced transition was refused: another worker took the key over, the record is no
    /// longer in progress (and the call was not a replay of the transition that finished it), or
    /// the record is gone (deleted or past retention). Nothing changed.
    #[error("lease lost on {key}: presented token {presented}, {why}")]
    LeaseLost {
        /// The key of the lease.
        key: IdempotencyKey,
        /// The token the caller presented.
        presented: FencingToken,
        /// What the store found instead of the caller's live lease.
        why: LostLease,
    },

    /// An argument was rejected before anything was written.
    #[error("invalid {field}: {reason}")]
    InvalidInput {
        /// Which input was bad (`key`, `namespace`, `owner`, `lease_ttl`, ...).
        field: &'static str,
        /// Why it was rejected.
        reason: String,
    },

    /// A result to store is larger than the store accepts. Nothing was written.
    #[error("result of {len} bytes is over the limit of {max} bytes")]
    ResultTooLarge {
        /// Size of the rejected result.
        len: usize,
        /// The store's limit.
        max: usize,
    },

    /// The store could not be reached or did not answer in time. Retryable: the operation may or
    /// may not have taken effect, and every transition is safe to retry (a replayed transition
    /// that already took effect answers `Ok`).
    ///
    /// `Display` shows the whole chain of causes, so a log line alone tells what happened.
    #[error("{store} store unavailable: {}", Chain(source.as_ref()))]
    Unavailable {
        /// Which backend.
        store: &'static str,
        /// The underlying error.
        #[source]
        source: BoxError,
    },

    /// The store answered with an error that retrying will not fix.
    ///
    /// `Display` shows the whole chain of causes, so a log line alone tells what happened.
    #[error("{store} store error: {}", Chain(source.as_ref()))]
    Backend {
        /// Which backend.
        store: &'static str,
        /// The underlying error.
        #[source]
        source: BoxError,
    },

    /// A stored record could not be decoded.
    #[error("corrupt record in {store} store for {key}: {reason}")]
    CorruptRecord {
        /// Which backend.
        store: &'static str,
        /// The storage key as text.
        key: String,
        /// What was wrong.
        reason: String,
    },

    /// A transactional completion ([`TransactionalStore::complete_with`](crate::TransactionalStore::complete_with))
    /// was refused because one of the handler's own writes could not apply: a condition the
    /// handler put on it failed (DynamoDB `ConditionCheck` or condition expression, a compare
    /// the handler asked for). Nothing was written, neither the writes nor the completion; the
    /// lease is still held. The executor records it as a handler failure whose kind the user
    /// chooses (retryable or terminal).
    #[error("{store} store refused write {index} of the handler's effect: {reason}")]
    EffectRefused {
        /// Which backend.
        store: &'static str,
        /// The position of the refused write in the handler's list, from 0.
        index: usize,
        /// What the store said.
        reason: String,
    },

    /// The store does not offer this operation (a custom store that implements only the
    /// required methods of the trait, for instance, has no listing).
    #[error("{store} store does not support {operation}")]
    Unsupported {
        /// Which backend.
        store: &'static str,
        /// The operation (`list`, ...).
        operation: &'static str,
    },

    /// The store answers but is not set up for idem: a table, schema or index is missing or has
    /// another shape. Nothing was written. `fix` says how to set it up.
    #[error("{store} store is not set up: {missing}; {fix}")]
    NotSetUp {
        /// Which backend.
        store: &'static str,
        /// What is missing (for instance `table "idem"."idem_records"`).
        missing: String,
        /// How to create it (for instance `run PostgresStore::migrate()`).
        fix: String,
    },
}

/// Why a fenced transition was refused: what the store found instead of the caller's live lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LostLease {
    /// Another acquisition took the key over: the record carries a newer token.
    Superseded {
        /// The record's current token.
        current: FencingToken,
    },
    /// The record still carries the caller's token but is no longer in progress, and the call
    /// was not a replay of the transition that finished it (a `complete` after a `fail`, a
    /// `complete` with other result bytes, ...).
    NotInProgress {
        /// The state the record is in.
        state: StateKind,
    },
    /// There is no record: it was deleted or is past its retention.
    Gone,
}

impl LostLease {
    /// Classifies a refusal from the token and state the store found (`None`: no record).
    ///
    /// A different token is [`LostLease::Superseded`], whatever the state; the caller's own token
    /// on a record not in progress is [`LostLease::NotInProgress`]. Stores call this after their
    /// transition was refused, so `found` is never the caller's live lease; if it is (a store bug
    /// or a record changed between two reads), it is reported as superseded by the same token.
    pub fn classify(presented: FencingToken, found: Option<(FencingToken, StateKind)>) -> Self {
        match found {
            None => Self::Gone,
            Some((current, _)) if current != presented => Self::Superseded { current },
            Some((_, StateKind::InProgress)) => Self::Superseded { current: presented },
            Some((_, state)) => Self::NotInProgress { state },
        }
    }

    /// The record's current token, where the store reported one that differs from the caller's.
    pub fn current_token(&self) -> Option<FencingToken> {
        match self {
            Self::Superseded { current } => Some(*current),
            _ => None,
        }
    }
}

impl fmt::Display for LostLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Superseded { current } => write!(f, "superseded by token {current}"),
            Self::NotInProgress { state } => {
                write!(f, "the record is no longer in progress (it is {state})")
            }
            Self::Gone => f.write_str("the record is gone (deleted or past retention)"),
        }
    }
}

/// Displays an error and every `source` below it, joined by `: `.
struct Chain<'a>(&'a (dyn std::error::Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut last = self.0.to_string();
        let mut next = self.0.source();
        while let Some(cause) = next {
            let text = cause.to_string();
            // Many drivers repeat their cause's text in their own; print each text once.
            if !last.contains(&text) {
                write!(f, ": {text}")?;
            }
            last = text;
            next = cause.source();
        }
        Ok(())
    }
}

/// The error inside [`Error::Unavailable`] when a store gave up waiting for an answer.
#[derive(Clone, Copy, Debug, thiserror::Error)]
#[error("no answer within {after:?}")]
pub struct TimedOut {
    /// How long the store waited.
    pub after: Duration,
}

impl Error {
    /// Builds [`Error::InvalidInput`].
    pub fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidInput {
            field,
            reason: reason.into(),
        }
    }

    /// Builds [`Error::Unavailable`].
    pub fn unavailable(store: &'static str, source: impl Into<BoxError>) -> Self {
        Self::Unavailable {
            store,
            source: source.into(),
        }
    }

    /// Builds [`Error::Backend`].
    pub fn backend(store: &'static str, source: impl Into<BoxError>) -> Self {
        Self::Backend {
            store,
            source: source.into(),
        }
    }

    /// Builds [`Error::Unavailable`] with [`TimedOut`]: the operation did not answer within
    /// `after`. It may or may not have taken effect.
    pub fn timed_out(store: &'static str, after: Duration) -> Self {
        Self::unavailable(store, TimedOut { after })
    }

    /// Builds [`Error::LeaseLost`] from the token and state the store found (`None`: no record),
    /// as [`LostLease::classify`] reads them.
    pub fn lease_lost(lease: &crate::Lease, found: Option<(FencingToken, StateKind)>) -> Self {
        Self::LeaseLost {
            key: lease.key.clone(),
            presented: lease.token,
            why: LostLease::classify(lease.token, found),
        }
    }

    /// Builds [`Error::NotSetUp`].
    pub fn not_set_up(
        store: &'static str,
        missing: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Self::NotSetUp {
            store,
            missing: missing.into(),
            fix: fix.into(),
        }
    }

    /// Builds [`Error::CorruptRecord`].
    pub fn corrupt(store: &'static str, key: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::CorruptRecord {
            store,
            key: key.into(),
            reason: reason.into(),
        }
    }

    /// Whether retrying the same operation later may succeed (only [`Error::Unavailable`]).
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Unavailable { .. })
    }

    /// Whether this is [`Error::LeaseLost`].
    pub fn is_lease_lost(&self) -> bool {
        matches!(self, Self::LeaseLost { .. })
    }
}
