//! What a handler receives and returns besides its value.

use std::fmt;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::heartbeat::LeaseDeadline;

use crate::error::BoxError;
use crate::key::IdempotencyKey;
use crate::record::{FencingToken, Lease};

/// What a handler knows about the delivery it processes.
///
/// Fence your own writes with [`token`](Self::token): a downstream system that keeps the highest
/// token seen per key and refuses lower ones cannot be written by a worker that lost its lease.
#[derive(Clone, Debug)]
pub struct HandlerContext {
    key: Option<IdempotencyKey>,
    lease: Option<Lease>,
    takeover: bool,
    cancel: CancellationToken,
    deadline: Option<LeaseDeadline>,
}

impl HandlerContext {
    pub(crate) fn leased(
        lease: Lease,
        takeover: bool,
        cancel: CancellationToken,
        deadline: LeaseDeadline,
    ) -> Self {
        Self {
            key: Some(lease.key.clone()),
            lease: Some(lease),
            takeover,
            cancel,
            deadline: Some(deadline),
        }
    }

    pub(crate) fn pass_through(key: Option<IdempotencyKey>) -> Self {
        Self {
            key,
            lease: None,
            takeover: false,
            cancel: CancellationToken::new(),
            deadline: None,
        }
    }

    /// The idempotency key; `None` when the message had none (pass-through).
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.key.as_ref()
    }

    /// The attempt number (1 for the first; 1 as well when not deduplicated).
    pub fn attempt(&self) -> u32 {
        self.lease.as_ref().map_or(1, |l| l.attempt)
    }

    /// The fencing token of this acquisition; `None` when not deduplicated.
    pub fn token(&self) -> Option<FencingToken> {
        self.lease.as_ref().map(|l| l.token)
    }

    /// The lease as acquired (heartbeats move its expiry on in the store, not in this copy);
    /// `None` when not deduplicated.
    pub fn lease(&self) -> Option<&Lease> {
        self.lease.as_ref()
    }

    /// Whether this acquisition took over the expired lease of a crashed or stalled attempt:
    /// its effects may be partly done.
    pub fn is_takeover(&self) -> bool {
        self.takeover
    }

    /// Whether the message goes through the store (`false` for a pass-through).
    pub fn is_deduplicated(&self) -> bool {
        self.lease.is_some()
    }

    /// The local lease deadline: until when this worker may assume it holds the lease. `None`
    /// when not deduplicated.
    ///
    /// It is the instant the acquire, or the last successful heartbeat, was *sent*, plus the lease
    /// TTL, minus a safety margin of a tenth of the lease (for clock drift between this process
    /// and the store). Heartbeats move it on; when the store is unreachable it stays put, and when
    /// it passes the executor cancels the handler (see the
    /// [module docs](crate::executor#lost-lease)). Check it (against
    /// [`tokio::time::Instant::now`]) before an irreversible action, and leave enough time for the
    /// action itself:
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use idem_core::executor::HandlerContext;
    /// fn may_charge(ctx: &HandlerContext) -> bool {
    ///     ctx.lease_deadline()
    ///         .is_none_or(|at| tokio::time::Instant::now() + Duration::from_secs(2) < at)
    /// }
    /// ```
    pub fn lease_deadline(&self) -> Option<Instant> {
        self.deadline.as_ref().map(LeaseDeadline::get)
    }

    /// Cancelled when a heartbeat finds the lease lost, or when the local
    /// [lease deadline](Self::lease_deadline) passes without a successful heartbeat. The executor
    /// then drops the handler's future at its next await point anyway; handlers doing blocking
    /// work can check it.
    pub fn cancellation_token(&self) -> &CancellationToken {
        &self.cancel
    }

    /// Whether the lease was found lost (or its local deadline passed).
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }
}

/// A handler's error: retryable (the default, and what `?` gives) or terminal.
///
/// A retryable error is recorded and the key can be acquired again by a redelivery, until the
/// attempts run out. A terminal error is recorded and replayed to every later delivery as
/// [`Outcome::Failed`](super::Outcome::Failed): the work never runs again.
///
/// ```
/// use idem_core::executor::HandlerError;
///
/// fn parse(amount: &str) -> Result<u64, HandlerError> {
///     // malformed input will never parse: terminal
///     amount.parse().map_err(HandlerError::terminal)
/// }
/// # assert!(parse("x").unwrap_err().is_terminal());
/// ```
pub struct HandlerError {
    source: BoxError,
    terminal: bool,
}

impl HandlerError {
    /// A retryable error.
    pub fn retryable(error: impl Into<BoxError>) -> Self {
        Self {
            source: error.into(),
            terminal: false,
        }
    }

    /// A terminal error.
    pub fn terminal(error: impl Into<BoxError>) -> Self {
        Self {
            source: error.into(),
            terminal: true,
        }
    }

    /// Whether the error is terminal.
    pub fn is_terminal(&self) -> bool {
        self.terminal
    }

    /// The underlying error.
    pub fn inner(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.source
    }

    /// Consumes the wrapper, giving the underlying error.
    pub fn into_inner(self) -> BoxError {
        self.source
    }

    /// The message recorded in the store: the error and its `source` chain, joined by `": "`.
    pub fn message(&self) -> String {
        let mut message = self.source.to_string();
        let mut source = self.source.source();
        while let Some(s) = source {
            message.push_str(": ");
            message.push_str(&s.to_string());
            source = s.source();
        }
        message
    }
}

impl<E: Into<BoxError>> From<E> for HandlerError {
    /// A retryable error, so that `?` works on any error.
    fn from(error: E) -> Self {
        Self::retryable(error)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("source", &self.source)
            .field("terminal", &self.terminal)
            .finish()
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.terminal {
            "terminal"
        } else {
            "retryable"
        };
        write!(f, "{kind} handler error: {}", self.source)
    }
}
