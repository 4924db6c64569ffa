//! What is published to the dead-letter exchange.

pub use idem_executor::DeadLetterReason;
use idem_executor::broker::{DeadLetterInfo, Fit, attempts_value};
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
/// (the broker closes the connection over a larger one). Should it not fit without them either,
/// it goes with this header, [`HEADER_ERROR`] and [`HEADER_KEY`] cut to
/// [`COMPACT_TEXT`](idem_executor::broker::COMPACT_TEXT) bytes.
pub const HEADER_DROPPED: &str = "idem-dlq-dropped-headers";

/// The dead letter's headers in the form `fit`: the original headers (when it keeps them; else
/// [`HEADER_DROPPED`] names them) with the dead-letter headers added (replacing any of the same
/// name), the error, the key and the dropped names cut to the form's limit.
pub(crate) fn headers(
    msg: &AmqpMessage,
    info: &DeadLetterInfo,
    attempts: Option<u32>,
    key_id: Option<&str>,
    fit: Fit,
) -> FieldTable {
    let mut headers = FieldTable::default();
    let mut dropped = None;
    match msg.headers() {
        Some(original) if fit.keeps_originals() => headers = original.clone(),
        Some(original) if !original.inner().is_empty() => {
            let names: Vec<&str> = original.inner().keys().map(ShortString::as_str).collect();
            dropped = Some(fit.cut(&names.join(",")).into_owned());
        }
        _ => {}
    }
    let attempts = attempts_value(attempts);
    let error = fit.cut(&info.error);
    let key_id = key_id.map(|key| fit.cut(key));
    let ours: [(&str, Option<&str>); 8] = [
        (HEADER_REASON, Some(info.reason.as_str())),
        (HEADER_ERROR, Some(&error)),
        (HEADER_ATTEMPTS, Some(attempts.as_str())),
        (HEADER_KEY, key_id.as_deref()),
        (HEADER_SOURCE_QUEUE, Some(msg.queue())),
        (HEADER_SOURCE_EXCHANGE, Some(msg.exchange())),
        (HEADER_SOURCE_ROUTING_KEY, Some(msg.routing_key())),
        (HEADER_DROPPED, dropped.as_deref()),
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
        let h = headers(&msg, &info, Some(3), Some("tx-1"), Fit::Whole);
        let text = |k: &str| match h.inner().get(k) {
            Some(AMQPValue::LongString(s)) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
            other => panic!("{k}: {other:?}"),
        };
        assert_eq!(text("trace"), "abc");
        assert_eq!(text(HEADER_REASON), "exhausted");
        assert_eq!(text(HEADER_ERROR), "boom\nline two", "kept as is");
        assert_eq!(text(HEADER_ATTEMPTS), "3");
        assert_eq!(text(HEADER_KEY), "tx-1");
        let unknown = headers(&msg, &info, None, None, Fit::Whole);
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
        let h = headers(&msg, &info, Some(0), Some(&"k".repeat(100_000)), Fit::Whole);
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

    #[test]
    fn smaller_forms_name_the_original_headers_and_cut_the_texts_shorter() {
        use idem_executor::broker::{COMPACT_TEXT, MAX_HEADER_TEXT};
        let mut orig = FieldTable::default();
        orig.insert(
            ShortString::from("trace"),
            AMQPValue::LongString(LongString::from("abc")),
        );
        let msg = AmqpMessage::new(b"x".to_vec(), BasicProperties::default().with_headers(orig));
        let info = DeadLetterInfo {
            reason: DeadLetterReason::Failed,
            error: "e".repeat(10_000),
            attempts: Some(1),
        };
        let key = "k".repeat(400);
        let len = |h: &FieldTable, name: &str| match h.inner().get(name) {
            Some(AMQPValue::LongString(s)) => s.as_bytes().len(),
            other => panic!("{name}: {other:?}"),
        };
        let without = headers(&msg, &info, Some(1), Some(&key), Fit::WithoutOriginals);
        assert!(!without.contains_key("trace"));
        assert!(
            matches!(without.inner().get(HEADER_DROPPED), Some(AMQPValue::LongString(s)) if s.as_bytes() == b"trace")
        );
        assert_eq!(len(&without, HEADER_KEY), 400, "a valid key kept whole");
        assert!(len(&without, HEADER_ERROR) <= MAX_HEADER_TEXT);
        let compact = headers(&msg, &info, Some(1), Some(&key), Fit::Compact);
        assert!(!compact.contains_key("trace"));
        assert!(compact.contains_key(HEADER_DROPPED));
        assert!(len(&compact, HEADER_KEY) <= COMPACT_TEXT);
        assert!(len(&compact, HEADER_ERROR) <= COMPACT_TEXT);
    }
}
