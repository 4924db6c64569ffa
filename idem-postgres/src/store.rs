//! [`PostgresStore`]: the [`IdempotencyStore`] on PostgreSQL.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use idem_core::machine::{self, AcquireDecision};
use idem_core::{
    AcquireOutcome, AcquireRequest, Completion, Error, Failure, FailureKind, FencingToken,
    Fingerprint, IdempotencyKey, IdempotencyStore, Lease, Limits, ListQuery, Page, Record,
    RecordState, Result, StateKind, check_lease_ttl,
};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Row, Statement};

use crate::batch::BatchSql;
use crate::config::PostgresConfig;
use crate::error::{
    Contention, STORE, is_serialization_failure, is_untranslatable, map_pg, map_pool, map_store_pg,
    untranslatable,
};
use crate::schema::{
    MIGRATIONS, MigrationReport, advisory_key, migrations_table, schema_advisory_key,
    validate_constraints,
};
use crate::sql::{Names, Sql, Stmt};

/// How many times one call re-runs its statement when the record changed between the
/// statement's snapshot and its row lock (see the crate docs, "Round trips").
pub(crate) const MAX_ROUNDS: u32 = 16;

/// The owner reported in [`AcquireOutcome::InProgress`] when the key is held by a transaction that
/// has not committed yet (a holder in in-transaction mode): its record is not visible, so its
/// owner is not known.
pub const UNCOMMITTED_OWNER: &str = "(uncommitted transaction)";

/// Which statement [`PostgresStore::statement_sql`] shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transition {
    /// `acquire`
    Acquire,
    /// `extend`
    Extend,
    /// `complete`
    Complete,
    /// `fail`
    Fail,
    /// `release`
    Release,
    /// `get`
    Get,
    /// `delete`
    Delete,
    /// `purge_expired`
    Purge,
}

/// The idempotency store on PostgreSQL: one table, one statement per transition.
///
/// Cheap to clone (the pool is shared). See the [crate docs](crate) for the table layout, the
/// clock, the SQL of each transition and [in-transaction mode](crate::transactional).
#[derive(Clone)]
pub struct PostgresStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) pool: Pool,
    pub(crate) names: Names,
    pub(crate) sql: Sql,
    /// The listing statement (see `list.rs`).
    pub(crate) list: Stmt,
    /// The batch statements (`batch.rs`).
    pub(crate) batch: BatchSql,
    pub(crate) config: PostgresConfig,
    /// `lock_timeout` value passed to acquire, in milliseconds.
    pub(crate) lock_timeout_ms: String,
    /// Client-side bound on one of the store's own statements.
    pub(crate) op_timeout: Duration,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.inner.names.qtable)
            .field("config", &self.inner.config)
            .field("pool", &self.inner.pool.status())
            .finish()
    }
}

impl PostgresStore {
    /// Builds a store from `config`: validates it and creates the connection pool. Connections
    /// are opened lazily, so this does not touch the network; the first operation on an
    /// unreachable server fails with [`Error::Unavailable`] within `connect_timeout`.
    ///
    /// Run [`migrate`](Self::migrate) once (at deploy time or start-up) before using the store.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad configuration (see [`PostgresConfig::validate`]),
    /// [`Error::Backend`] when the pool cannot be built.
    pub async fn connect(config: PostgresConfig) -> Result<Self> {
        config.validate()?;
        let mut pg = config.pg.clone();
        pg.connect_timeout(config.connect_timeout);
        pg.application_name(&config.application_name);
        let statement_ms = config.statement_timeout.as_millis();
        let options = match pg.get_options() {
            Some(existing) if !existing.is_empty() => {
                format!("{existing} -c statement_timeout={statement_ms}")
            }
            _ => format!("-c statement_timeout={statement_ms}"),
        };
        pg.options(options);
        let manager_config = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let manager = make_manager(pg, &config, manager_config);
        let pool = Pool::builder(manager)
            .max_size(config.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(config.pool_wait_timeout))
            .create_timeout(Some(config.connect_timeout))
            .recycle_timeout(Some(config.connect_timeout))
            .build()
            .map_err(|e| Error::backend(STORE, e))?;
        let names = Names::new(&config.schema, &config.table);
        let sql = Sql::new(&names);
        let batch = BatchSql::new(&names);
        Ok(Self {
            inner: Arc::new(Inner {
                pool,
                sql,
                list: crate::list::statement(&names),
                batch,
                names,
                lock_timeout_ms: config.lock_timeout.as_millis().to_string(),
                op_timeout: config.statement_timeout + Duration::from_secs(1),
                config,
            }),
        })
    }

