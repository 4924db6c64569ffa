//! The handler under its lease: panics caught, heartbeats, cancellation on a lost lease or a
//! passed local deadline.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::{Pin, pin};
use std::sync::{Arc, OnceLock};
use std::task::Poll;

use futures::FutureExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::time::Instant;
use tracing::Span;

use super::batch::RecordQueue;
use super::record::Failure;
use crate::Executor;
use crate::codec::Codec;
use crate::context::{HandlerContext, HandlerError};
use crate::error::ExecutorError;
use crate::heartbeat::{Heartbeats, Registration};
use crate::lease::{LeaseState, release_unstarted_lease};
use crate::metric_names::Counter;
use crate::outcome::Outcome;
use crate::transactional::Recorder;
use idem_core::{FailureKind, Lease};

/// Why a handler was cancelled.
enum Cancelled {
    /// A heartbeat found the lease lost.
    LeaseLost,
    /// The local lease deadline passed without a successful heartbeat.
    Deadline,
}

/// A lease held by this call, with its local deadline and (once needed) its heartbeat.
///
/// Dropped before its handler was called (the call dropped while the message waited for a
/// handler slot, say a batch given up on a revocation), it gives the key back: a release is sent
/// in the background, so that the next owner runs the handler at once, as this attempt, instead
/// of waiting out the lease and counting a takeover for a handler that never ran.
pub(super) struct Leased<'a> {
    heartbeats: &'a Arc<Heartbeats>,
    pub(super) state: Arc<LeaseState>,
    registration: OnceLock<Registration<'a>>,
    /// Where its completion or failure is sent: grouped with others in a batch, or (`None`)
    /// straight to the store.
    pub(super) records: Option<&'a RecordQueue>,
    /// Whether its handler was called (or the lease found lost): then a drop releases nothing.
    handled: bool,
}

/// How long a release sent for a lease dropped before its handler ran may take.
const DROP_RELEASE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

impl Drop for Leased<'_> {
    fn drop(&mut self) {
        if self.handled {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = self.heartbeats.store().clone();
        let lease = self.state.lease.clone();
        runtime.spawn(async move {
            let otherwise = "dropped before its handler ran, the lease expires";
            release_unstarted_lease(&store, &lease, DROP_RELEASE_TIMEOUT, otherwise).await;
        });
    }
}

impl<'a> Leased<'a> {
    /// A lease granted by an acquire sent at `sent`.
    pub(super) fn new(
        heartbeats: &'a Arc<Heartbeats>,
        lease: Lease,
        sent: Instant,
        ttl: std::time::Duration,
        records: Option<&'a RecordQueue>,
    ) -> Self {
        Self {
            heartbeats,
            state: LeaseState::new(lease, sent, ttl),
            registration: OnceLock::new(),
            records,
            handled: false,
        }
    }

    /// Marks the lease as taken care of: its handler is called (or it was found lost), and a
    /// drop releases nothing.
    pub(super) fn handled(&mut self) {
        self.handled = true;
    }

    /// The lease.
    pub(super) fn lease(&self) -> &Lease {
        &self.state.lease
    }

    /// Starts heartbeating, if not yet.
    pub(super) fn heartbeat(&self) {
        self.registration
            .get_or_init(|| self.heartbeats.register(Arc::clone(&self.state)));
    }
}

/// What one handler run came to.
pub(super) enum Handled<T> {
    Value(T),
    Error(HandlerError),
    Panicked(String),
}

impl<C: Codec, R: Recorder> Executor<C, R> {
    /// Runs the handler under the lease, heartbeating while it is pending, then records what it
    /// came to.
    pub(super) async fn execute<F, Fut, T>(
        &self,
        lease: Lease,
        sent: Instant,
        takeover: bool,
        handler: F,
        span: &Span,
    ) -> Result<Outcome<T>, ExecutorError>
    where
        F: FnOnce(HandlerContext) -> Fut,
        Fut: Future<Output = Result<R::Returns<T>, HandlerError>>,
        T: Serialize + DeserializeOwned,
    {
        let inner = &self.inner;
        self.started(&lease, takeover, span);
        let leased = Leased::new(&inner.heartbeats, lease, sent, inner.config.lease_ttl, None);
        self.execute_leased(leased, takeover, handler).await
    }

