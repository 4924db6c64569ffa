//! How an executor records a handler's success: the plain completion, or the transactional one
//! that commits the handler's writes with it.
//!
//! An [`Executor`](crate::Executor) is generic over its [`Recorder`]: [`Plain`] (the default)
//! records the result with [`complete`](idem_core::IdempotencyStore::complete), and
//! [`Transactional<S>`] records it with
//! [`complete_with`](idem_core::TransactionalStore::complete_with) together with the writes the
//! handler hands back in a [`Commit`]. Everything else (keys, fingerprints, acquire, heartbeats,
//! cancellation, failures, re-sends, the dead-letter hook, tracing, metrics, replays) is the same
//! code for both: the recording step is the only thing that differs.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::config::{ConfigError, ExecutorConfig, MissingKeyPolicy, StoreErrorPolicy};
use idem_core::{DynStore, IdempotencyStore, Lease, TransactionalStore};

/// What a transactional handler returns: its result, and the writes to commit with it.
///
/// The executor stores `result` (through its [`Codec`](crate::Codec)) and applies `writes` in
/// ONE atomic operation of the store
/// ([`TransactionalStore::complete_with`](idem_core::TransactionalStore::complete_with)): both
/// commit, or neither does. `W` is the store's own writes type
/// ([`MemoryWrites`](idem_core::MemoryWrites) for `MemoryStore`; the Redis, DynamoDB and
/// PostgreSQL stores each have theirs), so one handler shape serves every transactional store.
///
/// ```
/// use idem_core::MemoryWrites;
/// use idem_executor::Commit;
///
/// let commit = Commit::new(42u64, MemoryWrites::new().put("balance/alice", "58"));
/// assert_eq!(commit.result, 42);
/// assert_eq!(commit.writes.len(), 1);
/// // A result with nothing to write: `W` must have a default (no writes).
/// let _: Commit<&str, MemoryWrites> = Commit::result_only("nothing to do");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Commit<T, W> {
    /// The handler's result, stored and replayed to duplicates.
    pub result: T,
    /// The writes committed with the result.
    pub writes: W,
}

impl<T, W> Commit<T, W> {
    /// The result `result`, committed with `writes`.
    pub fn new(result: T, writes: W) -> Self {
        Self { result, writes }
    }

    /// The result alone, with no writes (`W::default()`).
    pub fn result_only(result: T) -> Self
    where
        W: Default,
    {
        Self::new(result, W::default())
    }

    /// The result and the writes.
    pub fn into_parts(self) -> (T, W) {
        (self.result, self.writes)
    }
}

mod sealed {
    pub trait Sealed {}
}

/// How an [`Executor`](crate::Executor) records a handler's success: [`Plain`] or
/// [`Transactional<S>`]. Sealed: those two are the only implementations.
///
/// Code that must work with both (a broker runner, say) is generic over `R: Recorder` and asks
/// its handler for [`R::Returns<T>`](Recorder::Returns): `T` for a plain executor,
/// [`Commit<T, W>`] for a transactional one. See
/// [the crate docs](crate#runners-and-the-transactional-path).
pub trait Recorder: sealed::Sealed + Send + Sync + 'static {
    /// What a handler returns for a result `T`: `T` itself ([`Plain`]), or [`Commit<T, W>`]
    /// with the store's writes type `W` ([`Transactional<S>`]).
    type Returns<T>;

    /// The writes carried by [`Returns<T>`](Self::Returns) (`()` for [`Plain`]).
    #[doc(hidden)]
    type Writes: Clone + Send + Sync + 'static;

    /// Whether the handler's effect commits with the completion.
    #[doc(hidden)]
    const TRANSACTIONAL: bool;

    /// Splits what the handler returned into its result and its writes.
    #[doc(hidden)]
    fn split<T>(returned: Self::Returns<T>) -> (T, Self::Writes);

    /// Records the success: `complete`, or `complete_with` and the writes.
    #[doc(hidden)]
    fn complete<'a>(
        &'a self,
        store: &'a DynStore,
        lease: &'a Lease,
        result: Bytes,
        retention: Duration,
        writes: Self::Writes,
    ) -> impl Future<Output = idem_core::Result<()>> + Send + 'a;

    /// Refuses what this recorder cannot honour.
    #[doc(hidden)]
    fn check_config(config: &ExecutorConfig) -> Result<(), ConfigError>;
}

