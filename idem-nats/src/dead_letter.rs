//! What is published to the dead-letter subject.

use async_nats::HeaderMap;
pub use idem_executor::DeadLetterReason;
use idem_executor::broker::{DeadLetterInfo, Fit, attempts_value};

use crate::message::NatsMessage;

pub use idem_executor::broker::{
    COMPACT_TEXT, HEADER_ATTEMPTS, HEADER_ERROR, HEADER_KEY, HEADER_REASON,
};
/// Header with the stream the message was read from.
pub const HEADER_SOURCE_STREAM: &str = "idem-dlq-source-stream";
/// Header with the subject the message was published on.
pub const HEADER_SOURCE_SUBJECT: &str = "idem-dlq-source-subject";
/// Header with the message's sequence number in its stream (decimal).
pub const HEADER_SOURCE_SEQUENCE: &str = "idem-dlq-source-sequence";
/// Header with the durable consumer the runner read the message through.
pub const HEADER_SOURCE_CONSUMER: &str = "idem-dlq-source-consumer";
/// Header with the deliveries the server counted for the message, this one included.
pub const HEADER_DELIVERED: &str = "idem-dlq-delivered";
/// Header keeping the original `Nats-Msg-Id`, when the message had one: the dead letter carries
/// its own ([`dead_letter_id`]), so a dead letter published twice is stored once.
pub const HEADER_SOURCE_MSG_ID: &str = "idem-dlq-source-msg-id";
/// What the name of any other original header starting with `Nats-` is prefixed with in the
/// dead letter: the server acts on such headers when they are published (`Nats-Expected-Stream`
/// refuses a message published to another stream, `Nats-Rollup` purges the subject or the
/// stream, `Nats-TTL` expires the message), so the dead letter keeps them only under another
/// name, e.g. `idem-dlq-source-Nats-Expected-Stream`.
pub const HEADER_SOURCE_NATS_PREFIX: &str = "idem-dlq-source-";

/// Whether `name` is one of the server's own headers (`Nats-` and any case), other than
/// `Nats-Msg-Id`.
fn server_header(name: &str) -> bool {
    name.get(..5)
        .is_some_and(|p| p.eq_ignore_ascii_case("nats-"))
}

/// A text as a NATS header value: `\` as `\\`, CR as `\r`, LF as `\n` (a header value cannot
/// hold a line break). Reversed by [`unescape`].
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\r' => out.push_str("\\r"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// The text [`escape`] was given.
pub fn unescape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let mut chars = value.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('r') => out.push('\r'),
            Some('n') => out.push('\n'),
            Some(other) => out.push(other),
            None => out.push('\\'),
        }
    }
    out
}

/// `text` as a dead letter in form `fit` writes it into a header: a NUL as `\0`, then
/// [`escape`]d, then cut on a character boundary to the form's limit ([`Fit::limit`]), ending
/// with `…`. The cut comes after the escaping, so the value the server gets is within the limit
/// even for a text of many line breaks, and it never splits an escape sequence in two.
fn header_value(fit: Fit, text: &str) -> String {
    // (`fit_text` with no limit only writes a NUL as `\0`, as `Fit::cut` would.)
    let escaped = escape(&idem_core::fit_text(text, usize::MAX));
    if escaped.len() <= fit.limit() {
        return escaped;
    }
    let cut = fit.cut(&escaped);
    let body = cut.strip_suffix('…').unwrap_or(&cut);
    // `escape` writes each `\` as the first of two characters: an odd run of them at the end
    // is a pair cut in two, whose first half goes.
    let backslashes = body.len() - body.trim_end_matches('\\').len();
    let body = match backslashes % 2 {
        1 => &body[..body.len() - 1],
        _ => body,
    };
    format!("{body}…")
}

/// Header naming (comma-separated, cut as [`HEADER_ERROR`] is) the original headers a dead
/// letter goes without: present only when, with them, it was over the server's payload limit
/// (headers count towards it).
pub const HEADER_DROPPED: &str = "idem-dlq-dropped-headers";

/// The `Nats-Msg-Id` of the dead letter of `msg` read through `consumer`:
/// `<stream>.<consumer>.<sequence>`. The same message dead-lettered twice by one consumer (a
/// crash between the publication and the term) is stored once within the dead-letter stream's
/// duplicate window, while two consumers of one stream that both dead-letter it each have theirs
/// stored. Neither a stream's nor a consumer's name can hold a `.`, so no two of them give the
/// same id.
pub fn dead_letter_id(stream: &str, consumer: &str, sequence: u64) -> String {
    format!("{stream}.{consumer}.{sequence}")
}

