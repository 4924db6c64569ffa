//! The store-outage fault test: many keys delivered several times to concurrent workers that
//! crash and stall past their lease, while the store itself is killed and restarted, once with
//! the handler's effect written through [`TransactionalStore::complete_with`] and once with the
//! effect written outside the store. It prints one table and checks the transactional path:
//! no lost key, no duplicate effect, no zombie write.
//!
//! A backend's test supplies the store (a private server on its own port, never a shared one),
//! an [`Outage`] that kills and restarts that server, and [`Effects`]: how to append "this token
//! applied the effect of this key" to the store inside the transaction, and read the list back.
//!
//! What a worker does with one delivery, until the delivery is settled:
//! - `acquire`; `Unavailable` → back off and retry; `InProgress` → wait and retry;
//!   `Replayed` → settled (a duplicate);
//! - `Acquired`: with probability `crash_rate` the worker dies after its handler ran (outside
//!   path: the effect is already written; transactional path: the writes were never sent) and
//!   the delivery comes back; with probability `stall_rate` it stalls past its lease, then
//!   tries to finish as a zombie; otherwise it finishes at once;
//! - finishing: outside path, write the effect to the outside ledger, then `complete`;
//!   transactional path, `complete_with` carrying the effect. Either is re-sent on
//!   `Unavailable` until the local lease deadline (acquire time + lease − lease/10), as the
//!   executor does; past it, or on `LeaseLost`, the delivery comes back (redelivered).
//!
//! Afterwards every key must be completed, and its effect applied exactly once, by the token
//! that completed it.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::{
    AcquireOutcome, AcquireRequest, Error, FencingToken, IdempotencyKey, IdempotencyStore,
    Namespace, RecordState, Result, TransactionalStore,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sizes and rates of one run.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct OutagePlan {
    /// Distinct keys (the figure: 10,000).
    pub keys: usize,
    /// Deliveries of each key.
    pub deliveries: usize,
    /// Concurrent workers.
    pub workers: usize,
    /// Probability that a worker crashes after its handler ran.
    pub crash_rate: f64,
    /// Probability that a worker stalls past its lease before it finishes.
    pub stall_rate: f64,
    /// The lease of every acquisition.
    pub lease_ttl: Duration,
    /// How many times the store is killed during a run (at even intervals of progress).
    pub kills: usize,
    /// How long the store stays down each time.
    pub down_for: Duration,
    /// The bound on a whole run: past it the run fails and says how far it got.
    pub timeout: Duration,
    /// The random seed (printed, so a failing run can be repeated).
    pub seed: u64,
}

impl Default for OutagePlan {
    /// 10,000 keys × 3 deliveries, 16 workers, 5% crashes, 2% stalls, 500 ms leases, two kills
    /// of 1 s each. `IDEM_OUTAGE_KEYS` and `IDEM_OUTAGE_SEED` override the key count and seed.
    fn default() -> Self {
        let keys = std::env::var("IDEM_OUTAGE_KEYS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(10_000);
        let seed = std::env::var("IDEM_OUTAGE_SEED")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(rand::random);
        Self {
            keys,
            deliveries: 3,
            workers: 16,
            crash_rate: 0.05,
            stall_rate: 0.02,
            lease_ttl: Duration::from_millis(500),
            kills: 2,
            down_for: Duration::from_secs(1),
            timeout: Duration::from_secs(600),
            seed,
        }
    }
}

impl OutagePlan {
    /// Sets the number of keys.
    pub fn with_keys(mut self, keys: usize) -> Self {
        self.keys = keys;
        self
    }

    /// Sets the number of workers.
    pub fn with_workers(mut self, workers: usize) -> Self {
        self.workers = workers;
        self
    }

    /// Sets the lease of every acquisition.
    pub fn with_lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// Sets how long the store stays down each time.
    pub fn with_down_for(mut self, down_for: Duration) -> Self {
        self.down_for = down_for;
        self
    }
}

/// Kills and restarts the store's server.
#[async_trait]
pub trait Outage: Send + Sync {
    /// Kills the server at once (`SIGKILL`, terminated connections).
    async fn kill(&self);
    /// Brings it back and returns once it answers.
    async fn restart(&self);
}

/// How the transactional path writes and reads the effect of a key in the store under test.
#[async_trait]
pub trait Effects<S: TransactionalStore>: Send + Sync {
    /// Writes that append `token` to the effect list of `key` (appended, never overwritten, so
    /// every application shows).
    fn apply(&self, key: &IdempotencyKey, token: FencingToken) -> S::Writes;

