//! The custom-store kit: a complete [`IdempotencyStore`](crate::IdempotencyStore) from a small
//! compare-and-swap over bytes.
//!
//! Writing a store from scratch means solving, in the store's own language, the hard parts that
//! every shipped store solved once: one atomic decision per transition, fencing tokens that keep
//! rising after a delete or an expiry, what to answer when a reply is lost, the input checks,
//! replays. With the kit, a store author implements [`CasBackend`] (four small methods over
//! opaque bytes, two more optional) and wraps it in a [`KitStore`], which runs the reference
//! state machine ([`machine`](crate::machine)) on top and passes the whole conformance suite
//! when the backend keeps its contract.
//!
//! ```
//! # use idem_core::kit::{CasBackend, KitStore};
//! # fn demo<B: CasBackend>(backend: B) {
//! let store = KitStore::new(backend); // an IdempotencyStore
//! # let _ = store;
//! # }
//! ```
//!
//! The guide `docs/custom-store.md` walks through a whole example (the in-memory map of
//! `idem/examples/kit_memory.rs`) and tells when to write the full trait instead.
//!
//! # What the backend promises
//!
//! - [`load`](CasBackend::load) returns the value stored under a key with its version.
//! - [`store`](CasBackend::store) writes a value only if the key still holds the version the
//!   caller loaded (or is still absent, when the caller loaded nothing), atomically: two
//!   writers that loaded the same version can never both succeed. This one rule is what makes
//!   every transition atomic; a backend that checks the version and writes in two steps lets
//!   two workers acquire the same key (conformance C02 catches it for the insert of an absent
//!   key, C19 for the update of a present one).
//! - [`delete`](CasBackend::delete) removes a key only if it still holds the version given.
//! - A version is never reused for a key, including after the key was deleted and written
//!   again (a counter, a random 64-bit start, a server revision): otherwise a worker that loaded
//!   a value just before a delete could overwrite the value written after it.
//!
//! `idem_conformance::backend::check_backend` checks these rules on a backend alone; no
//! store-level scenario sees a version reused after a delete or a delete that does not compare.
//! - Errors: [`Error::Unavailable`] when the backend could not be
//!   reached or did not answer in time, so the operation may or may not have taken effect (the
//!   kit then reloads, see below); [`Error::Backend`] when it answered
//!   with an error that retrying will not fix (a permission, a malformed request, a full
//!   quota); [`Error::NotSetUp`] when its table, bucket or schema is
//!   missing. Never answer `Ok` for a write that did not happen.
//!
//! # What the kit does
//!
//! **Costs.** `acquire` is one `load` plus, when it changes the record (a fresh key, a
//! takeover, a retry), one `store`. A duplicate (a replay, a busy key, a conflict, an exhausted
//! or failed key) is one `load` and nothing else. `extend`, `complete`, `fail` and `release`
//! are one `load` plus one `store`; a replayed or refused one is one `load`. `get` is one
//! `load`; `delete` is one `load` plus one `store` (a tombstone, below). A kit store therefore
//! makes two requests where the shipped stores make one: fine for an embedded store or a
//! key-value store on the same host, worth knowing for a remote one. Conformance C23 (one
//! round trip per transition) does not fit a kit store: declare it
//! [`in_process`](https://docs.rs/idem-conformance) with that reason, and count its requests in
//! a test of your own.
//!
//! **Version conflicts.** When `store` answers [`Cas::Conflict`] (someone else wrote the key
//! between the load and the write), the kit loads again and decides again on what it finds, as
//! if the call had just started: the racers of a fresh key see the winner's record and answer
//! `InProgress`. After [`KitOptions::max_conflicts`] conflicts in one call (the key changes
//! faster than the call can decide) it gives up with [`Error::Unavailable`]
//! whose source is [`Contended`]; nothing was written by that call.
//!
//! **Lost replies.** When `store` answers `Unavailable`, the write may have happened. The kit
//! loads the key again: if it holds exactly the bytes the kit wrote, the write happened and
//! the call answers as if the reply had arrived (an `acquire` returns its lease); otherwise it
//! decides again on what it finds (a `complete` whose write happened and was followed by
//! another change finds its own completion and answers `Ok` by the replay rule). At most
//! [`KitOptions::max_ambiguous`] such reloads per call; then, or when the reload itself fails,
//! the call answers the `Unavailable`. A record carries its token, which has a random part
//! (below), and the microsecond of the write, so equal bytes mean the call's own write, or that
//! of a call with the same effect at the same microsecond (the same transition re-sent by the
//! same holder, a second delete), which answers the same. Two acquisitions of a key by one
//! owner in one microsecond write equal bytes but for their tokens, which differ but once in
//! 2^20 such coincidences.
//!
//! **Tokens and tombstones.** A new token is `max(previous + 1, now in microseconds)` plus a
//! random number of microseconds below 2^20 (about one second), where
//! `previous` is the token of whatever the key holds: a live record, a record past retention
//! (read as absent, still counted), or a *tombstone*. [`delete`](crate::IdempotencyStore::delete)
//! does not remove the key: it stores a 10-byte tombstone holding the record's token, which
//! every operation reads as no record. So tokens rise strictly after a delete or an expiry
//! whatever the clock does, as long as the key's value is there. `purge_expired` turns records
//! past retention into tombstones, and removes a tombstone (or a record past retention) only
//! once the clock has passed its token by [`KitOptions::tombstone_ttl`] (7 days by default):
//! from then on the clock term alone keeps the next token higher, unless the clock steps back
//! by more than that.
//!
//! **Clock.** Leases and retention are judged on [`CasBackend::now`] when the backend has a
//! clock (a server's time, costing whatever asking for it costs, once per call), else on
//! [`KitOptions::clock`], the client's clock ([`SystemClock`] by default).
//! With the client clock, every process using the store must agree on the time: a process
//! whose clock runs `s` ahead takes over an expired lease up to `s` early and reads a record as
//! past retention up to `s` early. Keep hosts synchronised (NTP keeps them within
//! milliseconds) and leases far longer than the skew; processes on one host share one clock.
//!
//! **Input checks.** Every call runs the core checks before touching the backend:
//! [`AcquireRequest::validate`](crate::AcquireRequest::validate),
//! [`check_lease_ttl`](crate::check_lease_ttl), [`Limits::check_complete`](crate::Limits::check_complete),
//! [`Limits::check_fail`](crate::Limits::check_fail), [`Limits::check_batch`](crate::Limits::check_batch)
//! (batches loop over the single calls, the trait's defaults). Owners, error texts and results
//! are stored as the exact bytes given.
//!
//! **Records.** The record encoding ([`encode`], [`decode`]) starts with a format byte; a value
//! that is not a record of a known format (another program's data under the same key, a value
//! cut short) is [`Error::CorruptRecord`], never a panic, and is
//! left untouched.
//!
//! **Listing and purging** need to enumerate keys: [`CasBackend::scan`]. Without it
//! (the default answers [`Error::Unsupported`]),
//! [`list`](crate::IdempotencyStore::list) answers `Unsupported` and
//! [`purge_expired`](crate::IdempotencyStore::purge_expired) answers `Ok(0)`: records past
//! retention read as absent anyway, and stay (holding their token) until written over.