    /// Creates or upgrades the schema: the schema itself when missing, the records table, the
    /// token sequence, the index the sweeper uses, and a `<table>_migrations` table recording
    /// which versions were applied. Safe to run concurrently from several processes (an advisory
    /// lock serializes them) and to run again (it applies only what is missing). A table created
    /// by an older version of the crate is upgraded in place; see the crate docs, "Schema
    /// versions".
    ///
    /// # Errors
    /// [`Error::Unavailable`] or [`Error::Backend`] from the server (for instance missing
    /// privileges); [`Error::Backend`] when the database holds a schema version newer than this
    /// crate knows.
    pub async fn migrate(&self) -> Result<MigrationReport> {
        // Every statement has the server-side statement timeout; this bounds the whole against a
        // server that stopped answering.
        let limit = self.inner.op_timeout * 10;
        let report = tokio::time::timeout(limit, self.migrate_unbounded())
            .await
            .map_err(|_| Error::timed_out(STORE, limit))??;
        tokio::time::timeout(limit, self.validate_constraints())
            .await
            .map_err(|_| Error::timed_out(STORE, limit))??;
        Ok(report)
    }

    /// Validates the constraints migrations added `NOT VALID` (see `schema.rs`), each only when
    /// the catalog shows it not validated yet, after the migration committed: the scan runs
    /// under a lock that lets reads and writes go on. If it is interrupted, the next `migrate`
    /// finishes it; meanwhile the constraint already checks every new row.
    async fn validate_constraints(&self) -> Result<()> {
        let n = &self.inner.names;
        let client = self.conn().await?;
        for (name, validate) in validate_constraints(n) {
            let pending = client
                .query_opt(
                    "SELECT 1 FROM pg_catalog.pg_constraint \
                     WHERE conrelid = $1::text::regclass AND conname = $2::text \
                        AND NOT convalidated",
                    &[&n.qtable, &name],
                )
                .await
                .map_err(map_pg)?
                .is_some();
            if pending {
                client.batch_execute(&validate).await.map_err(map_pg)?;
                tracing::info!(table = %n.qtable, constraint = %name, "idem-postgres constraint validated");
            }
        }
        Ok(())
    }

    async fn migrate_unbounded(&self) -> Result<MigrationReport> {
        let n = &self.inner.names;
        let mut client = self.inner.pool.get().await.map_err(|e| self.map_pool(e))?;
        let tx = client.transaction().await.map_err(map_pg)?;
        tx.execute(
            "SELECT pg_advisory_xact_lock($1::bigint)",
            &[&advisory_key(n)],
        )
        .await
        .map_err(map_pg)?;
        let schema_exists = tx
            .query_opt(
                "SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1::text",
                &[&n.schema],
            )
            .await
            .map_err(map_pg)?
            .is_some();
        if !schema_exists {
            // The table's lock does not serialize two migrations of different tables into one
            // new schema, and two `CREATE SCHEMA IF NOT EXISTS` at once can both find it missing
            // and one then fail on the catalog's unique index (23505). The schema's own lock,
            // always taken after a table's, makes the second wait and find the schema made.
            tx.execute(
                "SELECT pg_advisory_xact_lock($1::bigint)",
                &[&schema_advisory_key(n)],
            )
            .await
            .map_err(map_pg)?;
            tx.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {}", n.qschema))
                .await
                .map_err(map_pg)?;
        }
        tx.batch_execute(&migrations_table(n))
            .await
            .map_err(map_pg)?;
        let current: i32 = tx
            .query_one(
                &format!("SELECT COALESCE(max(version), 0) FROM {}", n.qmigrations),
                &[],
            )
            .await
            .map_err(map_pg)?
            .get(0);
        let latest = MIGRATIONS.last().map_or(0, |m| m.version);
        if current > latest {
            return Err(Error::backend(
                STORE,
                format!(
                    "{} is at schema version {current}, newer than the {latest} this version of \
                     idem-postgres knows; upgrade the crate",
                    n.qtable
                ),
            ));
        }
        let mut applied = Vec::new();
        for m in MIGRATIONS.iter().filter(|m| m.version > current) {
            tx.batch_execute(&(m.sql)(n)).await.map_err(map_pg)?;
            tx.execute(
                &format!(
                    "INSERT INTO {} (version, description) VALUES ($1::integer, $2::text)",
                    n.qmigrations
                ),
                &[&m.version, &m.description],
            )
            .await
            .map_err(map_pg)?;
            applied.push(m.version as u32);
        }
        tx.commit().await.map_err(map_pg)?;
        if !applied.is_empty() {
            tracing::info!(table = %n.qtable, ?applied, "idem-postgres schema migrated");
        }
        Ok(MigrationReport {
            applied,
            version: latest.max(current) as u32,
        })
    }

