//! [`PgWrites`]: the statements a handler commits with its completion
//! ([`TransactionalStore::complete_with`](idem_core::TransactionalStore::complete_with) on
//! PostgreSQL).

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use idem_core::{Error, Result};
use tokio_postgres::types::ToSql;

/// The most statements one [`PgWrites`] may carry.
pub const MAX_WRITES: usize = 100;

/// The most parameters one statement may bind (the protocol's limit).
pub const MAX_PARAMS: usize = u16::MAX as usize;

/// One bound parameter of a statement in [`PgWrites`]: any value the driver can send
/// ([`ToSql`]), shared so that the writes can be cloned (an executor re-sends the same writes
/// after an ambiguous reply).
pub type PgParam = Arc<dyn ToSql + Send + Sync>;

/// Wraps a value as a [`PgParam`], for statements whose parameters are built as a list.
pub fn param<T: ToSql + Send + Sync + 'static>(value: T) -> PgParam {
    Arc::new(value)
}

/// The statements a handler commits together with its completion:
/// [`PostgresStore::complete_with`](crate::PostgresStore) runs them and the fenced completion in
/// ONE transaction, so they commit together or not at all (see the
/// [crate docs](crate#transactional-effects)).
///
/// Each statement is the caller's own SQL text with `$1..$n` placeholders and the values bound
/// to them: values are always sent as parameters, never written into the text. Keep the texts
/// fixed (statements are prepared once per pooled connection and cached by their text).
///
/// ```
/// use idem_postgres::{PgWrites, param};
///
/// let (account, amount, token) = ("alice", 1250i64, 7i64);
/// let writes = PgWrites::new()
///     // A condition: the balance must cover the amount, or nothing at all is committed.
///     .execute(
///         "UPDATE accounts SET balance = balance - $1 WHERE id = $2 AND balance >= $1",
///         (amount, account),
///     )
///     .expect_rows(1)
///     .execute(
///         "INSERT INTO ledger (account, amount, fence) VALUES ($1, $2, $3)",
///         (account, -amount, token),
///     )
///     // A list of values built at run time.
///     .execute("DELETE FROM holds WHERE account = $1", vec![param(account)]);
/// assert_eq!(writes.len(), 3);
/// ```
///
/// # What refuses the writes
///
/// Before anything is sent, [`Error::InvalidInput`] on the field `writes`:
/// more than [`MAX_WRITES`] statements, more than [`MAX_PARAMS`] parameters in one, an empty text
/// or one holding NUL (or only empty statements, `;`), a transaction-control statement (`BEGIN`,
/// `START`, `COMMIT`, `END`, `ROLLBACK`, `ABORT`, `SAVEPOINT`, `RELEASE`, `PREPARE
/// TRANSACTION`, also after empty statements, which the server drops: `;COMMIT` is a `COMMIT`;
/// it would end or split the transaction), a statement that changes the pooled connection's
/// session for every later call on it (`SET` other than `SET LOCAL`, `SET TRANSACTION` and `SET
/// CONSTRAINTS`, `SET SESSION CHARACTERISTICS` included; `RESET`, `PREPARE`, `DEALLOCATE`,
/// `DISCARD`, `LISTEN`, `UNLISTEN`, `LOAD`), a transaction characteristic that cannot be set
/// once the transaction has run a query (below), [`expect_rows`](Self::expect_rows) before any
/// statement; and, once the texts are prepared (before the transaction starts), a text the
/// server refuses to prepare (a syntax error, an unknown column or function: SQLSTATE class
/// `42`, or `0A`), a parameter count other than the statement's, or a value of a type the
/// statement's parameter does not take.
///
/// **Transaction characteristics.** The completion's statement runs first in the transaction,
/// and PostgreSQL takes an isolation level, `[NOT] DEFERRABLE` or an imported snapshot only
/// before a transaction's first query (after it, SQLSTATE `25001`: "must be called before any
/// query"), so the writes cannot set them: `SET TRANSACTION` with `ISOLATION LEVEL`, `[NOT]
/// DEFERRABLE` or `SNAPSHOT` among its modes (also written `SET LOCAL TRANSACTION` or `SET
/// SESSION TRANSACTION`), and `SET [LOCAL] transaction_isolation` or `transaction_deferrable`,
/// are refused before anything is sent, even an isolation level equal to the one in force
/// (which the server would take as a no-op). The transaction has the isolation level its
/// `BEGIN` gives it: the server's or role's `default_transaction_isolation`. `SET TRANSACTION
/// READ ONLY` runs (the statements after it may not write: a write then fails with `25006`, a
/// [`Error::Backend`]), and so does `SET TRANSACTION READ WRITE`, which changes nothing (the
/// completion has written) except after `READ ONLY`, where the server refuses it (`25001`,
/// below).
///
/// A statement naming a table or schema that does not exist (SQLSTATE `42P01`, which a table in
/// a missing schema also gives, or `3F000`) is [`Error::NotSetUp`] instead, naming the statement
/// and, in the server's message, the table: the database is not set up for the handler yet (a
/// consumer deployed before the migration that creates its table), so the message is retried
/// and goes through once the table exists, as on DynamoDB. Nothing is written and the record
/// stays in progress.
///
/// A privilege the store's role lacks (SQLSTATE `42501`, "permission denied for ...") is
/// [`Error::Backend`] naming the statement, wherever PostgreSQL checks it: most privileges are
/// checked when the statement runs, in the transaction (`INSERT`, `UPDATE`, `DELETE` or `SELECT`
/// on a table or column, `EXECUTE` on a function, `USAGE` on a sequence), so the statements
/// before it have run and are rolled back; `USAGE` on a schema the statement names is checked
/// when it is prepared, before the transaction. Nothing is written and the record stays in
/// progress, under the lease. Not [`Error::Unavailable`]: retrying alone does not help, the
/// operator grants the privilege, and a later delivery of the message goes through (Redis
/// answers an ACL denial the same way).
///
/// In the transaction, [`Error::EffectRefused`] with the statement's index (nothing is
/// written, the record stays in progress): a statement whose [`expect_rows`](Self::expect_rows)
/// condition fails, or that the database refuses because of the data: an integrity constraint
/// (class `23`: unique, check, foreign key, not null, exclusion), a data exception (class `22`:
/// a value out of range, a division by zero, ...), a program limit (class `54`: an index row too
/// large) or an exception raised by a trigger or function (class `P0`, `RAISE EXCEPTION`). A
/// constraint declared `DEFERRABLE INITIALLY DEFERRED` is checked at `COMMIT`: its refusal
/// carries the index [`len`](Self::len) (the commit). A statement that cannot run inside a
/// transaction, or not after its first query, in a way its text does not show (SQLSTATE
/// `25001`: `VACUUM`, `CREATE INDEX CONCURRENTLY`, `set_config('transaction_isolation', ...)`,
/// `READ WRITE` after `READ ONLY`) is [`Error::InvalidInput`] on `writes`, nothing written. Any
/// other error the server gives a statement is [`Error::Backend`] naming it.
///
/// Serialization failures, deadlocks, lock and statement timeouts and lost connections are
/// [`Error::Unavailable`] (retryable) and roll everything back.
///
/// # What the store cannot check
///
/// The statements run with the store's role, so they can reach what it can, its records table
/// included: a statement that deletes or changes idem's records (this key's or another's)
/// commits like any other, and a deleted record lets the next delivery run the effect again.
/// Keep business tables out of the store's schema and never name it in the writes. What else
/// outlives the transaction on the pooled connection is not seen either: a function that changes
/// a session setting (`set_config(name, value, false)`), a temporary table without `ON COMMIT
/// DROP`, a cursor `WITH HOLD`, and a session-level advisory lock (`pg_advisory_lock`,
/// `pg_advisory_lock_shared`, `pg_try_advisory_lock`, ...): neither the commit nor a rollback
/// releases it, so it stays held by the pooled connection while that connection serves other
/// calls or sits idle, until `pg_advisory_unlock` on that same connection or its close, and
/// every other session waiting for it waits until then. Take the transaction-level forms
/// (`pg_advisory_xact_lock`, `pg_advisory_xact_lock_shared`, `pg_try_advisory_xact_lock`, ...),
/// which the transaction's end releases.
#[derive(Clone, Default)]
pub struct PgWrites {
    pub(crate) statements: Vec<PgStatement>,
    /// A misuse of the builder (`expect_rows` before any statement), reported as
    /// [`Error::InvalidInput`] when the writes are sent.
    misuse: Option<&'static str>,
}

