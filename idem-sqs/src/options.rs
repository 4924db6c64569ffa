//! Runner options.

use std::time::Duration;

use idem_executor::broker::{self, LostTimeouts};

use crate::error::RunnerError;

/// The longest visibility timeout SQS accepts: 12 hours.
pub const MAX_VISIBILITY: Duration = Duration::from_secs(12 * 3600);
/// The longest long poll SQS accepts: 20 seconds.
pub const MAX_WAIT_TIME: Duration = Duration::from_secs(20);
/// The most messages one `ReceiveMessage` (and one batched delete) takes: 10.
pub const MAX_BATCH: usize = 10;
/// The most batched delete calls in flight at once ([`RunnerOptions::max_delete_calls`]).
pub const MAX_DELETE_CALLS: usize = 1024;

/// Options of an [`SqsRunner`](crate::SqsRunner). Every field has a default; set them with the
/// `with_*` methods.
///
/// ```
/// use std::time::Duration;
/// use idem_sqs::RunnerOptions;
///
/// let options = RunnerOptions::default()
///     .with_max_in_flight(32)
///     .with_wait_time(Duration::from_secs(5))
///     .with_visibility_timeout(Duration::from_secs(60));
/// # let _ = options;
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RunnerOptions {
    /// Messages processed at once (default 16; 1 to [`broker::MAX_IN_FLIGHT`]). The runner
    /// receives only as many messages as it has room for, so none waits in memory with its
    /// visibility running out.
    pub max_in_flight: usize,
    /// The most messages asked for by one `ReceiveMessage` (default 10, at most 10).
    pub batch_size: usize,
    /// How long one `ReceiveMessage` waits for messages (long polling; default 20 s; 1 s to
    /// 20 s, whole seconds). Zero (short polling) is refused: an empty queue would be polled
    /// again at once, in a loop of billed requests. A shutdown waits for the receive in flight
    /// up to this plus [`call_timeout`](Self::call_timeout) (see the crate docs' "Shutdown").
    pub wait_time: Duration,
    /// The visibility timeout asked for at each receive and set again at each extension while
    /// the message is processed (default 30 s; whole seconds, at least 2 s, at most 12 h). It is
    /// also how long a message stays invisible after its consumer died.
    pub visibility_timeout: Duration,
    /// How often the visibility of a message in process is extended. Default `None`: the
    /// executor's heartbeat interval or a third of the visibility timeout, whichever is shorter,
    /// so the visibility is extended at least as often as the lease. At most a third of the
    /// visibility timeout: an extension waits at most half an interval for its answer, so
    /// after one that failed (or was abandoned) the next is sent, and answered, half an
    /// interval at least before the visibility set before the failure runs out.
    pub visibility_extend_interval: Option<Duration>,
    /// Shortest delay before a message is received again after a retry (default 1 s: SQS counts
    /// visibility in whole seconds, so a hint of zero never spins).
    pub min_retry_delay: Duration,
    /// Longest delay before a message is received again after a retry (default 5 min, at most
    /// 12 h). A key held by another consumer's live lease is looked at again at least this often.
    pub max_retry_delay: Duration,
    /// Pause between two tries of a failed dead-letter send (default 1 s). The message's
    /// visibility is extended meanwhile; the executor is not called again.
    pub dead_letter_retry_delay: Duration,
    /// Longest wait at shutdown for the messages in process to finish (default 30 s). Then they
    /// are treated as lost: a handler not started yet releases its lease (no attempt counted)
    /// and its message is made visible again at once; a running handler gets
    /// [`orphan_timeout`](Self::orphan_timeout); a message still waiting for its dead-letter
    /// send is let try until the orphan timeout too.
    pub drain_timeout: Duration,
    /// Twice how long a handler still running at the drain timeout may go on (default 10 s):
    /// half-way its context's cancellation token is cancelled, which the executor reads as a
    /// lost lease (it drops the handler unless it returns in that same poll, recording nothing,
    /// and answers `LeaseLost`); its message is then made visible again after the retry delay
    /// (the executor's `retry_delay` clamped to [`min_retry_delay`](Self::min_retry_delay) and
    /// [`max_retry_delay`](Self::max_retry_delay): 1 s at least), and its lease is left to
    /// expire (never released once it started): a redelivery waits for the lease to end. What
    /// is still there at the orphan timeout is aborted, its message left to its visibility.
    pub orphan_timeout: Duration,
    /// Longest wait for the release of a lease whose handler had not started at the drain
    /// timeout (default 5 s, below [`orphan_timeout`](Self::orphan_timeout)).
    pub release_timeout: Duration,
    /// Batched delete calls sent at once (default 4; 1 to [`MAX_DELETE_CALLS`]). A delete goes
    /// out at once when no call is in flight; otherwise it waits, with the others that come in
    /// meanwhile, until no call is in flight any more, or until 10 are waiting and a call is free
    /// (up to 10 per call).
    pub max_delete_calls: usize,
    /// Longest wait for SQS's answer to one call (default 30 s; above zero): a visibility
    /// change, a delete, a dead-letter send; a receive may take [`wait_time`](Self::wait_time)
    /// on top, and a visibility extension waits no longer than half the extension interval.
    /// The AWS SDK bounds no call unless the client's config sets a timeout, and a
    /// call that never answers would hold what waits on it (the receive loop, or every later
    /// partial batch of deletes) for good. A call that timed out counts as failed and is tried
    /// again as a failed call is; it may still have taken effect (a message deleted, a dead
    /// letter sent: then sent twice on a standard dead-letter queue).
    pub call_timeout: Duration,
}

