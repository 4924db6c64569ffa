//! [`TransactionalStore`] on PostgreSQL: the fenced completion and the handler's statements
//! ([`PgWrites`]) in one transaction, pipelined on one connection.
//!
//! One call sends, in this order and without waiting for any reply (tokio-postgres writes a
//! request to the connection at its future's first poll, so polling each future once, in order,
//! queues them in order):
//!
//! 1. `BEGIN`;
//! 2. the `complete_with` statement: the fenced `complete` (token, state, retention), which also
//!    returns what it found (for `LeaseLost` and replays) and arms the guard;
//! 3. the guard, which fails (aborting the transaction) unless step 2 completed the record;
//! 4. the handler's statements, in order;
//! 5. `COMMIT`, which the server turns into a rollback when anything before it failed.
//!
//! When a statement carries a row-count condition ([`PgWrites::expect_rows`]) step 5 is held
//! back until the counts are read: then `COMMIT` or `ROLLBACK` follows, a second round trip.
//!
//! The completion goes first so that a refused or replayed completion runs none of the
//! handler's statements (they fail with `25P02` without executing: no trigger fires, no
//! sequence advances), and so that two completions of one key meet on the record's row lock
//! before either touches the handler's rows.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use deadpool_postgres::Object;
use idem_core::{Error, IdempotencyStore, Lease, Result, StateKind, TransactionalStore};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Row, Statement};

use crate::error::{
    Contention, STORE, is_connection_error, is_retryable_state, map_pg, map_store_pg,
};
use crate::store::{MAX_ROUNDS, PostgresStore, column, micros, state_kind, token_of};
use crate::writes::{PgWrites, invalid};

type PgResult<T> = std::result::Result<T, tokio_postgres::Error>;
type Request<'a, T> = Pin<Box<dyn Future<Output = PgResult<T>> + Send + 'a>>;

/// A request of the pipeline: queued on the connection (pending), or already answered at its
/// first poll (which, for tokio-postgres, means it was never sent: a closed connection, or a
/// value that does not encode).
enum Sent<'a, T> {
    Pending(Request<'a, T>),
    NotSent(PgResult<T>),
}

impl<'a, T> Sent<'a, T> {
    /// Polls `request` once, which queues it on the connection.
    async fn send(mut request: Request<'a, T>) -> Self {
        match futures::poll!(request.as_mut()) {
            Poll::Ready(answer) => Self::NotSent(answer),
            Poll::Pending => Self::Pending(request),
        }
    }

    fn was_sent(&self) -> bool {
        matches!(self, Self::Pending(_))
    }

    async fn answer(self) -> PgResult<T> {
        match self {
            Self::Pending(request) => request.await,
            Self::NotSent(answer) => answer,
        }
    }
}

/// What the `complete_with` statement found.
enum Completion {
    /// It completed the record: the handler's statements ran after it.
    Applied,
    /// The same completion had already taken effect: `Ok`, nothing ran.
    Replayed,
    /// Refused: the lease is lost (superseded, finished otherwise, or gone).
    Lost(Error),
    /// Its snapshot and its row lock disagreed (a concurrent writer got in between): send the
    /// whole pipeline again.
    Again,
}

/// How one pipeline ended (`outcome` is `None` when it must be sent again), and whether the
/// connection is back at rest (no transaction open, no reply pending) so it can return to the
/// pool.
struct Ended {
    outcome: Option<Result<()>>,
    at_rest: bool,
}

#[async_trait]
impl TransactionalStore for PostgresStore {
    type Writes = PgWrites;

    /// Runs the fenced completion and `writes` in ONE transaction; see the
    /// [crate docs](crate#transactional-effects) and [`PgWrites`] for what refuses them.
    ///
    /// With no statements it is [`complete`](IdempotencyStore::complete). Otherwise the
    /// statements are prepared on the connection (the first time that connection sees their
    /// texts: one round trip for all of them, cached afterwards), then the transaction is sent
    /// as one pipeline: one round trip, two when a statement carries a row-count condition. The
    /// whole call is bounded by `statement_timeout` plus one second; past it the connection is
    /// dropped (the server rolls back whatever did not commit) and the call answers
    /// [`Error::Unavailable`].
    async fn complete_with(
        &self,
        lease: &Lease,
        result: Bytes,
        retention: Duration,
        writes: PgWrites,
    ) -> Result<()> {
        self.inner
            .config
            .limits
            .check_complete(&result, retention)?;
        writes.check()?;
        if writes.is_empty() {
            return self.complete(lease, result, retention).await;
        }
        let client = Unsettled(Some(self.conn().await?));
        let limit = self.inner.op_timeout;
        match tokio::time::timeout(
            limit,
            self.complete_with_on(&client, lease, &result, retention, &writes),
        )
        .await
        {
            Ok(ended) => {
                client.settle(ended.at_rest);
                ended
                    .outcome
                    .unwrap_or_else(|| Err(Error::unavailable(STORE, Contention(MAX_ROUNDS))))
            }
            Err(_) => {
                drop(client);
                Err(Error::timed_out(STORE, limit))
            }
        }
    }
}