/// One statement of [`PgWrites`].
#[derive(Clone)]
pub(crate) struct PgStatement {
    pub(crate) sql: Cow<'static, str>,
    pub(crate) params: Vec<PgParam>,
    /// The row count the statement must report (rows affected, or returned by a query).
    pub(crate) expect_rows: Option<u64>,
}

impl fmt::Debug for PgWrites {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut list = f.debug_list();
        for s in &self.statements {
            list.entry(&format_args!(
                "{:?} with {} parameters{}",
                s.sql,
                s.params.len(),
                match s.expect_rows {
                    Some(n) => format!(", expecting {n} rows"),
                    None => String::new(),
                }
            ));
        }
        list.finish()
    }
}

impl PgWrites {
    /// No statements.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a statement: its SQL text with `$1..$n` placeholders, and the values bound to them
    /// (a tuple of up to 12 values, an array of values of one type, `()` for none, or a
    /// `Vec<PgParam>`).
    pub fn execute(mut self, sql: impl Into<Cow<'static, str>>, params: impl Params) -> Self {
        self.statements.push(PgStatement {
            sql: sql.into(),
            params: params.into_params(),
            expect_rows: None,
        });
        self
    }

    /// Makes the last statement added a condition: it must affect (for a query: return) exactly
    /// `rows` rows, or the whole completion is refused with [`Error::EffectRefused`] and
    /// nothing is written. For instance `UPDATE accounts SET balance = balance - $1 WHERE id = $2
    /// AND balance >= $1` with `expect_rows(1)`: the debit happens only if the balance covers it.
    ///
    /// The database cannot check a row count by itself within the transaction, so writes with a
    /// condition cost a second round trip: the client reads the counts, then sends `COMMIT`
    /// (see the [crate docs](crate#transactional-effects)).
    pub fn expect_rows(mut self, rows: u64) -> Self {
        match self.statements.last_mut() {
            Some(last) => last.expect_rows = Some(rows),
            None => self.misuse = Some("expect_rows was called before any statement was added"),
        }
        self
    }

