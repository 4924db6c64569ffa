//! How records look: aligned tables for people, one JSON object per line for programs.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use comfy_table::presets::NOTHING;
use comfy_table::{CellAlignment, ContentArrangement, Table};
use idem_core::{Record, RecordState, Status};
use serde_json::{Value, json};

use crate::failure::hidden;

/// Most characters (or bytes, in hex) of a result or error a table shows; `--json` shows all.
const SHOWN: usize = 512;

/// How a stored result is written out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Shown {
    /// UTF-8 text: no control characters other than tab and line breaks (`\n`, or `\r\n`:
    /// a `\r` alone would bring what follows over what precedes it on a terminal), no format
    /// or separator characters such as U+202E.
    Text(String),
    /// Anything else, as lowercase hex.
    Hex(String),
}

impl Shown {
    pub(crate) fn of(bytes: &[u8]) -> Self {
        match std::str::from_utf8(bytes) {
            Ok(text) if plain(text) => Self::Text(text.to_owned()),
            _ => Self::Hex(hex::encode(bytes)),
        }
    }

    fn encoding(&self) -> &'static str {
        match self {
            Self::Text(_) => "utf8",
            Self::Hex(_) => "hex",
        }
    }

    fn text(&self) -> &str {
        match self {
            Self::Text(t) | Self::Hex(t) => t,
        }
    }
}

/// Whether `text` shows as it is on a terminal: its only control characters are tabs and line
/// breaks (`\n`, or `\r` right before `\n`); no bare `\r`, no escape, no format or separator
/// character.
fn plain(text: &str) -> bool {
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\t' | '\n' => {}
            '\r' if chars.peek() == Some(&'\n') => {}
            c if hidden(c) => return false,
            _ => {}
        }
    }
    true
}

/// A table with no borders, columns two spaces apart, never wrapped (so it stays aligned when
/// piped).
pub(crate) fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(NOTHING)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(header.iter().copied());
    for column in t.column_iter_mut() {
        column.set_padding((0, 2));
    }
    t
}

/// Right-aligns column `i` (numbers).
pub(crate) fn right_align(t: &mut Table, i: usize) {
    if let Some(column) = t.column_mut(i) {
        column.set_cell_alignment(CellAlignment::Right);
    }
}