/// The plain recorder (the default of [`Executor`](crate::Executor)): the handler returns its
/// result `T`, recorded with [`complete`](idem_core::IdempotencyStore::complete). Any effect the
/// handler has lives outside the store.
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct Plain;

impl sealed::Sealed for Plain {}

impl Recorder for Plain {
    type Returns<T> = T;
    type Writes = ();
    const TRANSACTIONAL: bool = false;

    fn split<T>(returned: T) -> (T, ()) {
        (returned, ())
    }

    fn complete<'a>(
        &'a self,
        store: &'a DynStore,
        lease: &'a Lease,
        result: Bytes,
        retention: Duration,
        (): (),
    ) -> impl Future<Output = idem_core::Result<()>> + Send + 'a {
        store.complete(lease, result, retention)
    }

    fn check_config(_: &ExecutorConfig) -> Result<(), ConfigError> {
        Ok(())
    }
}

/// The transactional recorder of a [`TransactionalExecutor`](crate::TransactionalExecutor): the
/// handler returns a [`Commit<T, S::Writes>`](Commit), recorded with
/// [`complete_with`](idem_core::TransactionalStore::complete_with) on the store `S` the executor
/// was built over, so the records and the writes always go to the same store.
///
/// `S::Writes` must be `Clone`: a completion answered `Unavailable` is sent again, with the same
/// writes, while the lease holds (the store answers `Ok` to a completion that already took
/// effect and applies nothing again).
pub struct Transactional<S> {
    store: Arc<S>,
}

impl<S> Transactional<S> {
    pub(crate) fn new(store: Arc<S>) -> Self {
        Self { store }
    }

    /// The store.
    pub fn store(&self) -> &Arc<S> {
        &self.store
    }
}

impl<S: IdempotencyStore> fmt::Debug for Transactional<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transactional")
            .field("store", &self.store.name())
            .finish()
    }
}

impl<S> sealed::Sealed for Transactional<S> {}

impl<S> Recorder for Transactional<S>
where
    S: TransactionalStore,
    S::Writes: Clone,
{
    type Returns<T> = Commit<T, S::Writes>;
    type Writes = S::Writes;
    const TRANSACTIONAL: bool = true;

    fn split<T>(returned: Commit<T, S::Writes>) -> (T, S::Writes) {
        returned.into_parts()
    }

    fn complete<'a>(
        &'a self,
        _: &'a DynStore,
        lease: &'a Lease,
        result: Bytes,
        retention: Duration,
        writes: S::Writes,
    ) -> impl Future<Output = idem_core::Result<()>> + Send + 'a {
        self.store.complete_with(lease, result, retention, writes)
    }

    fn check_config(config: &ExecutorConfig) -> Result<(), ConfigError> {
        // The writes commit only with the completion of an acquired key: running the handler
        // without the store would drop them, silently losing the effect.
        if config.missing_key == MissingKeyPolicy::PassThrough {
            return Err(ConfigError::new(
                "missing_key",
                "is PassThrough; a transactional executor commits the handler's writes with the \
                 key's completion, so a message without a key cannot run: use Reject",
            ));
        }
        if config.store_errors == StoreErrorPolicy::FailOpen {
            return Err(ConfigError::new(
                "store_errors",
                "is FailOpen; a transactional executor commits the handler's writes through the \
                 store, so it cannot run the handler without it: use FailClosed",
            ));
        }
        Ok(())
    }
}
