//! Connection, naming and timeout options of a [`PostgresStore`](crate::PostgresStore).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use idem_core::{Error, Limits, Result};

/// Default schema holding the table: `idem`.
pub const DEFAULT_SCHEMA: &str = "idem";
/// Default table name: `records`.
pub const DEFAULT_TABLE: &str = "records";
/// Longest schema name accepted, in bytes (PostgreSQL's identifier limit).
pub const MAX_SCHEMA_LEN: usize = 63;
/// Longest table name accepted, in bytes: the crate derives `<table>_token_seq`,
/// `<table>_migrations`, `<table>_expires_at_idx` and `<table>_state_check` from it, and each must fit PostgreSQL's
/// 63-byte identifier limit (PostgreSQL would silently truncate a longer one).
pub const MAX_TABLE_LEN: usize = 48;

/// Options of a [`PostgresStore`](crate::PostgresStore): where to connect, which schema and table
/// to use, pool size, and the timeouts that make a dead or overloaded server fail fast.
///
/// Built with [`PostgresConfig::new`] (a libpq-style URL or key/value string) or
/// [`PostgresConfig::from_pg_config`], then refined with the `with_*` methods. Schema and table
/// names are validated by [`PostgresStore::connect`](crate::PostgresStore::connect) (and by
/// [`PostgresConfig::validate`]).
///
/// ```
/// use std::time::Duration;
/// use idem_postgres::PostgresConfig;
///
/// let config = PostgresConfig::new("postgres://app@127.0.0.1:5432/payments")?
///     .with_schema("idem")
///     .with_table("orders_consumer")
///     .with_pool_size(32)
///     .with_lock_timeout(Duration::from_millis(500));
/// config.validate()?;
/// # Ok::<(), idem_core::Error>(())
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct PostgresConfig {
    /// The `tokio-postgres` connection settings (host, port, user, database, ...). No default:
    /// given to [`PostgresConfig::new`] or [`PostgresConfig::from_pg_config`]. Its
    /// `connect_timeout`, `application_name` and `options` are overwritten from this
    /// configuration when the store connects (`-c statement_timeout=...` is appended to
    /// `options`).
    pub pg: tokio_postgres::Config,
    /// Schema holding the table and its sequence (created by [`migrate`](crate::PostgresStore::migrate)
    /// when missing). Must match `^[a-z_][a-z0-9_]{0,62}$` and must not start with `pg_`.
    /// Default: [`DEFAULT_SCHEMA`] (`idem`).
    pub schema: String,
    /// Table name. Must match `^[a-z_][a-z0-9_]{0,47}$`. Default: [`DEFAULT_TABLE`]
    /// (`records`).
    pub table: String,
    /// Most connections the pool opens. Default: 16.
    pub pool_size: usize,
    /// Bound on opening one connection (TCP connect plus startup and authentication).
    /// Default: 3 s.
    pub connect_timeout: Duration,
    /// Bound on waiting for a free pooled connection. Default: 5 s.
    pub pool_wait_timeout: Duration,
    /// Server-side `statement_timeout` of every pooled connection (so it also applies to the
    /// business statements of [in-transaction mode](crate::transactional)). The client also gives up
    /// on any of the store's own statements after this plus one second, dropping the connection,
    /// so a server that stopped answering cannot hang a caller. Default: 5 s.
    pub statement_timeout: Duration,
    /// How long an acquire waits on a row lock held by another open transaction (a holder in
    /// in-transaction mode) before answering `InProgress` (and how long recording a failed
    /// transactional attempt waits before reporting it as not recorded). Must be shorter than
    /// [`statement_timeout`](Self::statement_timeout), or the statement timeout would cut the
    /// wait first and the duplicate would get `Unavailable` instead of `InProgress`.
    /// Default: 1 s.
    pub lock_timeout: Duration,
    /// `application_name` of the pooled connections, visible in `pg_stat_activity`. At most 63
    /// printable ASCII characters. Default: `idem`.
    pub application_name: String,
    /// [In-transaction mode](crate::transactional) only, in a transaction it opens itself
    /// ([`InTransaction::run`](crate::InTransaction::run)): the transaction's
    /// `idle_in_transaction_session_timeout` (set with `SET LOCAL`, so it lasts for that
    /// transaction only). When the handler leaves the transaction idle longer than this (it awaits
    /// something else with the transaction open, or the process hangs or loses the network), the
    /// server ends the session, which rolls the transaction back and frees the key, whatever the
    /// client does. Default: 10 s.
    pub transaction_idle_timeout: Duration,
    /// [In-transaction mode](crate::transactional) only: the bound on one whole call (the acquire,
    /// the handler, the completion and the commit). Past it the handler's future is dropped, the
    /// running statement, if any, is cancelled, the transaction is rolled back (the connection is
    /// closed, or, in a transaction you opened, rolled back to the mode's savepoint), the key is
    /// free again and the attempt is recorded as a retryable failure. Default: 30 s.
    pub transaction_timeout: Duration,
    /// Size limits for results and error messages. Default: [`Limits::default`].
    pub limits: Limits,
    #[cfg(feature = "tls")]
    pub(crate) tls: Option<std::sync::Arc<rustls::ClientConfig>>,
}