    /// Every token that applied the effect of `key`, in any order.
    async fn applied(&self, key: &IdempotencyKey) -> Result<Vec<FencingToken>>;
}

/// Where the handler's effect is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EffectPath {
    /// With the completion, in one atomic operation ([`TransactionalStore::complete_with`]).
    Transactional,
    /// In a ledger outside the store, before a plain `complete`: what any idempotency layer
    /// whose effect lives elsewhere does.
    Outside,
}

impl fmt::Display for EffectPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Transactional => "transactional",
            Self::Outside => "outside the store",
        })
    }
}

/// What one run counted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutageReport {
    /// Keys run.
    pub keys: usize,
    /// Deliveries settled (every one must be).
    pub deliveries: usize,
    /// Workers that crashed after their handler ran.
    pub crashes: usize,
    /// Workers that stalled past their lease.
    pub stalls: usize,
    /// Times the store was killed.
    pub kills: usize,
    /// Operations answered `Unavailable` (the outages as the workers saw them).
    pub unavailable: u64,
    /// Keys not completed at the end, or completed without an effect.
    pub lost_keys: usize,
    /// Effects applied more than once (the extra applications, summed over keys).
    pub duplicate_effects: usize,
    /// Effects applied by a token other than the one that completed the key.
    pub zombie_writes: usize,
    /// Wall time of the run.
    pub elapsed: Duration,
}

/// Prints reports as one table.
pub fn table(rows: &[(EffectPath, &OutageReport)]) -> String {
    let mut out = format!(
        "{:<18} {:>6} {:>10} {:>7} {:>6} {:>5} {:>11} {:>9} {:>17} {:>13} {:>8}\n",
        "effect written",
        "keys",
        "deliveries",
        "crashes",
        "stalls",
        "kills",
        "unavailable",
        "lost keys",
        "duplicate effects",
        "zombie writes",
        "seconds"
    );
    for (path, r) in rows {
        out.push_str(&format!(
            "{:<18} {:>6} {:>10} {:>7} {:>6} {:>5} {:>11} {:>9} {:>17} {:>13} {:>8.1}\n",
            path.to_string(),
            r.keys,
            r.deliveries,
            r.crashes,
            r.stalls,
            r.kills,
            r.unavailable,
            r.lost_keys,
            r.duplicate_effects,
            r.zombie_writes,
            r.elapsed.as_secs_f64()
        ));
    }
    out
}

/// Runs both paths with the same plan, prints the table (to stdout, with `name` and the seed),
/// and checks the transactional path: 0 lost keys, 0 duplicate effects, 0 zombie writes, and
/// that the store was really killed. Returns both reports.
///
/// # Panics
/// When the transactional path lost, duplicated or let a zombie write, when any key of either
/// path did not complete, or when a run outlasts [`OutagePlan::timeout`].
pub async fn run_both<S: TransactionalStore>(
    name: &str,
    plan: &OutagePlan,
    store: Arc<S>,
    outage: Arc<dyn Outage>,
    effects: Arc<dyn Effects<S>>,
) -> (OutageReport, OutageReport) {
    let tx = run(
        plan,
        EffectPath::Transactional,
        store.clone(),
        outage.clone(),
        effects,
    )
    .await;
    let outside = run(
        plan,
        EffectPath::Outside,
        store,
        outage,
        Arc::new(NoEffects),
    )
    .await;
    println!(
        "{name}: {} keys x {} deliveries, {} workers, lease {:?}, store killed {} times for {:?} \
         (seed {})\n{}",
        plan.keys,
        plan.deliveries,
        plan.workers,
        plan.lease_ttl,
        plan.kills,
        plan.down_for,
        plan.seed,
        table(&[
            (EffectPath::Transactional, &tx),
            (EffectPath::Outside, &outside)
        ])
    );
    assert_eq!(
        (tx.lost_keys, tx.duplicate_effects, tx.zombie_writes),
        (0, 0, 0),
        "{name}: the transactional path must lose nothing, duplicate nothing and accept no zombie \
         write (seed {}): {tx:?}",
        plan.seed
    );
    assert_eq!(
        outside.lost_keys, 0,
        "{name}: every key must complete on the outside path too (seed {}): {outside:?}",
        plan.seed
    );
    for r in [&tx, &outside] {
        assert_eq!(
            r.kills, plan.kills,
            "{name}: the store must have been killed"
        );
        assert!(
            r.unavailable > 0,
            "{name}: the workers never saw the outage; the kill did not reach the store"
        );
    }
    (tx, outside)
}