mod codec;
mod store;

use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;

use crate::clock::{Clock, SystemClock};
use crate::error::{Error, Result};
use crate::record::Limits;

pub use codec::{Stored, decode, encode, storage_key};
pub use store::KitStore;

/// A value loaded from the backend, with its version.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Versioned<V> {
    /// The stored bytes, exactly as written.
    pub value: Bytes,
    /// Their version: what a conditional [`store`](CasBackend::store) or
    /// [`delete`](CasBackend::delete) presents.
    pub version: V,
}

impl<V> Versioned<V> {
    /// A value and its version.
    pub fn new(value: impl Into<Bytes>, version: V) -> Self {
        Self {
            value: value.into(),
            version,
        }
    }
}

/// One key found by [`CasBackend::scan`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Scanned<V> {
    /// The key, as the kit gave it to [`store`](CasBackend::store).
    pub key: Vec<u8>,
    /// Its value and version.
    pub value: Versioned<V>,
}

impl<V> Scanned<V> {
    /// A key with its value and version.
    pub fn new(key: impl Into<Vec<u8>>, value: Versioned<V>) -> Self {
        Self {
            key: key.into(),
            value,
        }
    }
}

/// What a conditional write did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Cas {
    /// The condition held and the write took effect.
    Written,
    /// The key no longer holds the expected version (or is no longer absent, or is gone):
    /// nothing was written.
    Conflict,
}

