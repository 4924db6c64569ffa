//! The crate-owned schema and its versioned migrations.

use crate::sql::Names;

/// One step of the schema's history. Steps are applied in order, each once, inside one
/// transaction that holds an advisory lock, so several processes can run
/// [`migrate`](crate::PostgresStore::migrate) at the same time.
pub(crate) struct Migration {
    pub(crate) version: i32,
    pub(crate) description: &'static str,
    pub(crate) sql: fn(&Names) -> String,
}

/// Every migration this version of the crate knows, oldest first.
pub(crate) const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    description: "records table, token sequence, expiry index",
    sql: v1,
}];

/// The latest schema version this crate knows.
pub const SCHEMA_VERSION: u32 = 1;

fn v1(n: &Names) -> String {
    let Names {
        qtable,
        qseq,
        qindex,
        ..
    } = n;
    format!(
        "CREATE SEQUENCE IF NOT EXISTS {qseq} AS bigint MINVALUE 1 NO CYCLE; \
         CREATE TABLE IF NOT EXISTS {qtable} (\
            namespace        text        NOT NULL, \
            id               text        NOT NULL, \
            state            text        NOT NULL CHECK (state IN ('in_progress', 'released', \
                                            'completed', 'failed_retryable', 'failed_terminal')), \
            fingerprint      bytea       CHECK (octet_length(fingerprint) = 32), \
            token            bigint      NOT NULL CHECK (token > 0), \
            owner            text        NOT NULL, \
            attempts         integer     NOT NULL CHECK (attempts >= 0), \
            lease_expires_at timestamptz CHECK ((state = 'in_progress') = (lease_expires_at IS NOT NULL)), \
            result           bytea       CHECK ((state = 'completed') = (result IS NOT NULL)), \
            error            text        CHECK ((state LIKE 'failed%') = (error IS NOT NULL)), \
            created_at       timestamptz NOT NULL, \
            updated_at       timestamptz NOT NULL, \
            expires_at       timestamptz CHECK ((state IN ('in_progress', 'released')) = (expires_at IS NULL)), \
            PRIMARY KEY (namespace, id)); \
         CREATE INDEX IF NOT EXISTS {qindex} ON {qtable} (expires_at) WHERE expires_at IS NOT NULL;"
    )
}

/// The DDL of the latest schema for `schema`.`table`, as [`migrate`](crate::PostgresStore::migrate)
/// would create it on an empty database (without the migrations table); for reviews and for
/// teams that apply schema changes with their own tooling.
pub fn ddl(schema: &str, table: &str) -> idem_core::Result<String> {
    crate::config::check_identifier("schema", schema, crate::config::MAX_SCHEMA_LEN)?;
    crate::config::check_identifier("table", table, crate::config::MAX_TABLE_LEN)?;
    let names = Names::new(schema, table);
    let mut out = format!("CREATE SCHEMA IF NOT EXISTS {};", names.qschema);
    for m in MIGRATIONS {
        out.push(' ');
        out.push_str(&(m.sql)(&names));
    }
    Ok(out.replace("; ", ";\n"))
}

/// The migrations bookkeeping table.
pub(crate) fn migrations_table(n: &Names) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {} (\
            version     integer     PRIMARY KEY, \
            description text        NOT NULL, \
            applied_at  timestamptz NOT NULL DEFAULT now())",
        n.qmigrations
    )
}

/// A stable 64-bit key for `pg_advisory_xact_lock`, derived from the table's qualified name
/// (FNV-1a, so it is the same in every process and every build).
pub(crate) fn advisory_key(n: &Names) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in format!("idem-postgres migrate {}.{}", n.schema, n.table).bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h as i64
}

/// What [`migrate`](crate::PostgresStore::migrate) did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationReport {
    /// Versions applied by this call, oldest first (empty when the schema was up to date).
    pub applied: Vec<u32>,
    /// The schema version after the call.
    pub version: u32,
}