    /// How many statements.
    pub fn len(&self) -> usize {
        self.statements.len()
    }

    /// Whether there are no statements (then `complete_with` is a plain `complete`).
    pub fn is_empty(&self) -> bool {
        self.statements.is_empty()
    }

    /// Whether any statement carries a row-count condition.
    pub(crate) fn has_conditions(&self) -> bool {
        self.statements.iter().any(|s| s.expect_rows.is_some())
    }

    /// The checks that need no server: count, texts, parameter counts.
    pub(crate) fn check(&self) -> Result<()> {
        if let Some(misuse) = self.misuse {
            return Err(invalid(misuse.to_owned()));
        }
        if self.statements.len() > MAX_WRITES {
            return Err(invalid(format!(
                "{} statements, over the limit of {MAX_WRITES}",
                self.statements.len()
            )));
        }
        for (i, s) in self.statements.iter().enumerate() {
            if skip_blank(&s.sql).is_empty() {
                return Err(invalid(format!("statement {i} is empty")));
            }
            if s.sql.contains('\0') {
                return Err(invalid(format!(
                    "statement {i} holds a NUL character, which PostgreSQL cannot take in a query \
                     text"
                )));
            }
            if s.params.len() > MAX_PARAMS {
                return Err(invalid(format!(
                    "statement {i} binds {} parameters, over the protocol's limit of {MAX_PARAMS}",
                    s.params.len()
                )));
            }
            if let Some(keyword) = transaction_control(&s.sql) {
                return Err(invalid(format!(
                    "statement {i} is a transaction-control statement ({keyword}), which would end \
                     or split the transaction the writes commit in"
                )));
            }
            if let Some(keyword) = late_transaction_setting(&s.sql) {
                return Err(invalid(format!(
                    "statement {i} is a {keyword} statement, which PostgreSQL accepts only before \
                     a transaction's first query (SQLSTATE 25001 after it): the completion's \
                     statement runs first in the transaction the writes commit in, so the writes \
                     cannot set its isolation level, deferrability or snapshot (SET TRANSACTION \
                     READ ONLY and READ WRITE they can)"
                )));
            }
            if let Some(keyword) = session_change(&s.sql) {
                return Err(invalid(format!(
                    "statement {i} is a {keyword} statement, which changes the session of the \
                     pooled connection the writes run on (every later call on it would inherit \
                     the change); for a setting of this transaction alone use SET LOCAL"
                )));
            }
        }
        Ok(())
    }
}

