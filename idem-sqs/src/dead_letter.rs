//! The dead-letter queue: what is sent there, and how.

use std::borrow::Cow;
use std::collections::HashMap;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::MessageAttributeValue;
pub use idem_executor::DeadLetterReason;
pub use idem_executor::broker::COMPACT_TEXT;
use idem_executor::broker::{self, DeadLetterInfo, Fit, attempts_value};

use crate::call::{self, CallError};
use crate::message::SqsMessage;
use crate::options::RunnerOptions;

/// Attribute naming why the message was dead-lettered: a [`DeadLetterReason`] code.
pub const ATTR_REASON: &str = broker::HEADER_REASON;
/// Attribute with the error text: the last recorded error, or what was wrong with the message
/// (characters SQS does not allow in attribute values written as `\u{..}`, cut to
/// [`MAX_ERROR_LEN`] bytes with `…`, or to [`COMPACT_TEXT`] bytes when the dead-letter queue
/// refused the message as too large even without its original attributes; absent when the text
/// is empty).
pub const ATTR_ERROR: &str = broker::HEADER_ERROR;
/// Attribute with the number of attempts the store counted for the key (decimal; `0` when the
/// handler never ran for this payload, as for a conflict or an unreadable message; `unknown`
/// when the store could not be read).
pub const ATTR_ATTEMPTS: &str = broker::HEADER_ATTEMPTS;
/// Attribute with the idempotency key id, when the message had a readable one (written as
/// [`ATTR_ERROR`] is).
pub const ATTR_KEY: &str = broker::HEADER_KEY;
/// Attribute with the SQS message id of the original message.
pub const ATTR_SOURCE_MESSAGE_ID: &str = "idem-dlq-source-message-id";
/// Attribute listing (comma-separated, by name) the original message attributes that did not
/// fit: SQS takes at most [`MAX_ATTRIBUTES`] attributes per message, and the runner's own come
/// first. It also names the original attributes the runner's replaced (those of the same name,
/// as a dead letter dead-lettered again carries).
/// It names them all when the dead-letter queue refused the message with them as invalid (a
/// body near the size limit, whose attributes count towards it); refused again without them,
/// the message goes with this list, [`ATTR_ERROR`] and [`ATTR_KEY`] cut to [`COMPACT_TEXT`]
/// bytes.
pub const ATTR_DROPPED: &str = "idem-dlq-dropped-attributes";
/// The names of the runner's attributes: an original attribute of one of these names (a dead
/// letter dead-lettered again) is left out and named in [`ATTR_DROPPED`], even when the runner
/// writes no value for it this time (no error text, no key), so no stale one passes for current.
const RUNNER_ATTRIBUTES: [&str; 6] = [
    ATTR_REASON,
    ATTR_ERROR,
    ATTR_ATTEMPTS,
    ATTR_KEY,
    ATTR_SOURCE_MESSAGE_ID,
    ATTR_DROPPED,
];
/// The most message attributes SQS takes on one message.
pub const MAX_ATTRIBUTES: usize = 10;
/// The longest error text (or key) written to [`ATTR_ERROR`] (or [`ATTR_KEY`]), in bytes:
/// [`broker::MAX_HEADER_TEXT`], as every runner writes it.
pub const MAX_ERROR_LEN: usize = broker::MAX_HEADER_TEXT;