impl fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("PostgresConfig");
        // tokio_postgres::Config's Debug redacts the password.
        d.field("pg", &self.pg)
            .field("schema", &self.schema)
            .field("table", &self.table)
            .field("pool_size", &self.pool_size)
            .field("connect_timeout", &self.connect_timeout)
            .field("pool_wait_timeout", &self.pool_wait_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("lock_timeout", &self.lock_timeout)
            .field("application_name", &self.application_name)
            .field("transaction_idle_timeout", &self.transaction_idle_timeout)
            .field("transaction_timeout", &self.transaction_timeout)
            .field("limits", &self.limits);
        #[cfg(feature = "tls")]
        d.field("tls", &self.tls.is_some());
        d.finish()
    }
}

impl PostgresConfig {
    /// Parses a connection string: a URL (`postgres://user@host:port/db`) or libpq key/value
    /// pairs (`host=... user=... dbname=...`), with every other option at its default.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] with field `url` when it does not parse.
    pub fn new(url: &str) -> Result<Self> {
        let pg = tokio_postgres::Config::from_str(url).map_err(|e| {
            // tokio-postgres says "invalid connection string" and names what is wrong (an
            // unknown option, a bad value) in the error's source.
            let why = std::error::Error::source(&e).map_or(String::new(), |s| format!(": {s}"));
            Error::invalid(
                "url",
                format!("not a PostgreSQL connection string: {e}{why}"),
            )
        })?;
        Ok(Self::from_pg_config(pg))
    }

    /// Uses already-built `tokio-postgres` settings, with every other option at its default.
    pub fn from_pg_config(pg: tokio_postgres::Config) -> Self {
        Self {
            pg,
            schema: DEFAULT_SCHEMA.to_owned(),
            table: DEFAULT_TABLE.to_owned(),
            pool_size: 16,
            connect_timeout: Duration::from_secs(3),
            pool_wait_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(5),
            lock_timeout: Duration::from_secs(1),
            application_name: "idem".to_owned(),
            transaction_idle_timeout: Duration::from_secs(10),
            transaction_timeout: Duration::from_secs(30),
            limits: Limits::default(),
            #[cfg(feature = "tls")]
            tls: None,
        }
    }

    /// Sets the schema.
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Sets the table name.
    pub fn with_table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Sets the pool size.
    pub fn with_pool_size(mut self, size: usize) -> Self {
        self.pool_size = size;
        self
    }

    /// Sets the connect timeout.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets how long to wait for a free pooled connection.
    pub fn with_pool_wait_timeout(mut self, timeout: Duration) -> Self {
        self.pool_wait_timeout = timeout;
        self
    }

    /// Sets the statement timeout.
    pub fn with_statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// Sets the lock timeout of acquires.
    pub fn with_lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout;
        self
    }

    /// Sets the `application_name` of pooled connections.
    pub fn with_application_name(mut self, name: impl Into<String>) -> Self {
        self.application_name = name.into();
        self
    }

    /// Sets the `idle_in_transaction_session_timeout` of the transactions the in-transaction mode
    /// opens.
    pub fn with_transaction_idle_timeout(mut self, timeout: Duration) -> Self {
        self.transaction_idle_timeout = timeout;
        self
    }

    /// Sets the bound on one whole in-transaction call.
    pub fn with_transaction_timeout(mut self, timeout: Duration) -> Self {
        self.transaction_timeout = timeout;
        self
    }

    /// Sets the size limits.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Connects with TLS (rustls) using `tls`; the `sslmode` of the connection string decides
    /// whether TLS is required (`require`) or only preferred (`prefer`, the default).
    #[cfg(feature = "tls")]
    pub fn with_tls(mut self, tls: rustls::ClientConfig) -> Self {
        self.tls = Some(std::sync::Arc::new(tls));
        self
    }

    /// Connects with TLS, trusting the Mozilla root certificates bundled by `webpki-roots`
    /// and requiring TLS (`sslmode=require`).
    #[cfg(feature = "tls")]
    pub fn with_tls_webpki_roots(self) -> Self {
        let mut this = self.with_tls(crate::tls::webpki_client_config());
        this.pg.ssl_mode(tokio_postgres::config::SslMode::Require);
        this
    }

    /// Checks names, sizes and timeouts.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] naming the field: `schema`, `table`, `pool_size`,
    /// `connect_timeout`, `pool_wait_timeout`, `statement_timeout`, `lock_timeout` (also when it
    /// is not shorter than `statement_timeout`), `transaction_idle_timeout`,
    /// `transaction_timeout` or `application_name`.
    pub fn validate(&self) -> Result<()> {
        check_identifier("schema", &self.schema, MAX_SCHEMA_LEN)?;
        if self.schema.starts_with("pg_") {
            return Err(Error::invalid(
                "schema",
                "names starting with pg_ are reserved by PostgreSQL",
            ));
        }
        check_identifier("table", &self.table, MAX_TABLE_LEN)?;
        if self.pool_size == 0 {
            return Err(Error::invalid("pool_size", "must be at least 1"));
        }
        for (field, d) in [
            ("connect_timeout", self.connect_timeout),
            ("pool_wait_timeout", self.pool_wait_timeout),
            ("statement_timeout", self.statement_timeout),
            ("lock_timeout", self.lock_timeout),
            ("transaction_idle_timeout", self.transaction_idle_timeout),
            ("transaction_timeout", self.transaction_timeout),
        ] {
            if d < Duration::from_millis(1) || d > Duration::from_secs(24 * 3600) {
                return Err(Error::invalid(
                    field,
                    format!("is {d:?}; it must be between 1ms and 24h"),
                ));
            }
        }
        if self.lock_timeout >= self.statement_timeout {
            return Err(Error::invalid(
                "lock_timeout",
                format!(
                    "is {:?}; it must be shorter than statement_timeout ({:?}), so that a wait \
                     on a key held by an open transaction ends in InProgress, not in a \
                     statement timeout",
                    self.lock_timeout, self.statement_timeout
                ),
            ));
        }
        if self.application_name.len() > 63
            || !self
                .application_name
                .chars()
                .all(|c| c.is_ascii_graphic() || c == ' ')
        {
            return Err(Error::invalid(
                "application_name",
                "must be at most 63 printable ASCII characters",
            ));
        }
        Ok(())
    }
}