/// An atomic compare-and-swap over bytes: what a store author implements to get a complete
/// [`IdempotencyStore`](crate::IdempotencyStore) from [`KitStore`]. See the
/// [module docs](self) for the rules each method keeps and what the kit does with them.
///
/// Keys are byte strings of at most 577 bytes (a namespace, `:`, an id; never empty); values
/// are byte strings the kit encodes (a few dozen bytes plus the owner and the stored result or
/// error: size [`Limits`] to what the backend can hold).
#[async_trait]
pub trait CasBackend: Send + Sync + Debug + 'static {
    /// A value's version: a row version, a revision, an ETag. Never reused for a key.
    type Version: Clone + PartialEq + Send + Sync + Debug + 'static;

    /// A short name used in errors and metrics (`sqlite`, `etcd`, ...): the kit store's
    /// [`name`](crate::IdempotencyStore::name).
    fn name(&self) -> &'static str;

    /// The value stored under `key` and its version, or `None` when the key is absent.
    async fn load(&self, key: &[u8]) -> Result<Option<Versioned<Self::Version>>>;

    /// Writes `value` under `key` if the key still holds `expected` (`None`: if the key is
    /// still absent), in one atomic step. [`Cas::Conflict`] when it does not, writing nothing.
    async fn store(
        &self,
        key: &[u8],
        value: Bytes,
        expected: Option<&Self::Version>,
    ) -> Result<Cas>;

    /// Removes `key` if it still holds `expected`, in one atomic step. [`Cas::Conflict`] when
    /// it does not (or is already gone), removing nothing. Only `purge_expired` calls it.
    async fn delete(&self, key: &[u8], expected: &Self::Version) -> Result<Cas>;

    /// The store's clock, when it has one (`None`: the kit uses [`KitOptions::clock`], the
    /// client's). Called once per operation, before the first `load`. The default is `None`.
    async fn now(&self) -> Result<Option<SystemTime>> {
        Ok(None)
    }

    /// Up to `limit` keys that start with `prefix` and sort after `after` (byte order; `None`:
    /// from the first), in ascending byte order, with their values and versions. Fewer than
    /// `limit` means there are no more, so a backend must not cap `limit` (a listing asks for
    /// one key more than its page, up to [`MAX_PAGE`](crate::MAX_PAGE) + 1, to tell whether a
    /// key follows). Used by [`list`](crate::IdempotencyStore::list) (the
    /// prefix of one namespace) and [`purge_expired`](crate::IdempotencyStore::purge_expired)
    /// (every key: an empty prefix); it needs no snapshot: a key written meanwhile may or may
    /// not show.
    ///
    /// The default answers [`Error::Unsupported`]: then `list` is unsupported and
    /// `purge_expired` removes nothing (see the [module docs](self)).
    async fn scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<Scanned<Self::Version>>> {
        let _ = (prefix, after, limit);
        Err(Error::Unsupported {
            store: self.name(),
            operation: "scan",
        })
    }
}

#[async_trait]
impl<B: CasBackend + ?Sized> CasBackend for Arc<B> {
    type Version = B::Version;

    fn name(&self) -> &'static str {
        (**self).name()
    }
    async fn load(&self, key: &[u8]) -> Result<Option<Versioned<Self::Version>>> {
        (**self).load(key).await
    }
    async fn store(
        &self,
        key: &[u8],
        value: Bytes,
        expected: Option<&Self::Version>,
    ) -> Result<Cas> {
        (**self).store(key, value, expected).await
    }
    async fn delete(&self, key: &[u8], expected: &Self::Version) -> Result<Cas> {
        (**self).delete(key, expected).await
    }
    async fn now(&self) -> Result<Option<SystemTime>> {
        (**self).now().await
    }
    async fn scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<Scanned<Self::Version>>> {
        (**self).scan(prefix, after, limit).await
    }
}

/// How long a tombstone (and a record past retention) is kept by default: 7 days past its
/// token's time.
pub const DEFAULT_TOMBSTONE_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

/// The error inside [`Error::Unavailable`] when a call met more
/// version conflicts than [`KitOptions::max_conflicts`]: the key kept changing under it.
/// Nothing was written by the call; retrying later is safe.
#[derive(Clone, Copy, Debug, thiserror::Error)]
#[error("gave up after {conflicts} version conflicts in a row: the key keeps changing")]
pub struct Contended {
    /// How many conflicts the call met.
    pub conflicts: u32,
}

/// Options of a [`KitStore`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct KitOptions {
    /// The size limits the store enforces. Default [`Limits::default`].
    pub limits: Limits,
    /// The clock leases and retention are judged on when the backend has none
    /// ([`CasBackend::now`] answers `None`). Default [`SystemClock`]. Not used at all when the
    /// backend answers a time: a [`ManualClock`](crate::ManualClock) set here then moves nothing.
    pub clock: Arc<dyn Clock>,
    /// Version conflicts one call accepts (reloading and deciding again after each) before it
    /// answers `Unavailable` with [`Contended`]. Default 16.
    pub max_conflicts: u32,
    /// Reloads after an `Unavailable` from `store` (a reply that may have been lost) one call
    /// makes before it answers the `Unavailable`. Default 3.
    pub max_ambiguous: u32,
    /// How far the clock must have passed a tombstone's token (or a record's, past retention)
    /// before `purge_expired` removes it. Default [`DEFAULT_TOMBSTONE_TTL`]. The bound on how
    /// far back the clock may step without tokens repeating.
    pub tombstone_ttl: Duration,
}

impl Default for KitOptions {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            clock: Arc::new(SystemClock),
            max_conflicts: 16,
            max_ambiguous: 3,
            tombstone_ttl: DEFAULT_TOMBSTONE_TTL,
        }
    }
}

impl KitOptions {
    /// Sets the limits.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Sets the client clock (a [`ManualClock`](crate::ManualClock) in tests), used when the
    /// backend has no clock of its own ([`CasBackend::now`] answers `None`).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Sets the most version conflicts one call accepts.
    pub fn with_max_conflicts(mut self, max: u32) -> Self {
        self.max_conflicts = max;
        self
    }

    /// Sets the most reloads after an ambiguous write.
    pub fn with_max_ambiguous(mut self, max: u32) -> Self {
        self.max_ambiguous = max;
        self
    }

    /// Sets how long tombstones are kept.
    pub fn with_tombstone_ttl(mut self, ttl: Duration) -> Self {
        self.tombstone_ttl = ttl;
        self
    }
}
