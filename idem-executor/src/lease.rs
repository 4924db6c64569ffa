//! A lease in flight, shared by the executor, the heartbeat task and the handler's context.
//!
//! Its local deadline is the local instant until which this process may assume it still holds
//! the lease: `sent + ttl - ttl / 10`, where `sent` is the instant the acquire or the last
//! *successful* extend was sent (not answered: the store started the new lease at some point
//! after that). The tenth of the lease is a safety margin for the drift between the local clock
//! and the store's. The executor cancels a handler whose deadline passes.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use idem_core::{DynStore, Lease};

/// Gives a lease whose handler never started back to the store, waiting at most `timeout`, and
/// logs the outcome; `otherwise` says what happens when the release fails. `true` once
/// released.
pub(crate) async fn release_unstarted_lease(
    store: &DynStore,
    lease: &Lease,
    timeout: Duration,
    otherwise: &str,
) -> bool {
    match tokio::time::timeout(timeout, store.release(lease)).await {
        Ok(Ok(())) => {
            tracing::info!(key = %lease.key, token = %lease.token, "the handler never started: lease released");
            true
        }
        Ok(Err(e)) => {
            tracing::warn!(key = %lease.key, error = %e, "the handler never started: lease release failed; {otherwise}");
            false
        }
        Err(_) => {
            tracing::warn!(key = %lease.key, "the handler never started: lease release timed out; {otherwise}");
            false
        }
    }
}

/// One lease in flight: one allocation per message, the cancellation token made only when
/// something asks for it (a handler still pending at its first poll, or one that reads it).
#[derive(Debug)]
pub(crate) struct LeaseState {
    pub(crate) lease: Lease,
    /// Only moves forward.
    deadline: Mutex<Instant>,
    cancel: OnceLock<CancellationToken>,
}

impl LeaseState {
    /// The state of `lease`, of `ttl`, whose acquire was sent at `sent`.
    pub(crate) fn new(lease: Lease, sent: Instant, ttl: Duration) -> Arc<Self> {
        Arc::new(Self {
            lease,
            deadline: Mutex::new(local_deadline(sent, ttl)),
            cancel: OnceLock::new(),
        })
    }

    /// The current local deadline.
    pub(crate) fn deadline(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Moves the deadline on after an extension to `ttl` sent at `sent` succeeded.
    pub(crate) fn extended(&self, sent: Instant, ttl: Duration) {
        let mut at = self.deadline.lock().unwrap_or_else(|e| e.into_inner());
        *at = (*at).max(local_deadline(sent, ttl));
    }

    /// The token cancelled when the lease is found lost or its deadline passes.
    pub(crate) fn cancellation_token(&self) -> &CancellationToken {
        self.cancel.get_or_init(CancellationToken::new)
    }

    /// Cancels the handler.
    pub(crate) fn cancel(&self) {
        self.cancellation_token().cancel();
    }

    /// Whether the handler was cancelled.
    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancel
            .get()
            .is_some_and(CancellationToken::is_cancelled)
    }
}

/// `sent + ttl`, less the safety margin of a tenth of the lease.
fn local_deadline(sent: Instant, ttl: Duration) -> Instant {
    sent + (ttl - ttl / 10)
}