    /// Notes a lease about to run its handler on the span (and counts a takeover).
    pub(super) fn started(&self, lease: &Lease, takeover: bool, span: &Span) {
        span.record("attempt", lease.attempt);
        span.record("token", lease.token.get());
        if takeover {
            self.count(Counter::Takeovers);
            tracing::info!(attempt = lease.attempt, "took over an expired lease");
        }
    }

    /// Runs the handler under a lease already held, heartbeating while it is pending, then
    /// records what it came to.
    pub(super) async fn execute_leased<F, Fut, T>(
        &self,
        mut leased: Leased<'_>,
        takeover: bool,
        handler: F,
    ) -> Result<Outcome<T>, ExecutorError>
    where
        F: FnOnce(HandlerContext) -> Fut,
        Fut: Future<Output = Result<R::Returns<T>, HandlerError>>,
        T: Serialize + DeserializeOwned,
    {
        leased.handled();
        let ctx = HandlerContext::leased(Arc::clone(&leased.state), takeover);
        let handled = {
            let mut run = pin!(catching(handler, ctx));
            // A handler that finishes at its first poll never needs a heartbeat.
            match futures::poll!(run.as_mut()) {
                Poll::Ready(handled) => Ok(handled),
                Poll::Pending => Box::pin(watch(run, &leased)).await,
            }
            // The handler's future is dropped here, before anything is recorded.
        };
        // `leased` (and its heartbeat) lives until the record is settled.
        match handled {
            Err(Cancelled::LeaseLost) => {
                tracing::warn!("lease lost while the handler ran: handler cancelled");
                Ok(self.lease_lost())
            }
            Err(Cancelled::Deadline) => {
                tracing::warn!(
                    "local lease deadline passed without a successful heartbeat: handler cancelled"
                );
                Ok(self.lease_lost())
            }
            Ok(Handled::Value(returned)) => self.complete(&leased, returned).await,
            Ok(Handled::Error(e)) => {
                let kind = if e.is_terminal() {
                    FailureKind::Terminal
                } else {
                    FailureKind::Retryable
                };
                // Boxed, as every path off the successful one: they stay out of its state.
                Box::pin(self.record_failure(&leased, Failure::handler(e.message(), kind))).await
            }
            Ok(Handled::Panicked(message)) => {
                self.count(Counter::Panics);
                Box::pin(self.record_failure(&leased, Failure::panicked(panicked(&message)))).await
            }
        }
    }
}

/// Waits for a handler that did not finish at its first poll, heartbeating its lease; cancels it
/// when a heartbeat finds the lease lost or the local lease deadline passes.
async fn watch<H: Future>(
    mut run: Pin<&mut H>,
    leased: &Leased<'_>,
) -> Result<H::Output, Cancelled> {
    leased.heartbeat();
    let state = &leased.state;
    let cancelled = state.cancellation_token();
    loop {
        let at = state.deadline();
        tokio::select! {
            biased;
            handled = run.as_mut() => return Ok(handled),
            () = cancelled.cancelled() => return Err(Cancelled::LeaseLost),
            () = tokio::time::sleep_until(at) => {
                // A heartbeat may have moved the deadline on meanwhile.
                if state.deadline() <= Instant::now() {
                    state.cancel();
                    return Err(Cancelled::Deadline);
                }
            }
        }
    }
}

/// Runs the handler, catching a panic in its construction or in its future.
pub(super) async fn catching<F, Fut, T>(handler: F, ctx: HandlerContext) -> Handled<T>
where
    F: FnOnce(HandlerContext) -> Fut,
    Fut: Future<Output = Result<T, HandlerError>>,
{
    match AssertUnwindSafe(async move { handler(ctx).await })
        .catch_unwind()
        .await
    {
        Ok(Ok(value)) => Handled::Value(value),
        Ok(Err(e)) => Handled::Error(e),
        Err(payload) => Handled::Panicked(panic_message(&*payload)),
    }
}

/// The error recorded for a handler that panicked with `message`.
pub(super) fn panicked(message: &str) -> String {
    format!("handler panicked: {message}")
}

/// The message of a panic payload.
pub(super) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_owned()
    }
}