impl Default for RunnerOptions {
    fn default() -> Self {
        Self {
            max_in_flight: 16,
            batch_size: MAX_BATCH,
            wait_time: MAX_WAIT_TIME,
            visibility_timeout: Duration::from_secs(30),
            visibility_extend_interval: None,
            min_retry_delay: Duration::from_secs(1),
            max_retry_delay: Duration::from_secs(300),
            dead_letter_retry_delay: Duration::from_secs(1),
            drain_timeout: Duration::from_secs(30),
            orphan_timeout: Duration::from_secs(10),
            release_timeout: Duration::from_secs(5),
            max_delete_calls: 4,
            call_timeout: Duration::from_secs(30),
        }
    }
}

impl RunnerOptions {
    /// Sets [`max_in_flight`](Self::max_in_flight).
    pub fn with_max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }

    /// Sets [`batch_size`](Self::batch_size).
    pub fn with_batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Sets [`wait_time`](Self::wait_time).
    pub fn with_wait_time(mut self, wait: Duration) -> Self {
        self.wait_time = wait;
        self
    }

    /// Sets [`visibility_timeout`](Self::visibility_timeout).
    pub fn with_visibility_timeout(mut self, timeout: Duration) -> Self {
        self.visibility_timeout = timeout;
        self
    }

    /// Sets [`visibility_extend_interval`](Self::visibility_extend_interval).
    pub fn with_visibility_extend_interval(mut self, interval: Duration) -> Self {
        self.visibility_extend_interval = Some(interval);
        self
    }

    /// Sets [`min_retry_delay`](Self::min_retry_delay) and [`max_retry_delay`](Self::max_retry_delay).
    pub fn with_retry_delays(mut self, min: Duration, max: Duration) -> Self {
        self.min_retry_delay = min;
        self.max_retry_delay = max;
        self
    }

    /// Sets [`dead_letter_retry_delay`](Self::dead_letter_retry_delay).
    pub fn with_dead_letter_retry_delay(mut self, delay: Duration) -> Self {
        self.dead_letter_retry_delay = delay;
        self
    }

    /// Sets [`drain_timeout`](Self::drain_timeout).
    pub fn with_drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = timeout;
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

    /// Sets [`max_delete_calls`](Self::max_delete_calls).
    pub fn with_max_delete_calls(mut self, n: usize) -> Self {
        self.max_delete_calls = n;
        self
    }

    /// Sets [`call_timeout`](Self::call_timeout).
    pub fn with_call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// The visibility to set after a retry with this hint: clamped to the retry delays, then
    /// rounded up to whole seconds.
    pub(crate) fn retry_visibility(&self, hint: Duration) -> i32 {
        seconds_up(broker::retry_delay(
            hint,
            self.min_retry_delay,
            self.max_retry_delay,
        ))
    }

    /// The timeouts of a message lost at the drain timeout.
    pub(crate) fn lost_timeouts(&self) -> LostTimeouts {
        LostTimeouts {
            orphan: self.orphan_timeout,
            release: self.release_timeout,
        }
    }

    /// The extension interval in force with an executor heartbeating every `heartbeat`.
    pub(crate) fn extend_interval(&self, heartbeat: Duration) -> Duration {
        self.visibility_extend_interval
            .unwrap_or_else(|| heartbeat.min(self.visibility_timeout / 3))
    }

    /// How long a visibility extension every `interval` waits for its answer: `call_timeout`,
    /// but at most half the interval. With the interval at most a third of the visibility
    /// timeout, an extension that failed (or was abandoned) is followed by one sent an interval
    /// later and answered (or abandoned) by 2.5 intervals after the last accepted one, half an
    /// interval at least before the visibility that one set runs out.
    pub(crate) fn extension_timeout(&self, interval: Duration) -> Duration {
        self.call_timeout.min(interval / 2)
    }

    pub(crate) fn validate(&self, heartbeat: Duration) -> Result<(), RunnerError> {
        let whole = |field: &'static str, d: Duration| {
            if d.subsec_nanos() == 0 {
                Ok(())
            } else {
                Err(RunnerError::config(
                    field,
                    format!("{d:?} is not a whole number of seconds: SQS counts in seconds"),
                ))
            }
        };
        broker::check_count("max_in_flight", self.max_in_flight, broker::MAX_IN_FLIGHT)?;
        broker::check_count("max_delete_calls", self.max_delete_calls, MAX_DELETE_CALLS)?;
        if !(1..=MAX_BATCH).contains(&self.batch_size) {
            return Err(RunnerError::config(
                "batch_size",
                format!("{} is not between 1 and {MAX_BATCH}", self.batch_size),
            ));
        }
        whole("wait_time", self.wait_time)?;
        if self.wait_time.is_zero() {
            return Err(RunnerError::config(
                "wait_time",
                "is zero: short polling would ask an empty queue again at once, in a loop of \
                 billed requests; long-poll for 1 s at least",
            ));
        }
        if self.wait_time > MAX_WAIT_TIME {
            return Err(RunnerError::config(
                "wait_time",
                format!(
                    "{:?} is over SQS's longest poll, {MAX_WAIT_TIME:?}",
                    self.wait_time
                ),
            ));
        }
        whole("visibility_timeout", self.visibility_timeout)?;
        if self.visibility_timeout < Duration::from_secs(2)
            || self.visibility_timeout > MAX_VISIBILITY
        {
            return Err(RunnerError::config(
                "visibility_timeout",
                format!("{:?} is not between 2 s and 12 h", self.visibility_timeout),
            ));
        }
        let interval = self.extend_interval(heartbeat);
        if interval.is_zero() || interval > self.visibility_timeout / 3 {
            return Err(RunnerError::config(
                "visibility_extend_interval",
                format!(
                    "{interval:?} must be above zero and at most a third of the visibility \
                     timeout ({:?}), so that a failed extension is tried again, and answered, \
                     before the visibility runs out",
                    self.visibility_timeout
                ),
            ));
        }
        if self.min_retry_delay.is_zero()
            || self.min_retry_delay > self.max_retry_delay
            || self.max_retry_delay > MAX_VISIBILITY
        {
            return Err(RunnerError::config(
                "retry_delay",
                format!(
                    "min {:?} must be above zero and at most max {:?}, and max at most 12 h",
                    self.min_retry_delay, self.max_retry_delay
                ),
            ));
        }
        broker::check_nonzero([
            ("dead_letter_retry_delay", &self.dead_letter_retry_delay),
            ("call_timeout", &self.call_timeout),
        ])?;
        self.lost_timeouts().validate()?;
        Ok(())
    }
}

