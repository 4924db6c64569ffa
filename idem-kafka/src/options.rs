//! Runner options.

use std::time::Duration;

use idem_executor::broker;

use crate::dead_letter::DeadLetterTopic;
use crate::error::RunnerError;

/// Options of a [`KafkaRunner`](crate::KafkaRunner). Every field has a default; set them with
/// the `with_*` methods.
///
/// ```
/// use std::time::Duration;
/// use idem_kafka::{DeadLetterTopic, RunnerOptions};
///
/// let options = RunnerOptions::default()
///     .with_max_in_flight(8)
///     .with_commit_interval(Duration::from_millis(500))
///     .with_dead_letter_topic(DeadLetterTopic::Fixed("payments.dlq".into()));
/// # let _ = options;
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RunnerOptions {
    /// Executor batches processed at once across all partitions (default 16; 1 to
    /// [`broker::MAX_IN_FLIGHT`]). Within a partition
    /// at most [`max_batches_per_partition`](Self::max_batches_per_partition) at once.
    pub max_in_flight: usize,
    /// Most records of one partition handed to the executor in one batch (default 100, and at
    /// most the store's [`max_batch`](idem_core::Limits::max_batch)): the records waiting when
    /// a batch starts, up to this many, go to
    /// [`Executor::run_batch`](idem_executor::Executor::run_batch) together (one acquire call,
    /// grouped completions). Their handlers run concurrently (records of one key one after the
    /// other, in offset order); they are resolved and committed in offset order. `1` processes
    /// a partition's records strictly one at a time.
    pub max_batch: usize,
    /// Batches of one partition in process at once (default 2). While a batch is in process
    /// (its acquire call, its handlers, its completions), the next one's records are already
    /// acquired and run, so the store's round trips overlap the runner's own work instead of
    /// waiting for it. A batch starts only with records whose keys none of the partition's
    /// batches in process holds (the first record with such a key waits, and the batch ends
    /// before it), so records of one key still run one after the other in offset order; records
    /// are still resolved and committed in offset order. A batch's try holds one of the
    /// [`max_in_flight`](Self::max_in_flight) slots while it runs (a record tried again waits
    /// for one); a batch after the first starts only when a slot is free (otherwise its records
    /// wait for the next batch). Only a batch's first try overlaps the batches before it: a
    /// record of a later batch that needs another try (a retryable failure, a busy key) waits
    /// until the batches before it are resolved, where one behind a busy key in the same batch
    /// is tried again at its own retry delay meanwhile. `1` processes a partition's batches one
    /// at a time; so does a [`max_batch`](Self::max_batch) of 1 (one record at a time),
    /// whatever this is.
    pub max_batches_per_partition: usize,
    /// Records of a partition held by the runner, waiting or in process (default 100,000, as
    /// librdkafka's prefetch target `queued.min.messages`). A partition whose buffer is full, in
    /// records or in bytes
    /// ([`max_buffered_bytes_per_partition`](Self::max_buffered_bytes_per_partition)), is paused
    /// until it drains to half of both.
    ///
    /// A pause drops what the client prefetched for the partition, and after the resume the
    /// refetch may wait for a fetch request already in flight, up to `fetch.wait.max.ms` (500 ms
    /// by default), so a bound the runner reaches in the common case costs throughput: with
    /// 2,048 the runner measured about 4,000 records/s on one partition against about 7,800 with a
    /// buffer that never paused, and with 256 about 480. The byte bound is the one that bounds
    /// memory.
    pub max_buffered_per_partition: usize,
    /// Bytes of the records of a partition held by the runner, waiting or in process (default
    /// 64 MiB, as librdkafka's `queued.max.messages.kbytes`), counted as
    /// [`KafkaMessage::size`](crate::KafkaMessage::size) (key, value and headers). A partition
    /// whose buffer reaches it is paused until it drains to half (of this and of
    /// [`max_buffered_per_partition`](Self::max_buffered_per_partition)); the record that
    /// crosses it is kept, so a partition holds at most this plus one record. The runner holds
    /// up to this per assigned partition, on top of what librdkafka prefetches.
    pub max_buffered_bytes_per_partition: usize,
    /// How often resolved offsets are committed (default 1 s). Commits also happen at every
    /// revocation and at shutdown.
    pub commit_interval: Duration,
    /// Shortest pause before a record is tried again (default 5 ms), so a hint of zero never
    /// spins; also the first wait on a key another consumer holds.
    pub min_retry_delay: Duration,
    /// Longest pause before a record is tried again (default 5 s). A record whose key another
    /// consumer holds is tried again with exponential backoff (with jitter) from
    /// [`min_retry_delay`](Self::min_retry_delay) up to this, and never later than the holder's
    /// lease expiry: a holder that finishes in 300 ms costs a wait of about that long, and one
    /// that crashed is taken over as its lease ends.
    pub max_retry_delay: Duration,
    /// Where dead-lettered records go (default: the source topic + `.dlq`). The runner never
    /// creates these topics: see [Topics](crate#topics).
    pub dead_letter_topic: DeadLetterTopic,
    /// How long one dead-letter write may take before it is tried again (default 30 s). Also the
    /// dead-letter producer's `message.timeout.ms`, so that a write that timed out is not still
    /// queued in the client behind the next try. A write that timed out after it was sent may
    /// still have been appended by the broker (its acknowledgement is what was missing): the
    /// next try then writes the dead letter again, so dead letters are at least once (see
    /// [Offsets](crate#offsets-what-is-committed-and-when)).
    pub dead_letter_timeout: Duration,
    /// Longest wait of a revocation for the revoked partitions' in-flight records to release their
    /// leases or finish (default 10 s). The group's rebalance waits that long at most. A handler
    /// still running is signalled through its context's cancellation token after half of it,
    /// which the executor reads as a lost lease: it drops the handler unless it returns in that
    /// same poll, records nothing, and the lease is left to expire (never released).
    pub revoke_timeout: Duration,
    /// Longest wait for one lease release on revocation (default 5 s; must be below
    /// [`revoke_timeout`](Self::revoke_timeout)). Only leases whose handler had not started yet are
    /// released; when that release fails, the record's batch records a retryable failure for it
    /// instead (one attempt counted, the key free at once).
    pub release_timeout: Duration,
    /// Longest wait at shutdown for in-flight records to finish (default 30 s); the ones still
    /// running then are revoked as on a rebalance (signalled, then dropped with their leases left
    /// to expire).
    pub drain_timeout: Duration,
    /// Longest time the poll thread blocks in one poll (default 50 ms): the latency of applying a
    /// pause, a resume or a shutdown.
    pub poll_interval: Duration,
}

