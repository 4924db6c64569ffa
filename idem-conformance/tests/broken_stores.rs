//! The suite can fail: stores with one deliberate bug each make the scenarios that guard that
//! rule fail, while the same store without the bug passes them.
//!
//! `FlawedStore` runs the reference state machine (`idem_core::machine`) with one rule broken.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::future::BoxFuture;
use idem_conformance::{Config, Harness, scenarios};
use idem_core::machine::{self, AcquireDecision};
use idem_core::{
    AcquireOutcome, AcquireRequest, Clock, DynStore, FencingToken, IdempotencyKey,
    IdempotencyStore, Lease, ManualClock, MemoryStore, Record, Result, SystemClock,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bug {
    /// No bug: the control.
    None,
    /// `complete` does not check the token.
    CompleteSkipsTokenCheck,
    /// `acquire` reads, yields, then writes: not atomic.
    NonAtomicAcquire,
    /// `acquire` ignores the fingerprint.
    IgnoresFingerprint,
    /// A takeover keeps the old token.
    TakeoverKeepsToken,
}

#[derive(Debug)]
struct FlawedStore {
    bug: Bug,
    records: Mutex<HashMap<IdempotencyKey, Record>>,
    tokens: AtomicU64,
    clock: Arc<dyn Clock>,
}

impl FlawedStore {
    fn new(bug: Bug, clock: Arc<dyn Clock>) -> Self {
        Self {
            bug,
            records: Mutex::default(),
            tokens: AtomicU64::new(0),
            clock,
        }
    }

    fn decide(&self, existing: Option<&Record>, req: &AcquireRequest) -> AcquireDecision {
        let now = self.clock.now();
        let mut existing = existing.cloned();
        if self.bug == Bug::IgnoresFingerprint
            && let Some(r) = existing.as_mut()
        {
            r.fingerprint = None;
        }
        let next = || FencingToken::new(self.tokens.fetch_add(1, Ordering::SeqCst) + 1);
        let decision = machine::acquire(existing.as_ref(), req, now, next);
        match (self.bug, decision, existing) {
            (
                Bug::TakeoverKeepsToken,
                AcquireDecision::Write(
                    mut record,
                    AcquireOutcome::Acquired {
                        mut lease,
                        takeover: true,
                    },
                ),
                Some(old),
            ) => {
                record.token = old.token;
                lease.token = old.token;
                AcquireDecision::Write(
                    record,
                    AcquireOutcome::Acquired {
                        lease,
                        takeover: true,
                    },
                )
            }
            (_, decision, _) => decision,
        }
    }

    fn fenced<T>(&self, lease: &Lease, apply: impl FnOnce(&mut Record) -> T) -> Result<T> {
        let mut records = self.records.lock().unwrap();
        let now = self.clock.now();
        let record = machine::check_fence(records.get_mut(&lease.key), lease, now)?;
        Ok(apply(record))
    }
}

#[async_trait]
impl IdempotencyStore for FlawedStore {
    fn name(&self) -> &'static str {
        "flawed"
    }

    async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome> {
        req.validate()?;
        if self.bug == Bug::NonAtomicAcquire {
            let existing = self.records.lock().unwrap().get(&req.key).cloned();
            tokio::time::sleep(Duration::from_millis(1)).await;
            let decision = self.decide(existing.as_ref(), req);
            return Ok(apply(&mut self.records.lock().unwrap(), req, decision));
        }
        let mut records = self.records.lock().unwrap();
        let decision = self.decide(records.get(&req.key), req);
        Ok(apply(&mut records, req, decision))
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        idem_core::check_lease_ttl(ttl)?;
        let now = self.clock.now();
        self.fenced(lease, |r| machine::extend(r, lease, ttl, now))
    }

    async fn complete(&self, lease: &Lease, result: Bytes, retention: Duration) -> Result<()> {
        idem_core::check_retention(retention)?;
        self.limits().check_result(&result)?;
        let now = self.clock.now();
        if self.bug == Bug::CompleteSkipsTokenCheck {
            let mut records = self.records.lock().unwrap();
            if let Some(record) = records.get_mut(&lease.key) {
                machine::complete(record, result, retention, now);
                return Ok(());
            }
        }
        self.fenced(lease, |r| machine::complete(r, result, retention, now))
    }

    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        retryable: bool,
        retention: Duration,
    ) -> Result<()> {
        idem_core::check_retention(retention)?;
        self.limits().check_error(error)?;
        let now = self.clock.now();
        self.fenced(lease, |r| {
            machine::fail(r, error, retryable, retention, now)
        })
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let now = self.clock.now();
        self.fenced(lease, |r| machine::release(r, now))
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        let now = self.clock.now();
        let records = self.records.lock().unwrap();
        Ok(records.get(key).filter(|r| !r.is_expired(now)).cloned())
    }

    async fn delete(&self, key: &IdempotencyKey) -> Result<bool> {
        Ok(self.records.lock().unwrap().remove(key).is_some())
    }

    async fn purge_expired(&self, _limit: usize) -> Result<u64> {
        Ok(0)
    }
}

