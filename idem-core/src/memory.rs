//! The in-memory reference store.

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;

use crate::clock::{Clock, SystemClock};
use crate::error::{Error, Result};
use crate::key::{IdempotencyKey, Namespace};
use crate::list::{Cursor, ListQuery, Page};
use crate::machine::{self, AcquireDecision, Finish};
use crate::record::{
    AcquireOutcome, AcquireRequest, FailureKind, FencingToken, Lease, Limits, Record, StateKind,
    check_lease_ttl,
};
use crate::store::IdempotencyStore;

const SHARDS: usize = 64;

/// Most writes one [`MemoryWrites`] may carry (the same order of size as DynamoDB's 99).
pub const MAX_MEMORY_WRITES: usize = 100;

/// The writes a handler commits with its completion on a [`MemoryStore`]
/// ([`TransactionalStore`](crate::TransactionalStore)): puts, deletes and compare conditions
/// on the store's effect map, a stand-in for a real database's rows that tests and examples
/// read back with [`MemoryStore::effect`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryWrites {
    ops: Vec<MemoryWrite>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum MemoryWrite {
    Put(String, Bytes),
    Delete(String),
    Expect(String, Option<Bytes>),
}

impl MemoryWrites {
    /// No writes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` to `value`.
    pub fn put(mut self, key: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.ops.push(MemoryWrite::Put(key.into(), value.into()));
        self
    }

    /// Removes `key`.
    pub fn delete(mut self, key: impl Into<String>) -> Self {
        self.ops.push(MemoryWrite::Delete(key.into()));
        self
    }

    /// A condition: `key` must hold `value` (`None`: must be absent) when the writes apply, or
    /// the whole completion is refused with [`Error::EffectRefused`].
    pub fn expect(mut self, key: impl Into<String>, value: Option<Bytes>) -> Self {
        self.ops.push(MemoryWrite::Expect(key.into(), value));
        self
    }

    /// How many writes and conditions there are.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
}

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

/// One shard: its records, and the ids of each namespace's records by stored state (what
/// [`MemoryStore::list`](IdempotencyStore::list) reads, so that listing one state among many
/// does not look at the others).
#[derive(Debug, Default)]
struct Shard {
    records: HashMap<IdempotencyKey, Record>,
    by_state: HashMap<(Namespace, StateKind), BTreeSet<String>>,
}

impl Shard {
    fn state(&self, key: &IdempotencyKey) -> Option<StateKind> {
        self.records.get(key).map(|r| r.state.kind())
    }

    /// Brings the index up to date after `key`'s record went from state `before` to whatever
    /// it holds now.
    fn sync(&mut self, key: &IdempotencyKey, before: Option<StateKind>) {
        let after = self.state(key);
        if before == after {
            return;
        }
        if let Some(old) = before {
            let slot = (key.namespace().clone(), old);
            if let Some(ids) = self.by_state.get_mut(&slot) {
                ids.remove(key.id());
                if ids.is_empty() {
                    self.by_state.remove(&slot);
                }
            }
        }
        if let Some(new) = after {
            self.by_state
                .entry((key.namespace().clone(), new))
                .or_default()
                .insert(key.id().to_owned());
        }
    }

    fn insert(&mut self, record: Record) {
        let key = record.key.clone();
        let before = self.state(&key);
        self.records.insert(key.clone(), record);
        self.sync(&key, before);
    }

    fn remove(&mut self, key: &IdempotencyKey) -> Option<Record> {
        let before = self.state(key);
        let removed = self.records.remove(key);
        self.sync(key, before);
        removed
    }
}