/// [`Error::InvalidInput`] on the field `writes`.
pub(crate) fn invalid(reason: String) -> Error {
    Error::invalid("writes", reason)
}

/// The transaction-control keyword `sql` starts with, if any (after white space and comments).
fn transaction_control(sql: &str) -> Option<&'static str> {
    let mut rest = skip_blank(sql);
    let first = word(rest);
    let keyword = match first.to_ascii_uppercase().as_str() {
        "BEGIN" => "BEGIN",
        "START" => "START TRANSACTION",
        "COMMIT" => "COMMIT",
        "END" => "END",
        "ROLLBACK" => "ROLLBACK",
        "ABORT" => "ABORT",
        "SAVEPOINT" => "SAVEPOINT",
        "RELEASE" => "RELEASE",
        "PREPARE" => {
            rest = skip_blank(&rest[first.len()..]);
            if word(rest).eq_ignore_ascii_case("TRANSACTION") {
                "PREPARE TRANSACTION"
            } else {
                return None;
            }
        }
        _ => return None,
    };
    Some(keyword)
}

/// The transaction characteristic `sql` sets (after white space, comments and empty statements)
/// if PostgreSQL takes it only before a transaction's first query, which the writes never run
/// before (the completion's statement runs first): `SET TRANSACTION` (also `SET LOCAL
/// TRANSACTION`, `SET SESSION TRANSACTION`) with an `ISOLATION LEVEL`, `[NOT] DEFERRABLE` or
/// `SNAPSHOT` among its modes, and `SET [LOCAL | SESSION] transaction_isolation` or
/// `transaction_deferrable`. `READ ONLY` and `READ WRITE` can be set at any point (`READ WRITE`
/// not after `READ ONLY`, which the server refuses when it runs). (`SET SESSION CHARACTERISTICS`
/// changes the session's defaults: [`session_change`] finds it.)
fn late_transaction_setting(sql: &str) -> Option<&'static str> {
    let rest = skip_blank(sql);
    let first = word(rest);
    if !first.eq_ignore_ascii_case("SET") {
        return None;
    }
    let mut rest = skip_blank(&rest[first.len()..]);
    let mut next = word(rest);
    // `SET LOCAL TRANSACTION` and `SET SESSION TRANSACTION` are `SET TRANSACTION`; `SET local.x`
    // names a setting `local.x`.
    if ["LOCAL", "SESSION"]
        .iter()
        .any(|scope| next.eq_ignore_ascii_case(scope))
        && !rest[next.len()..].starts_with('.')
    {
        rest = skip_blank(&rest[next.len()..]);
        next = word(rest);
    }
    if rest[next.len()..].starts_with('.') {
        return None;
    }
    match next.to_ascii_lowercase().as_str() {
        "transaction_isolation" => Some("SET transaction_isolation"),
        "transaction_deferrable" => Some("SET transaction_deferrable"),
        "transaction" => {
            // The modes, separated by commas or white space: `READ ONLY, ISOLATION LEVEL ...`.
            let mut modes = &rest[next.len()..];
            loop {
                modes = skip_blank(modes);
                if let Some(after) = modes.strip_prefix(',') {
                    modes = after;
                    continue;
                }
                let mode = word(modes);
                match mode.to_ascii_uppercase().as_str() {
                    "" => return None,
                    "ISOLATION" => return Some("SET TRANSACTION ISOLATION LEVEL"),
                    "DEFERRABLE" => return Some("SET TRANSACTION [NOT] DEFERRABLE"),
                    "SNAPSHOT" => return Some("SET TRANSACTION SNAPSHOT"),
                    _ => modes = &modes[mode.len()..],
                }
            }
        }
        _ => None,
    }
}

