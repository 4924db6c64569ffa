//! Mapping driver and pool errors onto [`idem_core::Error`].

use std::error::Error as _;
use std::io;
use std::time::Duration;

use deadpool_postgres::{PoolError, TimeoutType};
use idem_core::Error;
use tokio_postgres::error::SqlState;

use crate::schema::SCHEMA_VERSION;
use crate::sql::Names;

pub(crate) const STORE: &str = "postgres";

/// SQLSTATEs after which the same operation may succeed later: the store was busy, restarting or
/// unreachable, or the transaction lost a race. They become [`Error::Unavailable`].
///
/// - `40001` serialization failure, `40P01` deadlock, `40003` statement completion unknown
/// - `55P03` lock not available (lock timeout), `57014` query canceled (statement timeout)
/// - `57P01` admin shutdown (also `pg_terminate_backend`), `57P02` crash shutdown,
///   `57P03` cannot connect now, `57P05` idle session timeout
/// - `25P03` idle-in-transaction timeout
/// - class `08` connection exceptions, class `53` insufficient resources (`53300` too many
///   connections, disk full, out of memory)
pub(crate) fn is_retryable_state(code: &SqlState) -> bool {
    let c = code.code();
    matches!(
        c,
        "40001"
            | "40P01"
            | "40003"
            | "55P03"
            | "57014"
            | "57P01"
            | "57P02"
            | "57P03"
            | "57P05"
            | "25P03"
    ) || c.starts_with("08")
        || c.starts_with("53")
}

/// Whether a driver error means the connection (rather than the statement) failed: closed,
/// I/O error, connect failure or timeout.
pub(crate) fn is_connection_error(e: &tokio_postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    if e.as_db_error().is_some() {
        return false;
    }
    let mut source = e.source();
    while let Some(s) = source {
        if s.is::<io::Error>() {
            return true;
        }
        source = s.source();
    }
    // tokio-postgres' own timeout kind has no public accessor.
    e.to_string().contains("timeout")
}

/// Maps a driver error: retryable SQLSTATEs and connection failures are
/// [`Error::Unavailable`], everything else [`Error::Backend`]; the driver error stays the source.
pub(crate) fn map_pg(e: tokio_postgres::Error) -> Error {
    let retryable = match e.code() {
        Some(code) => is_retryable_state(code),
        None => is_connection_error(&e),
    };
    if retryable {
        Error::unavailable(STORE, e)
    } else {
        Error::backend(STORE, e)
    }
}

/// Maps an error of one of the store's own statements: a missing schema, table, sequence or
/// column, or a table from before the latest schema version, is [`Error::NotSetUp`] naming the
/// table and how to set it up; everything else as [`map_pg`].
///
/// Only for the statements the store writes itself: a business statement of in-transaction mode
/// may miss a table of its own, which says nothing about the store's.
pub(crate) fn map_store_pg(e: tokio_postgres::Error, names: &Names) -> Error {
    not_set_up(&e, names).unwrap_or_else(|| map_pg(e))
}

/// [`Error::NotSetUp`] when `e` says the store's schema is missing or out of date.
///
/// - `3F000` invalid schema name (the schema does not exist)
/// - `42P01` undefined table (the table or its token sequence does not exist)
/// - `42703` undefined column (a column a later schema version added is missing)
/// - `23514` check violation of `<table>_state_check`: the table is at schema version 1, whose
///   check does not allow the state `failed_result_not_stored` (version 2)
fn not_set_up(e: &tokio_postgres::Error, names: &Names) -> Option<Error> {
    let db = e.as_db_error()?;
    let code = db.code();
    let missing = if [
        SqlState::INVALID_SCHEMA_NAME,
        SqlState::UNDEFINED_TABLE,
        SqlState::UNDEFINED_COLUMN,
    ]
    .contains(code)
    {
        format!("table {} (PostgreSQL says: {})", names.qtable, db.message())
    } else if *code == SqlState::CHECK_VIOLATION
        && db.constraint() == Some(names.state_check.as_str())
    {
        format!(
            "schema version {SCHEMA_VERSION} of table {} (the table predates it: its \
             constraint {} refused a state this version of idem-postgres writes)",
            names.qtable, names.qstate_check
        )
    } else {
        return None;
    };
    Some(Error::not_set_up(STORE, missing, fix(names)))
}

/// How to set the schema up, for [`Error::NotSetUp`].
pub(crate) fn fix(names: &Names) -> String {
    format!(
        "run PostgresStore::migrate() once (at deploy time or start-up) to create or upgrade it, \
         or apply the SQL of idem_postgres::ddl(\"{}\", \"{}\") with your own migration tool",
        names.schema, names.table
    )
}

