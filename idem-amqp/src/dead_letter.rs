//! What is published to the dead-letter exchange.

pub use idem_executor::DeadLetterReason;
use idem_executor::broker::{DeadLetterInfo, attempts_value};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use crate::message::AmqpMessage;

pub use idem_executor::broker::{HEADER_ATTEMPTS, HEADER_ERROR, HEADER_KEY, HEADER_REASON};
/// Header with the queue the message was consumed from.
pub const HEADER_SOURCE_QUEUE: &str = "idem-dlq-source-queue";
/// Header with the exchange the message was published to (empty: the default exchange).
pub const HEADER_SOURCE_EXCHANGE: &str = "idem-dlq-source-exchange";
/// Header with the routing key the message was published with.
pub const HEADER_SOURCE_ROUTING_KEY: &str = "idem-dlq-source-routing-key";

/// The original headers with the dead-letter headers added (replacing any of the same name).
pub(crate) fn headers(
    msg: &AmqpMessage,
    info: &DeadLetterInfo,
    attempts: Option<u32>,
    key_id: Option<&str>,
) -> FieldTable {
    let mut headers = msg.headers().cloned().unwrap_or_default();
    let attempts = attempts_value(attempts);
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
    use lapin::BasicProperties;

    use super::*;

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
