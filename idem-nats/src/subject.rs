//! NATS subjects: matching with the `*` and `>` wildcards, whether the subjects a consumer
//! receives include its own dead-letter subjects, and the protocol line a publication takes.

use crate::options::DeadLetterSubject;

/// The server's longest protocol line by default (`max_control_line`, 4,096 bytes): a
/// publication whose line (`HPUB <subject> <reply> <sizes>`) is longer makes the server close the
/// connection.
pub(crate) const MAX_CONTROL_LINE: usize = 4096;

/// The longest subject a JetStream publication can have when its reply inbox is `reply_len`
/// bytes long: the line `HPUB <subject> <reply> <header bytes> <total bytes>\r\n` (the sizes
/// counted as 10 digits each) within [`MAX_CONTROL_LINE`].
pub(crate) fn max_publish_subject(reply_len: usize) -> usize {
    let overhead = "HPUB ".len() + 1 + reply_len + 2 * (1 + 10) + "\r\n".len();
    MAX_CONTROL_LINE.saturating_sub(overhead)
}

/// Whether `subject` is a subject one can publish to: not empty, no empty token (no leading,
/// trailing or doubled `.`), no whitespace, no wildcard token.
pub(crate) fn is_literal(subject: &str) -> bool {
    !subject.is_empty()
        && !subject.contains(char::is_whitespace)
        && subject
            .split('.')
            .all(|token| !token.is_empty() && token != "*" && token != ">")
}

/// One token of a subject pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Token {
    /// A literal token.
    Literal(String),
    /// `*`: any one token.
    Any,
    /// Any one token that starts with this text and is longer: what a dead-letter prefix not
    /// ending in `.` (`dlq_`) makes of a wildcard first token.
    StartsWith(String),
    /// `>`: one or more tokens (only last).
    Rest,
}

/// The tokens of `pattern` (`*` and a last `>` are wildcards; anything else is literal).
fn tokens(pattern: &str) -> Vec<Token> {
    let parts: Vec<&str> = pattern.split('.').collect();
    let last = parts.len() - 1;
    parts
        .into_iter()
        .enumerate()
        .map(|(i, part)| match part {
            "*" => Token::Any,
            ">" if i == last => Token::Rest,
            literal => Token::Literal(literal.to_owned()),
        })
        .collect()
}

/// The token both `a` and `b` match, if any.
fn meet(a: &Token, b: &Token) -> Option<Token> {
    use Token::{Any, Literal, Rest, StartsWith};
    match (a, b) {
        (Literal(x), Literal(y)) => (x == y).then(|| a.clone()),
        (Any, t) | (t, Any) => Some(t.clone()),
        (StartsWith(p), Literal(x)) | (Literal(x), StartsWith(p)) => {
            (x.len() > p.len() && x.starts_with(p.as_str())).then(|| Literal(x.clone()))
        }
        (StartsWith(p), StartsWith(q)) => {
            if p.starts_with(q.as_str()) {
                Some(StartsWith(p.clone()))
            } else if q.starts_with(p.as_str()) {
                Some(StartsWith(q.clone()))
            } else {
                None
            }
        }
        // `>` is handled by `intersect`: it is a run of tokens, not one.
        (Rest, _) | (_, Rest) => None,
    }
}

/// The pattern of the subjects that match both `a` and `b`, or `None` when no subject does.
fn intersect(a: &[Token], b: &[Token]) -> Option<Vec<Token>> {
    match (a.split_first(), b.split_first()) {
        (None, None) => Some(Vec::new()),
        // `>` matches one or more tokens of any kind: what the other side matches from here.
        (Some((Token::Rest, _)), Some(_)) => Some(b.to_vec()),
        (Some(_), Some((Token::Rest, _))) => Some(a.to_vec()),
        (Some((x, xs)), Some((y, ys))) => {
            let first = meet(x, y)?;
            let mut rest = intersect(xs, ys)?;
            rest.insert(0, first);
            Some(rest)
        }
        _ => None,
    }
}

/// Whether the literal `subject` matches `pattern` (a subject with `*` and `>` wildcards), as
/// the server matches a stream's subjects and a consumer's filter.
pub(crate) fn matches(pattern: &str, subject: &str) -> bool {
    let literal: Vec<Token> = subject
        .split('.')
        .map(|t| Token::Literal(t.to_owned()))
        .collect();
    intersect(&tokens(pattern), &literal).is_some()
}

