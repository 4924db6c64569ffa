//! The store trait every backend implements.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::error::{Error, Result};
use crate::key::IdempotencyKey;
use crate::list::{ListQuery, Page};
use crate::record::{
    AcquireOutcome, AcquireRequest, Completion, Failure, FailureKind, Lease, Limits, Record,
};

/// A shared, type-erased store.
pub type DynStore = Arc<dyn IdempotencyStore>;

/// The backend contract: one atomic operation per state transition, fenced by token.
///
/// # Contract
///
/// Every implementation guarantees all of the following; `idem-conformance` checks each rule.
///
/// **Time.** Leases and retention are judged on the store's clock where the store has one (the
/// server's time on Redis and PostgreSQL; [`CasBackend::now`](crate::kit::CasBackend::now) on a
/// kit store). A store without one (DynamoDB, a kit store whose backend has no clock) judges on
/// the calling process's clock and says in its docs how far the processes' clocks may disagree.
/// A record past its retention deadline (`expires_at`) is treated as absent by every operation, whatever
/// the backend's own expiry sweeping does.
///
/// **Tokens.** Every acquisition and takeover issues a [`FencingToken`](crate::FencingToken)
/// strictly higher than every token the key ever had, including after the record was deleted or
/// expired, for as long as the store keeps a trace of the key (the record, a record past
/// retention, or the tombstone a delete leaves; a store may drop tombstones after a documented
/// time). With no trace left, the new token comes from the store's clock (or a sequence), and is
/// higher as long as that clock has not stepped back by more than the time since the earlier
/// token was issued.
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
/// (one round trip, with no read first; a store on the custom-store kit instead reads, then
/// writes only if the value is still what it read) that succeeds only when the record exists, is
/// not past retention, is `InProgress` and carries the lease's token. An expired lease whose key nobody
/// took over is still valid.
///
/// - `extend(lease, ttl)`: the lease now ends at store-now + `ttl`.
/// - `complete(lease, result, retention)`: `InProgress -> Completed`, kept for `retention`.
/// - `fail(lease, error, kind, retention)`: `InProgress -> Failed`, kept for `retention`.
/// - `release(lease)`: `InProgress -> Released`, the attempt is not counted.
///
/// **Replay.** Clients re-send after an ambiguous reply (a timeout, a dropped connection, an SDK
/// retry), so a finishing transition repeated with the same token after it took effect, with
/// the same arguments (the same result bytes; the same error text and kind; a release after the
/// release), returns `Ok` and changes nothing. With other arguments it is `LeaseLost`. The
/// reference rules are [`machine::finish`](crate::machine::finish).
///
/// Every other refused transition returns [`Error::LeaseLost`](crate::Error::LeaseLost) and
/// changes nothing; its [`LostLease`](crate::LostLease) says whether the token was superseded,
/// the record is no longer in progress (and its state), or the record is gone.
///
/// **Bad input** (owner, lease length, attempts, retention, result or error over
/// [`limits`](IdempotencyStore::limits), NUL in an owner or error text) is rejected with a typed
/// error before anything is written, by the core checks ([`AcquireRequest::validate`],
/// [`Limits::check_complete`], [`Limits::check_fail`]), so every store refuses the same inputs.
/// Keys are validated when built ([`IdempotencyKey::new`](crate::IdempotencyKey::new)).
///
/// **Fidelity.** Results round-trip byte-identical; error texts and owners round-trip exactly.
/// A store never alters what it is given.
///
/// **Batches.** `acquire_many`, `complete_many`, `fail_many` and `release_many` take up to
/// [`Limits::max_batch`] items (more: `InvalidInput` with field `batch`, nothing written) and
/// return one result per item, in order, exactly as the single calls made one after the other in
/// that order would have: atomic per key, not across keys. An item that appears twice is
/// processed twice, in order (the second acquire of a key the first one acquired sees it in
/// progress, held by the same owner). A per-item error (bad input, `LeaseLost`) is that item's
/// result; an error that stops the whole call (the store unreachable) is the call's `Err`, and
/// then any item may or may not have taken effect, as for a single call. The trait's defaults
/// loop over the single calls, so a store needs nothing more, and stop at the first
/// [`Unavailable`](crate::Error::Unavailable) or [`NotSetUp`](crate::Error::NotSetUp), which is
/// then the call's `Err` (the items after it would each wait out the same timeout to say the
/// same); stores that can do better answer a batch in one round trip (or one per server shard).
/// A store whose items reach the server as separate requests (DynamoDB's) may answer an outage
/// per item instead: each item then says `Unavailable`, and callers treat both forms alike.
///
/// **Infrastructure.** An unreachable store answers [`Error::Unavailable`](crate::Error::Unavailable)
/// within a bounded time; it never hangs. A store that answers but lacks its table or schema
/// answers [`Error::NotSetUp`](crate::Error::NotSetUp), saying how to create it.
#[async_trait]
pub trait IdempotencyStore: Send + Sync + Debug + 'static {
    /// A short backend name used in errors and metrics (`memory`, `redis`, `redis-cluster`, ...).
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

    /// Records a failure of the given kind.
    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()>;

    /// Gives the key back at once without counting an attempt.
    async fn release(&self, lease: &Lease) -> Result<()>;

    /// Acquires many keys: one outcome per request, in order (see "Batches" above). The default
    /// calls [`acquire`](Self::acquire) for each.
    async fn acquire_many(&self, reqs: &[AcquireRequest]) -> Result<Vec<Result<AcquireOutcome>>> {
        self.limits().check_batch(reqs.len())?;
        let mut out = Vec::with_capacity(reqs.len());
        for req in reqs {
            out.push(item_of_batch(self.acquire(req).await)?);
        }
        Ok(out)
    }

    /// Completes many leases with one retention: one result per item, in order. The default
    /// calls [`complete`](Self::complete) for each.
    async fn complete_many(
        &self,
        items: &[Completion],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        self.limits().check_batch(items.len())?;
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            out.push(item_of_batch(
                self.complete(&item.lease, item.result.clone(), retention)
                    .await,
            )?);
        }
        Ok(out)
    }

    /// Records many failures with one retention: one result per item, in order. The default
    /// calls [`fail`](Self::fail) for each.
    async fn fail_many(&self, items: &[Failure], retention: Duration) -> Result<Vec<Result<()>>> {
        self.limits().check_batch(items.len())?;
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            out.push(item_of_batch(
                self.fail(&item.lease, &item.error, item.kind, retention)
                    .await,
            )?);
        }
        Ok(out)
    }

    /// Releases many leases: one result per lease, in order. The default calls
    /// [`release`](Self::release) for each.
    async fn release_many(&self, leases: &[Lease]) -> Result<Vec<Result<()>>> {
        self.limits().check_batch(leases.len())?;
        let mut out = Vec::with_capacity(leases.len());
        for lease in leases {
            out.push(item_of_batch(self.release(lease).await)?);
        }
        Ok(out)
    }

    /// Operator read of the whole record; `None` when absent or past retention.
    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>>;

    /// Operator delete; returns whether a record was there (one past retention counts as absent,
    /// as for [`get`](Self::get)). Tokens stay monotonic afterwards.
    async fn delete(&self, key: &IdempotencyKey) -> Result<bool>;

    /// Operator listing: one page of the records of a namespace that match the query's status,
    /// age and owner filters ([`ListQuery::matches`] is the reference), in a store-defined order.
    /// Records past retention are never listed. Follow [`Page::next`] until it is `None`:
    /// every record that matches for the whole listing appears at least once; one that changes
    /// meanwhile may appear twice or not at all. A page may hold fewer records than the limit
    /// (even none) while more follow. Each store documents its cost.
    ///
    /// The default answers [`Error::Unsupported`].
    async fn list(&self, query: &ListQuery) -> Result<Page> {
        let _ = query;
        Err(Error::Unsupported {
            store: self.name(),
            operation: "list",
        })
    }

    /// Removes up to `limit` records past retention; returns how many. A no-op (returning 0) where
    /// the backend's own expiry does it.
    async fn purge_expired(&self, limit: usize) -> Result<u64>;
}