/// The statement kind `sql` starts with (after white space, comments and empty statements) if it
/// changes the connection's session beyond the transaction: a session setting (`SET` other than
/// `SET LOCAL`, `SET [SESSION] TRANSACTION` and `SET CONSTRAINTS`; `RESET`), a prepared statement of its
/// own or the pool's (`PREPARE`, `DEALLOCATE`), `DISCARD`, `LISTEN`, `UNLISTEN`, `LOAD`. The
/// pool hands the connection on as it is. (A function can still change a setting, such as
/// `set_config(name, value, false)`: the statement's text does not show it.)
fn session_change(sql: &str) -> Option<&'static str> {
    let first = word(skip_blank(sql));
    let keyword = match first.to_ascii_uppercase().as_str() {
        "SET" => {
            let after = skip_blank(&skip_blank(sql)[first.len()..]);
            let next = word(after);
            // `SET local.x = 1` names a setting `local.x`: a session one.
            let scoped = ["LOCAL", "TRANSACTION", "CONSTRAINTS"]
                .iter()
                .any(|scoped| next.eq_ignore_ascii_case(scoped))
                && !after[next.len()..].starts_with('.');
            // `SET SESSION TRANSACTION ...` is `SET TRANSACTION ...` (but `SET SESSION
            // CHARACTERISTICS AS TRANSACTION ...` sets the session's defaults).
            let scoped = scoped
                || next.eq_ignore_ascii_case("SESSION") && {
                    let then = skip_blank(&after[next.len()..]);
                    let then_word = word(then);
                    then_word.eq_ignore_ascii_case("TRANSACTION")
                        && !then[then_word.len()..].starts_with('.')
                };
            if scoped {
                return None;
            }
            "SET"
        }
        "RESET" => "RESET",
        "PREPARE" => "PREPARE",
        "DEALLOCATE" => "DEALLOCATE",
        "DISCARD" => "DISCARD",
        "LISTEN" => "LISTEN",
        "UNLISTEN" => "UNLISTEN",
        "LOAD" => "LOAD",
        _ => return None,
    };
    Some(keyword)
}