fn apply(
    records: &mut HashMap<IdempotencyKey, Record>,
    req: &AcquireRequest,
    decision: AcquireDecision,
) -> AcquireOutcome {
    match decision {
        AcquireDecision::Write(record, outcome) => {
            records.insert(req.key.clone(), record);
            outcome
        }
        AcquireDecision::Keep(outcome) => outcome,
        other => panic!("unknown decision {other:?}"),
    }
}

/// The non-atomic acquire needs real concurrency and a real clock; the others run on a manual
/// clock.
fn harness(bug: Bug) -> Harness {
    let unreachable = || async {
        let dead = MemoryStore::new();
        dead.set_available(false);
        Ok(Arc::new(dead) as DynStore)
    };
    if bug == Bug::NonAtomicAcquire {
        let store = Arc::new(FlawedStore::new(bug, Arc::new(SystemClock)));
        return Harness::new(store, Config::real_time()).with_unreachable(unreachable);
    }
    let clock = Arc::new(ManualClock::default());
    let store = Arc::new(FlawedStore::new(bug, clock.clone()));
    Harness::new(store, Config::manual_time(clock)).with_unreachable(unreachable)
}

type Scenario = fn(&Harness) -> BoxFuture<'_, ()>;

macro_rules! scenario {
    ($name:ident) => {
        (
            stringify!($name),
            (|h| Box::pin(scenarios::$name(h))) as Scenario,
        )
    };
}

/// Runs `scenario` on a store with `bug` in its own task; returns whether it passed.
async fn passes(bug: Bug, scenario: Scenario) -> bool {
    let h = harness(bug);
    tokio::spawn(async move { scenario(&h).await })
        .await
        .map_err(|e| assert!(e.is_panic(), "{e:?}"))
        .is_ok()
}

async fn check(bug: Bug, guarding: &[(&str, Scenario)]) {
    for (name, scenario) in guarding {
        assert!(
            passes(Bug::None, *scenario).await,
            "control: {name} must pass without a bug"
        );
        assert!(!passes(bug, *scenario).await, "{name} must catch {bug:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn completion_without_token_check_is_caught() {
    check(
        Bug::CompleteSkipsTokenCheck,
        &[
            scenario!(c07_zombie_fenced),
            scenario!(c12_release_does_not_count),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn non_atomic_acquire_is_caught() {
    check(Bug::NonAtomicAcquire, &[scenario!(c02_race_one_winner)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acquire_ignoring_fingerprint_is_caught() {
    check(
        Bug::IgnoresFingerprint,
        &[scenario!(c04_conflict_in_every_state)],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn takeover_keeping_the_token_is_caught() {
    check(
        Bug::TakeoverKeepsToken,
        &[scenario!(c06_crash_takeover), scenario!(c07_zombie_fenced)],
    )
    .await;
}

/// The control store passes the whole suite, so each failure above comes from its one bug.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_store_passes_every_scenario() {
    let all = [
        scenario!(c01_fresh_acquire),
        scenario!(c02_race_one_winner),
        scenario!(c03_replay_byte_identical),
        scenario!(c04_conflict_in_every_state),
        scenario!(c05_busy_with_retry_after),
        scenario!(c06_crash_takeover),
        scenario!(c07_zombie_fenced),
        scenario!(c08_heartbeat_keeps_lease),
        scenario!(c09_retryable_failure_reacquires),
        scenario!(c10_poison_exhausted),
        scenario!(c11_terminal_failure_replayed),
        scenario!(c12_release_does_not_count),
        scenario!(c13_retention_expiry),
        scenario!(c14_operator_delete),
        scenario!(c15_namespaces_isolated),
        scenario!(c16_bad_input_rejected),
        scenario!(c17_hostile_keys),
        scenario!(c18_get_shows_record),
        scenario!(c19_chaos_ledger),
        scenario!(c20_unreachable_store),
    ];
    for (name, scenario) in all {
        assert!(
            passes(Bug::None, scenario).await,
            "control store fails {name}"
        );
    }
}
