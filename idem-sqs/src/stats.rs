//! Counters of a running runner.

/// Names of the `metrics` counters the runner increments (through whatever recorder the
/// application installed), next to the executor's own `idem_*` counters.
pub mod metric_names {
    /// Messages received.
    pub const RECEIVED: &str = "idem_sqs_received";
    /// Messages whose handler ran to completion.
    pub const EXECUTED: &str = "idem_sqs_executed";
    /// Duplicates answered from the store.
    pub const REPLAYED: &str = "idem_sqs_replayed";
    /// Messages sent to the dead-letter queue, labelled `reason` (a
    /// [`DeadLetterReason`](crate::DeadLetterReason) code).
    pub const DEAD_LETTERED: &str = "idem_sqs_dead_lettered";
    /// Messages made visible again later (a retry: the visibility set to the outcome's delay).
    pub const RETRIES: &str = "idem_sqs_retries";
    /// Messages deleted (acknowledged or dead-lettered).
    pub const DELETED: &str = "idem_sqs_deleted";
    /// Deletes that failed (the message comes back and is replayed from the store).
    pub const DELETE_FAILURES: &str = "idem_sqs_delete_failures";
    /// Visibility extensions sent for messages in process.
    pub const VISIBILITY_EXTENSIONS: &str = "idem_sqs_visibility_extensions";
    /// Visibility changes (extensions, retries, releases) that failed.
    pub const VISIBILITY_FAILURES: &str = "idem_sqs_visibility_failures";
    /// Dead-letter sends that failed (tried again, unless the refusal stops the runner).
    pub const DEAD_LETTER_FAILURES: &str = "idem_sqs_dead_letter_failures";
    /// Leases released because the drain timed out before the message's handler started.
    pub const RELEASED: &str = "idem_sqs_leases_released";
    /// Messages given up at the drain timeout (made visible again, or left to their visibility).
    pub const ABANDONED: &str = "idem_sqs_abandoned";
    /// `ReceiveMessage` calls that failed.
    pub const RECEIVE_ERRORS: &str = "idem_sqs_receive_errors";
}

use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters of an [`SqsRunner`](crate::SqsRunner), shared with
/// [`SqsRunner::stats`](crate::SqsRunner::stats). Every count is of messages (not of keys) since
/// the runner started.
#[derive(Debug, Default)]
pub struct RunnerStats {
    pub(crate) receives: AtomicU64,
    pub(crate) received: AtomicU64,
    pub(crate) executed: AtomicU64,
    pub(crate) replayed: AtomicU64,
    pub(crate) acked_other: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) retries: AtomicU64,
    pub(crate) released: AtomicU64,
    pub(crate) deleted: AtomicU64,
    pub(crate) delete_calls: AtomicU64,
    pub(crate) delete_failures: AtomicU64,
    pub(crate) visibility_extensions: AtomicU64,
    pub(crate) visibility_failures: AtomicU64,
    pub(crate) dead_letter_failures: AtomicU64,
    pub(crate) receive_errors: AtomicU64,
    pub(crate) abandoned: AtomicU64,
    pub(crate) leases_released: AtomicU64,
}

impl RunnerStats {
    pub(crate) fn bump(counter: &AtomicU64) {
        Self::add(counter, 1);
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Bumps `counter` and the `metrics` counter `name` by `n`.
    pub(crate) fn count(counter: &AtomicU64, name: &'static str, n: u64) {
        Self::add(counter, n);
        metrics::counter!(name).increment(n);
    }

    fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    /// `ReceiveMessage` calls that returned (with or without messages).
    pub fn receives(&self) -> u64 {
        Self::get(&self.receives)
    }

    /// Messages received.
    pub fn received(&self) -> u64 {
        Self::get(&self.received)
    }

    /// Messages whose handler ran to completion here ([`Outcome::Executed`](idem_executor::Outcome::Executed)).
    pub fn executed(&self) -> u64 {
        Self::get(&self.executed)
    }

    /// Duplicates answered from the store ([`Outcome::Replayed`](idem_executor::Outcome::Replayed)).
    pub fn replayed(&self) -> u64 {
        Self::get(&self.replayed)
    }

    /// Other messages acknowledged (un-deduplicated runs that succeeded).
    pub fn acked_other(&self) -> u64 {
        Self::get(&self.acked_other)
    }

    /// Messages sent to the dead-letter queue.
    pub fn dead_lettered(&self) -> u64 {
        Self::get(&self.dead_lettered)
    }

    /// Messages given a retry: their visibility set to the outcome's delay, to be received again.
    pub fn retries(&self) -> u64 {
        Self::get(&self.retries)
    }

    /// Messages made visible again without being processed: the rest of a FIFO group after a
    /// retry, what a receive in flight at shutdown returned, and the messages given up at the
    /// drain timeout ([`abandoned`](Self::abandoned)).
    pub fn released(&self) -> u64 {
        Self::get(&self.released)
    }

    /// Messages deleted from the queue (acknowledged, or dead-lettered).
    pub fn deleted(&self) -> u64 {
        Self::get(&self.deleted)
    }

    /// `DeleteMessageBatch` calls sent.
    pub fn delete_calls(&self) -> u64 {
        Self::get(&self.delete_calls)
    }

    /// Deletes that failed: SQS delivers those messages again, and the store replays them.
    pub fn delete_failures(&self) -> u64 {
        Self::get(&self.delete_failures)
    }

    /// Visibility extensions sent for messages in process.
    pub fn visibility_extensions(&self) -> u64 {
        Self::get(&self.visibility_extensions)
    }

    /// Visibility changes that failed.
    pub fn visibility_failures(&self) -> u64 {
        Self::get(&self.visibility_failures)
    }

    /// Dead-letter sends that failed (and were tried again, unless the refusal, one that trying
    /// again cannot heal, stopped the runner).
    pub fn dead_letter_failures(&self) -> u64 {
        Self::get(&self.dead_letter_failures)
    }

    /// `ReceiveMessage` calls that failed.
    pub fn receive_errors(&self) -> u64 {
        Self::get(&self.receive_errors)
    }

    /// What was still in process when the drain timed out, given up: made visible again at once
    /// (its handler had not started) or left to its visibility (dropped). Counted once per
    /// message of a standard queue, but once per FIFO group of a receive (the group's messages
    /// it returned, processed one after another), however many of them were still held.
    pub fn abandoned(&self) -> u64 {
        Self::get(&self.abandoned)
    }

    /// Leases released because the drain timed out before the message's handler started (the
    /// key is free at once, no attempt counted).
    pub fn leases_released(&self) -> u64 {
        Self::get(&self.leases_released)
    }
}
