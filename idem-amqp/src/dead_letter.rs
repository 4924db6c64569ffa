//! What is published to the dead-letter exchange.

pub use idem_executor::DeadLetterReason;
use idem_executor::broker::{DeadLetterInfo, attempts_value, header_text};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use crate::message::AmqpMessage;

pub use idem_executor::broker::{HEADER_ATTEMPTS, HEADER_ERROR, HEADER_KEY, HEADER_REASON};
/// Header with the queue the message was consumed from.
pub const HEADER_SOURCE_QUEUE: &str = "idem-dlq-source-queue";
/// Header with the exchange the message was published to (empty: the default exchange).
pub const HEADER_SOURCE_EXCHANGE: &str = "idem-dlq-source-exchange";
/// Header with the routing key the message was published with.
pub const HEADER_SOURCE_ROUTING_KEY: &str = "idem-dlq-source-routing-key";
/// Header naming (comma-separated, cut as [`HEADER_ERROR`] is) the original headers a dead
/// letter goes without: present only when, with them, its properties would not fit in one frame
/// (the broker closes the connection over a larger one).
pub const HEADER_DROPPED: &str = "idem-dlq-dropped-headers";

/// The original headers (when `originals`; else [`HEADER_DROPPED`] names them) with the
/// dead-letter headers added (replacing any of the same name).
pub(crate) fn headers(
    msg: &AmqpMessage,
    info: &DeadLetterInfo,
    attempts: Option<u32>,
    key_id: Option<&str>,
    originals: bool,
) -> FieldTable {
    let mut headers = FieldTable::default();
    match msg.headers() {
        Some(original) if originals => headers = original.clone(),
        Some(original) if !original.inner().is_empty() => {
            let names: Vec<&str> = original.inner().keys().map(ShortString::as_str).collect();
            headers.insert(
                ShortString::from(HEADER_DROPPED),
                AMQPValue::LongString(LongString::from(header_text(&names.join(",")).as_ref())),
            );
        }
        _ => {}
    }
    let attempts = attempts_value(attempts);
    let error = header_text(&info.error);
    let key_id = key_id.map(header_text);
    let ours: [(&str, Option<&str>); 7] = [
        (HEADER_REASON, Some(info.reason.as_str())),
        (HEADER_ERROR, Some(&error)),
        (HEADER_ATTEMPTS, Some(attempts.as_str())),
        (HEADER_KEY, key_id.as_deref()),
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
        let h = headers(&msg, &info, Some(3), Some("tx-1"), true);
        let text = |k: &str| match h.inner().get(k) {
            Some(AMQPValue::LongString(s)) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
            other => panic!("{k}: {other:?}"),
        };
        assert_eq!(text("trace"), "abc");
        assert_eq!(text(HEADER_REASON), "exhausted");
        assert_eq!(text(HEADER_ERROR), "boom\nline two", "kept as is");
        assert_eq!(text(HEADER_ATTEMPTS), "3");
        assert_eq!(text(HEADER_KEY), "tx-1");
        let unknown = headers(&msg, &info, None, None, true);
        assert!(!unknown.contains_key(HEADER_KEY));
        assert!(
            matches!(unknown.inner().get(HEADER_ATTEMPTS), Some(AMQPValue::LongString(s)) if s.as_bytes() == b"unknown")
        );
    }

    #[test]
    fn a_long_error_and_key_are_cut() {
        let msg = AmqpMessage::new(b"x".to_vec(), BasicProperties::default());
        let info = DeadLetterInfo {
            reason: DeadLetterReason::InvalidKey,
            error: "e".repeat(100_000),
            attempts: Some(0),
        };
        let h = headers(&msg, &info, Some(0), Some(&"k".repeat(100_000)), true);
        for name in [HEADER_ERROR, HEADER_KEY] {
            let Some(AMQPValue::LongString(s)) = h.inner().get(name) else {
                panic!("{name} missing");
            };
            let s = std::str::from_utf8(s.as_bytes()).unwrap();
            assert!(
                s.len() <= idem_executor::broker::MAX_HEADER_TEXT && s.ends_with('…'),
                "{name}: {} bytes",
                s.len()
            );
        }
    }
}
