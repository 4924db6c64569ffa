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
/// while the handler runs, its future is dropped at its next await point and the lease released.
/// Handlers doing blocking work can watch [`HandlerContext::cancellation_token`] for a lost
/// lease; a revocation is not signalled there.
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
