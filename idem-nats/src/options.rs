//! Runner options.

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, Config as ConsumerConfig};
use idem_executor::broker::{self, LostTimeouts};

use crate::error::RunnerError;

/// Where dead letters are published. A JetStream stream must capture that subject (the runner
/// never creates it): see [Dead letters](crate#dead-letters).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterSubject {
    /// This prefix followed by the message's subject (default `dlq.`: `orders.created` goes to
    /// `dlq.orders.created`).
    Prefix(String),
    /// One subject for every message.
    Fixed(String),
}

impl Default for DeadLetterSubject {
    fn default() -> Self {
        Self::Prefix("dlq.".to_owned())
    }
}

/// The token that ends a dead-letter subject cut short ([`DeadLetterSubject::Prefix`]): the
/// prefix and the original subject would make a publication longer than the server's protocol
/// line (4,096 bytes), so the subject keeps the prefix and as many of the original subject's
/// leading tokens as fit, followed by this token (`dlq.orders.<4,000 bytes>` goes to
/// `dlq.orders.idem-subject-too-long`). The original subject is in the dead letter's
/// [`idem-dlq-source-subject`](crate::HEADER_SOURCE_SUBJECT) header.
pub const SUBJECT_TOO_LONG: &str = "idem-subject-too-long";

impl DeadLetterSubject {
    /// The dead-letter subject of a message published on `subject`.
    pub fn for_subject(&self, subject: &str) -> String {
        match self {
            Self::Prefix(prefix) => format!("{prefix}{subject}"),
            Self::Fixed(fixed) => fixed.clone(),
        }
    }

    /// [`for_subject`](Self::for_subject), cut short to at most `max_len` bytes: a prefixed
    /// subject over it keeps the prefix and as many whole leading tokens of `subject` as fit,
    /// followed by [`SUBJECT_TOO_LONG`]; with whether it was cut. (A fixed subject, and the
    /// prefix with [`SUBJECT_TOO_LONG`] alone, are checked against the limit when the runner is
    /// built, so the cut one is within it.)
    pub(crate) fn for_subject_within(&self, subject: &str, max_len: usize) -> (String, bool) {
        let whole = self.for_subject(subject);
        let Self::Prefix(prefix) = self else {
            return (whole, false);
        };
        if whole.len() <= max_len {
            return (whole, false);
        }
        let mut kept = String::new();
        for token in subject.split('.') {
            // `prefix` + kept (each token with its `.`) + token + `.` + SUBJECT_TOO_LONG
            let with = prefix.len() + kept.len() + token.len() + 1 + SUBJECT_TOO_LONG.len();
            if with > max_len {
                break;
            }
            kept.push_str(token);
            kept.push('.');
        }
        (format!("{prefix}{kept}{SUBJECT_TOO_LONG}"), true)
    }

    /// Checks that dead letters can be published: a literal subject (no wildcard, no empty
    /// token, no whitespace), within `max_len` bytes (for a prefix: with [`SUBJECT_TOO_LONG`]).
    pub(crate) fn validate(&self, max_len: usize) -> Result<(), RunnerError> {
        let (example, what) = match self {
            Self::Prefix(s) | Self::Fixed(s) if s.is_empty() => {
                return Err(RunnerError::config(
                    "dead_letter_subject",
                    "is empty: a prefix would publish back to the source subject",
                ));
            }
            Self::Prefix(prefix) => (format!("{prefix}{SUBJECT_TOO_LONG}"), "the prefix"),
            Self::Fixed(fixed) => (fixed.clone(), "the subject"),
        };
        if !crate::subject::is_literal(&example) {
            return Err(RunnerError::config(
                "dead_letter_subject",
                format!(
                    "{self:?}: {what} is not one a message can be published to (a wildcard, an \
                     empty token or whitespace)"
                ),
            ));
        }
        if example.len() > max_len {
            return Err(RunnerError::config(
                "dead_letter_subject",
                format!(
                    "{self:?}: {what} is too long: a publication to it would be over the \
                     server's {}-byte protocol line (subjects of at most {max_len} bytes)",
                    crate::subject::MAX_CONTROL_LINE
                ),
            ));
        }
        Ok(())
    }
}