/// The outside path needs no store-side effects.
struct NoEffects;

#[async_trait]
impl<S: TransactionalStore> Effects<S> for NoEffects {
    fn apply(&self, _: &IdempotencyKey, _: FencingToken) -> S::Writes {
        unreachable!("the outside path writes its effects to its own ledger")
    }

    async fn applied(&self, _: &IdempotencyKey) -> Result<Vec<FencingToken>> {
        unreachable!("the outside path reads its own ledger")
    }
}

struct Shared<S: TransactionalStore> {
    plan: OutagePlan,
    path: EffectPath,
    store: Arc<S>,
    effects: Arc<dyn Effects<S>>,
    queue: Mutex<VecDeque<usize>>,
    keys: Vec<IdempotencyKey>,
    /// The outside path's ledger: every token that applied each key's effect.
    ledger: Mutex<HashMap<usize, Vec<FencingToken>>>,
    settled: AtomicUsize,
    crashes: AtomicUsize,
    stalls: AtomicUsize,
    unavailable: AtomicU64,
}

/// Runs one path; see the module docs.
///
/// # Panics
/// When an operation fails other than with `Unavailable` or `LeaseLost`, or the run outlasts
/// [`OutagePlan::timeout`].
pub async fn run<S: TransactionalStore>(
    plan: &OutagePlan,
    path: EffectPath,
    store: Arc<S>,
    outage: Arc<dyn Outage>,
    effects: Arc<dyn Effects<S>>,
) -> OutageReport {
    let started = Instant::now();
    let ns = Namespace::new(format!("outage-{}", uuid::Uuid::new_v4().simple()))
        .expect("a generated namespace is valid");
    let keys: Vec<_> = (0..plan.keys)
        .map(|k| ns.key(format!("k{k}")).expect("valid key"))
        .collect();
    let mut rng = StdRng::seed_from_u64(plan.seed);
    let mut deliveries: Vec<usize> = (0..plan.keys)
        .flat_map(|k| std::iter::repeat_n(k, plan.deliveries))
        .collect();
    rand::seq::SliceRandom::shuffle(&mut deliveries[..], &mut rng);
    let total = deliveries.len();
    let shared = Arc::new(Shared {
        plan: plan.clone(),
        path,
        store,
        effects,
        queue: Mutex::new(deliveries.into()),
        keys,
        ledger: Mutex::default(),
        settled: AtomicUsize::new(0),
        crashes: AtomicUsize::new(0),
        stalls: AtomicUsize::new(0),
        unavailable: AtomicU64::new(0),
    });

    let workers: Vec<_> = (0..plan.workers)
        .map(|w| {
            let shared = shared.clone();
            let seed = plan.seed ^ (w as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            tokio::spawn(async move { worker(shared, w, seed).await })
        })
        .collect();
    let killer = {
        let shared = shared.clone();
        let plan = plan.clone();
        tokio::spawn(async move {
            let mut kills = 0;
            for k in 1..=plan.kills {
                let at = total * k / (plan.kills + 1);
                while shared.settled.load(Ordering::SeqCst) < at {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                outage.kill().await;
                tokio::time::sleep(plan.down_for).await;
                outage.restart().await;
                kills += 1;
            }
            kills
        })
    };
    let all = async {
        for w in workers {
            w.await.expect("a worker panicked");
        }
        killer.await.expect("the killer panicked")
    };
    let kills = match tokio::time::timeout(plan.timeout, all).await {
        Ok(kills) => kills,
        Err(_) => panic!(
            "{path}: the run did not finish within {:?}: {} of {total} deliveries settled (seed {})",
            plan.timeout,
            shared.settled.load(Ordering::SeqCst),
            plan.seed
        ),
    };
    let mut report = OutageReport {
        keys: plan.keys,
        deliveries: shared.settled.load(Ordering::SeqCst),
        crashes: shared.crashes.load(Ordering::SeqCst),
        stalls: shared.stalls.load(Ordering::SeqCst),
        kills,
        unavailable: shared.unavailable.load(Ordering::SeqCst),
        ..OutageReport::default()
    };
    count_effects(&shared, &mut report).await;
    report.elapsed = started.elapsed();
    report
}

async fn count_effects<S: TransactionalStore>(shared: &Shared<S>, report: &mut OutageReport) {
    use futures::stream::{self, StreamExt};
    let ledger = std::mem::take(&mut *shared.ledger.lock().unwrap_or_else(|e| e.into_inner()));
    let ledger = &ledger;
    // Each key: (completed with an effect?, extra applications, applications by another token).
    let counts: Vec<(bool, usize, usize)> = stream::iter(shared.keys.iter().enumerate())
        .map(|(k, key)| async move {
            let record = retry(shared, || shared.store.get(key)).await;
            let Some(record) = record.filter(|r| matches!(r.state, RecordState::Completed { .. }))
            else {
                return (false, 0, 0);
            };
            let applied = match shared.path {
                EffectPath::Transactional => retry(shared, || shared.effects.applied(key)).await,
                EffectPath::Outside => ledger.get(&k).cloned().unwrap_or_default(),
            };
            (
                !applied.is_empty(),
                applied.len().saturating_sub(1),
                applied.iter().filter(|t| **t != record.token).count(),
            )
        })
        .buffer_unordered(shared.plan.workers.max(1))
        .collect()
        .await;
    for (ok, duplicates, zombies) in counts {
        report.lost_keys += usize::from(!ok);
        report.duplicate_effects += duplicates;
        report.zombie_writes += zombies;
    }
}

/// Retries `op` while it answers `Unavailable`.
async fn retry<S, T, F, Fut>(shared: &Shared<S>, op: F) -> T
where
    S: TransactionalStore,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let mut backoff = Duration::from_millis(10);
    loop {
        match op().await {
            Ok(value) => return value,
            Err(Error::Unavailable { .. }) => {
                shared.unavailable.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
            Err(e) => panic!("unexpected store error: {e:?}"),
        }
    }
}

async fn worker<S: TransactionalStore>(shared: Arc<Shared<S>>, w: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let owner = format!("worker-{w}");
    loop {
        let next = shared
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front();
        let Some(k) = next else { return };
        while !deliver(&shared, &owner, k, &mut rng).await {}
        shared.settled.fetch_add(1, Ordering::SeqCst);
    }
}

/// One attempt at a delivery: `true` when settled, `false` when it comes back.
async fn deliver<S: TransactionalStore>(
    shared: &Shared<S>,
    owner: &str,
    k: usize,
    rng: &mut StdRng,
) -> bool {
    let plan = &shared.plan;
    let key = &shared.keys[k];
    // Attempts are not what this test measures: crashes and outages must never exhaust a key.
    let req = AcquireRequest::new(key.clone(), owner)
        .with_lease_ttl(plan.lease_ttl)
        .with_max_attempts(1_000);
    let sent = Instant::now();
    let lease = match retry(shared, || shared.store.acquire(&req)).await {
        AcquireOutcome::Acquired { lease, .. } => lease,
        AcquireOutcome::Replayed { .. } => return true,
        AcquireOutcome::InProgress { retry_after, .. } => {
            tokio::time::sleep(retry_after.min(Duration::from_millis(50))).await;
            return false;
        }
        other => panic!("{key}: unexpected acquire outcome {other:?}"),
    };
    let deadline = sent + plan.lease_ttl - plan.lease_ttl / 10;
    let roll: f64 = rng.random();
    let crash = roll < plan.crash_rate;
    let stall = !crash && roll < plan.crash_rate + plan.stall_rate;
    let outside = shared.path == EffectPath::Outside;
    let write_outside = || {
        shared
            .ledger
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(k)
            .or_default()
            .push(lease.token);
    };
    if crash {
        shared.crashes.fetch_add(1, Ordering::Relaxed);
        if outside {
            write_outside();
        }
        return false; // the consumer died; the broker redelivers
    }
    if stall {
        shared.stalls.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(plan.lease_ttl + plan.lease_ttl / 2).await;
    }
    if outside {
        write_outside();
    }
    let result = Bytes::from(lease.token.get().to_string());
    let retention = Duration::from_secs(3600);
    let mut backoff = Duration::from_millis(10);
    loop {
        let answer = match shared.path {
            EffectPath::Transactional => {
                let writes = shared.effects.apply(key, lease.token);
                shared
                    .store
                    .complete_with(&lease, result.clone(), retention, writes)
                    .await
            }
            EffectPath::Outside => {
                shared
                    .store
                    .complete(&lease, result.clone(), retention)
                    .await
            }
        };
        match answer {
            Ok(()) => return true,
            Err(Error::LeaseLost { .. }) => return false,
            Err(Error::Unavailable { .. }) => {
                shared.unavailable.fetch_add(1, Ordering::Relaxed);
                // A stalled worker is past its deadline already: it tries once, as a zombie.
                if stall || Instant::now() + backoff >= deadline {
                    return false;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(100));
            }
            Err(e) => panic!("{key}: unexpected completion error {e:?}"),
        }
    }
}
