//! The user's handler.

use std::future::Future;

use idem_core::executor::{HandlerContext, HandlerError};

use crate::message::KafkaMessage;

/// The business handler a [`KafkaRunner`](crate::KafkaRunner) runs for each record whose key it
/// acquired.
///
/// Implemented for every `Fn(KafkaMessage, HandlerContext) -> impl Future<Output =
/// Result<T, HandlerError>>` that is `Send + Sync + 'static` with a `Send` future. The context
/// carries the key, the attempt number and the lease's fencing token: fence downstream writes
/// with [`HandlerContext::token`].
///
/// When the record's partition is revoked (or the runner shuts down past its drain timeout)
/// while the handler runs, the handler is **let finish**: its result is recorded and committed as
/// usual. After half the [`revoke_timeout`](crate::RunnerOptions::revoke_timeout) it is signalled
/// through [`HandlerContext::cancellation_token`] (also cancelled when the lease is lost). The
/// executor then takes its result only if it returns at once (in the same poll, e.g. from a
/// `select!` on `cancellation_token().cancelled()` returning an error); otherwise it drops the
/// handler's future and records nothing. The lease of a handler that started is **never
/// released**: after a dropped run it expires, and the next owner sees
/// [`is_takeover`](HandlerContext::is_takeover) and the next [`attempt`](HandlerContext::attempt),
/// its cue to reconcile partly done effects. A record revoked before its handler was called has
/// its lease released at once instead (no attempt counted).
pub trait Handler<T>: Send + Sync + 'static {
    /// The future of one run.
    type Future: Future<Output = Result<T, HandlerError>> + Send + 'static;

    /// Runs the handler on one record.
    fn call(&self, msg: KafkaMessage, ctx: HandlerContext) -> Self::Future;
}

impl<F, Fut, T> Handler<T> for F
where
    F: Fn(KafkaMessage, HandlerContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, HandlerError>> + Send + 'static,
{
    type Future = Fut;

    fn call(&self, msg: KafkaMessage, ctx: HandlerContext) -> Fut {
        self(msg, ctx)
    }
}