/// The pooled connection of a `complete_with` under way. Unless the call ended with the
/// connection at rest ([`settle`](Self::settle)), it leaves the pool when dropped: the server
/// then rolls back whatever the closed connection did not commit. That covers the call's own
/// timeout and a caller that gives up on the call (a timeout or `select!` of its own, an
/// aborted task) while its transaction is open, say waiting for the row counts of a condition
/// before `COMMIT`. Back in the pool, such a connection would carry the open transaction into
/// the next calls on it: their statements, completions included, answered `Ok` and then
/// committed with a later `COMMIT` (the failed condition's writes too) or never.
struct Unsettled(Option<Object>);

impl Unsettled {
    /// Ends the call: back to the pool when `at_rest` (no transaction open) and still open,
    /// otherwise out of it.
    fn settle(mut self, at_rest: bool) {
        if let Some(client) = self.0.take()
            && (!at_rest || client.is_closed())
        {
            drop(Object::take(client));
        }
    }
}

impl std::ops::Deref for Unsettled {
    type Target = Object;

    fn deref(&self) -> &Object {
        self.0.as_ref().expect("a connection until settled")
    }
}

impl Drop for Unsettled {
    fn drop(&mut self) {
        if let Some(client) = self.0.take() {
            drop(Object::take(client));
        }
    }
}

impl PostgresStore {
    /// Prepares, checks and sends the pipeline until it ends (again while the completion's
    /// snapshot and row lock disagree, at most [`MAX_ROUNDS`] times: `outcome` is `None` then).
    async fn complete_with_on(
        &self,
        client: &Object,
        lease: &Lease,
        result: &[u8],
        retention: Duration,
        writes: &PgWrites,
    ) -> Ended {
        let prepared = match self.prepare_writes(client, writes).await {
            Ok(prepared) => prepared,
            Err(e) => {
                return Ended {
                    outcome: Some(Err(e)),
                    at_rest: true,
                };
            }
        };
        for _ in 0..MAX_ROUNDS {
            let ended = self
                .pipeline(client, &prepared, lease, result, retention, writes)
                .await;
            if ended.outcome.is_some() || !ended.at_rest {
                return ended;
            }
        }
        Ended {
            outcome: None,
            at_rest: true,
        }
    }

    /// Prepares the store's two statements and the handler's (through the connection's
    /// statement cache: pipelined, one round trip for all those not cached yet), then checks
    /// every value against its parameter's type, so that nothing can fail to encode once the
    /// transaction is under way.
    ///
    /// Returns the prepared `complete_with`, guard and handler statements, in that order.
    async fn prepare_writes(&self, client: &Object, writes: &PgWrites) -> Result<Vec<Statement>> {
        let cache = &client.statement_cache;
        let sql = &self.inner.sql;
        let own = futures::future::try_join(
            cache.prepare_typed(client, &sql.complete_with.sql, sql.complete_with.types),
            cache.prepare_typed(client, &sql.complete_with_guard.sql, &[]),
        );
        let theirs = futures::future::join_all(
            writes
                .statements
                .iter()
                .map(|s| cache.prepare_typed(client, &s.sql, &[])),
        );
        let (own, theirs) = futures::join!(own, theirs);
        let (complete, guard) = own.map_err(|e| map_store_pg(e, &self.inner.names))?;
        let mut prepared = Vec::with_capacity(writes.len() + 2);
        prepared.push(complete);
        prepared.push(guard);
        for (i, (statement, answer)) in writes.statements.iter().zip(theirs).enumerate() {
            let stmt = match answer {
                Ok(stmt) => stmt,
                Err(e) => return Err(refused_at_prepare(i, e)),
            };
            if stmt.params().len() != statement.params.len() {
                return Err(invalid(format!(
                    "statement {i} takes {} parameters, {} given",
                    stmt.params().len(),
                    statement.params.len()
                )));
            }
            let mut scratch = BytesMut::new();
            for (n, (value, ty)) in statement.params.iter().zip(stmt.params()).enumerate() {
                scratch.clear();
                if let Err(e) = value.to_sql_checked(ty, &mut scratch) {
                    return Err(invalid(format!("statement {i}, parameter ${}: {e}", n + 1)));
                }
            }
            prepared.push(stmt);
        }
        Ok(prepared)
    }