/// `table` as text, each line without trailing blanks.
pub(crate) fn lines(t: &Table) -> String {
    let mut out = String::new();
    for line in t.to_string().lines() {
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// An id, owner or error text as a table shows it: as is, or quoted and escaped when it holds
/// characters that would act on the terminal or not show (control, format and separator
/// characters), blanks at its ends (which a table would hide), or starts with a quote (so that
/// it is never taken for another text shown quoted).
pub(crate) fn shown_id(id: &str) -> String {
    if id.chars().any(hidden) || id.trim() != id || id.is_empty() || id.starts_with('"') {
        format!("{id:?}")
    } else {
        id.to_owned()
    }
}

/// RFC 3339 with milliseconds, UTC.
pub(crate) fn timestamp(at: SystemTime) -> String {
    if at < UNIX_EPOCH {
        return format!("{at:?}");
    }
    humantime::format_rfc3339_millis(at).to_string()
}

/// `3m 12s ago` or `in 25s`, to the second.
pub(crate) fn relative(at: SystemTime, now: SystemTime) -> String {
    let whole =
        |d: Duration| humantime::format_duration(Duration::from_secs(d.as_secs())).to_string();
    match now.duration_since(at) {
        Ok(past) if past.as_secs() == 0 => "now".to_owned(),
        Ok(past) => format!("{} ago", whole(past)),
        Err(future) => format!("in {}", whole(future.duration())),
    }
}

fn when(at: Option<SystemTime>, now: SystemTime) -> String {
    at.map_or_else(
        || "-".to_owned(),
        |at| format!("{} ({})", timestamp(at), relative(at, now)),
    )
}

fn json_time(at: Option<SystemTime>) -> Value {
    at.map_or(Value::Null, |at| Value::String(timestamp(at)))
}

fn failure(record: &Record) -> Option<(&str, &'static str)> {
    match &record.state {
        RecordState::Failed { error, kind } => Some((error, kind.name())),
        _ => None,
    }
}

fn result(record: &Record) -> Option<(Shown, usize)> {
    match &record.state {
        RecordState::Completed { result } => Some((Shown::of(result), result.len())),
        _ => None,
    }
}

/// A record as one JSON object: every field, the result as `utf8` text or `hex`.
pub(crate) fn record_json(record: &Record, status: Status) -> Value {
    let result = result(record);
    let failure = failure(record);
    json!({
        "namespace": record.key.namespace().as_str(),
        "id": record.key.id(),
        "status": status.name(),
        "state": record.state.name(),
        "token": record.token.get(),
        "owner": record.owner,
        "attempts": record.attempts,
        "created_at": json_time(Some(record.created_at)),
        "updated_at": json_time(Some(record.updated_at)),
        "lease_expires_at": json_time(record.lease_expires_at),
        "expires_at": json_time(record.expires_at),
        "fingerprint": record.fingerprint.map(|f| f.to_hex()),
        "result": result.as_ref().map(|(shown, _)| shown.text()),
        "result_encoding": result.as_ref().map(|(shown, _)| shown.encoding()),
        "result_len": result.as_ref().map(|(_, len)| len),
        "error": failure.map(|(error, _)| error),
        "failure_kind": failure.map(|(_, kind)| kind),
    })
}

fn cut(text: &str, what: &str, total: usize) -> String {
    match text.char_indices().nth(SHOWN) {
        Some((end, _)) => format!("{}… ({total} {what}; --json shows all)", &text[..end]),
        None => text.to_owned(),
    }
}

/// A record as a two-column table of its fields.
pub(crate) fn record_table(record: &Record, status: Status, now: SystemTime) -> String {
    let mut t = table(&["FIELD", "VALUE"]);
    let mut row = |field: &str, value: String| {
        t.add_row(vec![field.to_owned(), value]);
    };
    row("namespace", record.key.namespace().as_str().to_owned());
    row("id", shown_id(record.key.id()));
    row("status", status.name().to_owned());
    row("state", record.state.name().to_owned());
    row("token", record.token.to_string());
    row("owner", shown_id(&record.owner));
    row("attempts", record.attempts.to_string());
    row("created_at", when(Some(record.created_at), now));
    row("updated_at", when(Some(record.updated_at), now));
    row("lease_expires_at", when(record.lease_expires_at, now));
    row("expires_at", when(record.expires_at, now));
    row(
        "fingerprint",
        record
            .fingerprint
            .map_or_else(|| "-".to_owned(), |f| f.to_hex()),
    );
    if let Some((shown, len)) = result(record) {
        let what = match shown {
            Shown::Text(_) => "utf8",
            Shown::Hex(_) => "hex",
        };
        // A table shows `\r\n` line breaks as `\n` (`--json` keeps them): no `\r` reaches the
        // terminal, even where the text is cut.
        let text = shown.text().replace("\r\n", "\n");
        row("result", cut(&text, "characters", text.chars().count()));
        row("result_encoding", what.to_owned());
        row("result_len", format!("{len} bytes"));
    }
    if let Some((error, kind)) = failure(record) {
        let error = shown_id(error);
        row("error", cut(&error, "characters", error.chars().count()));
        row("failure_kind", kind.to_owned());
    }
    lines(&t)
}

/// The columns of a listing.
pub(crate) const LIST_HEADER: [&str; 7] = [
    "ID",
    "STATUS",
    "ATTEMPTS",
    "OWNER",
    "TOKEN",
    "UPDATED",
    "LEASE / RETENTION",
];

/// One record as a row of a listing.
pub(crate) fn list_row(record: &Record, status: Status, now: SystemTime) -> Vec<String> {
    let deadline = match (record.lease_expires_at, record.expires_at) {
        (Some(lease), _) if lease <= now => format!("lease expired {}", relative(lease, now)),
        (Some(lease), _) => format!("lease ends {}", relative(lease, now)),
        (None, Some(expiry)) => format!("kept until {}", timestamp(expiry)),
        (None, None) => "-".to_owned(),
    };
    vec![
        shown_id(record.key.id()),
        status.name().to_owned(),
        record.attempts.to_string(),
        shown_id(&record.owner),
        record.token.to_string(),
        relative(record.updated_at, now),
        deadline,
    ]
}

/// A listing table: `rows` under [`LIST_HEADER`], numbers right-aligned.
pub(crate) fn list_table(rows: impl IntoIterator<Item = Vec<String>>) -> String {
    let mut t = table(&LIST_HEADER);
    for row in rows {
        t.add_row(row);
    }
    right_align(&mut t, 2);
    lines(&t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_show_as_text_or_hex() {
        assert_eq!(
            Shown::of("héllo\n\tworld".as_bytes()),
            Shown::Text("héllo\n\tworld".into())
        );
        assert_eq!(Shown::of(&[0x00, 0x9f, 0xff]), Shown::Hex("009fff".into()));
        assert_eq!(
            Shown::of(b"nul\0inside"),
            Shown::Hex(hex::encode(b"nul\0inside"))
        );
        assert_eq!(Shown::of(b"\x1b[31m"), Shown::Hex("1b5b33316d".into()));
        assert_eq!(
            Shown::of("a\u{202e}b".as_bytes()),
            Shown::Hex("61e280ae62".into())
        );
        assert_eq!(
            Shown::of(b"{\n\t\"a\": 1\n}"),
            Shown::Text("{\n\t\"a\": 1\n}".into())
        );
        assert_eq!(Shown::of(b""), Shown::Text(String::new()));
        // Line breaks as `\r\n` are text; a `\r` alone (which rewrites the line on a terminal)
        // is not, nor another C0 control.
        assert_eq!(Shown::of(b"a\r\nb\r\n"), Shown::Text("a\r\nb\r\n".into()));
        for bytes in [
            &b"refunded\rcharged"[..],
            b"trailing\r",
            b"\r\r\n",
            b"\rx",
            b"bell\x07",
            b"back\x08space",
            b"\x1b[2K",
        ] {
            assert_eq!(
                Shown::of(bytes),
                Shown::Hex(hex::encode(bytes)),
                "{bytes:?}"
            );
        }
    }

    #[test]
    fn ids_that_a_table_would_hide_are_quoted() {
        assert_eq!(shown_id("order-42"), "order-42");
        assert_eq!(shown_id("a b"), "a b");
        assert_eq!(shown_id("line\nbreak"), "\"line\\nbreak\"");
        assert_eq!(shown_id(" padded"), "\" padded\"");
        // Never shown like another id, nor acting on the terminal.
        assert_eq!(shown_id("\"trail \""), "\"\\\"trail \\\"\"");
        assert_eq!(shown_id("rtl\u{202e}evil"), "\"rtl\\u{202e}evil\"");
        assert_eq!(shown_id("zero\u{200b}width"), "\"zero\\u{200b}width\"");
        assert_eq!(shown_id("esc\u{1b}[31m"), "\"esc\\u{1b}[31m\"");
        assert_eq!(shown_id("é支 ok"), "é支 ok");
    }

    #[test]
    fn relative_times() {
        let now = UNIX_EPOCH + Duration::from_secs(1_000_000);
        assert_eq!(relative(now - Duration::from_secs(192), now), "3m 12s ago");
        assert_eq!(relative(now + Duration::from_millis(25_400), now), "in 25s");
        assert_eq!(relative(now, now), "now");
    }

    #[test]
    fn long_texts_are_cut_in_tables_only() {
        let long = "é".repeat(SHOWN + 10);
        let shown = cut(&long, "characters", long.chars().count());
        assert!(shown.starts_with(&"é".repeat(SHOWN)), "{shown}");
        assert!(shown.ends_with(&format!("… ({} characters; --json shows all)", SHOWN + 10)));
        assert_eq!(cut("short", "characters", 5), "short");
    }
}