/// `text` as SQS takes it in an attribute value: the characters it refuses (controls other than
/// tab, line feed and carriage return; U+FFFE, U+FFFF) written as `\u{..}`.
pub(crate) fn attribute_text(text: &str) -> Cow<'_, str> {
    let refused = |c: char| matches!(c, '\u{0}'..='\u{8}' | '\u{b}' | '\u{c}' | '\u{e}'..='\u{1f}' | '\u{fffe}' | '\u{ffff}');
    if !text.chars().any(refused) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if refused(c) {
            out.push_str(&format!("\\u{{{:x}}}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

fn string(value: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .expect("the data type is set")
}

/// The dead-letter message's attributes: the runner's first, then the original ones (by name)
/// while they fit in [`MAX_ATTRIBUTES`] (none unless `fit` keeps them); when some do not, the
/// last place names them ([`ATTR_DROPPED`]). Texts are cut as `fit` cuts them.
pub(crate) fn attributes(
    msg: &SqsMessage,
    info: &DeadLetterInfo,
    attempts: Option<u32>,
    key_id: Option<&str>,
    fit: Fit,
) -> HashMap<String, MessageAttributeValue> {
    let text = |text: &str| string(&fit.cut(&attribute_text(text)));
    let mut out = HashMap::with_capacity(MAX_ATTRIBUTES);
    out.insert(ATTR_REASON.to_owned(), string(info.reason.as_str()));
    if !info.error.is_empty() {
        out.insert(ATTR_ERROR.to_owned(), text(&info.error));
    }
    let attempts = attempts_value(attempts);
    out.insert(ATTR_ATTEMPTS.to_owned(), string(&attempts));
    if let Some(key) = key_id.filter(|k| !k.is_empty()) {
        out.insert(ATTR_KEY.to_owned(), text(key));
    }
    if !msg.message_id().is_empty() {
        out.insert(ATTR_SOURCE_MESSAGE_ID.to_owned(), string(msg.message_id()));
    }
    // Original attributes of the runner's names (a dead letter dead-lettered again) are replaced
    // by the runner's, and named as dropped.
    let (mut original, replaced): (Vec<_>, Vec<_>) = msg
        .attributes()
        .into_iter()
        .flatten()
        .partition(|(name, _)| !RUNNER_ATTRIBUTES.contains(&name.as_str()));
    original.sort_by(|a, b| a.0.cmp(b.0));
    let room = MAX_ATTRIBUTES - out.len();
    let kept = match original.len() {
        _ if !fit.keeps_originals() => 0,
        n if n <= room && replaced.is_empty() => n,
        // The last place names the rest.
        n => n.min(room - 1),
    };
    out.extend(
        original[..kept]
            .iter()
            .map(|(k, v)| (String::clone(k), MessageAttributeValue::clone(v))),
    );
    let mut dropped: Vec<&str> = original[kept..]
        .iter()
        .chain(&replaced)
        .map(|(k, _)| k.as_str())
        .collect();
    if !dropped.is_empty() {
        dropped.sort_unstable();
        out.insert(ATTR_DROPPED.to_owned(), text(&dropped.join(",")));
    }
    out
}

/// The dead-letter queue and how to write to it.
#[derive(Clone, Debug)]
pub(crate) struct DeadLetterQueue {
    pub(crate) url: String,
    pub(crate) fifo: bool,
}

impl DeadLetterQueue {
    /// Sends the original body with `attributes`, waiting at most the `call_timeout` of
    /// `options`. On a FIFO dead-letter queue the message keeps its group (or `idem-dlq` from a
    /// standard queue), and its deduplication id is the source message id, so a send repeated
    /// (after a crash, or a call that timed out) within SQS's five-minute window is dropped.
    pub(crate) async fn send(
        &self,
        client: &Client,
        options: &RunnerOptions,
        msg: &SqsMessage,
        attributes: HashMap<String, MessageAttributeValue>,
    ) -> Result<(), CallError> {
        let mut send = client
            .send_message()
            .queue_url(&self.url)
            .message_body(msg.body())
            .set_message_attributes(Some(attributes));
        if self.fifo {
            send = send
                .message_group_id(msg.message_group_id().unwrap_or("idem-dlq"))
                .message_deduplication_id(msg.message_id());
        }
        call::bounded(options.call_timeout, send.send())
            .await
            .map(|_| ())
    }
}

/// Whether SQS refused a send as invalid (`InvalidParameterValue`: a message over the queue's
/// size limit, an attribute it does not take), rather than failing to answer.
pub(crate) fn refused_as_invalid(error: &CallError) -> bool {
    use aws_sdk_sqs::error::ProvideErrorMetadata;
    error
        .sqs()
        .and_then(|e| e.code())
        .is_some_and(|code| code.starts_with("InvalidParameterValue"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_sqs::types::Message as Received;

    fn text(attrs: &HashMap<String, MessageAttributeValue>, name: &str) -> Option<String> {
        attrs.get(name)?.string_value().map(str::to_owned)
    }

    #[test]
    fn refused_characters_are_escaped_and_nothing_else() {
        assert!(matches!(
            attribute_text("plain ✓\ttab\nline"),
            Cow::Borrowed(_)
        ));
        assert_eq!(
            attribute_text("a\u{0}b\u{1b}c\u{ffff}"),
            "a\\u{0}b\\u{1b}c\\u{ffff}"
        );
    }

    #[test]
    fn ours_first_then_the_originals_that_fit() {
        let mut received = Received::builder().message_id("m-1").body("{}");
        for i in 0..7 {
            received = received.message_attributes(format!("a{i}"), string(&format!("v{i}")));
        }
        let msg = SqsMessage::new(received.build(), "http://q");
        let info = DeadLetterInfo {
            reason: DeadLetterReason::Conflict,
            error: "fingerprint\u{0} conflict".into(),
            attempts: Some(0),
        };
        let attrs = attributes(&msg, &info, Some(0), Some("tx-1"), Fit::Whole);
        assert_eq!(attrs.len(), MAX_ATTRIBUTES);
        assert_eq!(text(&attrs, ATTR_REASON).as_deref(), Some("conflict"));
        assert_eq!(
            text(&attrs, ATTR_ERROR).as_deref(),
            Some("fingerprint\\u{0} conflict")
        );
        assert_eq!(text(&attrs, ATTR_ATTEMPTS).as_deref(), Some("0"));
        assert_eq!(text(&attrs, ATTR_KEY).as_deref(), Some("tx-1"));
        assert_eq!(text(&attrs, ATTR_SOURCE_MESSAGE_ID).as_deref(), Some("m-1"));
        for i in 0..4 {
            assert_eq!(text(&attrs, &format!("a{i}")), Some(format!("v{i}")));
        }
        assert_eq!(text(&attrs, ATTR_DROPPED).as_deref(), Some("a4,a5,a6"));

        let few = SqsMessage::new(
            Received::builder()
                .message_id("m-2")
                .message_attributes("idempotency-key", string("tx-2"))
                .build(),
            "http://q",
        );
        let attrs = attributes(&few, &info, None, None, Fit::Whole);
        assert_eq!(text(&attrs, ATTR_ATTEMPTS).as_deref(), Some("unknown"));
        assert_eq!(text(&attrs, "idempotency-key").as_deref(), Some("tx-2"));
        assert!(!attrs.contains_key(ATTR_DROPPED) && !attrs.contains_key(ATTR_KEY));
    }

    #[test]
    fn original_attributes_of_the_runners_names_are_replaced_and_named() {
        let received = Received::builder()
            .message_id("m-3")
            .message_attributes(ATTR_REASON, string("exhausted"))
            .message_attributes(ATTR_ERROR, string("stale"))
            .message_attributes(ATTR_DROPPED, string("x"))
            .message_attributes("trace", string("t-1"))
            .build();
        let msg = SqsMessage::new(received, "http://q");
        let info = DeadLetterInfo {
            reason: DeadLetterReason::MissingKey,
            error: String::new(),
            attempts: Some(0),
        };
        let attrs = attributes(&msg, &info, Some(0), None, Fit::Whole);
        assert_eq!(text(&attrs, ATTR_REASON).as_deref(), Some("missing_key"));
        assert_eq!(text(&attrs, "trace").as_deref(), Some("t-1"));
        assert_eq!(
            text(&attrs, ATTR_ERROR),
            None,
            "no stale error passes for current"
        );
        assert_eq!(
            text(&attrs, ATTR_DROPPED).as_deref(),
            Some("idem-dlq-dropped-attributes,idem-dlq-error,idem-dlq-reason")
        );
    }

    #[test]
    fn a_long_error_and_key_are_cut_and_cut_short_in_the_compact_form() {
        let mut received = Received::builder().message_id("m-1");
        for i in 0..40 {
            received = received.message_attributes(format!("attribute-{i:02}"), string("v"));
        }
        let msg = SqsMessage::new(received.build(), "http://q");
        let info = DeadLetterInfo {
            reason: DeadLetterReason::InvalidKey,
            error: "e".repeat(100_000),
            attempts: Some(0),
        };
        let key = "k".repeat(100_000);
        let whole = attributes(&msg, &info, Some(0), Some(&key), Fit::Whole);
        for name in [ATTR_ERROR, ATTR_KEY] {
            let value = text(&whole, name).unwrap();
            assert!(
                value.len() <= MAX_ERROR_LEN && value.len() > COMPACT_TEXT && value.ends_with('…'),
                "{name}: {} bytes",
                value.len()
            );
        }
        let without = attributes(&msg, &info, Some(0), Some(&key), Fit::WithoutOriginals);
        assert!(!without.contains_key("attribute-00"));
        assert!(text(&without, ATTR_DROPPED).unwrap().len() > COMPACT_TEXT);
        let compact = attributes(&msg, &info, Some(0), Some(&key), Fit::Compact);
        for name in [ATTR_ERROR, ATTR_KEY, ATTR_DROPPED] {
            let value = text(&compact, name).unwrap();
            assert!(
                value.len() <= COMPACT_TEXT && value.ends_with('…'),
                "{name}: {} bytes",
                value.len()
            );
        }
        assert_eq!(text(&compact, ATTR_REASON).as_deref(), Some("invalid_key"));
        assert!(!compact.contains_key("attribute-00"));
    }
}