    /// Sends one pipeline (see the module docs) and reads every reply.
    async fn pipeline(
        &self,
        client: &Client,
        prepared: &[Statement],
        lease: &Lease,
        result: &[u8],
        retention: Duration,
        writes: &PgWrites,
    ) -> Ended {
        let (complete_stmt, guard_stmt, theirs) = (&prepared[0], &prepared[1], &prepared[2..]);
        let namespace = lease.key.namespace().as_str();
        let id = lease.key.id();
        let token = lease.token.get() as i64;
        let retention_us = micros(retention);
        let complete_params: [&(dyn ToSql + Sync); 5] =
            [&namespace, &id, &token, &result, &retention_us];

        let mut all_sent = true;
        let begin = Sent::send(Box::pin(client.batch_execute("BEGIN"))).await;
        all_sent &= begin.was_sent();
        let complete = Sent::send(Box::pin(client.query(complete_stmt, &complete_params))).await;
        all_sent &= complete.was_sent();
        let guard = Sent::send(Box::pin(client.query(guard_stmt, &[]))).await;
        all_sent &= guard.was_sent();
        let mut statements = Vec::with_capacity(theirs.len());
        for (stmt, statement) in theirs.iter().zip(&writes.statements) {
            let params = statement.params.iter().map(|p| &**p as &(dyn ToSql + Sync));
            let sent = Sent::send(Box::pin(client.execute_raw(stmt, params))).await;
            all_sent &= sent.was_sent();
            statements.push(sent);
        }
        // COMMIT goes in the same pipeline only when every request before it was queued (so it
        // cannot commit a transaction that lacks one of them) and no count must be read first.
        let conditions = writes.has_conditions();
        let commit = if all_sent && !conditions {
            Some(Sent::send(Box::pin(client.batch_execute("COMMIT"))).await)
        } else {
            None
        };

        let (begin, complete, guard, counts, commit) = futures::join!(
            begin.answer(),
            complete.answer(),
            guard.answer(),
            futures::future::join_all(statements.into_iter().map(Sent::answer)),
            async {
                match commit {
                    Some(commit) => Some(commit.answer().await),
                    None => None,
                }
            }
        );
        let mut broken = [
            begin.as_ref().err(),
            complete.as_ref().err(),
            guard.as_ref().err(),
        ]
        .into_iter()
        .flatten()
        .chain(counts.iter().filter_map(|c| c.as_ref().err()))
        .chain(commit.iter().filter_map(|c| c.as_ref().err()))
        .any(is_connection_error);
        if !all_sent {
            // A request was never sent: the connection is closed (or a value did not encode after
            // all); the transaction, if it began, did not commit, and is not at rest.
            let e = [begin.err(), complete.err(), guard.err()]
                .into_iter()
                .flatten()
                .chain(counts.into_iter().filter_map(Result::err))
                .next();
            return Ended {
                outcome: Some(Err(match e {
                    Some(e) => map_pg(e),
                    None => Error::backend(STORE, "a pipelined request was not sent"),
                })),
                at_rest: false,
            };
        }
        let step = self.classify(lease, begin, complete, guard, counts, writes);
        let outcome = match (commit, step) {
            // Pipelined COMMIT: it decides, when everything before it succeeded.
            (Some(commit), Step::Commit) => Some(commit.map_err(|e| refused_at_commit(e, writes))),
            // Pipelined COMMIT after a failure, a refusal or a replay: the server rolled back.
            (Some(_), Step::Stop(outcome)) => Some(outcome),
            (Some(_), Step::Again) => None,
            // Every condition held: commit now (the second round trip).
            (None, Step::Commit) => Some(client.batch_execute("COMMIT").await.map_err(|e| {
                broken |= is_connection_error(&e);
                refused_at_commit(e, writes)
            })),
            // Refused, failed or replayed with the transaction still open: roll it back.
            (None, step) => {
                if let Err(e) = client.batch_execute("ROLLBACK").await {
                    broken |= is_connection_error(&e);
                }
                match step {
                    Step::Stop(outcome) => Some(outcome),
                    _ => None,
                }
            }
        };
        match (outcome, broken) {
            (None, true) => Ended {
                outcome: Some(Err(Error::unavailable(
                    STORE,
                    "the connection failed while the completion was sent again",
                ))),
                at_rest: false,
            },
            (outcome, broken) => Ended {
                outcome,
                at_rest: !broken,
            },
        }
    }

