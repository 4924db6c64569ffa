//! What a handler receives and returns besides its value.

use std::fmt;
use std::sync::{Arc, OnceLock};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::lease::LeaseState;

use idem_core::{BoxError, FencingToken, IdempotencyKey, Lease};

/// What a handler knows about the delivery it processes.
///
/// Fence your own writes with [`token`](Self::token): a downstream system that keeps the highest
/// token seen per key and refuses lower ones cannot be written by a worker that lost its lease.
#[derive(Clone, Debug)]
pub struct HandlerContext {
    run: Run,
    takeover: bool,
}

#[derive(Clone, Debug)]
enum Run {
    /// Under a lease, shared with the executor and the heartbeat task.
    Leased(Arc<LeaseState>),
    /// Without the store.
    PassThrough {
        key: Option<IdempotencyKey>,
        /// Never cancelled; made when asked for.
        cancel: OnceLock<CancellationToken>,
    },
}

impl HandlerContext {
    pub(crate) fn leased(state: Arc<LeaseState>, takeover: bool) -> Self {
        Self {
            run: Run::Leased(state),
            takeover,
        }
    }

    pub(crate) fn pass_through(key: Option<IdempotencyKey>) -> Self {
        Self {
            run: Run::PassThrough {
                key,
                cancel: OnceLock::new(),
            },
            takeover: false,
        }
    }

    fn state(&self) -> Option<&LeaseState> {
        match &self.run {
            Run::Leased(state) => Some(state),
            Run::PassThrough { .. } => None,
        }
    }

    /// The idempotency key; `None` when the message had none (pass-through).
    pub fn key(&self) -> Option<&IdempotencyKey> {
        match &self.run {
            Run::Leased(state) => Some(&state.lease.key),
            Run::PassThrough { key, .. } => key.as_ref(),
        }
    }

    /// The attempt number (1 for the first; 1 as well when not deduplicated).
    pub fn attempt(&self) -> u32 {
        self.lease().map_or(1, |l| l.attempt)
    }

    /// The fencing token of this acquisition; `None` when not deduplicated.
    pub fn token(&self) -> Option<FencingToken> {
        self.lease().map(|l| l.token)
    }

    /// The lease as acquired (heartbeats move its expiry on in the store, not in this copy);
    /// `None` when not deduplicated.
    pub fn lease(&self) -> Option<&Lease> {
        self.state().map(|state| &state.lease)
    }

    /// Whether this acquisition took over the expired lease of a crashed or stalled attempt:
    /// its effects may be partly done.
    pub fn is_takeover(&self) -> bool {
        self.takeover
    }

    /// Whether the message goes through the store (`false` for a pass-through).
    pub fn is_deduplicated(&self) -> bool {
        self.state().is_some()
    }

    /// The local lease deadline: until when this worker may assume it holds the lease. `None`
    /// when not deduplicated.
    ///
    /// It is the instant the acquire, or the last successful heartbeat, was *sent*, plus the lease
    /// TTL, minus a safety margin of a tenth of the lease (for clock drift between this process
    /// and the store). Heartbeats move it on; when the store is unreachable it stays put, and when
    /// it passes the executor cancels the handler (see the
    /// [module docs](crate#decisions)). [`is_cancelled`](Self::is_cancelled) compares it with the
    /// current time; to leave enough time for an irreversible action itself, compare it with
    /// [`tokio::time::Instant::now`] plus what the action takes:
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use idem_executor::HandlerContext;
    /// fn may_charge(ctx: &HandlerContext) -> bool {
    ///     !ctx.is_cancelled()
    ///         && ctx
    ///             .lease_deadline()
    ///             .is_none_or(|at| tokio::time::Instant::now() + Duration::from_secs(2) < at)
    /// }
    /// ```
    pub fn lease_deadline(&self) -> Option<Instant> {
        self.state().map(LeaseState::deadline)
    }

    /// Cancelled when a heartbeat finds the lease lost, or when the local
    /// [lease deadline](Self::lease_deadline) passes without a successful heartbeat (noticed by
    /// the executor, or by [`is_cancelled`](Self::is_cancelled)). The executor then drops the
    /// handler's future at its next await point anyway; handlers doing blocking work can check
    /// it.
    pub fn cancellation_token(&self) -> &CancellationToken {
        match &self.run {
            Run::Leased(state) => state.cancellation_token(),
            Run::PassThrough { cancel, .. } => cancel.get_or_init(CancellationToken::new),
        }
    }

    /// Whether the handler must stop: the question to ask before every irreversible action.
    ///
    /// `true` when a heartbeat found the lease lost, or when the local
    /// [lease deadline](Self::lease_deadline) has passed: this compares the deadline with the
    /// current time itself, so it answers `true` at once after a stall (a blocked runtime, a
    /// long GC-like pause of the process, a blocking call) that outlasted the deadline, even
    /// before the executor's watch or the heartbeat task had a chance to run. It then also
    /// cancels the [`cancellation_token`](Self::cancellation_token), so both agree. Another
    /// worker may have taken the key over by then: whatever the handler does next would be a
    /// zombie's write (fence it downstream with [`token`](Self::token) in any case).
    ///
    /// Always `false` for a message not deduplicated.
    pub fn is_cancelled(&self) -> bool {
        self.state().is_some_and(|state| {
            if state.is_cancelled() {
                return true;
            }
            if state.deadline() <= Instant::now() {
                state.cancel();
                return true;
            }
            false
        })
    }
}

/// A handler's error: retryable (the default, and what `?` gives) or terminal.
///
/// A retryable error is recorded and the key can be acquired again by a redelivery, until the
/// attempts run out. A terminal error is recorded and replayed to every later delivery as
/// [`Outcome::Failed`](crate::Outcome::Failed): the work never runs again.
///
/// ```
/// use idem_executor::HandlerError;
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
