//! The crate-owned schema and its versioned migrations.

use idem_core::StateKind;

use crate::sql::Names;

/// One step of the schema's history. Steps are applied in order, each once, inside one
/// transaction that holds an advisory lock, so several processes can run
/// [`migrate`](crate::PostgresStore::migrate) at the same time. A step's text never changes
/// once released: databases record which versions they applied, not what the text was.
pub(crate) struct Migration {
    pub(crate) version: i32,
    pub(crate) description: &'static str,
    pub(crate) sql: fn(&Names) -> String,
}

/// Every migration this version of the crate knows, oldest first.
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "records table, token sequence, expiry index",
        sql: v1,
    },
    Migration {
        version: 2,
        description: "failure kind result_not_stored (state failed_result_not_stored)",
        sql: v2,
    },
    Migration {
        version: 3,
        description: "listing index (namespace, state, id)",
        sql: v3,
    },
];

/// The latest schema version this crate knows.
pub const SCHEMA_VERSION: u32 = 3;

/// `'in_progress', 'released', ...`: the `state` column's allowed values (the
/// [`StateKind::name`] of every state), as SQL literals.
fn state_list() -> String {
    StateKind::ALL
        .iter()
        .map(|s| format!("'{}'", s.name()))
        .collect::<Vec<_>>()
        .join(", ")
}

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

/// Version 2: the state `failed_result_not_stored` ([`FailureKind::ResultNotStored`]).
///
/// The `state` column keeps [`StateKind::name`], so a new failure kind is a new allowed value:
/// the v1 check constraint (named `<table>_state_check` by PostgreSQL) is replaced by one that
/// also allows it. The new constraint is added `NOT VALID`, so this step holds its exclusive lock
/// only for a catalog change and never scans the table: every existing row already satisfies it
/// (it allows a superset of v1's values), and new rows are checked as usual.
/// [`migrate`](crate::PostgresStore::migrate) then validates it after the commit, which scans the
/// table without blocking reads or writes (see [`validate_constraints`]).
///
/// [`FailureKind::ResultNotStored`]: idem_core::FailureKind::ResultNotStored
fn v2(n: &Names) -> String {
    let Names {
        qtable,
        qstate_check,
        ..
    } = n;
    format!(
        "ALTER TABLE {qtable} DROP CONSTRAINT {qstate_check},             ADD CONSTRAINT {qstate_check} CHECK (state IN ({states})) NOT VALID;",
        states = state_list()
    )
}

/// Version 3: the index the operator's listing reads, `(namespace, state, id COLLATE "C")`, so
/// that listing the records of one state (stuck, exhausted, failed) reads that part of the
/// index and never the whole table (see [`list`](idem_core::IdempotencyStore::list)).
///
/// Built inside the migration's transaction, which blocks writes to the table while the index
/// builds (seconds per million rows). To avoid that on a large table, create it beforehand with
/// `CREATE INDEX CONCURRENTLY "<table>_list_idx" ON "<schema>"."<table>" (namespace, state,
/// id COLLATE "C")`: this step then finds it and does nothing.
fn v3(n: &Names) -> String {
    format!(
        "CREATE INDEX IF NOT EXISTS {} ON {} (namespace, state, id COLLATE \"C\");",
        list_index(n),
        n.qtable
    )
}

/// `"table_list_idx"` (an index lives in its table's schema).
pub(crate) fn list_index(n: &Names) -> String {
    crate::config::quote(&format!("{}_list_idx", n.table))
}

/// Statements that validate the constraints migrations add `NOT VALID` (a table scan under a
/// `SHARE UPDATE EXCLUSIVE` lock, which lets reads and writes go on), run by
/// [`migrate`](crate::PostgresStore::migrate) after its transaction committed when the catalog
/// shows them not validated yet. Validating an already valid constraint changes nothing.
pub(crate) fn validate_constraints(n: &Names) -> Vec<(String, String)> {
    vec![(
        n.state_check.clone(),
        format!(
            "ALTER TABLE {} VALIDATE CONSTRAINT {}",
            n.qtable, n.qstate_check
        ),
    )]
}

/// The DDL of the latest schema for `schema`.`table`, as [`migrate`](crate::PostgresStore::migrate)
/// would create it on an empty database (without the migrations table): every migration in
/// order, then the validation of the constraints they add `NOT VALID`. For reviews and for teams
/// that apply schema changes with their own tooling (who then also record the versions, or never
/// call `migrate`).
pub fn ddl(schema: &str, table: &str) -> idem_core::Result<String> {
    crate::config::check_identifier("schema", schema, crate::config::MAX_SCHEMA_LEN)?;
    crate::config::check_identifier("table", table, crate::config::MAX_TABLE_LEN)?;
    let names = Names::new(schema, table);
    let mut out = format!("CREATE SCHEMA IF NOT EXISTS {};", names.qschema);
    for m in MIGRATIONS {
        out.push(' ');
        out.push_str(&(m.sql)(&names));
    }
    for (_, validate) in validate_constraints(&names) {
        out.push(' ');
        out.push_str(&validate);
        out.push(';');
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
    fnv1a(&format!("idem-postgres migrate {}.{}", n.schema, n.table))
}

/// The advisory key a migration holds while it creates the table's schema; taken after the
/// table's own key, never before it, so two migrations cannot wait on each other.
pub(crate) fn schema_advisory_key(n: &Names) -> i64 {
    fnv1a(&format!("idem-postgres schema {}", n.schema))
}

fn fnv1a(text: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_consecutive_and_end_at_schema_version() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.version as usize, i + 1, "{}", m.description);
        }
        assert_eq!(
            MIGRATIONS.last().map(|m| m.version as u32),
            Some(SCHEMA_VERSION)
        );
    }

    #[test]
    fn the_state_check_allows_every_state() {
        let sql = ddl("idem", "records").unwrap();
        let v2 = sql
            .lines()
            .find(|l| l.contains("ADD CONSTRAINT \"records_state_check\""))
            .unwrap_or_else(|| panic!("no v2 constraint in {sql}"));
        for state in StateKind::ALL {
            assert!(v2.contains(&format!("'{}'", state.name())), "{state}: {v2}");
        }
        assert!(
            sql.trim_end().ends_with(
                "ALTER TABLE \"idem\".\"records\" VALIDATE CONSTRAINT \"records_state_check\";"
            ),
            "{sql}"
        );
    }
}
