//! The differential model test on `MemoryStore`, and proof that it can fail: stores with one
//! deliberate bug each diverge from the model within the first histories, and the report names
//! the shortest failing history.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_conformance::model::{self, ModelConfig};
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, FailureKind, IdempotencyKey, IdempotencyStore, Lease,
    ManualClock, MemoryStore, Record, Result,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_store_matches_the_model() {
    let clock = Arc::new(ManualClock::default());
    let store = Arc::new(MemoryStore::with_clock(clock.clone()));
    let config = ModelConfig::manual_time(clock);
    let histories = config.histories;
    let report = model::check(store, config).await;
    assert_eq!(report.histories, u64::from(histories));
}

/// The same on the system clock, as the server-backed stores run: waits sleep, and leases end
/// between two readings of the clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_store_on_the_system_clock_matches_the_model() {
    let store = Arc::new(MemoryStore::new());
    let histories = model::DEFAULT_HISTORIES / 5;
    let report = model::check(store, ModelConfig::real_time().with_histories(histories)).await;
    assert_eq!(report.histories, u64::from(histories));
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bug {
    /// `acquire` allows one attempt more than asked (a poison message runs once too often).
    OneAttemptTooMany,
    /// `release` is answered `Ok` without releasing when the record is not in progress.
    ReleaseOfFinishedRecordOk,
    /// `get` hides the fingerprint.
    GetDropsFingerprint,
}

/// `MemoryStore` with one bug.
#[derive(Debug)]
struct Broken {
    inner: MemoryStore,
    bug: Bug,
}

#[async_trait]
impl IdempotencyStore for Broken {
    fn name(&self) -> &'static str {
        "broken"
    }

    async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome> {
        if self.bug == Bug::OneAttemptTooMany {
            let req = req.clone().with_max_attempts(req.max_attempts + 1);
            return self.inner.acquire(&req).await;
        }
        self.inner.acquire(req).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        self.inner.extend(lease, ttl).await
    }

    async fn complete(&self, lease: &Lease, result: Bytes, retention: Duration) -> Result<()> {
        self.inner.complete(lease, result, retention).await
    }

    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        self.inner.fail(lease, error, kind, retention).await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let answer = self.inner.release(lease).await;
        if self.bug == Bug::ReleaseOfFinishedRecordOk
            && let Err(idem_core::Error::LeaseLost {
                why: idem_core::LostLease::NotInProgress { .. },
                ..
            }) = &answer
        {
            return Ok(());
        }
        answer
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        let mut record = self.inner.get(key).await?;
        if self.bug == Bug::GetDropsFingerprint
            && let Some(record) = &mut record
        {
            record.fingerprint = None;
        }
        Ok(record)
    }

    async fn delete(&self, key: &IdempotencyKey) -> Result<bool> {
        self.inner.delete(key).await
    }

    async fn purge_expired(&self, limit: usize) -> Result<u64> {
        self.inner.purge_expired(limit).await
    }
}

/// The seed of the broken-store runs (any seed works; a fixed one keeps the run repeatable).
const SEED: u64 = 20_261_124;

async fn catches(bug: Bug) {
    let clock = Arc::new(ManualClock::default());
    let store = Arc::new(Broken {
        inner: MemoryStore::with_clock(clock.clone()),
        bug,
    });
    // One thread and a fixed seed on a manual clock: the same histories, the same shrinking,
    // every run (with several threads, which one fails first, and so what shrinking starts
    // from, depends on scheduling).
    let config = ModelConfig::manual_time(clock)
        .with_threads(1)
        .with_seed(SEED);
    let report = model::run(store, config).await;
    let divergence = report
        .divergence
        .unwrap_or_else(|| panic!("{bug:?}: the model test did not notice the bug"));
    let shown = divergence.to_string();
    eprintln!("{bug:?}:\n{shown}");
    assert!(
        divergence.histories_before < 100,
        "{bug:?}: found only after {} histories",
        divergence.histories_before
    );
    assert!(shown.contains("Shortest failing history"), "{shown}");
    assert!(shown.contains("DIVERGED"), "{shown}");
    // Shrinking leaves only what the bug needs: a handful of steps.
    assert!(
        divergence.history.0.len() <= 8,
        "{bug:?}: the shortest history has {} steps:\n{shown}",
        divergence.history.0.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn catches_one_attempt_too_many() {
    catches(Bug::OneAttemptTooMany).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn catches_a_release_of_a_finished_record_answered_ok() {
    catches(Bug::ReleaseOfFinishedRecordOk).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn catches_get_dropping_the_fingerprint() {
    catches(Bug::GetDropsFingerprint).await;
}