/// A store that commits a handler's own writes in the same atomic operation as the completion,
/// so the effect and the record commit together or not at all: a worker that lost its lease
/// writes nothing, and a store outage between the effect and the completion cannot make the
/// effect happen twice (the effect *is* the completion).
///
/// # Contract
///
/// `complete_with(lease, result, retention, writes)` is [`complete`](IdempotencyStore::complete)
/// plus `writes`, in ONE atomic operation (one round trip):
///
/// - fenced exactly as `complete`: a stale or finished lease gets
///   [`Error::LeaseLost`](crate::Error::LeaseLost) and nothing is written, neither the record
///   nor any of `writes`;
/// - replay: the same completion re-sent after it took effect (same token, same result bytes)
///   answers `Ok` and applies nothing again;
/// - writes the store cannot take (too many, a command outside the documented set, a key the
///   operation cannot reach atomically) are refused with
///   [`Error::InvalidInput`](crate::Error::InvalidInput) before anything is sent; the record
///   stays in progress and the lease is still held;
/// - a write whose own condition fails refuses the whole operation with
///   [`Error::EffectRefused`](crate::Error::EffectRefused); nothing is written;
/// - the bad-input checks of `complete` run first, as for `complete`.
#[async_trait]
pub trait TransactionalStore: IdempotencyStore {
    /// The writes a handler hands back to commit with its completion: data commands for Redis,
    /// transaction items for DynamoDB, statements for PostgreSQL. `Clone`, because a completion
    /// answered `Unavailable` is re-sent with the same writes while the lease holds (a re-send
    /// after it took effect applies nothing again).
    type Writes: Clone + Send + Sync + 'static;