    /// The connection pool, for running business statements on the same database (and for
    /// [in-transaction mode](crate::transactional) with a transaction you open yourself).
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// The configuration the store was built with.
    pub fn config(&self) -> &PostgresConfig {
        &self.inner.config
    }

    /// The quoted, schema-qualified table name (`"schema"."table"`).
    pub fn qualified_table(&self) -> &str {
        &self.inner.names.qtable
    }

    /// The exact SQL text the store sends for `which`, for reviews, `EXPLAIN` and benchmarks
    /// (the `pg_bench` benchmark runs `pgbench` on these very texts). Parameters are `$1..$n`;
    /// the comments in `sql.rs` list them.
    pub fn statement_sql(&self, which: Transition) -> &str {
        let s = &self.inner.sql;
        match which {
            Transition::Acquire => &s.acquire.sql,
            Transition::Extend => &s.extend.sql,
            Transition::Complete => &s.complete.sql,
            Transition::Fail => &s.fail.sql,
            Transition::Release => &s.release.sql,
            Transition::Get => &s.get.sql,
            Transition::Delete => &s.delete.sql,
            Transition::Purge => &s.purge.sql,
        }
    }

    /// A pool error, with this store's bounds.
    fn map_pool(&self, e: deadpool_postgres::PoolError) -> Error {
        let c = &self.inner.config;
        map_pool(e, c.pool_wait_timeout, c.connect_timeout)
    }

    /// Takes a pooled connection.
    pub(crate) async fn conn(&self) -> Result<Object> {
        self.inner.pool.get().await.map_err(|e| self.map_pool(e))
    }