/// The original headers (when `fit` is [`Fit::Whole`]; else [`HEADER_DROPPED`] names them) with
/// the dead-letter headers added (replacing any of the same name).
pub(crate) fn headers(
    msg: &NatsMessage,
    consumer: &str,
    info: &DeadLetterInfo,
    attempts: Option<u32>,
    key_id: Option<&str>,
    fit: Fit,
) -> HeaderMap {
    let originals = fit.keeps_originals();
    let cut = |text: &str| header_value(fit, text);
    let mut headers = HeaderMap::new();
    let mut source_msg_id = None;
    let mut dropped = Vec::new();
    if let Some(orig) = msg.headers() {
        for (name, values) in orig.iter() {
            let text: &str = name.as_ref();
            if text == "Nats-Msg-Id" {
                source_msg_id = values.first().map(|v| v.as_str().to_owned());
                continue;
            }
            if !originals {
                dropped.push(text);
                continue;
            }
            let renamed = server_header(text).then(|| format!("{HEADER_SOURCE_NATS_PREFIX}{text}"));
            for value in values {
                match &renamed {
                    Some(renamed) => headers.append(renamed.as_str(), value.clone()),
                    None => headers.append(name.clone(), value.clone()),
                }
            }
        }
    }
    let attempts = attempts_value(attempts);
    let ours: [(&str, Option<String>); 10] = [
        (HEADER_REASON, Some(info.reason.as_str().to_owned())),
        (HEADER_ERROR, Some(cut(&info.error))),
        (HEADER_ATTEMPTS, Some(attempts)),
        (HEADER_KEY, key_id.map(cut)),
        (HEADER_SOURCE_STREAM, Some(msg.stream().to_owned())),
        (HEADER_SOURCE_SUBJECT, Some(msg.subject().to_owned())),
        (
            HEADER_SOURCE_SEQUENCE,
            Some(msg.stream_sequence().to_string()),
        ),
        (HEADER_SOURCE_CONSUMER, Some(consumer.to_owned())),
        (HEADER_DELIVERED, Some(msg.delivered().to_string())),
        (HEADER_SOURCE_MSG_ID, source_msg_id),
    ];
    for (name, value) in ours {
        if let Some(value) = value {
            headers.insert(name, value);
        }
    }
    if !dropped.is_empty() {
        dropped.sort_unstable();
        headers.insert(HEADER_DROPPED, cut(&dropped.join(",")));
    }
    headers.insert(
        "Nats-Msg-Id",
        dead_letter_id(msg.stream(), consumer, msg.stream_sequence()),
    );
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_round_trips_and_has_no_line_break() {
        for text in ["plain", "two\nlines\r\n", "back\\slash\\n", "", "\\", "é\n"] {
            let escaped = escape(text);
            assert!(!escaped.contains(['\r', '\n']), "{escaped:?}");
            assert_eq!(unescape(&escaped), text);
        }
        assert_eq!(escape("a\nb"), "a\\nb");
    }

    #[test]
    fn headers_keep_the_original_ones_and_escape_texts() {
        let mut orig = HeaderMap::new();
        orig.insert("trace", "abc");
        orig.insert("Nats-Msg-Id", "producer-1");
        let msg = NatsMessage::new("orders.created", "{}", Some(orig));
        let info = DeadLetterInfo {
            reason: DeadLetterReason::Failed,
            error: "bad\nline".into(),
            attempts: Some(2),
        };
        let h = headers(&msg, "billing", &info, Some(2), Some("k\r1"), Fit::Whole);
        let get = |n: &str| h.get(n).map(|v| v.as_str().to_owned());
        assert_eq!(get("trace").as_deref(), Some("abc"));
        assert_eq!(get(HEADER_REASON).as_deref(), Some("failed"));
        assert_eq!(get(HEADER_ERROR).as_deref(), Some("bad\\nline"));
        assert_eq!(get(HEADER_KEY).as_deref(), Some("k\\r1"));
        assert_eq!(get(HEADER_ATTEMPTS).as_deref(), Some("2"));
        assert_eq!(
            get(HEADER_SOURCE_SUBJECT).as_deref(),
            Some("orders.created")
        );
        assert_eq!(get(HEADER_SOURCE_MSG_ID).as_deref(), Some("producer-1"));
        assert_eq!(get(HEADER_SOURCE_CONSUMER).as_deref(), Some("billing"));
        assert_eq!(
            get("Nats-Msg-Id").as_deref(),
            Some(".billing.0"),
            "stream.consumer.sequence"
        );
    }

    #[test]
    fn a_text_is_cut_after_escaping_and_no_escape_is_split() {
        // 300 line breaks escape to 600 bytes; with one byte before them, the cut at 253 bytes
        // (256 less the `…`) falls between two escape sequences, without it inside one.
        for (text, form) in [
            ("\n".repeat(300), Fit::Compact),
            (format!("a{}", "\n".repeat(300)), Fit::Compact),
            ("\\".repeat(5_000), Fit::Whole),
            (format!("a{}", "\r".repeat(5_000)), Fit::WithoutOriginals),
            (format!("x\0{}", "\n".repeat(300)), Fit::Compact),
        ] {
            let value = header_value(form, &text);
            assert!(value.len() <= form.limit(), "{} bytes", value.len());
            let body = value
                .strip_suffix('…')
                .expect("cut short, so it ends with …");
            let back = unescape(body).replace("\\0", "\0");
            assert!(
                text.starts_with(&back),
                "{back:?} is not where the text starts"
            );
            assert!(value.len() + 4 >= form.limit(), "cut too short: {value:?}");
            assert!(!value.contains(['\r', '\n']));
        }
        assert_eq!(header_value(Fit::Compact, "a\nb"), "a\\nb");
        assert_eq!(header_value(Fit::Compact, "a\0b"), "a\\\\0b");
    }

    #[test]
    fn a_long_error_and_key_are_cut() {
        let msg = NatsMessage::new("orders.created", "{}", None);
        let info = DeadLetterInfo {
            reason: DeadLetterReason::InvalidKey,
            error: "e".repeat(100_000),
            attempts: Some(0),
        };
        let h = headers(
            &msg,
            "c",
            &info,
            Some(0),
            Some(&"k".repeat(100_000)),
            Fit::Whole,
        );
        let compact = headers(
            &msg,
            "c",
            &info,
            Some(0),
            Some(&"k".repeat(100_000)),
            Fit::Compact,
        );
        for name in [HEADER_ERROR, HEADER_KEY] {
            let value = h.get(name).unwrap().as_str();
            assert!(
                value.len() <= idem_executor::broker::MAX_HEADER_TEXT && value.ends_with('…'),
                "{name}: {} bytes",
                value.len()
            );
            let value = compact.get(name).unwrap().as_str();
            assert!(
                value.len() <= COMPACT_TEXT && value.ends_with('…'),
                "{name}: {} bytes",
                value.len()
            );
        }
    }
}