    /// Reads the replies before `COMMIT`: whether the transaction may commit (everything
    /// succeeded and every condition held), or what the call answers (it must not commit), or
    /// that the pipeline must be sent again.
    fn classify(
        &self,
        lease: &Lease,
        begin: PgResult<()>,
        complete: PgResult<Vec<Row>>,
        guard: PgResult<Vec<Row>>,
        counts: Vec<PgResult<u64>>,
        writes: &PgWrites,
    ) -> Step {
        if let Err(e) = begin {
            return Step::Stop(Err(map_pg(e)));
        }
        let rows = match complete {
            Ok(rows) => rows,
            Err(e) => return Step::Stop(Err(map_store_pg(e, &self.inner.names))),
        };
        match completion(rows.first(), lease) {
            Err(e) | Ok(Completion::Lost(e)) => return Step::Stop(Err(e)),
            Ok(Completion::Replayed) => return Step::Stop(Ok(())),
            // The guard aborted the transaction: nothing ran, send it all again.
            Ok(Completion::Again) => return Step::Again,
            Ok(Completion::Applied) => {}
        }
        if let Err(e) = guard {
            // The completion applied, so the guard did not refuse: something else failed.
            return Step::Stop(Err(map_pg(e)));
        }
        for (i, (count, statement)) in counts.into_iter().zip(&writes.statements).enumerate() {
            match count {
                Err(e) => return Step::Stop(Err(refused_statement(i, e))),
                Ok(n) => {
                    if let Some(expected) = statement.expect_rows
                        && n != expected
                    {
                        return Step::Stop(Err(Error::EffectRefused {
                            store: STORE,
                            index: i,
                            reason: format!(
                                "statement {i} must affect {expected} rows (expect_rows) and \
                                 affected {n}"
                            ),
                        }));
                    }
                }
            }
        }
        Step::Commit
    }
}

/// What the replies before `COMMIT` decide.
enum Step {
    /// Everything succeeded and every condition held: commit.
    Commit,
    /// The call answers this; the transaction must not commit.
    Stop(Result<()>),
    /// The completion's snapshot and row lock disagreed: nothing ran, send it all again.
    Again,
}

/// Reads the row of the `complete_with` statement.
fn completion(row: Option<&Row>, lease: &Lease) -> Result<Completion> {
    let key = &lease.key;
    let Some(row) = row else {
        return Err(Error::corrupt(
            STORE,
            key.to_string(),
            "complete_with returned no row",
        ));
    };
    if column::<bool>(row, "done", key)? {
        return Ok(Completion::Applied);
    }
    if column::<bool>(row, "replayed", key)? {
        return Ok(Completion::Replayed);
    }
    let current: Option<i64> = column(row, "current_token", key)?;
    let state: Option<String> = column(row, "current_state", key)?;
    let found = match (current, state) {
        (Some(token), Some(state)) => Some((token_of(token, key)?, state_kind(&state, key)?)),
        _ => None,
    };
    if found == Some((lease.token, StateKind::InProgress)) {
        return Ok(Completion::Again);
    }
    Ok(Completion::Lost(Error::lease_lost(lease, found)))
}

/// The error of a handler's statement that failed in the transaction.
///
/// - The data refused the effect: [`Error::EffectRefused`] (see [`refuses_the_effect`]).
/// - `25001` (active SQL transaction): the statement cannot run inside a transaction block, or
///   not after the transaction's first query, which the completion's statement always is
///   (`VACUUM`, `CREATE INDEX CONCURRENTLY`, a transaction characteristic set by a function,
///   `SET TRANSACTION READ WRITE` after `READ ONLY`): it can never run in the writes, so
///   [`Error::InvalidInput`] on `writes`, as the texts [`PgWrites::check`] refuses.
/// - Retryable SQLSTATEs and connection failures (a timeout, a deadlock, a lost connection):
///   as any other store error, [`Error::Unavailable`].
/// - Any other error of the server (a missing privilege, `42501`; a write after the writes made
///   the transaction read-only, `25006`): [`Error::Backend`] naming the statement.
///
/// `25P02` cannot show here: the first failure is read first.
fn refused_statement(index: usize, e: tokio_postgres::Error) -> Error {
    let Some(db) = e.as_db_error() else {
        return map_pg(e);
    };
    if refuses_the_effect(db.code()) {
        return Error::EffectRefused {
            store: STORE,
            index,
            reason: describe(db),
        };
    }
    if *db.code() == SqlState::ACTIVE_SQL_TRANSACTION {
        return invalid(format!(
            "statement {index} cannot run in the transaction the writes commit in, after the \
             completion's statement: {}",
            describe(db)
        ));
    }
    if is_retryable_state(db.code()) {
        return map_pg(e);
    }
    Error::backend(STORE, StatementFailed::new(index, "failed", e))
}

