//! The in-memory reference store.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;

use crate::clock::{Clock, SystemClock};
use crate::error::{Error, Result};
use crate::key::IdempotencyKey;
use crate::machine::{self, AcquireDecision};
use crate::record::{
    AcquireOutcome, AcquireRequest, FencingToken, Lease, Limits, Record, check_lease_ttl,
    check_retention,
};
use crate::store::IdempotencyStore;

const SHARDS: usize = 64;

/// The error inside [`Error::Unavailable`] while a [`MemoryStore`] simulates an outage.
#[derive(Debug, thiserror::Error)]
#[error("simulated outage")]
pub struct SimulatedOutage;

/// The reference implementation of [`IdempotencyStore`], in process memory.
///
/// For tests, single-process tools and as the executable specification of the contract: every
/// transition runs the pure functions of [`machine`] under a per-shard lock, so it is atomic and
/// scales across threads. Nothing survives the process.
///
/// - The clock is injectable ([`MemoryStore::with_clock`] and [`ManualClock`](crate::ManualClock)),
///   so tests expire leases and retention without sleeping.
/// - Fencing tokens come from one store-wide counter, so they stay strictly increasing per key
///   after a delete or an expiry.
/// - [`MemoryStore::set_available`] simulates an outage: every operation then fails with
///   [`Error::Unavailable`], which lets consumers test their fail-closed handling.
///
/// Cloning is cheap and shares the data.
#[derive(Clone, Debug)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    shards: Box<[Mutex<HashMap<IdempotencyKey, Record>>]>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
    tokens: AtomicU64,
    limits: Limits,
    available: AtomicBool,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store on the system clock with default limits.
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock))
    }

    /// An empty store on the given clock.
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        Self::with_options(clock, Limits::default())
    }

    /// An empty store on the given clock and limits.
    pub fn with_options(clock: Arc<dyn Clock>, limits: Limits) -> Self {
        Self {
            inner: Arc::new(Inner {
                shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
                hasher: RandomState::new(),
                clock,
                tokens: AtomicU64::new(0),
                limits,
                available: AtomicBool::new(true),
            }),
        }
    }

    /// Turns the simulated outage off (`true`) or on (`false`).
    pub fn set_available(&self, available: bool) {
        self.inner.available.store(available, Ordering::SeqCst);
    }

    /// Number of records held, including expired ones not yet purged.
    pub fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| lock(s).len()).sum()
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(
        &self,
        key: &IdempotencyKey,
    ) -> Result<MutexGuard<'_, HashMap<IdempotencyKey, Record>>> {
        if !self.inner.available.load(Ordering::SeqCst) {
            return Err(Error::unavailable("memory", SimulatedOutage));
        }
        let index = self.inner.hasher.hash_one(key) as usize % SHARDS;
        Ok(lock(&self.inner.shards[index]))
    }

    fn now(&self) -> SystemTime {
        self.inner.clock.now()
    }

    fn next_token(&self) -> FencingToken {
        FencingToken::new(self.inner.tokens.fetch_add(1, Ordering::SeqCst) + 1)
    }

    fn fenced<T>(
        &self,
        lease: &Lease,
        apply: impl FnOnce(&mut Record, SystemTime) -> T,
    ) -> Result<T> {
        let mut shard = self.shard(&lease.key)?;
        let now = self.now();
        let record = machine::check_fence(shard.get_mut(&lease.key), lease, now)?;
        Ok(apply(record, now))
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a shard lock cannot leave a record half-written: every mutation is a
    // whole-value assignment computed before it is made.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[async_trait]
impl IdempotencyStore for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn limits(&self) -> Limits {
        self.inner.limits
    }

    async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome> {
        req.validate()?;
        let mut shard = self.shard(&req.key)?;
        let now = self.now();
        match machine::acquire(shard.get(&req.key), req, now, || self.next_token()) {
            AcquireDecision::Write(record, outcome) => {
                shard.insert(req.key.clone(), record);
                Ok(outcome)
            }
            AcquireDecision::Keep(outcome) => Ok(outcome),
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        check_lease_ttl(ttl)?;
        self.fenced(lease, |record, now| {
            machine::extend(record, lease, ttl, now)
        })
    }

    async fn complete(&self, lease: &Lease, result: Bytes, retention: Duration) -> Result<()> {
        check_retention(retention)?;
        self.inner.limits.check_result(&result)?;
        self.fenced(lease, |record, now| {
            machine::complete(record, result, retention, now)
        })
    }

    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        retryable: bool,
        retention: Duration,
    ) -> Result<()> {
        check_retention(retention)?;
        self.inner.limits.check_error(error)?;
        self.fenced(lease, |record, now| {
            machine::fail(record, error, retryable, retention, now)
        })
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.fenced(lease, machine::release)
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        let shard = self.shard(key)?;
        let now = self.now();
        Ok(shard.get(key).filter(|r| !r.is_expired(now)).cloned())
    }

    async fn delete(&self, key: &IdempotencyKey) -> Result<bool> {
        let mut shard = self.shard(key)?;
        let now = self.now();
        Ok(shard.remove(key).is_some_and(|r| !r.is_expired(now)))
    }

    async fn purge_expired(&self, limit: usize) -> Result<u64> {
        if !self.inner.available.load(Ordering::SeqCst) {
            return Err(Error::unavailable("memory", SimulatedOutage));
        }
        let now = self.now();
        let mut purged = 0usize;
        for shard in self.inner.shards.iter() {
            if purged >= limit {
                break;
            }
            let mut shard = lock(shard);
            let expired: Vec<IdempotencyKey> = shard
                .iter()
                .filter(|(_, r)| r.is_expired(now))
                .map(|(k, _)| k.clone())
                .take(limit - purged)
                .collect();
            for key in expired {
                shard.remove(&key);
                purged += 1;
            }
        }
        Ok(purged as u64)
    }
}
