//! Exit codes and the one-line error every failure prints.

use std::fmt;
use std::process::ExitCode;

use idem_core::Error;

use crate::store_url::BadUrl;

/// How `idem` ends. The numbers are part of its interface (documented in `--help` and the
/// README).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Code {
    /// 0: done.
    Ok = 0,
    /// 1: a record named on the command line does not exist (or is past retention).
    NotFound = 1,
    /// 2: bad usage: a bad argument or store URL, a command the store does not offer, or a
    /// destructive command refused without confirmation.
    Usage = 2,
    /// 3: the store could not be reached or did not answer within `--timeout`.
    Unavailable = 3,
    /// 4: the store answered with an error: not set up, a record that does not decode, a
    /// server error; or the output could not be written.
    Store = 4,
}

impl From<Code> for ExitCode {
    fn from(code: Code) -> Self {
        ExitCode::from(code as u8)
    }
}

/// A failure: its exit code and one line of text.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) code: Code,
    message: String,
}

impl Failure {
    pub(crate) fn new(code: Code, message: impl fmt::Display) -> Self {
        Self {
            code,
            message: one_line(&message.to_string()),
        }
    }

    pub(crate) fn usage(message: impl fmt::Display) -> Self {
        Self::new(Code::Usage, message)
    }

    pub(crate) fn not_found(message: impl fmt::Display) -> Self {
        Self::new(Code::NotFound, message)
    }

    /// A failure with the exit code and no message of its own (already told).
    pub(crate) fn silent(code: Code) -> Self {
        Self {
            code,
            message: String::new(),
        }
    }

    pub(crate) fn message(&self) -> &str {
        &self.message
    }
}

/// How a command ends when both it and the writing of its output may have failed: a real
/// failure wins over a closed pipe (`Code::Ok`, silent), and `cause` (the command's, say a store
/// error) over `output` when both are real. A closed pipe alone still ends quietly.
pub(crate) fn prevail(
    cause: Result<(), Failure>,
    output: Result<(), Failure>,
) -> Result<(), Failure> {
    match (cause, output) {
        (Err(e), _) if e.code != Code::Ok => Err(e),
        (_, Err(w)) => Err(w),
        (cause, Ok(())) => cause,
    }
}

impl From<BadUrl> for Failure {
    fn from(e: BadUrl) -> Self {
        Self::usage(e)
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::Unavailable { .. } => Code::Unavailable,
            Error::InvalidInput { .. } | Error::Unsupported { .. } => Code::Usage,
            _ => Code::Store,
        };
        let message = match &e {
            Error::Unsupported {
                operation: "list", ..
            } => format!(
                "{e}: this store has no listing yet, so list, stats, release-stuck and \
                 filtered delete cannot run on it (get and delete by id can)"
            ),
            Error::NotSetUp { .. } => format!("{e} (`idem migrate` sets it up)"),
            _ => e.to_string(),
        };
        Self::new(code, message)
    }
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            // The reader went away (`idem list | head`): nothing more to say.
            return Self::silent(Code::Ok);
        }
        Self::new(Code::Store, format!("cannot write the output: {e}"))
    }
}

/// Whether `c` would act on the terminal or not show: a control character, or a format or
/// separator character (U+200B, U+202E, U+2028, ...). These are what Rust's `escape_debug`
/// writes as an escape, besides the quotes and the backslash.
pub(crate) fn hidden(c: char) -> bool {
    !matches!(c, '\\' | '"' | '\'') && c.escape_debug().nth(1).is_some()
}

/// `text` with every [hidden](hidden) character escaped (`\u{1b}`, `\n`, `\u{202e}`): safe to
/// print, and one line.
pub(crate) fn visible(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(hidden) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match hidden(c) {
            true => out.extend(c.escape_debug()),
            false => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// `text` on one line: line breaks (some drivers put them in their errors) become `; `.
fn one_line(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for (i, line) in text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .enumerate()
    {
        if i > 0 {
            out.push_str("; ");
        }
        out.push_str(&visible(line));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_the_error() {
        let unavailable = Error::timed_out("redis", std::time::Duration::from_secs(1));
        assert_eq!(Failure::from(unavailable).code, Code::Unavailable);
        let unsupported = Error::Unsupported {
            store: "redis",
            operation: "list",
        };
        let f = Failure::from(unsupported);
        assert_eq!(f.code, Code::Usage);
        assert!(f.message().contains("does not support list"), "{f:?}");
        assert_eq!(
            Failure::from(Error::invalid("namespace", "bad")).code,
            Code::Usage
        );
        let f = Failure::from(Error::not_set_up("postgres", "table x", "run migrate"));
        assert_eq!(f.code, Code::Store);
        assert!(f.message().contains("idem migrate"), "{f:?}");
    }

    #[test]
    fn a_closed_pipe_never_hides_a_failure() {
        let pipe = || {
            Err(Failure::from(std::io::Error::from(
                std::io::ErrorKind::BrokenPipe,
            )))
        };
        let store = || Err(Failure::new(Code::Unavailable, "redis store unavailable"));
        let code = |r: Result<(), Failure>| r.map_or_else(|f| f.code, |()| Code::Ok);
        assert_eq!(code(prevail(store(), pipe())), Code::Unavailable);
        assert_eq!(code(prevail(pipe(), store())), Code::Unavailable);
        assert_eq!(code(prevail(Ok(()), pipe())), Code::Ok);
        let written = Err(Failure::from(std::io::Error::other("disk full")));
        assert_eq!(code(prevail(Ok(()), written)), Code::Store);
        let not_found = Err(Failure::silent(Code::NotFound));
        assert_eq!(code(prevail(not_found, pipe())), Code::NotFound);
    }

    #[test]
    fn messages_are_one_line() {
        let f = Failure::new(Code::Store, "first\n  second\r\n\nthird");
        assert_eq!(f.message(), "first; second; third");
    }

    #[test]
    fn messages_cannot_drive_the_terminal() {
        let f = Failure::new(
            Code::Store,
            "corrupt record for ns:\u{1b}[2J\0x\u{202e}y \"q\"",
        );
        assert_eq!(
            f.message(),
            "corrupt record for ns:\\u{1b}[2J\\0x\\u{202e}y \"q\""
        );
    }
}