/// Maps a pool error: timeouts, a closed pool and connection failures are
/// [`Error::Unavailable`]; a timeout says which bound ran out (`wait`: the pool's wait for a
/// free connection; `connect`: opening or checking one), as [`Error::timed_out`] does.
pub(crate) fn map_pool(e: PoolError, wait: Duration, connect: Duration) -> Error {
    match e {
        PoolError::Backend(e) => map_pg(e),
        PoolError::Timeout(TimeoutType::Wait) => Error::timed_out(STORE, wait),
        PoolError::Timeout(TimeoutType::Create | TimeoutType::Recycle) => {
            Error::timed_out(STORE, connect)
        }
        PoolError::Closed => Error::unavailable(STORE, e),
        PoolError::PostCreateHook(_) | PoolError::NoRuntimeSpecified => Error::backend(STORE, e),
    }
}

/// The SQLSTATE behind a store error, if any.
pub(crate) fn sqlstate(e: &Error) -> Option<&SqlState> {
    let (Error::Unavailable { source, .. } | Error::Backend { source, .. }) = e else {
        return None;
    };
    source
        .downcast_ref::<tokio_postgres::Error>()
        .and_then(tokio_postgres::Error::code)
}

/// A store statement (a single statement, its own transaction) that lost to a concurrent writer
/// of its row under a stricter `default_transaction_isolation` than `READ COMMITTED` (`40001`,
/// "could not serialize access due to concurrent update"): it changed nothing, and run again it
/// takes a new snapshot that sees the writer's row, answering as under `READ COMMITTED` (a
/// racing acquire `InProgress`, not a store error).
pub(crate) fn is_serialization_failure(e: &Error) -> bool {
    sqlstate(e).is_some_and(|c| *c == SqlState::T_R_SERIALIZATION_FAILURE)
}

/// `22P05`: a text parameter has a character the database's encoding cannot hold (a database
/// in `LATIN1` given `支`). The client always sends UTF-8; the server converts.
pub(crate) fn is_untranslatable(e: &Error) -> bool {
    sqlstate(e) == Some(&SqlState::UNTRANSLATABLE_CHARACTER)
}

/// The [`Error::InvalidInput`] on `field` for a text the database's encoding cannot hold,
/// keeping the server's words.
pub(crate) fn untranslatable(field: &'static str, e: &Error) -> Error {
    Error::invalid(
        field,
        format!("the database's encoding cannot hold it ({e}); a UTF8 database holds every text"),
    )
}

/// Acquire kept seeing the record change under it (a pathological write storm on one key).
#[derive(Debug, thiserror::Error)]
#[error("the record changed concurrently {0} times in a row; try again")]
pub struct Contention(pub u32);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_timeouts_name_the_bound_that_ran_out() {
        let (wait, connect) = (Duration::from_millis(700), Duration::from_secs(3));
        for (kind, after) in [
            (TimeoutType::Wait, wait),
            (TimeoutType::Create, connect),
            (TimeoutType::Recycle, connect),
        ] {
            match map_pool(PoolError::Timeout(kind), wait, connect) {
                Error::Unavailable { source, .. } => {
                    let timed_out = source
                        .downcast_ref::<idem_core::TimedOut>()
                        .unwrap_or_else(|| panic!("{kind:?}: {source}"));
                    assert_eq!(timed_out.after, after, "{kind:?}");
                }
                other => panic!("{kind:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn retryable_states() {
        for c in [
            SqlState::T_R_SERIALIZATION_FAILURE,
            SqlState::T_R_DEADLOCK_DETECTED,
            SqlState::LOCK_NOT_AVAILABLE,
            SqlState::QUERY_CANCELED,
            SqlState::ADMIN_SHUTDOWN,
            SqlState::CONNECTION_FAILURE,
            SqlState::TOO_MANY_CONNECTIONS,
            SqlState::CANNOT_CONNECT_NOW,
        ] {
            assert!(is_retryable_state(&c), "{c:?}");
        }
        for c in [
            SqlState::UNIQUE_VIOLATION,
            SqlState::SYNTAX_ERROR,
            SqlState::UNDEFINED_TABLE,
            SqlState::INSUFFICIENT_PRIVILEGE,
            SqlState::CHECK_VIOLATION,
        ] {
            assert!(!is_retryable_state(&c), "{c:?}");
        }
    }
}