    /// Completes the work and applies `writes` in the same atomic operation.
    async fn complete_with(
        &self,
        lease: &Lease,
        result: Bytes,
        retention: Duration,
        writes: Self::Writes,
    ) -> Result<()>;
}

#[async_trait]
impl<T: TransactionalStore + ?Sized> TransactionalStore for Arc<T> {
    type Writes = T::Writes;

    async fn complete_with(
        &self,
        lease: &Lease,
        result: Bytes,
        retention: Duration,
        writes: Self::Writes,
    ) -> Result<()> {
        (**self)
            .complete_with(lease, result, retention, writes)
            .await
    }
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
                kind: FailureKind,
                retention: Duration,
            ) -> Result<()> {
                (**self).fail(lease, error, kind, retention).await
            }
            async fn release(&self, lease: &Lease) -> Result<()> {
                (**self).release(lease).await
            }
            async fn acquire_many(
                &self,
                reqs: &[AcquireRequest],
            ) -> Result<Vec<Result<AcquireOutcome>>> {
                (**self).acquire_many(reqs).await
            }
            async fn complete_many(
                &self,
                items: &[Completion],
                retention: Duration,
            ) -> Result<Vec<Result<()>>> {
                (**self).complete_many(items, retention).await
            }
            async fn fail_many(
                &self,
                items: &[Failure],
                retention: Duration,
            ) -> Result<Vec<Result<()>>> {
                (**self).fail_many(items, retention).await
            }
            async fn release_many(&self, leases: &[Lease]) -> Result<Vec<Result<()>>> {
                (**self).release_many(leases).await
            }
            async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
                (**self).get(key).await
            }
            async fn list(&self, query: &ListQuery) -> Result<Page> {
                (**self).list(query).await
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

/// One item's answer in the default batch loops: its own result, or, when it says the store is
/// unreachable or not set up, the whole call's `Err` (see "Batches" on [`IdempotencyStore`]).
fn item_of_batch<T>(answer: Result<T>) -> Result<Result<T>> {
    match answer {
        Err(e @ (Error::Unavailable { .. } | Error::NotSetUp { .. })) => Err(e),
        other => Ok(other),
    }
}
