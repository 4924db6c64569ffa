//! The one error type of idem stores.

use crate::key::IdempotencyKey;
use crate::record::FencingToken;

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
    /// A fenced transition presented a token that is not the record's current one, or the record
    /// is gone: another worker took the key over (or it was deleted or expired). Nothing changed.
    #[error("lease lost on {key}: presented token {presented}, current {}", fmt_current(.current))]
    LeaseLost {
        /// The key of the lease.
        key: IdempotencyKey,
        /// The token the caller presented.
        presented: FencingToken,
        /// The record's current token, or `None` when there is no record.
        current: Option<FencingToken>,
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
    /// may not have taken effect, and every transition is safe to retry.
    #[error("{store} store unavailable: {source}")]
    Unavailable {
        /// Which backend.
        store: &'static str,
        /// The underlying error.
        #[source]
        source: BoxError,
    },

    /// The store answered with an error that retrying will not fix.
    #[error("{store} store error: {source}")]
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
}

fn fmt_current(current: &Option<FencingToken>) -> String {
    match current {
        Some(token) => token.to_string(),
        None => "none (record gone)".to_owned(),
    }
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
