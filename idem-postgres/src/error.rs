//! Mapping driver and pool errors onto [`idem_core::Error`].

use std::error::Error as _;
use std::io;

use deadpool_postgres::PoolError;
use idem_core::Error;
use tokio_postgres::error::SqlState;

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

/// Maps a pool error: timeouts, a closed pool and connection failures are
/// [`Error::Unavailable`].
pub(crate) fn map_pool(e: PoolError) -> Error {
    match e {
        PoolError::Backend(e) => map_pg(e),
        PoolError::Timeout(_) | PoolError::Closed => Error::unavailable(STORE, e),
        PoolError::PostCreateHook(_) | PoolError::NoRuntimeSpecified => Error::backend(STORE, e),
    }
}

/// The client gave up on a statement (the server did not answer within the statement timeout
/// plus a margin).
#[derive(Debug, thiserror::Error)]
#[error("no answer from PostgreSQL within {0:?}; the connection was dropped")]
pub struct ClientTimeout(pub std::time::Duration);

/// Acquire kept seeing the record change under it (a pathological write storm on one key).
#[derive(Debug, thiserror::Error)]
#[error("the record changed concurrently {0} times in a row; try again")]
pub struct Contention(pub u32);

#[cfg(test)]
mod tests {
    use super::*;

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