/// The patterns of `prefix` followed by any subject of `pattern` (several when the prefix does
/// not end in `.` and the pattern starts with `>`).
fn prefixed(prefix: &str, pattern: &[Token]) -> Vec<Vec<Token>> {
    let literal = |t: &str| Token::Literal(t.to_owned());
    if let Some(whole) = prefix.strip_suffix('.') {
        let mut out: Vec<Token> = whole.split('.').map(literal).collect();
        out.extend_from_slice(pattern);
        return vec![out];
    }
    // The prefix's last token and the pattern's first one make one token.
    let (head, partial) = match prefix.rsplit_once('.') {
        Some((head, partial)) => (head.split('.').map(literal).collect(), partial),
        None => (Vec::new(), prefix),
    };
    let with = |first: Token, rest: &[Token]| {
        let mut out: Vec<Token> = head.clone();
        out.push(first);
        out.extend_from_slice(rest);
        out
    };
    match pattern.split_first() {
        None => vec![with(literal(partial), &[])],
        Some((Token::Literal(t), rest)) => vec![with(literal(&format!("{partial}{t}")), rest)],
        Some((Token::StartsWith(t), rest)) => {
            vec![with(Token::StartsWith(format!("{partial}{t}")), rest)]
        }
        Some((Token::Any, rest)) => vec![with(Token::StartsWith(partial.to_owned()), rest)],
        // `>`: one token or more, the first of them joined to the prefix.
        Some((Token::Rest, _)) => vec![
            with(Token::StartsWith(partial.to_owned()), &[]),
            with(Token::StartsWith(partial.to_owned()), &[Token::Rest]),
        ],
    }
}