    /// Runs one cached, prepared statement on a pooled connection, bounded by the client-side
    /// timeout. A connection that timed out or failed is dropped rather than returned to the pool.
    pub(crate) async fn query(
        &self,
        stmt: &Stmt,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>> {
        let client = self.conn().await?;
        let run = async {
            let prepared: Statement = client.prepare_typed_cached(&stmt.sql, stmt.types).await?;
            client.query(&prepared, params).await
        };
        let result = tokio::time::timeout(self.inner.op_timeout, run).await;
        settle(client, result, self.inner.op_timeout, &self.inner.names)
    }

    /// Like [`query`](Self::query), returning the affected row count.
    async fn execute(&self, stmt: &Stmt, params: &[&(dyn ToSql + Sync)]) -> Result<u64> {
        let client = self.conn().await?;
        let run = async {
            let prepared: Statement = client.prepare_typed_cached(&stmt.sql, stmt.types).await?;
            client.execute(&prepared, params).await
        };
        let result = tokio::time::timeout(self.inner.op_timeout, run).await;
        settle(client, result, self.inner.op_timeout, &self.inner.names)
    }

    /// Runs one fenced transition, re-running it when its snapshot and its row lock disagreed.
    /// Returns the record's new `lease_expires_at` (only `extend` sets one).
    async fn fenced(
        &self,
        lease: &Lease,
        stmt: &Stmt,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<SystemTime>> {
        for _ in 0..MAX_ROUNDS {
            let rows = match self.query(stmt, params).await {
                Ok(rows) => rows,
                Err(e) if is_serialization_failure(&e) => continue,
                Err(e) => return Err(e),
            };
            if let Some(done) = fenced_outcome(rows.first(), lease)? {
                return done;
            }
        }
        Err(Error::unavailable(STORE, Contention(MAX_ROUNDS)))
    }
}

#[cfg(not(feature = "tls"))]
fn make_manager(
    pg: tokio_postgres::Config,
    _config: &PostgresConfig,
    manager_config: ManagerConfig,
) -> Manager {
    Manager::from_config(pg, tokio_postgres::NoTls, manager_config)
}

#[cfg(feature = "tls")]
fn make_manager(
    pg: tokio_postgres::Config,
    config: &PostgresConfig,
    manager_config: ManagerConfig,
) -> Manager {
    match &config.tls {
        Some(tls) => Manager::from_config(
            pg,
            tokio_postgres_rustls::MakeRustlsConnect::new((**tls).clone()),
            manager_config,
        ),
        None => Manager::from_config(pg, tokio_postgres::NoTls, manager_config),
    }
}

/// Finishes one of the store's statements run on a pooled connection: maps errors (a missing
/// or outdated schema to [`Error::NotSetUp`]), and detaches the connection from the pool when it
/// timed out or failed at the connection level (so a half-read or dead connection is never
/// handed out again).
fn settle<T>(
    client: Object,
    result: std::result::Result<
        std::result::Result<T, tokio_postgres::Error>,
        tokio::time::error::Elapsed,
    >,
    op_timeout: Duration,
    names: &Names,
) -> Result<T> {
    match result {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => {
            if crate::error::is_connection_error(&e) {
                drop(Object::take(client));
            }
            Err(map_store_pg(e, names))
        }
        Err(_) => {
            drop(Object::take(client));
            Err(Error::timed_out(STORE, op_timeout))
        }
    }
}

impl PostgresStore {
    /// An acquire refused with `22P05`: [`Error::InvalidInput`] on `key` when the key is the
    /// text at fault, so the message is refused alone; `e` as it is when the key's id is ASCII
    /// (which every server encoding holds) or the namespace or the owner cannot be held either
    /// (every acquire would fail: a setup problem, not one key's). A namespace or owner outside
    /// ASCII is sent once more on its own to find out.
    pub(crate) async fn key_refused(&self, req: &AcquireRequest, e: Error) -> Error {
        if req.key.id().is_ascii() {
            // Not the key's doing (a trigger, say): left as the server said it.
            return e;
        }
        let ns = req.key.namespace().as_str();
        let owner = req.owner.as_str();
        if !(ns.is_ascii() && owner.is_ascii()) {
            let probe = async {
                let client = self.conn().await.ok()?;
                client
                    .query_one("SELECT $1::text, $2::text", &[&ns, &owner])
                    .await
                    .ok()
            };
            let held = tokio::time::timeout(self.inner.op_timeout, probe).await;
            if !matches!(held, Ok(Some(_))) {
                return e;
            }
        }
        untranslatable("key", &e)
    }
}

/// Microseconds of a duration already validated against the contract's maxima (so it fits).
/// The values the acquire statement binds besides the request's own fields, kept together so
/// that the plain and the transactional acquire bind the same parameters in the same order.
pub(crate) struct AcquireArgs<'r> {
    namespace: &'r str,
    id: &'r str,
    fingerprint: Option<&'r [u8]>,
    lease_us: i64,
    max_attempts: i64,
}

impl<'r> AcquireArgs<'r> {
    pub(crate) fn new(req: &'r AcquireRequest) -> Self {
        Self {
            namespace: req.key.namespace().as_str(),
            id: req.key.id(),
            fingerprint: req.fingerprint.as_ref().map(|f| &f.as_bytes()[..]),
            lease_us: micros(req.lease_ttl),
            max_attempts: i64::from(req.max_attempts),
        }
    }

    /// `$1..$7` of the acquire statement.
    pub(crate) fn params<'a>(
        &'a self,
        req: &'a AcquireRequest,
        lock_timeout_ms: &'a String,
    ) -> [&'a (dyn ToSql + Sync); 7] {
        [
            &self.namespace,
            &self.id,
            &self.fingerprint,
            &req.owner,
            &self.lease_us,
            &self.max_attempts,
            lock_timeout_ms,
        ]
    }
}

pub(crate) fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

fn corrupt(key: &IdempotencyKey, reason: impl Into<String>) -> Error {
    Error::corrupt(STORE, key.to_string(), reason)
}

pub(crate) fn column<'r, T: tokio_postgres::types::FromSql<'r>>(
    row: &'r Row,
    name: &str,
    key: &IdempotencyKey,
) -> Result<T> {
    row.try_get(name)
        .map_err(|e| corrupt(key, format!("column {name}: {e}")))
}

