//! Runner options.

use std::time::Duration;

use idem_executor::broker::{self, LostTimeouts};

use crate::error::RunnerError;

/// Options of an [`AmqpRunner`](crate::AmqpRunner). Every field has a default; set them with the
/// `with_*` methods.
///
/// ```
/// use std::time::Duration;
/// use idem_amqp::RunnerOptions;
///
/// let options = RunnerOptions::default()
///     .with_prefetch(32)
///     .with_retry_delays(Duration::from_millis(100), Duration::from_secs(10));
/// # let _ = options;
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RunnerOptions {
    /// The channel's prefetch count (`basic.qos`, default 16): the deliveries the broker sends
    /// ahead of their acknowledgements, and so the messages processed at once.
    pub prefetch: u16,
    /// Largest group of deliveries run through one executor batch (default 64, at least 1; a
    /// group is also bounded by [`prefetch`](Self::prefetch) and the store's
    /// [`max_batch`](idem_core::Limits::max_batch)). The deliveries at hand together when one
    /// arrives form a group, in a task of its own: their keys are acquired in one store call,
    /// their handlers run concurrently (up to the executor's batch concurrency; those of one key
    /// one after the other), their results are recorded in grouped calls, and each delivery is
    /// settled (ack, retry or dead letter) as soon as its own outcome is recorded, so a slow
    /// handler holds back no other delivery beyond the executor's batch concurrency. Copies of
    /// one key in a group run their handlers back to back (see the README's "Consumer
    /// timeout"). `1` runs each delivery on its own (two store round trips per message).
    pub max_batch: usize,
    /// Shortest delay of a retry (default 100 ms; at least 1 ms, the unit of a message's
    /// expiration), so a hint of zero never spins.
    pub min_retry_delay: Duration,
    /// Longest delay of a retry (default 5 s): a key held by a live lease is looked at again at
    /// least this often. Also the most a retry can be held up by the ones ahead of it in the
    /// retry queue (the broker expires messages at the head of a queue only).
    pub max_retry_delay: Duration,
    /// Longest wait for the broker to confirm a retry or dead-letter publication (default 30 s).
    pub publish_timeout: Duration,
    /// Longest wait for a connection and what the runner does on it before consuming (channels,
    /// declarations, `basic.consume`), default 30 s: a broker that accepts the TCP connection
    /// but never finishes the handshake fails the first connection
    /// ([`RunnerError::TimedOut`](crate::RunnerError::TimedOut)) or counts as a failed
    /// reconnection, never hangs the runner.
    pub connect_timeout: Duration,
    /// How long a handler may go on after its delivery was lost (its channel or connection
    /// closed, or the drain timed out) before it is signalled (default 10 s): half-way through,
    /// its context's cancellation token is cancelled, and the executor, which reads that as a
    /// lost lease, drops the handler unless it returns in that same poll, recording nothing. Its
    /// lease is never released once it started: it expires and the next owner takes the key
    /// over.
    pub orphan_timeout: Duration,
    /// Longest wait for one lease release (default 5 s; must be below
    /// [`orphan_timeout`](Self::orphan_timeout)). Only the leases of deliveries whose handler had
    /// not started when the delivery was lost are released.
    pub release_timeout: Duration,
    /// Longest wait at shutdown for the deliveries in process to finish (default 30 s); the ones
    /// still running then are treated as lost deliveries (see
    /// [`orphan_timeout`](Self::orphan_timeout)).
    pub drain_timeout: Duration,
    /// First delay before reconnecting after the connection or channel was lost (default
    /// 100 ms); it doubles at each failed attempt up to
    /// [`max_reconnect_delay`](Self::max_reconnect_delay).
    pub min_reconnect_delay: Duration,
    /// Longest delay between two reconnection attempts (default 5 s). The runner retries until
    /// it is shut down.
    pub max_reconnect_delay: Duration,
    /// The consumer tag (default empty: the broker names the consumer).
    pub consumer_tag: String,
}

impl Default for RunnerOptions {
    fn default() -> Self {
        Self {
            prefetch: 16,
            max_batch: 64,
            min_retry_delay: Duration::from_millis(100),
            max_retry_delay: Duration::from_secs(5),
            publish_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(30),
            orphan_timeout: Duration::from_secs(10),
            release_timeout: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(30),
            min_reconnect_delay: Duration::from_millis(100),
            max_reconnect_delay: Duration::from_secs(5),
            consumer_tag: String::new(),
        }
    }
}

impl RunnerOptions {
    /// Sets [`prefetch`](Self::prefetch).
    pub fn with_prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// Sets [`max_batch`](Self::max_batch).
    pub fn with_max_batch(mut self, n: usize) -> Self {
        self.max_batch = n;
        self
    }

    /// Sets [`min_retry_delay`](Self::min_retry_delay) and [`max_retry_delay`](Self::max_retry_delay).
    pub fn with_retry_delays(mut self, min: Duration, max: Duration) -> Self {
        self.min_retry_delay = min;
        self.max_retry_delay = max;
        self
    }