/// Options of a [`NatsRunner`](crate::NatsRunner). Every field has a default; set them with the
/// `with_*` methods.
///
/// ```
/// use std::time::Duration;
/// use idem_nats::RunnerOptions;
///
/// let options = RunnerOptions::default()
///     .with_max_in_flight(32)
///     .with_ack_wait(Duration::from_secs(60));
/// # let _ = options;
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RunnerOptions {
    /// Messages processed at once (default 16; 1 to [`broker::MAX_IN_FLIGHT`]). The runner pulls
    /// only as many messages as it has free slots, so none waits in a client buffer with its ack
    /// deadline running. A message's slot is freed as its final ack, nak or term is sent: the
    /// wait for the server's confirmation of a double ack does not hold it.
    pub max_in_flight: usize,
    /// Largest group of messages run through one executor batch (default 64; at least 1, at
    /// most the store's [`max_batch`](idem_core::Limits::max_batch)). The
    /// messages a pull has brought and that are at hand together form a group: their keys are
    /// acquired in one store call, their handlers run concurrently, their results are recorded
    /// in grouped calls, and each message is settled, its slot freed, as soon as its own outcome
    /// is recorded (a slow handler holds back no other message beyond the executor's batch
    /// concurrency; see the crate docs, "What happens to a message"). `1` runs each message on
    /// its own: two store round trips per message.
    pub max_batch: usize,
    /// How long one pull request waits for messages (default 1 s; at least 1 ms): the idle pace
    /// of pull requests, and the longest a shutdown waits for the pull in flight.
    pub pull_expiry: Duration,
    /// Whether the runner creates the durable pull consumer when it does not exist at the
    /// start (default `true`), with [`ack_wait`](Self::ack_wait),
    /// [`max_deliver`](Self::max_deliver) and [`filter_subject`](Self::filter_subject),
    /// delivering the stream from its first message. Never while running: a consumer deleted
    /// then stops the runner ([`RunnerError::ConsumerDeleted`]). A consumer deleted while no
    /// runner ran is created so too at the next start, and every message whose record the store
    /// no longer keeps runs again: in production, create the consumer with the deployment and
    /// turn this off. An existing consumer is used as it is: its configuration is read from the
    /// server and checked (explicit acks, not `headers_only`, `ack_wait` and every `backoff`
    /// entry above the executor's heartbeat interval, `max_deliver` above `max_attempts`).
    pub create_consumer: bool,
    /// The consumer's ack deadline when the runner creates it (default 30 s). Must exceed the
    /// executor's heartbeat interval: the runner sends a progress ack (`+WPI`) at every heartbeat
    /// interval while it holds a message, so the deadline never expires under a live lease.
    pub ack_wait: Duration,
    /// The consumer's `max_deliver` when the runner creates it (default `None`: unlimited;
    /// `Some(-1)` means the same; `Some(0)` or another negative is a configuration error, which
    /// the server would take as unlimited).
    /// When set, it must exceed the executor's
    /// [`max_attempts`](idem_executor::ExecutorConfig::max_attempts): every nak (a retry, a key in
    /// progress elsewhere) is a delivery too. A message on its last allowed delivery is never
    /// nak'ed: it is dead-lettered (reason `exhausted`) where it would be, and run where it would
    /// be sent back unrun (arriving during a stop, or beyond a pull's free slots). Only a dead
    /// letter that cannot be published when the drain times out ends in a nak (see the crate
    /// docs, "max_deliver and max_attempts").
    pub max_deliver: Option<i64>,
    /// The consumer's subject filter when the runner creates it (default `None`: the whole
    /// stream).
    pub filter_subject: Option<String>,
    /// Shortest nak delay (default 100 ms), so a hint of zero never spins.
    pub min_retry_delay: Duration,
    /// Longest nak delay (default 5 s): a key held by a live lease is looked at again at least
    /// this often.
    pub max_retry_delay: Duration,
    /// Where dead letters go (default: `dlq.` + the message's subject). Must be a subject one
    /// can publish to, short enough for the server's protocol line (a prefixed subject too long
    /// is cut short: [`SUBJECT_TOO_LONG`]), and not one the consumer receives (checked at the
    /// start against the stream's subjects and the consumer's filter).
    pub dead_letter_subject: DeadLetterSubject,
    /// Longest wait for the stream's acknowledgement of a dead-letter publication (default
    /// 30 s).
    pub publish_timeout: Duration,
    /// Twice how long a handler may go on after the drain timed out (default 10 s): half-way
    /// its context's cancellation token is cancelled, which the executor reads as a lost lease
    /// (it drops the handler unless it returns in that same poll, recording nothing). Its lease
    /// is never released once it started.
    pub orphan_timeout: Duration,
    /// Longest wait for one lease release (default 5 s; must be below
    /// [`orphan_timeout`](Self::orphan_timeout)).
    pub release_timeout: Duration,
    /// Longest wait at shutdown for the messages in process to finish (default 30 s).
    pub drain_timeout: Duration,
    /// First delay before pulling again after a pull failed (default 100 ms),
    /// doubling up to [`max_reconnect_delay`](Self::max_reconnect_delay).
    pub min_reconnect_delay: Duration,
    /// Longest delay between two attempts to pull again (default 5 s).
    pub max_reconnect_delay: Duration,
}

