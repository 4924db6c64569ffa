//! The store trait every backend implements.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::error::Result;
use crate::key::IdempotencyKey;
use crate::record::{AcquireOutcome, AcquireRequest, Lease, Limits, Record};

/// A shared, type-erased store.
pub type DynStore = Arc<dyn IdempotencyStore>;

/// The backend contract: one atomic operation per state transition, fenced by token.
///
/// # Contract
///
/// Every implementation guarantees all of the following; `idem-conformance` checks each rule.
///
/// **Time.** Leases and retention are judged on the store's clock, never the caller's. A record
/// past its retention deadline (`expires_at`) is treated as absent by every operation, whatever
/// the backend's own expiry sweeping does.
///
/// **Tokens.** Every acquisition and takeover issues a [`FencingToken`](crate::FencingToken)
/// strictly higher than every token the key ever had, including after the record was deleted or
/// expired.
///
/// **`acquire`** is ONE atomic operation and returns exactly one of:
///
/// | record found | result |
/// |---|---|
/// | none, or past retention | `Acquired { attempt: 1, takeover: false }` with a new token |
/// | any state, both fingerprints present and different | `Conflict`, record untouched |
/// | `InProgress`, lease live | `InProgress { owner, retry_after }` |
/// | `InProgress`, lease expired, attempts < max | `Acquired { attempt: n + 1, takeover: true }`, new token |
/// | `InProgress`, lease expired, attempts >= max | `Exhausted { attempts, last_error: None }` |
/// | `Released`, attempts < max | `Acquired { attempt: n + 1, takeover: false }`, new token |
/// | `Completed` | `Replayed { result }`, byte-identical |
/// | `Failed` retryable, attempts < max | `Acquired { attempt: n + 1, takeover: false }`, new token |
/// | `Failed` retryable, attempts >= max | `Exhausted { attempts, last_error: Some(error) }` |
/// | `Failed` terminal | `Failed { error }`, never re-run |
///
/// `Exhausted` is returned to every later acquire too. A record or request without a
/// fingerprint never conflicts. An acquisition keeps the record's original fingerprint and
/// `created_at`, and clears its retention deadline (records in progress are kept until finished).
///
/// **Fenced transitions** (`extend`, `complete`, `fail`, `release`) are each ONE atomic operation
/// that succeeds only when the record exists, is not past retention, is `InProgress` and carries
/// the lease's token. Otherwise they return [`Error::LeaseLost`](crate::Error::LeaseLost) and
/// change nothing. An expired lease whose key nobody took over is still valid.
///
/// - `extend(lease, ttl)`: the lease now ends at store-now + `ttl`.
/// - `complete(lease, result, retention)`: `InProgress -> Completed`, kept for `retention`.
/// - `fail(lease, error, retryable, retention)`: `InProgress -> Failed`, kept for `retention`.
/// - `release(lease)`: `InProgress -> Released`, the attempt is not counted.
///
/// **Bad input** (owner, lease length, attempts, retention, result or error over
/// [`limits`](IdempotencyStore::limits)) is rejected with a typed error before anything is written.
/// Keys are validated when built ([`IdempotencyKey::new`]).
///
/// **Infrastructure.** An unreachable store answers [`Error::Unavailable`](crate::Error::Unavailable)
/// within a bounded time; it never hangs.
#[async_trait]
pub trait IdempotencyStore: Send + Sync + Debug + 'static {
    /// A short backend name used in errors and metrics (`memory`, `redis`, ...).
    fn name(&self) -> &'static str;

    /// The size limits this store enforces.
    fn limits(&self) -> Limits {
        Limits::default()
    }

    /// Acquires the key, or reports why not (see the contract table).
    async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome>;

    /// Heartbeat: extends the lease to store-now + `ttl`, returning the new lease.
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease>;

    /// Records the result and finishes the work.
    async fn complete(&self, lease: &Lease, result: Bytes, retention: Duration) -> Result<()>;

    /// Records a failure.
    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        retryable: bool,
        retention: Duration,
    ) -> Result<()>;

    /// Gives the key back at once without counting an attempt.
    async fn release(&self, lease: &Lease) -> Result<()>;

    /// Operator read of the whole record; `None` when absent or past retention.
    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>>;

    /// Operator delete; returns whether a record was there. Tokens stay monotonic afterwards.
    async fn delete(&self, key: &IdempotencyKey) -> Result<bool>;

    /// Removes up to `limit` records past retention; returns how many. A no-op (returning 0) where
    /// the backend's own expiry does it.
    async fn purge_expired(&self, limit: usize) -> Result<u64>;
}

macro_rules! forward_store {
    ($($ptr:ident),*) => {$(
        #[async_trait]
        impl<T: IdempotencyStore + ?Sized> IdempotencyStore for $ptr<T> {
            fn name(&self) -> &'static str {
                (**self).name()
            }
            fn limits(&self) -> Limits {
                (**self).limits()
            }
            async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome> {
                (**self).acquire(req).await
            }
            async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
                (**self).extend(lease, ttl).await
            }
            async fn complete(&self, lease: &Lease, result: Bytes, retention: Duration) -> Result<()> {
                (**self).complete(lease, result, retention).await
            }
            async fn fail(
                &self,
                lease: &Lease,
                error: &str,
                retryable: bool,
                retention: Duration,
            ) -> Result<()> {
                (**self).fail(lease, error, retryable, retention).await
            }
            async fn release(&self, lease: &Lease) -> Result<()> {
                (**self).release(lease).await
            }
            async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
                (**self).get(key).await
            }
            async fn delete(&self, key: &IdempotencyKey) -> Result<bool> {
                (**self).delete(key).await
            }
            async fn purge_expired(&self, limit: usize) -> Result<u64> {
                (**self).purge_expired(limit).await
            }
        }
    )*};
}

forward_store!(Arc, Box);