#[derive(Debug)]
struct Inner {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
    tokens: AtomicU64,
    limits: Limits,
    available: AtomicBool,
    effects: Mutex<HashMap<String, Bytes>>,
    /// Records `list` looked at: see [`MemoryStore::records_examined`].
    examined: AtomicU64,
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
                effects: Mutex::default(),
                examined: AtomicU64::new(0),
            }),
        }
    }

    /// Turns the simulated outage off (`true`) or on (`false`).
    pub fn set_available(&self, available: bool) {
        self.inner.available.store(available, Ordering::SeqCst);
    }

    /// Number of records held, including expired ones not yet purged.
    pub fn len(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|s| lock(s).records.len())
            .sum()
    }

    /// How many records [`list`](IdempotencyStore::list) calls on this store (and its clones)
    /// have looked at so far. `list` reads only the records of the query's namespace in the
    /// stored states its statuses can come from ([`Status::states`](crate::Status::states)), through a per-shard
    /// index, so listing one state among many looks at that state's records and no others.
    pub fn records_examined(&self) -> u64 {
        self.inner.examined.load(Ordering::Relaxed)
    }

    /// The value a [`MemoryWrites`] committed at `key`, if any.
    pub fn effect(&self, key: &str) -> Option<Bytes> {
        lock(&self.inner.effects).get(key).cloned()
    }

    /// Every effect key that starts with `prefix`, with its value, in key order.
    pub fn effects_with_prefix(&self, prefix: &str) -> Vec<(String, Bytes)> {
        let mut found: Vec<_> = lock(&self.inner.effects)
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        found.sort();
        found
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, key: &IdempotencyKey) -> Result<MutexGuard<'_, Shard>> {
        if !self.inner.available.load(Ordering::SeqCst) {
            return Err(Error::unavailable("memory", SimulatedOutage));
        }
        let index = self.inner.hasher.hash_one(key) as usize % SHARDS;
        Ok(lock(&self.inner.shards[index]))
    }

    fn now(&self) -> Result<SystemTime> {
        crate::clock::checked("memory", self.inner.clock.now())
    }

    fn next_token(&self) -> FencingToken {
        FencingToken::new(self.inner.tokens.fetch_add(1, Ordering::SeqCst) + 1)
    }

    fn finish(&self, lease: &Lease, how: Finish<'_>) -> Result<()> {
        let mut shard = self.shard(&lease.key)?;
        let now = self.now()?;
        let before = shard.state(&lease.key);
        let result = machine::finish(shard.records.get_mut(&lease.key), lease, how, now).map(drop);
        shard.sync(&lease.key, before);
        result
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a shard lock could leave a record half-changed (the machine changes
    // a record in place), so nothing that runs under the lock may panic: deadlines are computed
    // from a checked clock (`clock::checked`) and bounded durations, and no user code runs there.
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
        let now = self.now()?;
        match machine::acquire(shard.records.get(&req.key), req, now, || self.next_token()) {
            AcquireDecision::Write(record, outcome) => {
                shard.insert(record);
                Ok(outcome)
            }
            AcquireDecision::Keep(outcome) => Ok(outcome),
        }
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        check_lease_ttl(ttl)?;
        let mut shard = self.shard(&lease.key)?;
        let now = self.now()?;
        let record = machine::check_fence(shard.records.get_mut(&lease.key), lease, now)?;
        Ok(machine::extend(record, lease, ttl, now))
    }

    async fn complete(&self, lease: &Lease, result: Bytes, retention: Duration) -> Result<()> {
        self.inner.limits.check_complete(&result, retention)?;
        self.finish(
            lease,
            Finish::Complete {
                result: &result,
                retention,
            },
        )
    }

    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        self.inner.limits.check_fail(error, retention)?;
        self.finish(
            lease,
            Finish::Fail {
                error,
                kind,
                retention,
            },
        )
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.finish(lease, Finish::Release)
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        let shard = self.shard(key)?;
        let now = self.now()?;
        Ok(shard
            .records
            .get(key)
            .filter(|r| !r.is_expired(now))
            .cloned())
    }

    async fn delete(&self, key: &IdempotencyKey) -> Result<bool> {
        let mut shard = self.shard(key)?;
        let now = self.now()?;
        Ok(shard.remove(key).is_some_and(|r| !r.is_expired(now)))
    }

    /// Reads, in every shard, the ids of the namespace's records in the stored states the
    /// query's statuses can come from (a per-shard index by namespace and state, in id order),
    /// so the records looked at are those of the wanted states only, and in each shard and
    /// state at most the page's limit plus one past the cursor that match
    /// ([`MemoryStore::records_examined`] counts them); sorted by id, the cursor is the last id
    /// returned, hex-encoded.
    async fn list(&self, query: &ListQuery) -> Result<Page> {
        query.validate()?;
        if !self.inner.available.load(Ordering::SeqCst) {
            return Err(Error::unavailable("memory", SimulatedOutage));
        }
        let after = match &query.cursor {
            None => None,
            Some(c) => Some(
                hex::decode(c.as_str())
                    .ok()
                    .and_then(|b| String::from_utf8(b).ok())
                    .ok_or_else(|| Error::invalid("cursor", "is not a cursor of this store"))?,
            ),
        };
        let states: Vec<StateKind> = if query.statuses.is_empty() {
            StateKind::ALL.to_vec()
        } else {
            query
                .statuses
                .iter()
                .flat_map(|s| s.states())
                .copied()
                .collect()
        };
        let now = self.now()?;
        let mut found: Vec<Record> = Vec::new();
        let mut examined = 0u64;
        for shard in self.inner.shards.iter() {
            let shard = lock(shard);
            for state in StateKind::ALL.iter().filter(|s| states.contains(s)) {
                let Some(ids) = shard.by_state.get(&(query.namespace.clone(), *state)) else {
                    continue;
                };
                let from = match &after {
                    Some(a) => std::ops::Bound::Excluded(a.clone()),
                    None => std::ops::Bound::Unbounded,
                };
                // Ids come in order: past `limit + 1` matches here, none can be on this page.
                let mut taken = 0;
                for id in ids.range((from, std::ops::Bound::Unbounded)) {
                    if taken > query.limit {
                        break;
                    }
                    let Ok(key) = query.namespace.key(id) else {
                        continue;
                    };
                    let Some(record) = shard.records.get(&key) else {
                        continue;
                    };
                    examined += 1;
                    if !record.is_expired(now) && query.matches(record, now) {
                        found.push(record.clone());
                        taken += 1;
                    }
                }
            }
        }
        self.inner.examined.fetch_add(examined, Ordering::Relaxed);
        found.sort_by(|a, b| a.key.id().cmp(b.key.id()));
        let next = (found.len() > query.limit).then(|| {
            found.truncate(query.limit);
            Cursor::new(hex::encode(found[query.limit - 1].key.id()))
        });
        Ok(Page::new(found, next))
    }

    async fn purge_expired(&self, limit: usize) -> Result<u64> {
        if !self.inner.available.load(Ordering::SeqCst) {
            return Err(Error::unavailable("memory", SimulatedOutage));
        }
        let now = self.now()?;
        let mut purged = 0usize;
        for shard in self.inner.shards.iter() {
            if purged >= limit {
                break;
            }
            let mut shard = lock(shard);
            let expired: Vec<IdempotencyKey> = shard
                .records
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

#[async_trait]
impl crate::store::TransactionalStore for MemoryStore {
    type Writes = MemoryWrites;

    async fn complete_with(
        &self,
        lease: &Lease,
        result: Bytes,
        retention: Duration,
        writes: MemoryWrites,
    ) -> Result<()> {
        self.inner.limits.check_complete(&result, retention)?;
        if writes.len() > MAX_MEMORY_WRITES {
            return Err(Error::invalid(
                "writes",
                format!(
                    "{} writes, the most one completion carries is {MAX_MEMORY_WRITES}",
                    writes.len()
                ),
            ));
        }
        // Lock order: the record's shard, then the effects.
        let mut shard = self.shard(&lease.key)?;
        let now = self.now()?;
        let before = shard.state(&lease.key);
        let result = complete_with_in(
            &mut shard.records,
            lease,
            &result,
            retention,
            writes,
            now,
            &self.inner.effects,
        );
        shard.sync(&lease.key, before);
        result
    }
}

/// The body of [`MemoryStore::complete_with`] on the record's shard (locked by the caller).
fn complete_with_in(
    records: &mut HashMap<IdempotencyKey, Record>,
    lease: &Lease,
    result: &Bytes,
    retention: Duration,
    writes: MemoryWrites,
    now: SystemTime,
    effects: &Mutex<HashMap<String, Bytes>>,
) -> Result<()> {
    let record = records.get_mut(&lease.key);
    let how = Finish::Complete { result, retention };
    let live = record.as_deref().is_some_and(|r| {
        !r.is_expired(now) && r.token == lease.token && r.state == crate::RecordState::InProgress
    });
    if !live {
        // A replay answers Ok without applying the writes again; anything else is refused.
        return machine::finish(record, lease, how, now).map(drop);
    }
    let mut effects = lock(effects);
    for (index, op) in writes.ops.iter().enumerate() {
        if let MemoryWrite::Expect(key, want) = op
            && effects.get(key) != want.as_ref()
        {
            return Err(Error::EffectRefused {
                store: "memory",
                index,
                reason: format!("condition on {key:?} failed"),
            });
        }
    }
    machine::finish(record, lease, how, now)?;
    for op in writes.ops {
        match op {
            MemoryWrite::Put(key, value) => {
                effects.insert(key, value);
            }
            MemoryWrite::Delete(key) => {
                effects.remove(&key);
            }
            MemoryWrite::Expect(..) => {}
        }
    }
    Ok(())
}