/// `d` in whole seconds, rounded up, as SQS takes them.
pub(crate) fn seconds_up(d: Duration) -> i32 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    i32::try_from(secs).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEARTBEAT: Duration = Duration::from_secs(10);

    fn field(r: Result<(), RunnerError>) -> &'static str {
        match r {
            Err(RunnerError::Config { field, .. }) => field,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn retry_visibility_is_clamped_and_rounded_up() {
        let o = RunnerOptions::default();
        assert_eq!(o.retry_visibility(Duration::ZERO), 1);
        assert_eq!(o.retry_visibility(Duration::from_millis(1500)), 2);
        assert_eq!(o.retry_visibility(Duration::from_secs(3)), 3);
        assert_eq!(o.retry_visibility(Duration::from_secs(3600)), 300);
    }

    #[test]
    fn the_extension_keeps_in_step_with_the_lease() {
        let o = RunnerOptions::default();
        assert_eq!(o.extend_interval(HEARTBEAT), HEARTBEAT, "the lease's pace");
        assert_eq!(
            o.extend_interval(Duration::from_secs(60)),
            Duration::from_secs(10),
            "a third of the visibility when the lease beats slower"
        );
        assert!(o.validate(HEARTBEAT).is_ok());
    }

    /// Short polling is refused: with a `wait_time` of zero an empty queue was asked again at
    /// once, in a loop (1,025 `ReceiveMessage` calls in 3 s).
    #[test]
    fn a_zero_wait_time_is_refused() {
        let r = RunnerOptions::default()
            .with_wait_time(Duration::ZERO)
            .validate(HEARTBEAT);
        assert!(
            matches!(&r, Err(RunnerError::Config { field: "wait_time", reason }) if reason.contains("zero")),
            "{r:?}"
        );
        assert!(
            RunnerOptions::default()
                .with_wait_time(Duration::from_secs(1))
                .validate(HEARTBEAT)
                .is_ok()
        );
    }

    /// The README's promise, for every interval and call timeout the validation lets through:
    /// after an extension SQS accepted (sent at 0: the visibility runs until the visibility
    /// timeout `V` at least; the receive's answer counts as one), the next one, sent at the
    /// interval `I`, fails or is abandoned by `I + T` (`T` the extension's timeout), before the
    /// one after is due at `2 I`, and that one is answered or abandoned by `2 I + T`, half an
    /// interval at least before `V`. With the interval at half the visibility and `T` up to the
    /// interval, as before, that retry went out when the visibility ran out.
    #[test]
    fn a_failed_extension_is_retried_and_answered_before_the_visibility_runs_out() {
        let secs = Duration::from_secs;
        let mut checked = 0;
        for visibility in [2, 3, 4, 5, 7, 10, 30, 60, 301, 43_200].map(secs) {
            for heartbeat in [Duration::from_millis(300), secs(1), secs(10), secs(3600)] {
                for call_timeout in [Duration::from_millis(50), secs(1), secs(30), secs(3600)] {
                    let explicit = [
                        None,
                        Some(visibility / 3),
                        Some(visibility / 3 + Duration::from_nanos(1)),
                        Some(visibility / 2),
                        Some(visibility / 4),
                    ];
                    for interval in explicit {
                        let mut o = RunnerOptions::default()
                            .with_visibility_timeout(visibility)
                            .with_call_timeout(call_timeout);
                        o.visibility_extend_interval = interval;
                        if o.validate(heartbeat).is_err() {
                            continue;
                        }
                        checked += 1;
                        let i = o.extend_interval(heartbeat);
                        let t = o.extension_timeout(i);
                        assert!(t <= i / 2 && t <= call_timeout, "{o:?}");
                        assert!(i + t < 2 * i, "the failed one ends before the next is due");
                        assert!(
                            2 * i + t + i / 2 <= visibility,
                            "the retry is answered half an interval before the visibility runs \
                             out: {o:?}, interval {i:?}, timeout {t:?}"
                        );
                    }
                }
            }
        }
        assert!(checked > 100, "{checked} combinations let through");
        let half = RunnerOptions::default().with_visibility_extend_interval(secs(15));
        assert_eq!(
            field(half.validate(HEARTBEAT)),
            "visibility_extend_interval",
            "half of the 30 s visibility, as allowed before"
        );
        let third = RunnerOptions::default().with_visibility_extend_interval(secs(10));
        assert!(third.validate(HEARTBEAT).is_ok());
        assert_eq!(third.extension_timeout(secs(10)), secs(5));
    }

    #[test]
    fn validation_names_the_field() {
        let d = RunnerOptions::default;
        assert_eq!(
            field(d().with_max_in_flight(0).validate(HEARTBEAT)),
            "max_in_flight"
        );
        assert_eq!(
            field(d().with_batch_size(11).validate(HEARTBEAT)),
            "batch_size"
        );
        assert_eq!(
            field(d().with_batch_size(0).validate(HEARTBEAT)),
            "batch_size"
        );
        assert_eq!(
            field(
                d().with_wait_time(Duration::from_secs(21))
                    .validate(HEARTBEAT)
            ),
            "wait_time"
        );
        assert_eq!(
            field(
                d().with_wait_time(Duration::from_millis(500))
                    .validate(HEARTBEAT)
            ),
            "wait_time"
        );
        assert_eq!(
            field(
                d().with_visibility_timeout(Duration::from_secs(1))
                    .validate(HEARTBEAT)
            ),
            "visibility_timeout"
        );
        assert_eq!(
            field(
                d().with_visibility_extend_interval(Duration::from_secs(11))
                    .validate(HEARTBEAT)
            ),
            "visibility_extend_interval"
        );
        assert_eq!(
            field(d().with_wait_time(Duration::ZERO).validate(HEARTBEAT)),
            "wait_time"
        );
        assert_eq!(
            field(
                d().with_retry_delays(Duration::from_secs(2), Duration::from_secs(1))
                    .validate(HEARTBEAT)
            ),
            "retry_delay"
        );
        assert_eq!(
            field(d().with_max_delete_calls(0).validate(HEARTBEAT)),
            "max_delete_calls"
        );
        assert_eq!(
            field(d().with_call_timeout(Duration::ZERO).validate(HEARTBEAT)),
            "call_timeout"
        );
        // Counts semaphores are sized by, and a retry delay of zero (a message received again
        // at once, in a loop).
        assert_eq!(
            field(d().with_max_in_flight(usize::MAX).validate(HEARTBEAT)),
            "max_in_flight"
        );
        assert_eq!(
            field(d().with_max_delete_calls(usize::MAX).validate(HEARTBEAT)),
            "max_delete_calls"
        );
        assert_eq!(
            field(
                d().with_retry_delays(Duration::ZERO, Duration::from_secs(1))
                    .validate(HEARTBEAT)
            ),
            "retry_delay"
        );
        assert!(
            d().with_max_in_flight(broker::MAX_IN_FLIGHT)
                .with_max_delete_calls(MAX_DELETE_CALLS)
                .validate(HEARTBEAT)
                .is_ok()
        );
    }
}
