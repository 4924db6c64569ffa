//! The handler API every runner shares.

use std::future::Future;

use crate::context::{HandlerContext, HandlerError};
use crate::message::Message;

/// A message handler registered once and called for every message whose key was acquired: the
/// one handler API of the executor and of every runner built on it (Kafka today; SQS, AMQP and
/// NATS later), so one handler type serves every broker.
///
/// `M` is what the handler is given besides its [`HandlerContext`]: the runner's message type
/// (`KafkaMessage`, ...), or `()` for a handler that needs only the context. `T` is what the
/// handler returns: on a plain [`Executor`](crate::Executor), its result, stored through the
/// executor's [`Codec`](crate::Codec) and replayed to duplicates; on a
/// [`TransactionalExecutor`](crate::TransactionalExecutor), a [`Commit`](crate::Commit) of that
/// result and the writes to commit with it (the executor's
/// [`Recorder::Returns`](crate::Recorder::Returns) names which).
///
/// Implemented for
/// - closures `Fn(M, HandlerContext) -> impl Future<Output = Result<T, HandlerError>>`, for any
///   message type `M` that implements [`Message`];
/// - closures `Fn(HandlerContext) -> impl Future<Output = Result<T, HandlerError>>`, as
///   `Handler<(), T>`;
///
/// and by hand for handler types that hold clients and configuration:
///
/// ```
/// use std::future::Future;
/// use idem_executor::{Handler, HandlerContext, HandlerError, RawMessage};
///
/// struct Charge { bank: std::sync::Arc<String> }
///
/// impl Handler<RawMessage, String> for Charge {
///     type Future = std::pin::Pin<Box<dyn Future<Output = Result<String, HandlerError>> + Send>>;
///
///     fn call(&self, msg: RawMessage, ctx: HandlerContext) -> Self::Future {
///         let bank = self.bank.clone();
///         Box::pin(async move {
///             // charge msg.payload() at `bank`, fenced with ctx.token()
///             Ok(format!("{} bytes charged at {bank} (attempt {})", msg.headers().len(), ctx.attempt()))
///         })
///     }
/// }
///
/// fn register<H: Handler<RawMessage, String>>(_: H) {}
/// register(Charge { bank: "acme".to_owned().into() });
/// register(|msg: RawMessage, ctx: HandlerContext| async move {
///     Ok::<_, HandlerError>(format!("{} bytes, token {:?}", msg.payload().len(), ctx.token()))
/// });
/// # use idem_executor::Message;
/// ```
///
/// Run one message through it with [`Executor::handle`](crate::Executor::handle), or call
/// [`call`](Self::call) from the closure given to [`Executor::run`](crate::Executor::run) (what
/// a runner does when it wraps every call, to react to a revoked partition say). On a value of a
/// concrete closure type, write `Handler::call(&f, msg, ctx)`: `f.call(..)` would also name the
/// unstable `Fn::call` and draw a future-compatibility warning (generic code over `H: Handler`
/// is unaffected).
///
/// The bounds (`Send + Sync + 'static` handler, `Send + 'static` future) are what a runner needs
/// to share the handler between its tasks and spawn its calls. [`Executor::run`](crate::Executor::run)
/// needs none of them: it takes any `FnOnce(HandlerContext)` closure.
pub trait Handler<M, T>: Send + Sync + 'static {
    /// The future of one call.
    type Future: Future<Output = Result<T, HandlerError>> + Send + 'static;

    /// Handles one message. Called at most once per message delivery, only when the key was
    /// acquired (or the message passes through un-deduplicated by policy).
    fn call(&self, msg: M, ctx: HandlerContext) -> Self::Future;
}

impl<F, M, Fut, T> Handler<M, T> for F
where
    F: Fn(M, HandlerContext) -> Fut + Send + Sync + 'static,
    M: Message,
    Fut: Future<Output = Result<T, HandlerError>> + Send + 'static,
{
    type Future = Fut;

    fn call(&self, msg: M, ctx: HandlerContext) -> Fut {
        self(msg, ctx)
    }
}

// `()` is not a `Message` (and no other crate can make it one), so this impl does not overlap
// the one above.
impl<F, Fut, T> Handler<(), T> for F
where
    F: Fn(HandlerContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, HandlerError>> + Send + 'static,
{
    type Future = Fut;

    fn call(&self, (): (), ctx: HandlerContext) -> Fut {
        self(ctx)
    }
}