/// The source of [`Error::Backend`] for a handler's statement the server refused for a reason
/// that is neither its data nor its text (a missing privilege, ...): names the statement and
/// keeps the driver's error (the server's message) as its source.
#[derive(Debug, thiserror::Error)]
#[error("statement {index} of the handler's writes {what} (SQLSTATE {code})")]
struct StatementFailed {
    index: usize,
    what: &'static str,
    code: String,
    #[source]
    source: tokio_postgres::Error,
}

impl StatementFailed {
    fn new(index: usize, what: &'static str, source: tokio_postgres::Error) -> Self {
        Self {
            index,
            what,
            code: source.code().map_or("", SqlState::code).to_owned(),
            source,
        }
    }
}

/// A failed `COMMIT`: a deferred constraint refuses the effect as a whole (index `len`), the
/// rest as any store error (a lost connection is ambiguous: `Unavailable`).
fn refused_at_commit(e: tokio_postgres::Error, writes: &PgWrites) -> Error {
    match e.as_db_error() {
        Some(db) if refuses_the_effect(db.code()) => Error::EffectRefused {
            store: STORE,
            index: writes.len(),
            reason: format!("at COMMIT: {}", describe(db)),
        },
        _ => map_pg(e),
    }
}

/// A handler's statement the server would not prepare.
///
/// A table or schema it names that does not exist (`42P01` undefined table, which PostgreSQL
/// also answers for `schema.table` in a missing schema; `3F000` invalid schema name) is
/// [`Error::NotSetUp`]: the database is not set up for the handler yet (a consumer deployed
/// before the migration that creates its table), so the message is retried and goes through
/// once the table exists, as on DynamoDB. A privilege the store's role lacks (`42501`, at
/// prepare: `USAGE` on a schema the statement names) is [`Error::Backend`] naming the
/// statement, as when PostgreSQL checks the privilege at run time (most of them, see
/// [`refused_statement`]): the operator grants it, and the message goes through when retried.
/// Any other statement that can never run is invalid input (the rest of SQLSTATE class `42`,
/// syntax or access rule, and `0A`, not supported); the rest (a lost connection, ...) as any
/// store error.
fn refused_at_prepare(index: usize, e: tokio_postgres::Error) -> Error {
    if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) {
        return Error::backend(STORE, StatementFailed::new(index, "does not prepare", e));
    }
    match e.as_db_error() {
        Some(db)
            if [SqlState::UNDEFINED_TABLE, SqlState::INVALID_SCHEMA_NAME].contains(db.code()) =>
        {
            Error::not_set_up(
                STORE,
                format!(
                    "a table or schema that statement {index} of the handler's writes names: {}",
                    describe(db)
                ),
                "create it (run the migration that does), or correct the name in the writes",
            )
        }
        Some(db) if matches!(&db.code().code()[..2], "42" | "0A") => invalid(format!(
            "statement {index} does not prepare: {}",
            describe(db)
        )),
        _ => map_pg(e),
    }
}

/// Whether a statement's SQLSTATE means the database refused the effect for its data: class
/// `23` (integrity constraints), `22` (data exceptions), `P0` (raised by a trigger or function),
/// `54` (a program limit met while the statement ran: an index row or a row too large).
fn refuses_the_effect(code: &SqlState) -> bool {
    matches!(&code.code()[..2], "23" | "22" | "P0" | "54")
}

/// The server's message, SQLSTATE and, when there is one, constraint.
fn describe(db: &tokio_postgres::error::DbError) -> String {
    let mut out = format!("{} (SQLSTATE {}", db.message(), db.code().code());
    if let Some(constraint) = db.constraint() {
        out.push_str(", constraint ");
        out.push_str(constraint);
    }
    out.push(')');
    if let Some(detail) = db.detail() {
        out.push_str(": ");
        out.push_str(detail);
    }
    out
}