pub(crate) fn token_of(raw: i64, key: &IdempotencyKey) -> Result<FencingToken> {
    u64::try_from(raw)
        .map(FencingToken::new)
        .map_err(|_| corrupt(key, format!("negative token {raw}")))
}

/// The [`StateKind`] a `state` column holds (its [`StateKind::name`]).
pub(crate) fn state_kind(name: &str, key: &IdempotencyKey) -> Result<StateKind> {
    StateKind::from_name(name).ok_or_else(|| corrupt(key, format!("unknown state {name:?}")))
}

/// The `state` column's value for a failure of `kind`.
pub(crate) fn failed_state(kind: FailureKind) -> &'static str {
    StateKind::Failed(kind).name()
}

/// Decodes a record from a row holding the columns of [`crate::sql::RECORD_COLUMNS`] by name.
pub(crate) fn decode_record(row: &Row, key: &IdempotencyKey) -> Result<Record> {
    let state_name: String = column(row, "state", key)?;
    let result: Option<Vec<u8>> = column(row, "result", key)?;
    let error: Option<String> = column(row, "error", key)?;
    let state = match state_kind(&state_name, key)? {
        StateKind::InProgress => RecordState::InProgress,
        StateKind::Released => RecordState::Released,
        StateKind::Completed => RecordState::Completed {
            result: Bytes::from(result.ok_or_else(|| corrupt(key, "completed without result"))?),
        },
        StateKind::Failed(kind) => RecordState::Failed {
            error: error.ok_or_else(|| corrupt(key, "failed without error"))?,
            kind,
        },
        other => return Err(corrupt(key, format!("unknown state {other:?}"))),
    };
    let fingerprint: Option<Vec<u8>> = column(row, "fingerprint", key)?;
    let fingerprint = fingerprint
        .map(|bytes| Fingerprint::try_from(bytes.as_slice()))
        .transpose()
        .map_err(|e| corrupt(key, e.to_string()))?;
    let attempts: i32 = column(row, "attempts", key)?;
    Ok(Record {
        key: key.clone(),
        state,
        fingerprint,
        token: token_of(column(row, "token", key)?, key)?,
        owner: column(row, "owner", key)?,
        attempts: u32::try_from(attempts)
            .map_err(|_| corrupt(key, format!("negative attempts {attempts}")))?,
        lease_expires_at: column(row, "lease_expires_at", key)?,
        created_at: column(row, "created_at", key)?,
        updated_at: column(row, "updated_at", key)?,
        expires_at: column(row, "expires_at", key)?,
    })
}

/// Classifies the row of the acquire statement. `None` means the statement's snapshot and its
/// row lock disagreed (a concurrent writer got in between) and it must be run again.
pub(crate) fn acquire_outcome(
    row: Option<&Row>,
    req: &AcquireRequest,
) -> Result<Option<AcquireOutcome>> {
    let key = &req.key;
    let row = row.ok_or_else(|| corrupt(key, "acquire returned no row"))?;
    let now: SystemTime = column(row, "now", key)?;
    let found: bool = column(row, "found", key)?;
    if let Some(token) = column::<Option<i64>>(row, "new_token", key)? {
        let attempts: i32 = column(row, "new_attempts", key)?;
        let expires_at: SystemTime = column(row, "new_lease_expires_at", key)?;
        // A takeover replaces a live record that was in progress. Read from the raw columns: the
        // old record may have been past retention and undecodable, and was overwritten anyway.
        let old_state: Option<String> = column(row, "state", key)?;
        let old_expires_at: Option<SystemTime> = column(row, "expires_at", key)?;
        // `inserted`: the statement inserted a fresh row (the record `old` saw, if any, was
        // deleted concurrently), so nothing was taken over.
        let inserted: bool = column(row, "new_inserted", key)?;
        let takeover = !inserted
            && found
            && old_state.as_deref() == Some("in_progress")
            && old_expires_at.is_none_or(|at| at > now);
        return Ok(Some(AcquireOutcome::Acquired {
            lease: Lease {
                key: key.clone(),
                owner: req.owner.clone(),
                token: token_of(token, key)?,
                attempt: u32::try_from(attempts)
                    .map_err(|_| corrupt(key, format!("negative attempts {attempts}")))?,
                expires_at,
            },
            takeover,
        }));
    }
    // Nothing written: the snapshot's record decides, by the reference rules. If those rules
    // say "acquire" the row changed under the statement: run it again.
    let old = if found {
        Some(decode_record(row, key)?).filter(|r| !r.is_expired(now))
    } else {
        None
    };
    match machine::acquire(old.as_ref(), req, now, || FencingToken::new(0)) {
        AcquireDecision::Keep(outcome) => Ok(Some(outcome)),
        _ => Ok(None),
    }
}

