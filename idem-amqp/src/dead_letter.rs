//! What is published to the dead-letter exchange.

pub use idem_executor::DeadLetterReason;
use idem_executor::{ExecutorError, Outcome};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use crate::message::AmqpMessage;

/// Header naming why the message was dead-lettered: a [`DeadLetterReason`] code.
pub const HEADER_REASON: &str = "idem-dlq-reason";
/// Header with the error text: the last recorded error, or what was wrong with the message.
pub const HEADER_ERROR: &str = "idem-dlq-error";
/// Header with the number of attempts the store counted for the key (decimal text; `0` when the
/// handler never ran for this payload, as for a conflict or an unreadable message; `unknown`
/// when the store could not be read).
pub const HEADER_ATTEMPTS: &str = "idem-dlq-attempts";
/// Header with the idempotency key id, when the message had a readable one.
pub const HEADER_KEY: &str = "idem-dlq-key";
/// Header with the queue the message was consumed from.
pub const HEADER_SOURCE_QUEUE: &str = "idem-dlq-source-queue";
/// Header with the exchange the message was published to (empty: the default exchange).
pub const HEADER_SOURCE_EXCHANGE: &str = "idem-dlq-source-exchange";
/// Header with the routing key the message was published with.
pub const HEADER_SOURCE_ROUTING_KEY: &str = "idem-dlq-source-routing-key";

/// What the runner writes beside the original message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DeadLetterInfo {
    pub(crate) reason: DeadLetterReason,
    pub(crate) error: String,
    /// `None` when the count must be read from the store.
    pub(crate) attempts: Option<u32>,
}

/// What to write for a result whose broker action is
/// [`BrokerAction::DeadLetter`](idem_executor::BrokerAction::DeadLetter): the action's `reason`
/// and `error`, and the attempt count. `attempt` is the attempt of the handler run in this call
/// (0 when the handler did not run).
pub(crate) fn classify<T>(
    result: &Result<Outcome<T>, ExecutorError>,
    reason: DeadLetterReason,
    error: String,
    attempt: u32,
) -> DeadLetterInfo {
    let ran = (attempt > 0).then_some(attempt);
    let attempts = match result {
        // The handler never ran for this payload.
        Ok(Outcome::Conflict)
        | Err(
            ExecutorError::MissingKey
            | ExecutorError::InvalidKey(_)
            | ExecutorError::InvalidMessage { .. },
        ) => Some(0),
        Ok(Outcome::Exhausted { attempts, .. }) => Some(*attempts),
        Ok(Outcome::NotCommitted { attempt, .. }) => Some(*attempt),
        // Un-deduplicated: the one run of this call, counted nowhere else.
        Ok(Outcome::NotDeduplicated { .. }) => Some(1),
        // A replayed result that does not decode: the count is the store's.
        Err(ExecutorError::Decode { .. }) => None,
        // `Failed`, `ResultNotStored`: this call's run, or (replayed) the store's count.
        _ => ran,
    };
    DeadLetterInfo {
        reason,
        error,
        attempts,
    }
}

/// The original headers with the dead-letter headers added (replacing any of the same name).
pub(crate) fn headers(
    msg: &AmqpMessage,
    info: &DeadLetterInfo,
    attempts: Option<u32>,
    key_id: Option<&str>,
) -> FieldTable {
    let mut headers = msg.headers().cloned().unwrap_or_default();
    let attempts = attempts.map_or_else(|| "unknown".to_owned(), |n| n.to_string());
    let ours: [(&str, Option<&str>); 7] = [
        (HEADER_REASON, Some(info.reason.as_str())),
        (HEADER_ERROR, Some(info.error.as_str())),
        (HEADER_ATTEMPTS, Some(attempts.as_str())),
        (HEADER_KEY, key_id),
        (HEADER_SOURCE_QUEUE, Some(msg.queue())),
        (HEADER_SOURCE_EXCHANGE, Some(msg.exchange())),
        (HEADER_SOURCE_ROUTING_KEY, Some(msg.routing_key())),
    ];
    for (name, value) in ours {
        if let Some(value) = value {
            headers.insert(
                ShortString::from(name),
                AMQPValue::LongString(LongString::from(value)),
            );
        }
    }
    headers
}

#[cfg(test)]
mod tests {
    use idem_executor::BrokerAction;
    use lapin::BasicProperties;

    use super::*;

    fn info(result: &Result<Outcome<()>, ExecutorError>, attempt: u32) -> DeadLetterInfo {
        let BrokerAction::DeadLetter { reason, error } = BrokerAction::of(result) else {
            panic!("not dead-lettered: {result:?}");
        };
        classify(result, reason, error, attempt)
    }

    #[test]
    fn classification() {
        let conflict = info(&Ok(Outcome::Conflict), 0);
        assert_eq!(
            (conflict.reason, conflict.attempts),
            (DeadLetterReason::Conflict, Some(0))
        );
        let exhausted = info(
            &Ok(Outcome::Exhausted {
                attempts: 3,
                last_error: Some("boom".into()),
            }),
            3,
        );
        assert_eq!(
            exhausted,
            DeadLetterInfo {
                reason: DeadLetterReason::Exhausted,
                error: "boom".into(),
                attempts: Some(3)
            }
        );
        let failed = Ok(Outcome::Failed {
            error: "bad".into(),
        });
        assert_eq!(info(&failed, 2).attempts, Some(2));
        assert_eq!(info(&failed, 0).attempts, None, "read from the store");
        let missing = info(&Err(ExecutorError::MissingKey), 0);
        assert_eq!(
            (missing.reason, missing.attempts),
            (DeadLetterReason::MissingKey, Some(0))
        );
    }

    #[test]
    fn headers_keep_the_original_ones() {
        let mut orig = FieldTable::default();
        orig.insert(
            ShortString::from("trace"),
            AMQPValue::LongString(LongString::from("abc")),
        );
        let msg = AmqpMessage::new(b"x".to_vec(), BasicProperties::default().with_headers(orig));
        let info = DeadLetterInfo {
            reason: DeadLetterReason::Exhausted,
            error: "boom\nline two".into(),
            attempts: Some(3),
        };
        let h = headers(&msg, &info, Some(3), Some("tx-1"));
        let text = |k: &str| match h.inner().get(k) {
            Some(AMQPValue::LongString(s)) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
            other => panic!("{k}: {other:?}"),
        };
        assert_eq!(text("trace"), "abc");
        assert_eq!(text(HEADER_REASON), "exhausted");
        assert_eq!(text(HEADER_ERROR), "boom\nline two", "kept as is");
        assert_eq!(text(HEADER_ATTEMPTS), "3");
        assert_eq!(text(HEADER_KEY), "tx-1");
        let unknown = headers(&msg, &info, None, None);
        assert!(!unknown.contains_key(HEADER_KEY));
        assert!(
            matches!(unknown.inner().get(HEADER_ATTEMPTS), Some(AMQPValue::LongString(s)) if s.as_bytes() == b"unknown")
        );
    }
}