/// A pattern written back as text (`StartsWith("dlq_")` as `dlq_*`).
fn render(pattern: &[Token]) -> String {
    pattern
        .iter()
        .map(|t| match t {
            Token::Literal(s) => s.clone(),
            Token::Any => "*".to_owned(),
            Token::StartsWith(s) => format!("{s}*"),
            Token::Rest => ">".to_owned(),
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// The subjects a durable consumer receives: those its stream captures (its `subjects`) that
/// pass its filter (none: all of them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Consumed {
    /// The stream's subjects.
    pub(crate) stream: Vec<String>,
    /// The consumer's filter subjects (empty: no filter).
    pub(crate) filters: Vec<String>,
}

impl Consumed {
    /// From a stream's subjects and a consumer's `filter_subject` (empty: none). (The several
    /// `filter_subjects` of a NATS 2.10 consumer are not read by this build of the client: such
    /// a consumer counts as unfiltered, which can only find more dead letters coming back.)
    pub(crate) fn new(stream: &[String], filter: &str) -> Self {
        Self {
            stream: stream.to_vec(),
            filters: if filter.is_empty() {
                Vec::new()
            } else {
                vec![filter.to_owned()]
            },
        }
    }

    /// The patterns of the subjects received: each stream subject within each filter.
    fn patterns(&self) -> Vec<Vec<Token>> {
        let mut out = Vec::new();
        for subject in &self.stream {
            let subject = tokens(subject);
            if self.filters.is_empty() {
                out.push(subject);
                continue;
            }
            for filter in &self.filters {
                out.extend(intersect(&subject, &tokens(filter)));
            }
        }
        out
    }

    /// Whether a message published on the literal `subject` reaches this consumer.
    pub(crate) fn takes(&self, subject: &str) -> bool {
        self.stream.iter().any(|s| matches(s, subject))
            && (self.filters.is_empty() || self.filters.iter().any(|f| matches(f, subject)))
    }

    /// Where the dead letters of this consumer's messages would come back to it: `None` when
    /// they never do, else a description of one such case (for the configuration error).
    pub(crate) fn loop_through(&self, dead_letters: &DeadLetterSubject) -> Option<String> {
        match dead_letters {
            DeadLetterSubject::Fixed(subject) => self.takes(subject).then(|| {
                format!("every dead letter goes to {subject}, which the consumer receives")
            }),
            DeadLetterSubject::Prefix(prefix) => {
                let received = self.patterns();
                for from in &received {
                    for dead in prefixed(prefix, from) {
                        if let Some(both) = received.iter().find_map(|r| intersect(&dead, r)) {
                            return Some(format!(
                                "a message on {} is dead-lettered to {}, which the consumer \
                                 receives",
                                render(from),
                                render(&both)
                            ));
                        }
                    }
                }
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_match_patterns_with_wildcards() {
        for (pattern, subject) in [
            ("orders.created", "orders.created"),
            ("orders.*", "orders.created"),
            ("*.created", "orders.created"),
            ("orders.>", "orders.created"),
            ("orders.>", "orders.created.eu"),
            (">", "orders"),
            (">", "a.b.c"),
            ("*.*.c", "a.b.c"),
            ("a.*.>", "a.b.c.d"),
        ] {
            assert!(
                matches(pattern, subject),
                "{pattern} should match {subject}"
            );
        }
        for (pattern, subject) in [
            ("orders.created", "orders.updated"),
            ("orders.*", "orders"),
            ("orders.*", "orders.created.eu"),
            ("orders.>", "orders"),
            ("*", "a.b"),
            ("a.*.>", "a.b"),
            ("orders", "orders.created"),
            ("ord*", "orders"),
            ("a.>.c", "a.b.c"),
        ] {
            assert!(
                !matches(pattern, subject),
                "{pattern} should not match {subject}"
            );
        }
    }

    #[test]
    fn intersections_are_what_both_patterns_match() {
        let both = |a: &str, b: &str| intersect(&tokens(a), &tokens(b)).map(|p| render(&p));
        assert_eq!(both("a.*", "*.b").as_deref(), Some("a.b"));
        assert_eq!(both("a.>", "*.*.c").as_deref(), Some("a.*.c"));
        assert_eq!(both(">", "a.*").as_deref(), Some("a.*"));
        assert_eq!(both("a.>", ">").as_deref(), Some("a.>"));
        assert_eq!(both("a.*", "a.b.c"), None);
        assert_eq!(both("a.>", "b.>"), None);
        assert_eq!(both("a", "a.>"), None);
    }

    #[test]
    fn consumed_subjects_follow_the_stream_and_the_filter() {
        let unfiltered = Consumed::new(&["orders.>".into()], "");
        assert!(unfiltered.takes("orders.dead"));
        assert!(!unfiltered.takes("dlq.orders.created"));
        let filtered = Consumed::new(&["orders.>".into()], "orders.created");
        assert!(filtered.takes("orders.created"));
        assert!(!filtered.takes("orders.dead"), "the filter keeps it out");
        let wildcard = Consumed::new(&["orders.>".into()], "orders.eu.*");
        assert!(wildcard.takes("orders.eu.x") && !wildcard.takes("orders.us.x"));
        let two = Consumed::new(&["orders.>".into(), "refunds.>".into()], "");
        assert!(two.takes("refunds.x") && !two.takes("dlq.refunds.x"));
    }

    #[test]
    fn dead_letters_the_consumer_receives_are_found() {
        let fixed = |s: &str| DeadLetterSubject::Fixed(s.to_owned());
        let prefix = |s: &str| DeadLetterSubject::Prefix(s.to_owned());
        let stream = |subjects: &[&str], filter: &str| {
            let subjects: Vec<String> = subjects.iter().map(|s| (*s).to_owned()).collect();
            Consumed::new(&subjects, filter)
        };
        // The default: `dlq.` + subject, a stream on `orders.>`.
        let orders = stream(&["orders.>"], "");
        assert_eq!(orders.loop_through(&DeadLetterSubject::default()), None);
        assert_eq!(orders.loop_through(&fixed("dead")), None);
        assert!(orders.loop_through(&fixed("orders.dead")).is_some());
        assert!(orders.loop_through(&prefix("orders.dlq.")).is_some());
        // A stream that captures everything takes any dead letter.
        assert!(
            stream(&[">"], "")
                .loop_through(&DeadLetterSubject::default())
                .is_some()
        );
        // The stream captures `dlq.>` as well, but the filter keeps the dead letters out.
        let both = stream(&["orders.>", "dlq.>"], "orders.>");
        assert_eq!(both.loop_through(&DeadLetterSubject::default()), None);
        assert_eq!(both.loop_through(&fixed("dlq.all")), None);
        assert!(
            stream(&["orders.>", "dlq.>"], "")
                .loop_through(&DeadLetterSubject::default())
                .is_some()
        );
        // `dlq.orders.x` is captured by `*.orders.*`: a loop.
        assert!(
            stream(&["orders.*", "*.orders.*"], "")
                .loop_through(&prefix("dlq."))
                .is_some()
        );
        // A prefix without a trailing dot joins the first token.
        assert!(
            stream(&["*.created"], "")
                .loop_through(&prefix("dlq_"))
                .is_some()
        );
        assert!(stream(&[">"], "").loop_through(&prefix("dlq_")).is_some());
        assert!(
            stream(&["orders.*"], "")
                .loop_through(&prefix("dlq_"))
                .is_none()
        );
        assert!(
            stream(&["orders.*", "dlq_orders.*"], "")
                .loop_through(&prefix("dlq_"))
                .is_some()
        );
        // `a.dlq_<token>.orders` never equals `a.x.orders`.
        assert!(
            stream(&["*.orders", "a.x.orders"], "")
                .loop_through(&prefix("a.dlq_"))
                .is_none()
        );
        assert!(
            stream(&["*.orders", "a.dlq_x.orders"], "")
                .loop_through(&prefix("a.dlq_"))
                .is_some()
        );
        // A mirror (no subjects of its own) captures nothing.
        assert_eq!(stream(&[], "").loop_through(&fixed("x")), None);
    }

    #[test]
    fn literal_subjects_and_the_publish_line() {
        assert!(is_literal("dlq.orders"));
        for bad in ["", "dlq..x", ".dlq", "dlq.", "dlq.*", "dlq.>", "a b"] {
            assert!(!is_literal(bad), "{bad:?}");
        }
        // `_INBOX.` + a 22-character nuid: 29 bytes.
        assert_eq!(max_publish_subject(29), 4096 - 5 - 1 - 29 - 22 - 2);
    }
}