/// Classifies the row of a fenced statement: `Some(Ok(..))` done (applied, or replayed: the
/// same transition already finished the record under this token), `Some(Err(LeaseLost))`
/// refused, saying what the statement found; `None` when the snapshot still showed the lease as
/// current although the update did not match (a concurrent writer, such as an earlier send of
/// this very call, got in between): run it again to see what it left.
pub(crate) fn fenced_outcome(
    row: Option<&Row>,
    lease: &Lease,
) -> Result<Option<Result<Option<SystemTime>>>> {
    let key = &lease.key;
    let row = row.ok_or_else(|| corrupt(key, "fenced statement returned no row"))?;
    if column::<bool>(row, "done", key)? {
        return Ok(Some(Ok(column(row, "lease_expires_at", key)?)));
    }
    if column::<bool>(row, "replayed", key)? {
        return Ok(Some(Ok(None)));
    }
    let current: Option<i64> = column(row, "current_token", key)?;
    let state: Option<String> = column(row, "current_state", key)?;
    let found = match (current, state) {
        (Some(token), Some(state)) => Some((token_of(token, key)?, state_kind(&state, key)?)),
        _ => None,
    };
    if found == Some((lease.token, StateKind::InProgress)) {
        return Ok(None);
    }
    Ok(Some(Err(Error::lease_lost(lease, found))))
}