impl Default for RunnerOptions {
    fn default() -> Self {
        Self {
            max_in_flight: 16,
            max_batch: 100,
            max_batches_per_partition: 2,
            max_buffered_per_partition: 100_000,
            max_buffered_bytes_per_partition: 64 * 1024 * 1024,
            commit_interval: Duration::from_secs(1),
            min_retry_delay: Duration::from_millis(5),
            max_retry_delay: Duration::from_secs(5),
            dead_letter_topic: DeadLetterTopic::default(),
            dead_letter_timeout: Duration::from_secs(30),
            revoke_timeout: Duration::from_secs(10),
            release_timeout: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(30),
            poll_interval: Duration::from_millis(50),
        }
    }
}

impl RunnerOptions {
    /// Sets [`max_in_flight`](Self::max_in_flight).
    pub fn with_max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }

    /// Sets [`max_batch`](Self::max_batch).
    pub fn with_max_batch(mut self, n: usize) -> Self {
        self.max_batch = n;
        self
    }

    /// Sets [`max_batches_per_partition`](Self::max_batches_per_partition).
    pub fn with_max_batches_per_partition(mut self, n: usize) -> Self {
        self.max_batches_per_partition = n;
        self
    }

    /// Sets [`max_buffered_per_partition`](Self::max_buffered_per_partition).
    pub fn with_max_buffered_per_partition(mut self, n: usize) -> Self {
        self.max_buffered_per_partition = n;
        self
    }

    /// Sets [`max_buffered_bytes_per_partition`](Self::max_buffered_bytes_per_partition).
    pub fn with_max_buffered_bytes_per_partition(mut self, bytes: usize) -> Self {
        self.max_buffered_bytes_per_partition = bytes;
        self
    }

    /// Sets [`commit_interval`](Self::commit_interval).
    pub fn with_commit_interval(mut self, interval: Duration) -> Self {
        self.commit_interval = interval;
        self
    }

    /// Sets [`min_retry_delay`](Self::min_retry_delay) and [`max_retry_delay`](Self::max_retry_delay).
    pub fn with_retry_delays(mut self, min: Duration, max: Duration) -> Self {
        self.min_retry_delay = min;
        self.max_retry_delay = max;
        self
    }

    /// Sets [`dead_letter_topic`](Self::dead_letter_topic).
    pub fn with_dead_letter_topic(mut self, topic: DeadLetterTopic) -> Self {
        self.dead_letter_topic = topic;
        self
    }

    /// Sets [`dead_letter_timeout`](Self::dead_letter_timeout).
    pub fn with_dead_letter_timeout(mut self, timeout: Duration) -> Self {
        self.dead_letter_timeout = timeout;
        self
    }

    /// Sets [`revoke_timeout`](Self::revoke_timeout).
    pub fn with_revoke_timeout(mut self, timeout: Duration) -> Self {
        self.revoke_timeout = timeout;
        self
    }

    /// Sets [`release_timeout`](Self::release_timeout).
    pub fn with_release_timeout(mut self, timeout: Duration) -> Self {
        self.release_timeout = timeout;
        self
    }

    /// Sets [`drain_timeout`](Self::drain_timeout).
    pub fn with_drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = timeout;
        self
    }

    /// Sets [`poll_interval`](Self::poll_interval).
    pub fn with_poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// The pause before trying a record again, from the outcome's hint.
    pub(crate) fn retry_delay(&self, hint: Duration) -> Duration {
        broker::retry_delay(hint, self.min_retry_delay, self.max_retry_delay)
    }

    /// Checks the options, `max_batch` against the store's
    /// [`max_batch`](idem_core::Limits::max_batch).
    pub(crate) fn validate(&self, store_max_batch: usize) -> Result<(), RunnerError> {
        broker::check_count("max_in_flight", self.max_in_flight, broker::MAX_IN_FLIGHT)?;
        broker::check_count("max_batch", self.max_batch, store_max_batch.max(1))?;
        broker::check_count(
            "max_batches_per_partition",
            self.max_batches_per_partition,
            broker::MAX_IN_FLIGHT,
        )?;
        if self.max_buffered_per_partition == 0 {
            return Err(RunnerError::config(
                "max_buffered_per_partition",
                "must be at least 1",
            ));
        }
        if self.max_buffered_bytes_per_partition == 0 {
            return Err(RunnerError::config(
                "max_buffered_bytes_per_partition",
                "must be at least 1",
            ));
        }
        broker::check_delays("retry_delay", self.min_retry_delay, self.max_retry_delay)?;
        broker::check_nonzero([
            ("commit_interval", &self.commit_interval),
            ("dead_letter_timeout", &self.dead_letter_timeout),
            ("revoke_timeout", &self.revoke_timeout),
            ("release_timeout", &self.release_timeout),
        ])?;
        // librdkafka polls in whole milliseconds: a shorter interval is a poll that never
        // waits, a spinning poll thread.
        broker::check_within(
            [("poll_interval", &self.poll_interval)],
            Duration::from_millis(1),
            Duration::MAX,
            "librdkafka polls in whole milliseconds",
        )?;
        if self.release_timeout >= self.revoke_timeout {
            return Err(RunnerError::config(
                "release_timeout",
                format!(
                    "{:?} must be below revoke_timeout {:?}: a release runs within the revocation",
                    self.release_timeout, self.revoke_timeout
                ),
            ));
        }
        self.dead_letter_topic.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delay_is_clamped() {
        let o = RunnerOptions::default();
        assert_eq!(o.retry_delay(Duration::ZERO), Duration::from_millis(5));
        assert_eq!(
            o.retry_delay(Duration::from_secs(1)),
            Duration::from_secs(1)
        );
        assert_eq!(
            o.retry_delay(Duration::from_secs(30)),
            Duration::from_secs(5)
        );
    }

    #[test]
    fn validation_names_the_field() {
        assert!(RunnerOptions::default().validate(1000).is_ok());
        let r = RunnerOptions::default()
            .with_max_in_flight(0)
            .validate(1000);
        assert!(
            matches!(
                r,
                Err(RunnerError::Config {
                    field: "max_in_flight",
                    ..
                })
            ),
            "{r:?}"
        );
        let r = RunnerOptions::default()
            .with_max_batches_per_partition(0)
            .validate(1000);
        assert!(
            matches!(
                r,
                Err(RunnerError::Config {
                    field: "max_batches_per_partition",
                    ..
                })
            ),
            "{r:?}"
        );
        let r = RunnerOptions::default()
            .with_retry_delays(Duration::from_secs(2), Duration::from_secs(1))
            .validate(1000);
        assert!(
            matches!(
                r,
                Err(RunnerError::Config {
                    field: "retry_delay",
                    ..
                })
            ),
            "{r:?}"
        );
        let r = RunnerOptions::default()
            .with_revoke_timeout(Duration::from_secs(5))
            .validate(1000);
        assert!(
            matches!(
                r,
                Err(RunnerError::Config {
                    field: "release_timeout",
                    ..
                })
            ),
            "release_timeout must be below revoke_timeout: {r:?}"
        );
        let r = RunnerOptions::default()
            .with_dead_letter_topic(crate::DeadLetterTopic::Suffix(String::new()))
            .validate(1000);
        assert!(
            matches!(
                r,
                Err(RunnerError::Config {
                    field: "dead_letter_topic",
                    ..
                })
            ),
            "{r:?}"
        );
        // Counts a semaphore and buffers are sized by, a batch over the store's limit, and a
        // poll interval librdkafka would round to zero.
        for (o, expected) in [
            (
                RunnerOptions::default().with_max_in_flight(usize::MAX),
                "max_in_flight",
            ),
            (
                RunnerOptions::default().with_max_batches_per_partition(usize::MAX),
                "max_batches_per_partition",
            ),
            (RunnerOptions::default().with_max_batch(1001), "max_batch"),
            (
                RunnerOptions::default().with_max_batch(usize::MAX),
                "max_batch",
            ),
            (
                RunnerOptions::default().with_poll_interval(Duration::from_nanos(1)),
                "poll_interval",
            ),
            (
                RunnerOptions::default().with_max_buffered_per_partition(0),
                "max_buffered_per_partition",
            ),
            (
                RunnerOptions::default().with_max_buffered_bytes_per_partition(0),
                "max_buffered_bytes_per_partition",
            ),
        ] {
            match o.validate(1000) {
                Err(RunnerError::Config { field, .. }) => assert_eq!(field, expected),
                other => panic!("{expected}: {other:?}"),
            }
        }
        assert!(
            RunnerOptions::default()
                .with_max_batch(1000)
                .with_max_in_flight(broker::MAX_IN_FLIGHT)
                .with_poll_interval(Duration::from_millis(1))
                .validate(1000)
                .is_ok()
        );
    }
}