/// Checks a schema or table name: `^[a-z_][a-z0-9_]*$`, 1 to `max` bytes.
///
/// Names are also double-quoted wherever they appear in SQL, so this is a second line of defence:
/// only names that need no quoting at all are accepted, which keeps them readable in `psql` too.
pub(crate) fn check_identifier(field: &'static str, name: &str, max: usize) -> Result<()> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !first_ok || !rest_ok || name.len() > max {
        return Err(Error::invalid(
            field,
            format!(
                "{name:?} is not a plain identifier: use 1 to {max} characters of a-z, 0-9 and _, \
                 not starting with a digit"
            ),
        ));
    }
    Ok(())
}

/// Double-quotes an identifier already checked by [`check_identifier`].
pub(crate) fn quote(name: &str) -> String {
    debug_assert!(!name.contains('"'));
    format!("\"{name}\"")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_string_that_does_not_parse_says_why() {
        let e = PostgresConfig::new("postgres://u@127.0.0.1/db?colour=blue").unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(e, Error::InvalidInput { field: "url", .. })
                && text.contains("unknown option `colour`"),
            "{text}"
        );
    }

    #[test]
    fn identifiers() {
        for ok in ["idem", "_x", "a1_b2", &"a".repeat(48)] {
            assert!(check_identifier("table", ok, MAX_TABLE_LEN).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "1abc",
            "Abc",
            "a-b",
            "a b",
            "a\"b",
            "a;drop table x",
            "ä",
            "a$1",
            &"a".repeat(49),
        ] {
            let r = check_identifier("table", bad, MAX_TABLE_LEN);
            assert!(
                matches!(r, Err(Error::InvalidInput { field: "table", .. })),
                "{bad:?}: {r:?}"
            );
        }
    }

    #[test]
    fn config_validation() {
        let c = PostgresConfig::new("postgres://u@127.0.0.1:5432/db").unwrap();
        assert!(c.validate().is_ok());
        let r = c.clone().with_schema("pg_catalog").validate();
        assert!(
            matches!(
                r,
                Err(Error::InvalidInput {
                    field: "schema",
                    ..
                })
            ),
            "{r:?}"
        );
        let r = c.clone().with_pool_size(0).validate();
        assert!(
            matches!(
                r,
                Err(Error::InvalidInput {
                    field: "pool_size",
                    ..
                })
            ),
            "{r:?}"
        );
        for (lock, statement) in [(5_000, 5_000), (6_000, 5_000)] {
            let r = c
                .clone()
                .with_lock_timeout(Duration::from_millis(lock))
                .with_statement_timeout(Duration::from_millis(statement))
                .validate();
            assert!(
                matches!(
                    r,
                    Err(Error::InvalidInput {
                        field: "lock_timeout",
                        ..
                    })
                ),
                "{lock} {statement}: {r:?}"
            );
        }
        assert!(
            c.clone()
                .with_lock_timeout(Duration::from_millis(4_999))
                .with_statement_timeout(Duration::from_millis(5_000))
                .validate()
                .is_ok()
        );
        let r = c.with_lock_timeout(Duration::ZERO).validate();
        assert!(
            matches!(
                r,
                Err(Error::InvalidInput {
                    field: "lock_timeout",
                    ..
                })
            ),
            "{r:?}"
        );
        let r = PostgresConfig::new("postgres://[bad");
        assert!(
            matches!(r, Err(Error::InvalidInput { field: "url", .. })),
            "{r:?}"
        );
    }
}