#[async_trait]
impl IdempotencyStore for PostgresStore {
    fn name(&self) -> &'static str {
        STORE
    }

    fn limits(&self) -> Limits {
        self.inner.config.limits
    }

    async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome> {
        req.validate()?;
        let args = AcquireArgs::new(req);
        let params = args.params(req, &self.inner.lock_timeout_ms);
        for _ in 0..MAX_ROUNDS {
            let rows = match self.query(&self.inner.sql.acquire, &params).await {
                Ok(rows) => rows,
                Err(e) if is_lock_timeout(&e) => return Ok(self.locked_outcome()),
                Err(e) if is_serialization_failure(&e) => continue,
                Err(e) if is_untranslatable(&e) => return Err(self.key_refused(req, e).await),
                Err(e) => return Err(e),
            };
            if let Some(outcome) = acquire_outcome(rows.first(), req)? {
                return Ok(outcome);
            }
        }
        Err(Error::unavailable(STORE, Contention(MAX_ROUNDS)))
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        check_lease_ttl(ttl)?;
        let token = lease.token.get() as i64;
        let ttl_us = micros(ttl);
        let expires_at = self
            .fenced(
                lease,
                &self.inner.sql.extend,
                &[
                    &lease.key.namespace().as_str(),
                    &lease.key.id(),
                    &token,
                    &ttl_us,
                ],
            )
            .await?
            .ok_or_else(|| corrupt(&lease.key, "extend returned no lease end"))?;
        Ok(Lease {
            expires_at,
            ..lease.clone()
        })
    }

    async fn complete(&self, lease: &Lease, result: Bytes, retention: Duration) -> Result<()> {
        self.inner
            .config
            .limits
            .check_complete(&result, retention)?;
        let token = lease.token.get() as i64;
        let retention_us = micros(retention);
        let result: &[u8] = &result;
        self.fenced(
            lease,
            &self.inner.sql.complete,
            &[
                &lease.key.namespace().as_str(),
                &lease.key.id(),
                &token,
                &result,
                &retention_us,
            ],
        )
        .await
        .map(drop)
    }

    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        self.inner.config.limits.check_fail(error, retention)?;
        let state = failed_state(kind);
        let token = lease.token.get() as i64;
        let retention_us = micros(retention);
        self.fenced(
            lease,
            &self.inner.sql.fail,
            &[
                &lease.key.namespace().as_str(),
                &lease.key.id(),
                &token,
                &error,
                &state,
                &retention_us,
            ],
        )
        .await
        .map(drop)
        // The key was held by this lease, so the text refused is the error's.
        .map_err(|e| match is_untranslatable(&e) {
            true => untranslatable("error", &e),
            false => e,
        })
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let token = lease.token.get() as i64;
        self.fenced(
            lease,
            &self.inner.sql.release,
            &[&lease.key.namespace().as_str(), &lease.key.id(), &token],
        )
        .await
        .map(drop)
    }

    /// One statement per batch over parameter arrays (see the [crate docs](crate#batches)).
    async fn acquire_many(&self, reqs: &[AcquireRequest]) -> Result<Vec<Result<AcquireOutcome>>> {
        self.acquire_batch(reqs).await
    }

    /// One statement per batch over parameter arrays (see the [crate docs](crate#batches)).
    async fn complete_many(
        &self,
        items: &[Completion],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        self.complete_batch(items, retention).await
    }

    /// One statement per batch over parameter arrays (see the [crate docs](crate#batches)).
    async fn fail_many(&self, items: &[Failure], retention: Duration) -> Result<Vec<Result<()>>> {
        self.fail_batch(items, retention).await
    }

    /// One statement per batch over parameter arrays (see the [crate docs](crate#batches)).
    async fn release_many(&self, leases: &[Lease]) -> Result<Vec<Result<()>>> {
        self.release_batch(leases).await
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        let rows = self
            .query(&self.inner.sql.get, &[&key.namespace().as_str(), &key.id()])
            .await?;
        rows.first().map(|row| decode_record(row, key)).transpose()
    }

    async fn delete(&self, key: &IdempotencyKey) -> Result<bool> {
        let params: [&(dyn ToSql + Sync); 2] = [&key.namespace().as_str(), &key.id()];
        for _ in 0..MAX_ROUNDS {
            let rows = match self.query(&self.inner.sql.delete, &params).await {
                Ok(rows) => rows,
                Err(e) if is_serialization_failure(&e) => continue,
                Err(e) => return Err(e),
            };
            return match rows.first() {
                Some(row) => column(row, "live", key),
                None => Ok(false),
            };
        }
        Err(Error::unavailable(STORE, Contention(MAX_ROUNDS)))
    }

    /// Keyset pages over the listing index `(namespace, state, id)` (schema version 3), one
    /// state at a time and only the states the query's statuses can come from, so listing one
    /// state among many reads only that state's part of the index (see
    /// [`explain_list`](PostgresStore::explain_list)). Ids come in byte order within a state;
    /// the cursor is the state and the last id.
    async fn list(&self, query: &ListQuery) -> Result<Page> {
        self.list_page(query).await
    }

    async fn purge_expired(&self, limit: usize) -> Result<u64> {
        if limit == 0 {
            return Ok(0);
        }
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.execute(&self.inner.sql.purge, &[&limit]).await
    }
}

impl PostgresStore {
    /// Asks the server to cancel the statement running on the connection of `token`, if any
    /// (best effort, bounded by `connect_timeout`: it opens a connection of its own).
    pub(crate) async fn cancel(&self, token: &tokio_postgres::CancelToken) {
        let limit = self.inner.config.connect_timeout;
        #[cfg(feature = "tls")]
        if let Some(tls) = &self.inner.config.tls {
            let tls = tokio_postgres_rustls::MakeRustlsConnect::new((**tls).clone());
            let _ = tokio::time::timeout(limit, token.cancel_query(tls)).await;
            return;
        }
        let _ = tokio::time::timeout(limit, token.cancel_query(tokio_postgres::NoTls)).await;
    }

    /// The outcome of an acquire that hit the lock timeout: the key is held by an open
    /// transaction.
    pub(crate) fn locked_outcome(&self) -> AcquireOutcome {
        AcquireOutcome::InProgress {
            owner: UNCOMMITTED_OWNER.to_owned(),
            retry_after: self.inner.config.lock_timeout,
        }
    }
}

/// Whether an error is PostgreSQL's lock timeout (`55P03`).
pub(crate) fn is_lock_timeout(e: &Error) -> bool {
    let Error::Unavailable { source, .. } = e else {
        return false;
    };
    source
        .downcast_ref::<tokio_postgres::Error>()
        .and_then(tokio_postgres::Error::code)
        .is_some_and(|c| *c == tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE)
}
