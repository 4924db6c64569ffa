//! Dead-lettering: the typed reason every runner writes, and the hook's event.

use std::fmt;

use idem_core::IdempotencyKey;

/// Why a message goes to a dead-letter destination: the `reason` of
/// [`BrokerAction::DeadLetter`](crate::BrokerAction::DeadLetter), shared by every runner (a Kafka
/// header, an SQS message attribute, an AMQP header all carry its [`as_str`](Self::as_str) code).
///
/// | code | outcome or error |
/// |---|---|
/// | `conflict` | [`Outcome::Conflict`](crate::Outcome::Conflict) |
/// | `exhausted` | [`Outcome::Exhausted`](crate::Outcome::Exhausted) |
/// | `failed` | [`Outcome::Failed`](crate::Outcome::Failed), or a terminal failure of an [un-deduplicated](crate::Outcome::NotDeduplicated) run |
/// | `result_not_stored` | [`Outcome::ResultNotStored`](crate::Outcome::ResultNotStored) |
/// | `missing_key` | [`ExecutorError::MissingKey`](crate::ExecutorError::MissingKey) |
/// | `invalid_key` | [`ExecutorError::InvalidKey`](crate::ExecutorError::InvalidKey) |
/// | `invalid_message` | [`ExecutorError::InvalidMessage`](crate::ExecutorError::InvalidMessage) |
/// | `decode` | [`ExecutorError::Decode`](crate::ExecutorError::Decode) |
/// | `undelivered` | no outcome: the broker's delivery limit came first (NATS `max_deliver`) |
///
/// ```
/// use idem_executor::{BrokerAction, DeadLetterReason, Outcome};
///
/// let outcome: Outcome<()> = Outcome::Failed { error: "amount is negative".into() };
/// let BrokerAction::DeadLetter { reason, error } = outcome.action() else { unreachable!() };
/// assert_eq!((reason.as_str(), error.as_str()), ("failed", "amount is negative"));
/// assert_eq!(DeadLetterReason::from_name("failed"), Some(reason));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// `conflict`: the key was used before with a different payload. The handler did not run for
    /// this message.
    Conflict,
    /// `exhausted`: the key failed or crashed the maximum number of attempts: a poison message.
    Exhausted,
    /// `failed`: the handler failed terminally, now or before (or a terminal failure of an
    /// un-deduplicated run).
    Failed,
    /// `result_not_stored`: the handler succeeded (its effect is applied) but its result could
    /// not be stored; the key is recorded as such and never runs again.
    ResultNotStored,
    /// `missing_key`: the message has no idempotency key and the executor rejects such messages.
    MissingKey,
    /// `invalid_key`: the message's key is not a valid idempotency key (too long, NUL).
    InvalidKey,
    /// `invalid_message`: the message cannot be read as configured (key header not UTF-8, payload
    /// not JSON, ...).
    InvalidMessage,
    /// `decode`: the stored result of the key does not decode as the handler's result type.
    Decode,
    /// `undelivered`: the broker's own delivery limit (a NATS consumer's `max_deliver`) was
    /// reached before the key had a final outcome here: a store outage, a copy held behind the
    /// key in progress elsewhere, a drain that cut the handler short. Not poison: the handler
    /// may never have run for this message; republish it once the cause is gone (the store
    /// replays the key if another copy completed it).
    Undelivered,
}

impl DeadLetterReason {
    /// Every reason, in declaration order.
    pub const ALL: [DeadLetterReason; 9] = [
        Self::Conflict,
        Self::Exhausted,
        Self::Failed,
        Self::ResultNotStored,
        Self::MissingKey,
        Self::InvalidKey,
        Self::InvalidMessage,
        Self::Decode,
        Self::Undelivered,
    ];

    /// The stable code: `conflict`, `exhausted`, `failed`, `result_not_stored`, `missing_key`,
    /// `invalid_key`, `invalid_message`, `decode`, `undelivered`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Conflict => "conflict",
            Self::Exhausted => "exhausted",
            Self::Failed => "failed",
            Self::ResultNotStored => "result_not_stored",
            Self::MissingKey => "missing_key",
            Self::InvalidKey => "invalid_key",
            Self::InvalidMessage => "invalid_message",
            Self::Decode => "decode",
            Self::Undelivered => "undelivered",
        }
    }

    /// The reason whose [`as_str`](Self::as_str) code is `name` (for a dead-letter consumer
    /// reading the code back); `None` for an unknown code.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The event passed to the dead-letter hook
/// ([`ExecutorBuilder::on_dead_letter`](crate::ExecutorBuilder::on_dead_letter)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The exhausted key.
    pub key: IdempotencyKey,
    /// Attempts made (the configured maximum).
    pub attempts: u32,
    /// The error of the last attempt.
    pub last_error: String,
    /// Whether the last attempt panicked.
    pub panicked: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_and_read_back() {
        let mut seen = std::collections::HashSet::new();
        for reason in DeadLetterReason::ALL {
            assert!(seen.insert(reason.as_str()), "{reason:?}");
            assert_eq!(DeadLetterReason::from_name(reason.as_str()), Some(reason));
            assert_eq!(reason.to_string(), reason.as_str());
        }
        assert_eq!(DeadLetterReason::from_name("other"), None);
    }
}