impl Default for RunnerOptions {
    fn default() -> Self {
        Self {
            max_in_flight: 16,
            max_batch: 64,
            pull_expiry: Duration::from_secs(1),
            create_consumer: true,
            ack_wait: Duration::from_secs(30),
            max_deliver: None,
            filter_subject: None,
            min_retry_delay: Duration::from_millis(100),
            max_retry_delay: Duration::from_secs(5),
            dead_letter_subject: DeadLetterSubject::default(),
            publish_timeout: Duration::from_secs(30),
            orphan_timeout: Duration::from_secs(10),
            release_timeout: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(30),
            min_reconnect_delay: Duration::from_millis(100),
            max_reconnect_delay: Duration::from_secs(5),
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

    /// Sets [`pull_expiry`](Self::pull_expiry).
    pub fn with_pull_expiry(mut self, expiry: Duration) -> Self {
        self.pull_expiry = expiry;
        self
    }

    /// Sets [`create_consumer`](Self::create_consumer).
    pub fn with_create_consumer(mut self, create: bool) -> Self {
        self.create_consumer = create;
        self
    }

    /// Sets [`ack_wait`](Self::ack_wait).
    pub fn with_ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// Sets [`max_deliver`](Self::max_deliver).
    pub fn with_max_deliver(mut self, max_deliver: Option<i64>) -> Self {
        self.max_deliver = max_deliver;
        self
    }

    /// Sets [`filter_subject`](Self::filter_subject).
    pub fn with_filter_subject(mut self, subject: impl Into<String>) -> Self {
        self.filter_subject = Some(subject.into());
        self
    }

    /// Sets [`min_retry_delay`](Self::min_retry_delay) and [`max_retry_delay`](Self::max_retry_delay).
    pub fn with_retry_delays(mut self, min: Duration, max: Duration) -> Self {
        self.min_retry_delay = min;
        self.max_retry_delay = max;
        self
    }

    /// Sets [`dead_letter_subject`](Self::dead_letter_subject).
    pub fn with_dead_letter_subject(mut self, subject: DeadLetterSubject) -> Self {
        self.dead_letter_subject = subject;
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

    /// The nak delay, from the outcome's hint.
    pub(crate) fn retry_delay(&self, hint: Duration) -> Duration {
        broker::retry_delay(hint, self.min_retry_delay, self.max_retry_delay)
    }

    /// The timeouts of a message lost at the drain timeout.
    pub(crate) fn lost_timeouts(&self) -> LostTimeouts {
        LostTimeouts {
            orphan: self.orphan_timeout,
            release: self.release_timeout,
        }
    }

    /// The delay before pulling again after `failures` failures in a row.
    pub(crate) fn reconnect_delay(&self, failures: u32) -> Duration {
        broker::reconnect_delay(failures, self.min_reconnect_delay, self.max_reconnect_delay)
    }

    /// Checks the options against the executor's heartbeat interval and maximum attempts, the
    /// store's largest batch and the longest subject a publication can have (`max_subject`).
    pub(crate) fn validate(
        &self,
        heartbeat: Duration,
        max_attempts: u32,
        store_max_batch: usize,
        max_subject: usize,
    ) -> Result<(), RunnerError> {
        broker::check_count("max_in_flight", self.max_in_flight, broker::MAX_IN_FLIGHT)?;
        if self.max_batch == 0 || self.max_batch > store_max_batch {
            return Err(RunnerError::config(
                "max_batch",
                format!(
                    "{} is not within 1 and the store's max_batch {store_max_batch}",
                    self.max_batch
                ),
            ));
        }
        broker::check_delays("retry_delay", self.min_retry_delay, self.max_retry_delay)?;
        broker::check_delays(
            "reconnect_delay",
            self.min_reconnect_delay,
            self.max_reconnect_delay,
        )?;
        broker::check_nonzero([("publish_timeout", &self.publish_timeout)])?;
        // The server takes these as 64-bit nanoseconds: a longer one wraps (a negative ack
        // deadline, an expired pull, an unreadable nak delay); a pull shorter than a
        // millisecond gets no answer.
        let nanos = Duration::from_nanos(i64::MAX as u64);
        broker::check_within(
            [("pull_expiry", &self.pull_expiry)],
            Duration::from_millis(1),
            nanos,
            "a shorter pull gets no answer from the server; NATS carries durations as 64-bit nanoseconds",
        )?;
        broker::check_within(
            [
                ("ack_wait", &self.ack_wait),
                ("retry_delay", &self.max_retry_delay),
            ],
            Duration::ZERO,
            nanos,
            "NATS carries durations as 64-bit nanoseconds",
        )?;
        self.lost_timeouts().validate()?;
        self.dead_letter_subject.validate(max_subject)?;
        if let Some(max_deliver) = self.max_deliver
            && (max_deliver == 0 || max_deliver < -1)
        {
            return Err(RunnerError::config(
                "max_deliver",
                format!(
                    "Some({max_deliver}): a consumer delivers a message a positive number of \
                     times, or without limit (None, which the server calls -1; it takes 0 and \
                     other negatives as unlimited too)"
                ),
            ));
        }
        check_consumer(
            self.ack_wait,
            self.max_deliver.unwrap_or(-1),
            &[],
            heartbeat,
            max_attempts,
        )
    }
}

/// The rules a consumer's `ack_wait`, `backoff` and `max_deliver` must follow (for one the
/// runner creates, and for one it finds on the server).
pub(crate) fn check_consumer(
    ack_wait: Duration,
    max_deliver: i64,
    backoff: &[Duration],
    heartbeat: Duration,
    max_attempts: u32,
) -> Result<(), RunnerError> {
    // Zero: the server's default (30 s).
    let ack_wait = if ack_wait.is_zero() {
        Duration::from_secs(30)
    } else {
        ack_wait
    };
    if ack_wait <= heartbeat {
        return Err(RunnerError::config(
            "ack_wait",
            format!(
                "{ack_wait:?} must exceed the executor's heartbeat interval {heartbeat:?}: progress \
                 acks go out at every heartbeat, and the server would redeliver a message whose \
                 lease is still live"
            ),
        ));
    }
    // With a backoff list, the server gives a redelivered message the ack deadline of the entry
    // for its delivery count (the last entry past the end), not `ack_wait`.
    if let Some(shortest) = backoff.iter().min()
        && *shortest <= heartbeat
    {
        return Err(RunnerError::config(
            "backoff",
            format!(
                "the consumer's backoff {backoff:?} has an entry of {shortest:?}, not above the \
                 executor's heartbeat interval {heartbeat:?}: the server makes each entry the ack \
                 deadline of a redelivery, progress acks go out at every heartbeat, and it would \
                 redeliver a message whose handler is still running (copies then meet the key \
                 in progress until max_deliver, and one is dead-lettered as exhausted while the \
                 original completes). Raise every entry above the heartbeat interval (two or \
                 three intervals), or remove the backoff: the runner's retries are naks with \
                 their own delay (min_retry_delay to max_retry_delay)"
            ),
        ));
    }
    if max_deliver > 0 && max_deliver <= i64::from(max_attempts) {
        return Err(RunnerError::config(
            "max_deliver",
            format!(
                "{max_deliver} must exceed the executor's max_attempts {max_attempts} (or be \
                 unlimited, -1): every nak is a delivery too, and the server would stop \
                 delivering a message before the executor dead-letters it"
            ),
        ));
    }
    Ok(())
}

/// Checks a consumer found on the server (or just created) before the runner reads from it:
/// explicit acks, whole messages (not `headers_only`), `ack_wait` and every `backoff` entry above
/// the heartbeat interval, `max_deliver` above `max_attempts`, and pull limits the runner's pulls
/// fit.
pub(crate) fn check_found_consumer(
    name: &str,
    config: &ConsumerConfig,
    options: &RunnerOptions,
    heartbeat: Duration,
    max_attempts: u32,
) -> Result<(), RunnerError> {
    if config.ack_policy != AckPolicy::Explicit {
        return Err(RunnerError::config(
            "ack_policy",
            format!(
                "consumer {name} acknowledges {:?}: the runner needs explicit acks",
                config.ack_policy
            ),
        ));
    }
    if config.headers_only {
        return Err(RunnerError::config(
            "headers_only",
            format!(
                "consumer {name} delivers headers only: handlers would run on an empty payload, \
                 fingerprints be taken of it and dead letters carry it; the runner needs a \
                 consumer that delivers whole messages"
            ),
        ));
    }
    check_consumer(
        config.ack_wait,
        config.max_deliver,
        &config.backoff,
        heartbeat,
        max_attempts,
    )?;
    check_pull_limits(
        config.max_batch,
        config.max_expires,
        options.max_in_flight,
        options.pull_expiry,
    )
}

/// Checks an existing consumer's limits on pull requests against what the runner asks for:
/// pulls of up to `max_in_flight` messages (the consumer's `max_batch`, 0 for no limit) that
/// wait up to `pull_expiry` (its `max_expires`, zero for no limit). The server refuses every pull
/// over either limit, so such a consumer would deliver nothing to the runner.
pub(crate) fn check_pull_limits(
    max_batch: i64,
    max_expires: Duration,
    max_in_flight: usize,
    pull_expiry: Duration,
) -> Result<(), RunnerError> {
    if max_batch > 0 && usize::try_from(max_batch).is_ok_and(|max| max < max_in_flight) {
        return Err(RunnerError::config(
            "max_in_flight",
            format!(
                "the consumer takes pulls of at most {max_batch} messages (max_batch) and the                  runner pulls up to {max_in_flight} (max_in_flight): the server would refuse                  its pulls; lower max_in_flight or raise the consumer's max_batch"
            ),
        ));
    }
    if !max_expires.is_zero() && max_expires < pull_expiry {
        return Err(RunnerError::config(
            "pull_expiry",
            format!(
                "the consumer takes pulls that wait at most {max_expires:?} (max_expires) and                  the runner's wait {pull_expiry:?} (pull_expiry): the server would refuse its                  pulls; lower pull_expiry or raise the consumer's max_expires"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HB: Duration = Duration::from_secs(10);
    /// The longest subject with the default 29-byte inbox.
    const MAX_SUBJECT: usize = 4037;

    fn config_field(r: Result<(), RunnerError>) -> &'static str {
        match r {
            Err(RunnerError::Config { field, .. }) => field,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_backoff_entry_not_above_the_heartbeat_is_refused() {
        let s = Duration::from_secs;
        // The server makes BackOff[0] the ack_wait, and each entry the ack deadline of a
        // redelivery: the second entry here is under the heartbeat.
        assert_eq!(
            config_field(check_consumer(s(30), 10, &[s(30), s(5)], HB, 5)),
            "backoff"
        );
        assert_eq!(
            config_field(check_consumer(s(30), 10, &[s(30), HB], HB, 5)),
            "backoff"
        );
        assert!(check_consumer(s(30), 10, &[s(30), s(11), s(60)], HB, 5).is_ok());
    }

    #[test]
    fn a_headers_only_consumer_is_refused() {
        let options = RunnerOptions::default();
        let config = ConsumerConfig {
            ack_policy: AckPolicy::Explicit,
            ..ConsumerConfig::default()
        };
        assert!(check_found_consumer("c", &config, &options, HB, 5).is_ok());
        let headers_only = ConsumerConfig {
            headers_only: true,
            ..config.clone()
        };
        assert_eq!(
            config_field(check_found_consumer("c", &headers_only, &options, HB, 5)),
            "headers_only"
        );
        let backoff = ConsumerConfig {
            backoff: vec![Duration::from_secs(30), Duration::from_millis(500)],
            max_deliver: 10,
            ..config.clone()
        };
        assert_eq!(
            config_field(check_found_consumer("c", &backoff, &options, HB, 5)),
            "backoff"
        );
        let none = ConsumerConfig {
            ack_policy: AckPolicy::None,
            ..config
        };
        assert_eq!(
            config_field(check_found_consumer("c", &none, &options, HB, 5)),
            "ack_policy"
        );
    }

    #[test]
    fn a_dead_letter_subject_too_long_is_cut_at_a_token() {
        let prefix = DeadLetterSubject::default();
        assert_eq!(
            prefix.for_subject_within("orders.created", 100),
            ("dlq.orders.created".to_owned(), false)
        );
        let long = format!("orders.{}.eu", "a".repeat(5_000));
        let (cut, was_cut) = prefix.for_subject_within(&long, MAX_SUBJECT);
        assert!(was_cut);
        assert_eq!(cut, format!("dlq.orders.{SUBJECT_TOO_LONG}"));
        // As many leading tokens as fit, exactly.
        let subject = format!("a.bb.{}", "c".repeat(40));
        let subject = subject.as_str();
        let limit = "dlq.a.bb.".len() + SUBJECT_TOO_LONG.len();
        assert_eq!(
            prefix.for_subject_within(subject, limit).0,
            format!("dlq.a.bb.{SUBJECT_TOO_LONG}")
        );
        assert_eq!(
            prefix.for_subject_within(subject, limit - 1).0,
            format!("dlq.a.{SUBJECT_TOO_LONG}")
        );
        assert_eq!(
            prefix.for_subject_within(&"x".repeat(5_000), MAX_SUBJECT).0,
            format!("dlq.{SUBJECT_TOO_LONG}")
        );
        // A fixed subject is never cut (its length is checked when the runner is built).
        let fixed = DeadLetterSubject::Fixed("dead".into());
        assert_eq!(
            fixed.for_subject_within(&long, 10),
            ("dead".to_owned(), false)
        );
    }

    #[test]
    fn dead_letter_subjects_must_be_publishable_and_fit_the_protocol_line() {
        let check = |d: DeadLetterSubject| d.validate(MAX_SUBJECT);
        assert!(check(DeadLetterSubject::default()).is_ok());
        assert!(check(DeadLetterSubject::Prefix("dlq_".into())).is_ok());
        assert!(check(DeadLetterSubject::Fixed("dead.letters".into())).is_ok());
        for bad in [
            DeadLetterSubject::Prefix(String::new()),
            DeadLetterSubject::Fixed(String::new()),
            DeadLetterSubject::Prefix("dlq.*.".into()),
            DeadLetterSubject::Prefix(".dlq.".into()),
            DeadLetterSubject::Fixed("dead.>".into()),
            DeadLetterSubject::Fixed("dead letters".into()),
            DeadLetterSubject::Fixed("d".repeat(MAX_SUBJECT + 1)),
            DeadLetterSubject::Prefix(format!("{}.", "d".repeat(MAX_SUBJECT))),
        ] {
            assert_eq!(
                config_field(check(bad.clone())),
                "dead_letter_subject",
                "{bad:?}"
            );
        }
        assert!(check(DeadLetterSubject::Fixed("d".repeat(MAX_SUBJECT))).is_ok());
    }

    #[test]
    fn pulls_must_fit_the_consumer_limits() {
        let second = Duration::from_secs(1);
        let field = |r: Result<(), RunnerError>| match r {
            Err(RunnerError::Config { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert!(check_pull_limits(0, Duration::ZERO, 16, second).is_ok());
        assert!(check_pull_limits(16, second, 16, second).is_ok());
        assert_eq!(
            field(check_pull_limits(15, Duration::ZERO, 16, second)),
            "max_in_flight"
        );
        assert_eq!(
            field(check_pull_limits(0, Duration::from_millis(999), 16, second)),
            "pull_expiry"
        );
    }

    #[test]
    fn delays_are_clamped() {
        let o = RunnerOptions::default();
        assert_eq!(o.retry_delay(Duration::ZERO), Duration::from_millis(100));
        assert_eq!(
            o.retry_delay(Duration::from_secs(90)),
            Duration::from_secs(5)
        );
        assert_eq!(o.reconnect_delay(0), Duration::from_millis(100));
        assert_eq!(o.reconnect_delay(50), Duration::from_secs(5));
    }

    #[test]
    fn ack_wait_must_exceed_the_heartbeat_and_max_deliver_the_attempts() {
        assert!(
            RunnerOptions::default()
                .validate(HB, 5, 1000, MAX_SUBJECT)
                .is_ok()
        );
        let field = |o: RunnerOptions, hb: Duration, attempts: u32| match o.validate(
            hb,
            attempts,
            1000,
            MAX_SUBJECT,
        ) {
            Err(RunnerError::Config { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        let o = RunnerOptions::default().with_ack_wait(Duration::from_secs(10));
        assert_eq!(field(o, HB, 5), "ack_wait");
        let o = RunnerOptions::default().with_max_deliver(Some(5));
        assert_eq!(field(o, HB, 5), "max_deliver");
        assert!(
            RunnerOptions::default()
                .with_max_deliver(Some(6))
                .validate(HB, 5, 1000, MAX_SUBJECT)
                .is_ok()
        );
        assert!(
            RunnerOptions::default()
                .with_max_deliver(Some(-1))
                .validate(HB, 5, 1000, MAX_SUBJECT)
                .is_ok()
        );
        for nonsense in [0, -2, i64::MIN] {
            let o = RunnerOptions::default().with_max_deliver(Some(nonsense));
            assert_eq!(field(o, HB, 5), "max_deliver", "Some({nonsense})");
        }
        assert_eq!(
            field(RunnerOptions::default().with_max_in_flight(0), HB, 5),
            "max_in_flight"
        );
        assert_eq!(
            field(RunnerOptions::default().with_max_batch(0), HB, 5),
            "max_batch"
        );
        assert_eq!(
            field(RunnerOptions::default().with_max_batch(1001), HB, 5),
            "max_batch"
        );
        assert!(
            RunnerOptions::default()
                .with_max_batch(1000)
                .validate(HB, 5, 1000, MAX_SUBJECT)
                .is_ok()
        );
        assert_eq!(
            field(
                RunnerOptions::default()
                    .with_dead_letter_subject(DeadLetterSubject::Prefix(String::new())),
                HB,
                5
            ),
            "dead_letter_subject"
        );
        // Counts a semaphore and buffers are sized by; durations NATS carries as 64-bit
        // nanoseconds (a longer one wraps), and a pull too short to be answered.
        let years = Duration::from_secs(300 * 365 * 24 * 3600);
        for (o, expected) in [
            (
                RunnerOptions::default().with_max_in_flight(usize::MAX),
                "max_in_flight",
            ),
            (
                RunnerOptions::default().with_max_in_flight(broker::MAX_IN_FLIGHT + 1),
                "max_in_flight",
            ),
            (
                RunnerOptions::default().with_pull_expiry(Duration::from_micros(999)),
                "pull_expiry",
            ),
            (
                RunnerOptions::default().with_pull_expiry(Duration::MAX),
                "pull_expiry",
            ),
            (RunnerOptions::default().with_ack_wait(years), "ack_wait"),
            (
                RunnerOptions::default().with_ack_wait(Duration::MAX),
                "ack_wait",
            ),
            (
                RunnerOptions::default().with_retry_delays(years, years),
                "retry_delay",
            ),
        ] {
            assert_eq!(field(o, HB, 5), expected);
        }
        assert!(
            RunnerOptions::default()
                .with_max_in_flight(broker::MAX_IN_FLIGHT)
                .with_pull_expiry(Duration::from_millis(1))
                .validate(HB, 5, 1000, MAX_SUBJECT)
                .is_ok()
        );
        // The server's default ack_wait (zero in a config) is 30 s.
        assert!(check_consumer(Duration::ZERO, -1, &[], HB, 5).is_ok());
        assert!(check_consumer(Duration::ZERO, -1, &[], Duration::from_secs(30), 5).is_err());
    }

    #[test]
    fn dead_letter_subjects() {
        assert_eq!(
            DeadLetterSubject::default().for_subject("orders.created"),
            "dlq.orders.created"
        );
        assert_eq!(
            DeadLetterSubject::Fixed("dead".into()).for_subject("orders.created"),
            "dead"
        );
    }
}
