//! Counters of a running runner.

/// Names of the `metrics` counters the runner increments (through whatever recorder the
/// application installed), next to the executor's own `idem_*` counters.
pub mod metric_names {
    /// Records whose handler ran to completion.
    pub const EXECUTED: &str = "idem_kafka_executed";
    /// Duplicates answered from the store.
    pub const REPLAYED: &str = "idem_kafka_replayed";
    /// Records written to the dead-letter topic, labelled `reason` (a
    /// [`DeadLetterReason`](crate::DeadLetterReason) code).
    pub const DEAD_LETTERED: &str = "idem_kafka_dead_lettered";
    /// Retry waits (the partition paused before the same record is tried again).
    pub const RETRIES: &str = "idem_kafka_retries";
    /// Leases released because a partition was revoked (or the drain timed out) before the
    /// record's handler was called (a handler that started never has its lease released).
    pub const RELEASED: &str = "idem_kafka_leases_released";
    /// Offset commits sent.
    pub const COMMITS: &str = "idem_kafka_commits";
    /// Offset commits that failed.
    pub const COMMIT_FAILURES: &str = "idem_kafka_commit_failures";
    /// Rebalance events.
    pub const REBALANCES: &str = "idem_kafka_rebalances";
}

use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters of a [`KafkaRunner`](crate::KafkaRunner), shared with
/// [`KafkaRunner::stats`](crate::KafkaRunner::stats). Every count is of records (not of keys)
/// since the runner started.
#[derive(Debug, Default)]
pub struct RunnerStats {
    pub(crate) received: AtomicU64,
    pub(crate) executed: AtomicU64,
    pub(crate) replayed: AtomicU64,
    pub(crate) acked_other: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) retries: AtomicU64,
    pub(crate) released: AtomicU64,
    pub(crate) abandoned: AtomicU64,
    pub(crate) commits: AtomicU64,
    pub(crate) commit_failures: AtomicU64,
    pub(crate) rebalances: AtomicU64,
}

impl RunnerStats {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Bumps `counter` and the `metrics` counter `name`.
    pub(crate) fn count(counter: &AtomicU64, name: &'static str) {
        Self::bump(counter);
        metrics::counter!(name).increment(1);
    }

    /// Records polled from Kafka and handed to a partition worker.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Records whose handler ran to completion here ([`Outcome::Executed`](idem_executor::Outcome::Executed)).
    pub fn executed(&self) -> u64 {
        self.executed.load(Ordering::Relaxed)
    }

    /// Duplicates answered from the store ([`Outcome::Replayed`](idem_executor::Outcome::Replayed)).
    pub fn replayed(&self) -> u64 {
        self.replayed.load(Ordering::Relaxed)
    }

    /// Other records acknowledged (un-deduplicated runs that succeeded).
    pub fn acked_other(&self) -> u64 {
        self.acked_other.load(Ordering::Relaxed)
    }

    /// Records written to the dead-letter topic.
    pub fn dead_lettered(&self) -> u64 {
        self.dead_lettered.load(Ordering::Relaxed)
    }

    /// Records resolved: executed, replayed, acknowledged otherwise or dead-lettered. Their
    /// offsets may be committed.
    pub fn resolved(&self) -> u64 {
        self.executed() + self.replayed() + self.acked_other() + self.dead_lettered()
    }

    /// Retry waits: a record that was in progress elsewhere, failed retryably, met a store or
    /// dead-letter error, or lost its lease, and was tried again after a pause.
    pub fn retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    /// Leases given back because the partition was revoked (or the drain timed out) before the
    /// record's handler was called.
    pub fn released(&self) -> u64 {
        self.released.load(Ordering::Relaxed)
    }

    /// Records left unresolved (and uncommitted) at a revocation or shutdown: the next owner of
    /// the partition receives them again.
    pub fn abandoned(&self) -> u64 {
        self.abandoned.load(Ordering::Relaxed)
    }

    /// Offset commits sent (periodic, at revocation and at shutdown).
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// Offset commits the broker refused or that failed.
    pub fn commit_failures(&self) -> u64 {
        self.commit_failures.load(Ordering::Relaxed)
    }

    /// Rebalance events seen (assignments and revocations).
    pub fn rebalances(&self) -> u64 {
        self.rebalances.load(Ordering::Relaxed)
    }
}
