//! Counters of a running runner.

/// Names of the `metrics` counters the runner increments (through whatever recorder the
/// application installed), next to the executor's own `idem_*` counters.
pub mod metric_names {
    /// Messages whose handler ran to completion, counted as their ack is sent.
    pub const EXECUTED: &str = "idem_nats_executed";
    /// Duplicates answered from the store (acknowledged).
    pub const REPLAYED: &str = "idem_nats_replayed";
    /// Messages published to the dead-letter subject (then terminated), labelled `reason` (a
    /// [`DeadLetterReason`](crate::DeadLetterReason) code).
    pub const DEAD_LETTERED: &str = "idem_nats_dead_lettered";
    /// Naks with a delay (a retry, a key in progress elsewhere, a lost lease, a store error).
    pub const NAKS: &str = "idem_nats_naks";
    /// Progress acks (`+WPI`) sent to hold a message's ack deadline.
    pub const PROGRESS: &str = "idem_nats_progress";
    /// Leases released because the drain timed out before the message's handler started.
    pub const RELEASED: &str = "idem_nats_leases_released";
    /// Messages given up at the drain timeout before their handler started or before their
    /// outcome was known (nak'ed for an immediate redelivery, or left to their ack deadline). A
    /// running handler the drain cut short has an outcome, a lost lease, and is counted under
    /// `NAKS` instead.
    pub const ABANDONED: &str = "idem_nats_abandoned";
    /// Acks, naks or terms that failed (or, for double acks, were not confirmed): the server
    /// redelivers the message after its ack deadline, and the store replays it.
    pub const ACK_FAILURES: &str = "idem_nats_ack_failures";
    /// Dead-letter publications that failed or were not acknowledged by a stream in time.
    pub const PUBLISH_FAILURES: &str = "idem_nats_publish_failures";
    /// Dead letters that came back to the consumer (the source stream captures the dead-letter
    /// subject) and were terminated rather than dead-lettered again, which would loop.
    pub const DEAD_LETTER_LOOPS: &str = "idem_nats_dead_letter_loops";
    /// Pull requests that failed (the server unreachable, the consumer gone); each is sent again
    /// after a bounded delay.
    pub const STREAM_ERRORS: &str = "idem_nats_stream_errors";
    /// Pulls held back because the last outcomes were store errors (the store is failing):
    /// each waits the reconnect delay of the failures in a row first.
    pub const STORE_PAUSES: &str = "idem_nats_store_pauses";
}

use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters of a [`NatsRunner`](crate::NatsRunner), shared with
/// [`NatsRunner::stats`](crate::NatsRunner::stats). Every count is of deliveries (not of keys)
/// since the runner started.
#[derive(Debug, Default)]
pub struct RunnerStats {
    pub(crate) received: AtomicU64,
    pub(crate) executed: AtomicU64,
    pub(crate) replayed: AtomicU64,
    pub(crate) acked_other: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) naks: AtomicU64,
    pub(crate) progress: AtomicU64,
    pub(crate) released: AtomicU64,
    pub(crate) abandoned: AtomicU64,
    pub(crate) ack_failures: AtomicU64,
    pub(crate) publish_failures: AtomicU64,
    pub(crate) dead_letter_loops: AtomicU64,
    pub(crate) stream_errors: AtomicU64,
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

    /// Deliveries received from the consumer.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Messages whose handler ran to completion here ([`Outcome::Executed`](idem_executor::Outcome::Executed)).
    /// Not a count of effects: a completion whose reply was lost (a store timeout after it
    /// landed) is retried, and its redelivery counts under `replayed`.
    pub fn executed(&self) -> u64 {
        self.executed.load(Ordering::Relaxed)
    }

    /// Duplicates answered from the store ([`Outcome::Replayed`](idem_executor::Outcome::Replayed)).
    pub fn replayed(&self) -> u64 {
        self.replayed.load(Ordering::Relaxed)
    }

    /// Other messages acknowledged (un-deduplicated runs that succeeded).
    pub fn acked_other(&self) -> u64 {
        self.acked_other.load(Ordering::Relaxed)
    }

    /// Messages published to the dead-letter subject.
    pub fn dead_lettered(&self) -> u64 {
        self.dead_lettered.load(Ordering::Relaxed)
    }

    /// Naks with a delay.
    pub fn naks(&self) -> u64 {
        self.naks.load(Ordering::Relaxed)
    }

    /// Progress acks sent.
    pub fn progress(&self) -> u64 {
        self.progress.load(Ordering::Relaxed)
    }

    /// Leases given back because the drain timed out before the handler started.
    pub fn released(&self) -> u64 {
        self.released.load(Ordering::Relaxed)
    }

    /// Messages given up at the drain timeout (see
    /// [`metric_names::ABANDONED`](metric_names::ABANDONED): a running handler the drain cut
    /// short is a nak).
    pub fn abandoned(&self) -> u64 {
        self.abandoned.load(Ordering::Relaxed)
    }

    /// Acks, naks or terms that failed.
    pub fn ack_failures(&self) -> u64 {
        self.ack_failures.load(Ordering::Relaxed)
    }

    /// Dead-letter publications that failed.
    pub fn publish_failures(&self) -> u64 {
        self.publish_failures.load(Ordering::Relaxed)
    }

    /// Dead letters received back from the source stream and terminated rather than
    /// dead-lettered again ([`metric_names::DEAD_LETTER_LOOPS`]).
    pub fn dead_letter_loops(&self) -> u64 {
        self.dead_letter_loops.load(Ordering::Relaxed)
    }

    /// Pull requests that failed.
    pub fn stream_errors(&self) -> u64 {
        self.stream_errors.load(Ordering::Relaxed)
    }

    /// Pulls held back while the store was failing (see
    /// [`metric_names::STORE_PAUSES`](metric_names::STORE_PAUSES)).
    pub fn store_pauses(&self) -> u64 {
        self.store_pauses.load(Ordering::Relaxed)
    }
}