    /// Sets [`connect_timeout`](Self::connect_timeout).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets [`publish_timeout`](Self::publish_timeout).
    pub fn with_publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }

    /// Sets [`orphan_timeout`](Self::orphan_timeout).
    pub fn with_orphan_timeout(mut self, timeout: Duration) -> Self {
        self.orphan_timeout = timeout;
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

    /// Sets [`min_reconnect_delay`](Self::min_reconnect_delay) and
    /// [`max_reconnect_delay`](Self::max_reconnect_delay).
    pub fn with_reconnect_delays(mut self, min: Duration, max: Duration) -> Self {
        self.min_reconnect_delay = min;
        self.max_reconnect_delay = max;
        self
    }

    /// Sets [`consumer_tag`](Self::consumer_tag).
    pub fn with_consumer_tag(mut self, tag: impl Into<String>) -> Self {
        self.consumer_tag = tag.into();
        self
    }

    /// The delay of a retry, from the outcome's hint.
    pub(crate) fn retry_delay(&self, hint: Duration) -> Duration {
        broker::retry_delay(hint, self.min_retry_delay, self.max_retry_delay)
    }

    /// The timeouts of a lost delivery.
    pub(crate) fn lost_timeouts(&self) -> LostTimeouts {
        LostTimeouts {
            orphan: self.orphan_timeout,
            release: self.release_timeout,
        }
    }

    /// The reconnection delay after `failures` failed attempts in a row.
    pub(crate) fn reconnect_delay(&self, failures: u32) -> Duration {
        broker::reconnect_delay(failures, self.min_reconnect_delay, self.max_reconnect_delay)
    }

    pub(crate) fn validate(&self) -> Result<(), RunnerError> {
        if self.prefetch == 0 {
            return Err(RunnerError::config(
                "prefetch",
                "must be at least 1 (0 means unlimited to the broker)",
            ));
        }
        if self.max_batch == 0 {
            return Err(RunnerError::config("max_batch", "must be at least 1"));
        }
        broker::check_delays("retry_delay", self.min_retry_delay, self.max_retry_delay)?;
        // A retry's delay is its message's expiration, in whole milliseconds: under one it
        // would be 0, no delay at all.
        broker::check_within(
            [
                ("retry_delay", &self.min_retry_delay),
                ("retry_delay", &self.max_retry_delay),
            ],
            Duration::from_millis(1),
            Duration::from_millis(u64::from(u32::MAX)),
            "a message expiration, in whole milliseconds up to 2^32 - 1",
        )?;
        broker::check_delays(
            "reconnect_delay",
            self.min_reconnect_delay,
            self.max_reconnect_delay,
        )?;
        broker::check_nonzero([
            ("publish_timeout", &self.publish_timeout),
            ("connect_timeout", &self.connect_timeout),
        ])?;
        self.lost_timeouts().validate()?;
        if self.consumer_tag.len() > 255 {
            return Err(RunnerError::config(
                "consumer_tag",
                "AMQP names are at most 255 bytes",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_are_clamped_and_bounded() {
        let o = RunnerOptions::default();
        assert_eq!(o.retry_delay(Duration::ZERO), Duration::from_millis(100));
        assert_eq!(
            o.retry_delay(Duration::from_secs(2)),
            Duration::from_secs(2)
        );
        assert_eq!(
            o.retry_delay(Duration::from_secs(90)),
            Duration::from_secs(5)
        );
        assert_eq!(o.reconnect_delay(0), Duration::from_millis(100));
        assert_eq!(o.reconnect_delay(3), Duration::from_millis(800));
        assert_eq!(o.reconnect_delay(1000), Duration::from_secs(5));
    }

    #[test]
    fn validation_names_the_field() {
        assert!(RunnerOptions::default().validate().is_ok());
        let field = |o: RunnerOptions| match o.validate() {
            Err(RunnerError::Config { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(RunnerOptions::default().with_prefetch(0)), "prefetch");
        assert_eq!(
            field(RunnerOptions::default().with_max_batch(0)),
            "max_batch"
        );
        assert_eq!(
            field(
                RunnerOptions::default()
                    .with_retry_delays(Duration::from_secs(2), Duration::from_secs(1))
            ),
            "retry_delay"
        );
        assert_eq!(
            field(RunnerOptions::default().with_orphan_timeout(Duration::from_secs(5))),
            "release_timeout"
        );
        assert_eq!(
            field(RunnerOptions::default().with_reconnect_delays(Duration::ZERO, Duration::ZERO)),
            "reconnect_delay"
        );
        // A retry's delay is an expiration in whole milliseconds.
        for (min, max) in [
            (Duration::from_nanos(1), Duration::from_secs(1)),
            (Duration::from_micros(999), Duration::from_secs(1)),
            (
                Duration::from_secs(1),
                Duration::from_millis(u64::from(u32::MAX) + 1),
            ),
        ] {
            assert_eq!(
                field(RunnerOptions::default().with_retry_delays(min, max)),
                "retry_delay",
                "{min:?} {max:?}"
            );
        }
        assert!(
            RunnerOptions::default()
                .with_retry_delays(
                    Duration::from_millis(1),
                    Duration::from_millis(u64::from(u32::MAX))
                )
                .validate()
                .is_ok()
        );
    }
}
