//! Counters of a running runner.

/// Names of the `metrics` counters the runner increments (through whatever recorder the
/// application installed), next to the executor's own `idem_*` counters.
pub mod metric_names {
    /// Deliveries whose handler ran to completion (acknowledged).
    pub const EXECUTED: &str = "idem_amqp_executed";
    /// Duplicates answered from the store (acknowledged).
    pub const REPLAYED: &str = "idem_amqp_replayed";
    /// Deliveries published to the dead-letter exchange (then acknowledged), labelled `reason`
    /// (a [`DeadLetterReason`](crate::DeadLetterReason) code).
    pub const DEAD_LETTERED: &str = "idem_amqp_dead_lettered";
    /// Deliveries published to the retry queue for a delayed redelivery (then acknowledged).
    pub const RETRIES: &str = "idem_amqp_retries";
    /// Deliveries given back with `basic.nack` and `requeue` (redelivered at once) because the
    /// retry publication failed, or the dead letter was not published within a minute.
    pub const REQUEUED: &str = "idem_amqp_requeued";
    /// Leases released because the delivery was lost (channel closed, drain timed out) before its
    /// handler started.
    pub const RELEASED: &str = "idem_amqp_leases_released";
    /// Deliveries left unacknowledged because their channel was lost or the drain timed out: the
    /// broker delivers them again.
    pub const ABANDONED: &str = "idem_amqp_abandoned";
    /// Acknowledgements (or nacks) that failed: the broker delivers the message again, and the
    /// store replays it.
    pub const ACK_FAILURES: &str = "idem_amqp_ack_failures";
    /// Retry or dead-letter publications refused, returned (unroutable) or not confirmed in time.
    pub const PUBLISH_FAILURES: &str = "idem_amqp_publish_failures";
    /// Connections or channels lost and opened again.
    pub const RECONNECTS: &str = "idem_amqp_reconnects";
    /// Times the runner held new deliveries back because the last outcomes were store errors
    /// (the store is failing): each waits the reconnect delay of the failures in a row.
    pub const STORE_PAUSES: &str = "idem_amqp_store_pauses";
}

use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters of an [`AmqpRunner`](crate::AmqpRunner), shared with
/// [`AmqpRunner::stats`](crate::AmqpRunner::stats). Every count is of deliveries (not of keys)
/// since the runner started.
#[derive(Debug, Default)]
pub struct RunnerStats {
    pub(crate) received: AtomicU64,
    pub(crate) executed: AtomicU64,
    pub(crate) replayed: AtomicU64,
    pub(crate) acked_other: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) retries: AtomicU64,
    pub(crate) requeued: AtomicU64,
    pub(crate) released: AtomicU64,
    pub(crate) abandoned: AtomicU64,
    pub(crate) ack_failures: AtomicU64,
    pub(crate) publish_failures: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    pub(crate) store_pauses: AtomicU64,
}

impl RunnerStats {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds `n` to `counter` and to the `metrics` counter `name`.
    pub(crate) fn add(counter: &AtomicU64, name: &'static str, n: usize) {
        let n = n as u64;
        counter.fetch_add(n, Ordering::Relaxed);
        metrics::counter!(name).increment(n);
    }

    /// Bumps `counter` and the `metrics` counter `name`.
    pub(crate) fn count(counter: &AtomicU64, name: &'static str) {
        Self::bump(counter);
        metrics::counter!(name).increment(1);
    }

    /// Deliveries received from the work queue.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Deliveries whose handler ran to completion here ([`Outcome::Executed`](idem_executor::Outcome::Executed)).
    pub fn executed(&self) -> u64 {
        self.executed.load(Ordering::Relaxed)
    }

    /// Duplicates answered from the store ([`Outcome::Replayed`](idem_executor::Outcome::Replayed)).
    pub fn replayed(&self) -> u64 {
        self.replayed.load(Ordering::Relaxed)
    }

    /// Other deliveries acknowledged (un-deduplicated runs that succeeded).
    pub fn acked_other(&self) -> u64 {
        self.acked_other.load(Ordering::Relaxed)
    }

    /// Deliveries published to the dead-letter exchange.
    pub fn dead_lettered(&self) -> u64 {
        self.dead_lettered.load(Ordering::Relaxed)
    }

    /// Deliveries published to the retry queue.
    pub fn retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    /// Deliveries given back (`basic.nack` with requeue) because their retry publication failed,
    /// or their dead letter was not published within a minute.
    pub fn requeued(&self) -> u64 {
        self.requeued.load(Ordering::Relaxed)
    }

    /// Deliveries resolved here: executed, replayed, acknowledged otherwise, dead-lettered, or
    /// handed to the retry queue.
    pub fn resolved(&self) -> u64 {
        self.executed()
            + self.replayed()
            + self.acked_other()
            + self.dead_lettered()
            + self.retries()
    }

    /// Leases given back because a delivery was lost before its handler started.
    pub fn released(&self) -> u64 {
        self.released.load(Ordering::Relaxed)
    }

    /// Deliveries left unacknowledged (lost channel, drain timeout): redelivered by the broker.
    pub fn abandoned(&self) -> u64 {
        self.abandoned.load(Ordering::Relaxed)
    }

    /// Acknowledgements that failed.
    pub fn ack_failures(&self) -> u64 {
        self.ack_failures.load(Ordering::Relaxed)
    }

    /// Publications (retry, dead letter) that failed.
    pub fn publish_failures(&self) -> u64 {
        self.publish_failures.load(Ordering::Relaxed)
    }

    /// Connections (or the consuming channel) lost and opened again.
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }

    /// Times new deliveries were held back while the store was failing (see
    /// [`metric_names::STORE_PAUSES`](metric_names::STORE_PAUSES)).
    pub fn store_pauses(&self) -> u64 {
        self.store_pauses.load(Ordering::Relaxed)
    }
}