/// `sql` without its leading white space, comments (`-- ...` lines, nested `/* ... */`) and
/// empty statements (`;`, which PostgreSQL drops: `;COMMIT` is a `COMMIT`).
fn skip_blank(mut sql: &str) -> &str {
    loop {
        sql = sql.trim_start_matches(|c: char| c.is_whitespace() || c == ';');
        if let Some(rest) = sql.strip_prefix("--") {
            // PostgreSQL's lexer ends a line comment at either.
            sql = rest.find(['\n', '\r']).map_or("", |at| &rest[at..]);
        } else if sql.starts_with("/*") {
            let mut depth = 0usize;
            let mut i = 0;
            let bytes = sql.as_bytes();
            while i < bytes.len() {
                if bytes[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if bytes[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            sql = sql.get(i..).unwrap_or("");
        } else {
            return sql;
        }
    }
}

/// The leading identifier-like word of `sql`.
fn word(sql: &str) -> &str {
    let end = sql
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(sql.len());
    &sql[..end]
}

/// The values bound to one statement of [`PgWrites`]: tuples of up to 12 values, arrays of
/// values of one type, `()` for none, and `Vec<PgParam>`.
pub trait Params {
    /// The values, in the order of `$1..$n`.
    fn into_params(self) -> Vec<PgParam>;
}

impl Params for Vec<PgParam> {
    fn into_params(self) -> Vec<PgParam> {
        self
    }
}

impl Params for () {
    fn into_params(self) -> Vec<PgParam> {
        Vec::new()
    }
}

impl<T: ToSql + Send + Sync + 'static, const N: usize> Params for [T; N] {
    fn into_params(self) -> Vec<PgParam> {
        self.into_iter().map(param).collect()
    }
}

macro_rules! tuple_params {
    ($($name:ident)+) => {
        impl<$($name: ToSql + Send + Sync + 'static),+> Params for ($($name,)+) {
            #[allow(non_snake_case)]
            fn into_params(self) -> Vec<PgParam> {
                let ($($name,)+) = self;
                vec![$(param($name)),+]
            }
        }
    };
}

tuple_params!(A);
tuple_params!(A B);
tuple_params!(A B C);
tuple_params!(A B C D);
tuple_params!(A B C D E);
tuple_params!(A B C D E F);
tuple_params!(A B C D E F G);
tuple_params!(A B C D E F G H);
tuple_params!(A B C D E F G H I);
tuple_params!(A B C D E F G H I J);
tuple_params!(A B C D E F G H I J K);
tuple_params!(A B C D E F G H I J K L);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transaction_control_is_found_after_blanks_and_comments() {
        for (sql, found) in [
            ("COMMIT", Some("COMMIT")),
            ("  commit;", Some("COMMIT")),
            ("-- note\n  Rollback to savepoint x", Some("ROLLBACK")),
            ("/* a /* nested */ comment */ begin", Some("BEGIN")),
            ("start transaction", Some("START TRANSACTION")),
            ("END", Some("END")),
            ("abort", Some("ABORT")),
            ("SAVEPOINT s", Some("SAVEPOINT")),
            ("release s", Some("RELEASE")),
            ("prepare transaction 'x'", Some("PREPARE TRANSACTION")),
            ("PREPARE q AS SELECT 1", None),
            ("INSERT INTO t VALUES ($1)", None),
            ("UPDATE t SET committed = true", None),
            ("commitments", None),
            ("-- COMMIT\nSELECT 1", None),
            ("/* unterminated", None),
            ("", None),
            // Empty statements before it are dropped by the server.
            (";COMMIT", Some("COMMIT")),
            (" ; end", Some("END")),
            ("/*x*/;ROLLBACK", Some("ROLLBACK")),
            (";;commit", Some("COMMIT")),
            ("\n;\nABORT", Some("ABORT")),
            ("; BEGIN", Some("BEGIN")),
            ("-- c\n;\t/* d */ ; savepoint s", Some("SAVEPOINT")),
            ("INSERT INTO t VALUES (';COMMIT')", None),
            // A line comment ends at a carriage return too.
            ("-- x\rCOMMIT\nWORK", Some("COMMIT")),
            ("-- x\r\nrollback", Some("ROLLBACK")),
        ] {
            assert_eq!(transaction_control(sql), found, "{sql:?}");
        }
    }

    #[test]
    fn session_changes_are_found_and_transaction_scoped_settings_are_not() {
        for (sql, found) in [
            ("SET default_transaction_read_only = on", Some("SET")),
            ("; set search_path TO other", Some("SET")),
            ("SET SESSION AUTHORIZATION nobody", Some("SET")),
            ("set role nobody", Some("SET")),
            ("RESET ALL", Some("RESET")),
            ("PREPARE q AS SELECT 1", Some("PREPARE")),
            ("deallocate all", Some("DEALLOCATE")),
            ("DISCARD ALL", Some("DISCARD")),
            ("LISTEN c", Some("LISTEN")),
            ("unlisten *", Some("UNLISTEN")),
            ("LOAD 'x'", Some("LOAD")),
            ("SET LOCAL statement_timeout = 1000", None),
            ("/* c */ set local lock_timeout TO 5", None),
            ("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE", None),
            ("SET CONSTRAINTS ALL DEFERRED", None),
            ("settle", None),
            ("UPDATE t SET x = 1", None),
            ("SELECT set_config('a.b', 'c', true)", None),
            ("SET local.x = 1", Some("SET")),
            ("set transaction.x TO 1", Some("SET")),
            ("SET --\rsearch_path = \nlocal", Some("SET")),
            // The session's defaults for later transactions.
            (
                "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE",
                Some("SET"),
            ),
            (
                "/* c */ set session characteristics as transaction read only",
                Some("SET"),
            ),
            // `SET SESSION TRANSACTION` is `SET TRANSACTION`: this transaction alone.
            ("SET SESSION TRANSACTION READ ONLY", None),
            ("set session /* c */ transaction read write", None),
            ("SET SESSION transaction.x = 1", Some("SET")),
            ("SET SESSION statement_timeout = 1000", Some("SET")),
        ] {
            assert_eq!(session_change(sql), found, "{sql:?}");
        }
    }

    #[test]
    fn transaction_characteristics_set_too_late_are_found() {
        const ISOLATION: Option<&str> = Some("SET TRANSACTION ISOLATION LEVEL");
        const DEFERRABLE: Option<&str> = Some("SET TRANSACTION [NOT] DEFERRABLE");
        const SNAPSHOT: Option<&str> = Some("SET TRANSACTION SNAPSHOT");
        for (sql, found) in [
            ("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE", ISOLATION),
            ("set transaction isolation level read committed", ISOLATION),
            (
                "  Set  Transaction\n\tIsolation Level Repeatable Read",
                ISOLATION,
            ),
            (
                "/* a /* nested */ c */ SET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
                ISOLATION,
            ),
            (
                "-- note\r\nSET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
                ISOLATION,
            ),
            (";; SET TRANSACTION ISOLATION LEVEL SERIALIZABLE", ISOLATION),
            (
                "SET /* c */ TRANSACTION -- c\n ISOLATION LEVEL SERIALIZABLE",
                ISOLATION,
            ),
            // Among other modes, with or without commas.
            (
                "SET TRANSACTION READ ONLY, ISOLATION LEVEL SERIALIZABLE",
                ISOLATION,
            ),
            (
                "SET TRANSACTION READ WRITE,ISOLATION LEVEL SERIALIZABLE",
                ISOLATION,
            ),
            (
                "set transaction read only isolation level serializable",
                ISOLATION,
            ),
            ("SET TRANSACTION DEFERRABLE", DEFERRABLE),
            ("SET TRANSACTION NOT DEFERRABLE", DEFERRABLE),
            ("set transaction read only deferrable", DEFERRABLE),
            (
                "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE, READ ONLY, DEFERRABLE",
                ISOLATION,
            ),
            ("SET TRANSACTION SNAPSHOT '00000003-0000001B-1'", SNAPSHOT),
            ("set transaction snapshot $1", SNAPSHOT),
            // `SET LOCAL TRANSACTION` and `SET SESSION TRANSACTION` are `SET TRANSACTION`.
            (
                "SET LOCAL TRANSACTION ISOLATION LEVEL SERIALIZABLE",
                ISOLATION,
            ),
            ("set session transaction deferrable", DEFERRABLE),
            // The settings behind them.
            (
                "SET LOCAL transaction_isolation = 'serializable'",
                Some("SET transaction_isolation"),
            ),
            (
                "set transaction_isolation TO 'serializable'",
                Some("SET transaction_isolation"),
            ),
            (
                "SET SESSION Transaction_Isolation = DEFAULT",
                Some("SET transaction_isolation"),
            ),
            (
                "SET LOCAL transaction_deferrable = on",
                Some("SET transaction_deferrable"),
            ),
            // What can be set after a query.
            ("SET TRANSACTION READ ONLY", None),
            ("set transaction read write", None),
            ("SET LOCAL TRANSACTION READ ONLY", None),
            ("SET SESSION TRANSACTION READ WRITE", None),
            ("SET LOCAL transaction_read_only = on", None),
            // Not transaction characteristics.
            (
                "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE",
                None,
            ),
            ("SET CONSTRAINTS ALL DEFERRED", None),
            ("SET LOCAL statement_timeout = 1000", None),
            ("SET transaction.isolation = 'x'", None),
            ("SET LOCAL transaction.deferrable = 'x'", None),
            ("SET local.transaction_isolation = 'x'", None),
            ("SET transaction_isolation_x = 1", None),
            ("UPDATE t SET transaction = 'ISOLATION'", None),
            (
                "SELECT set_config('transaction_isolation', 'serializable', true)",
                None,
            ),
            (
                "-- SET TRANSACTION ISOLATION LEVEL SERIALIZABLE\nSELECT 1",
                None,
            ),
            ("/* SET TRANSACTION DEFERRABLE */ SELECT 1", None),
            ("settransaction isolation level serializable", None),
            ("SET TRANSACTION", None),
            ("", None),
        ] {
            assert_eq!(late_transaction_setting(sql), found, "{sql:?}");
        }
    }

    #[test]
    fn checks_before_sending() {
        let ok = PgWrites::new().execute("INSERT INTO t VALUES ($1, $2)", (1i64, "a"));
        assert!(ok.check().is_ok());
        assert_eq!(ok.statements[0].params.len(), 2);
        let reason = |w: PgWrites| match w.check() {
            Err(Error::InvalidInput {
                field: "writes",
                reason,
            }) => reason,
            other => panic!("expected InvalidInput on writes, got {other:?}"),
        };
        let many = (0..=MAX_WRITES).fold(PgWrites::new(), |w, i| {
            w.execute("INSERT INTO t VALUES ($1)", [i as i64])
        });
        assert!(reason(many).contains("over the limit of 100"));
        assert!(reason(PgWrites::new().execute(" \n", ())).contains("empty"));
        assert!(reason(PgWrites::new().execute("SELECT '\0'", ())).contains("NUL"));
        assert!(reason(PgWrites::new().execute("COMMIT", ())).contains("COMMIT"));
        let late = reason(
            PgWrites::new()
                .execute("INSERT INTO t VALUES ($1)", [1i64])
                .execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE", ()),
        );
        assert!(late.contains("statement 1"), "{late}");
        assert!(late.contains("ISOLATION LEVEL"), "{late}");
        assert!(late.contains("completion's statement runs first"), "{late}");
        assert!(
            reason(PgWrites::new().execute("SET TRANSACTION SNAPSHOT '1'", ()))
                .contains("SNAPSHOT")
        );
        // The session's defaults: a session setting.
        assert!(
            reason(PgWrites::new().execute(
                "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE",
                ()
            ))
            .contains("changes the session")
        );
        for fine in [
            "SET TRANSACTION READ ONLY",
            "SET TRANSACTION READ WRITE",
            "SET SESSION TRANSACTION READ ONLY",
        ] {
            assert!(PgWrites::new().execute(fine, ()).check().is_ok(), "{fine}");
        }
        assert!(reason(PgWrites::new().expect_rows(1)).contains("before any statement"));
        let wide: Vec<PgParam> = (0..=MAX_PARAMS).map(|_| param(0i32)).collect();
        assert!(reason(PgWrites::new().execute("SELECT 1", wide)).contains("65535"));
        assert!(!PgWrites::new().execute("SELECT 1", ()).has_conditions());
        assert!(
            PgWrites::new()
                .execute("SELECT 1", ())
                .expect_rows(1)
                .has_conditions()
        );
    }
}
