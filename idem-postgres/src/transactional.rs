//! Transactional mode: the acquisition, the handler's business statements and the completion
//! commit or roll back together.
//!
//! For a handler whose effects are writes to the same PostgreSQL database, this gives an
//! exactly-once *effect*, not just at-most-once completion: there is no moment at which the
//! business writes are committed but the key is not completed, or the other way round.
//!
//! # Semantics
//!
//! [`PostgresStore::transactional`] takes a pooled connection and, in ONE transaction:
//!
//! 1. acquires the key (the same single statement as [`IdempotencyStore::acquire`]), with the
//!    configured [`lock_timeout`](crate::PostgresConfig::lock_timeout) for that statement only;
//! 2. when the key was acquired, runs the handler with the transaction and the lease, so its
//!    statements join the transaction (the lease's token is there for fencing downstream systems);
//! 3. records the completion (the fenced `complete` statement) with the handler's result;
//! 4. commits.
//!
//! What happens when things go wrong:
//!
//! | event | effect |
//! |---|---|
//! | the key is not acquirable (duplicate, busy, conflict, exhausted, terminal failure) | nothing written, handler not run: [`TxOutcome::NotRun`] with the acquire outcome |
//! | a concurrent duplicate holds the key in its own open transaction | this call waits at most `lock_timeout`, then [`TxOutcome::NotRun`] with [`AcquireOutcome::InProgress`] (owner [`UNCOMMITTED_OWNER`](crate::UNCOMMITTED_OWNER)) |
//! | the handler returns an error | the transaction rolls back (business writes and acquisition), then ONE statement outside it records the failed attempt (retryable or terminal), so poison messages still reach `Exhausted`: [`TxOutcome::HandlerFailed`] |
//! | the process crashes, the connection is killed, or the future is dropped, anywhere before commit | PostgreSQL rolls everything back; the key is as it was before the call. No attempt is counted (nothing survives to count it); the call, if it is still there to return, answers [`Error::Unavailable`] |
//! | the commit itself fails on a lost connection | [`Error::Unavailable`]: the outcome is unknown, and redelivery answers `Replayed` if it committed, or runs again if not |
//!
//! A handler that *crashes* the process every time is therefore retried without bound in this
//! mode (each crash rolls back its own acquisition); combine with a delivery-count limit in the
//! consumer (Kafka, SQS and RabbitMQ all have one) if such poison messages are possible.
//!
//! While the transaction is open its record is locked but not visible to others: a plain
//! [`acquire`](IdempotencyStore::acquire) of the same key also waits at most `lock_timeout` and
//! answers `InProgress`. Business statements run with the connection's `statement_timeout` and
//! the session's `lock_timeout` (the acquire's lock timeout is restored after it).
//!
//! # With a transaction you opened
//!
//! [`PostgresStore::transactional_in`] does the same inside a savepoint of your transaction, so
//! your earlier statements stay and you decide when to commit: the completion becomes visible
//! with your commit and vanishes with your rollback. A handler failure rolls back to the
//! savepoint (your transaction stays usable) and the failed attempt is recorded on a separate
//! connection from the store's pool (so if your transaction holds a connection of that same pool,
//! leave at least one other free).
//!
//! # The handler
//!
//! A closure taking the transaction and the lease and returning a boxed future, the usual shape
//! for an async callback that borrows its arguments:
//!
//! ```no_run
//! # async fn demo(store: idem_postgres::PostgresStore, req: idem_core::AcquireRequest)
//! # -> idem_core::Result<()> {
//! use std::time::Duration;
//! use idem_core::Bytes;
//! use idem_postgres::TxOutcome;
//!
//! let amount: i64 = 1250;
//! let outcome = store
//!     .transactional(&req, Duration::from_secs(86_400), |tx, lease| {
//!         Box::pin(async move {
//!             tx.execute(
//!                 "INSERT INTO payments (id, amount, fence) VALUES ($1, $2, $3)",
//!                 &[&lease.key.id(), &amount, &(lease.token.get() as i64)],
//!             )
//!             .await?;
//!             Ok(Bytes::from_static(b"paid"))
//!         })
//!     })
//!     .await?;
//! match outcome {
//!     TxOutcome::Executed { result, .. } => println!("done: {result:?}"),
//!     TxOutcome::NotRun(other) => println!("not run: {}", other.name()),
//!     TxOutcome::HandlerFailed { error, .. } => println!("failed, rolled back: {error}"),
//!     _ => {}
//! }
//! # Ok(()) }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::{Object, StatementCache};
use idem_core::{
    AcquireOutcome, AcquireRequest, BoxError, Error, IdempotencyStore, Lease, Result,
    check_retention,
};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row, Transaction};

use crate::error::{ClientTimeout, Contention, STORE, map_pg};
use crate::sql::Stmt;
use crate::store::{
    AcquireArgs, MAX_ROUNDS, PostgresStore, acquire_outcome, is_lock_timeout, micros,
    storable_error,
};

/// The future a transactional handler returns: the result to store, or why it failed.
pub type HandlerFuture<'a> =
    Pin<Box<dyn Future<Output = std::result::Result<Bytes, HandlerError>> + Send + 'a>>;

/// Why a transactional handler failed. Its transaction is rolled back and the attempt is recorded
/// as failed: retryable (a later delivery runs it again, until attempts run out) or terminal (the
/// error is replayed to every later delivery).
///
/// `?` on a `tokio_postgres::Error` gives a retryable failure.
#[derive(Debug)]
pub struct HandlerError {
    message: String,
    retryable: bool,
    source: Option<BoxError>,
}

impl HandlerError {
    /// A failure a later attempt may not repeat.
    pub fn retryable(error: impl Into<BoxError>) -> Self {
        Self::new(error.into(), true)
    }

    /// A failure that will happen again whatever the attempt: stored and replayed, never re-run.
    pub fn terminal(error: impl Into<BoxError>) -> Self {
        Self::new(error.into(), false)
    }

    fn new(source: BoxError, retryable: bool) -> Self {
        Self {
            message: source.to_string(),
            retryable,
            source: Some(source),
        }
    }

    /// Whether a later attempt may run the work again.
    pub fn is_retryable(&self) -> bool {
        self.retryable
    }

    /// The message stored with the failed attempt.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for HandlerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl From<tokio_postgres::Error> for HandlerError {
    fn from(e: tokio_postgres::Error) -> Self {
        Self::retryable(e)
    }
}

/// What one [`transactional`](PostgresStore::transactional) call did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TxOutcome {
    /// The handler ran and its writes committed together with the completion (with
    /// [`transactional_in`](PostgresStore::transactional_in): will commit with your transaction).
    Executed {
        /// The result the handler returned, now stored and replayed to duplicates.
        result: Bytes,
        /// The lease the handler ran under.
        lease: Lease,
    },
    /// The handler failed: its writes were rolled back, and the failed attempt was recorded
    /// (unless the key moved on meanwhile; see `recorded`).
    HandlerFailed {
        /// The handler's error message, as stored.
        error: String,
        /// Whether it was recorded as retryable.
        retryable: bool,
        /// Whether the failed attempt was recorded. `false` when, between the rollback and the
        /// recording, another worker acquired or finished the key: its state stands. Also `false`
        /// when another transaction held the key locked for longer than
        /// [`lock_timeout`](crate::PostgresConfig::lock_timeout) (a duplicate in transactional
        /// mode took it over): the attempt was not counted, because someone else holds it now.
        recorded: bool,
    },
    /// The key was not acquired, so the handler did not run and nothing was written: the acquire
    /// outcome (never [`AcquireOutcome::Acquired`]).
    NotRun(AcquireOutcome),
}

/// Statements around the acquire in a transaction: the acquire sets `lock_timeout` for the rest
/// of the transaction (`set_config(..., true)`), so the previous value is saved before and put
/// back after it. All three are pipelined: one network round trip.
const SAVE_LOCK_TIMEOUT: &str =
    "SELECT set_config('idem.lock_timeout_before', current_setting('lock_timeout'), true)";
const RESTORE_LOCK_TIMEOUT: &str =
    "SELECT set_config('lock_timeout', current_setting('idem.lock_timeout_before'), true)";

/// Runs a driver future under the client-side timeout, mapping errors.
async fn bounded<T>(
    limit: Duration,
    fut: impl Future<Output = std::result::Result<T, tokio_postgres::Error>>,
) -> Result<T> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r.map_err(map_pg),
        Err(_) => Err(Error::unavailable(STORE, ClientTimeout(limit))),
    }
}

fn typed<'p>(
    params: &[&'p (dyn ToSql + Sync)],
    types: &[Type],
) -> Vec<(&'p (dyn ToSql + Sync), Type)> {
    params.iter().copied().zip(types.iter().cloned()).collect()
}

/// Runs `stmt` on `tx`: prepared through `cache` when there is one, otherwise as one
/// `query_typed` round trip (parse, bind and execute together).
async fn tx_query(
    tx: &Transaction<'_>,
    cache: Option<&StatementCache>,
    stmt: &Stmt,
    params: &[&(dyn ToSql + Sync)],
    limit: Duration,
) -> Result<Vec<Row>> {
    let run = async {
        match cache {
            Some(cache) => {
                let prepared = cache
                    .prepare_typed(tx.client(), &stmt.sql, stmt.types)
                    .await?;
                tx.query(&prepared, params).await
            }
            None => tx.query_typed(&stmt.sql, &typed(params, stmt.types)).await,
        }
    };
    bounded(limit, run).await
}

impl PostgresStore {
    /// Acquires `req.key`, runs `handler` and records its completion, all in one transaction on a
    /// pooled connection, and commits. See the [module docs](self) for the exact semantics.
    ///
    /// `retention` is how long the completion (or a recorded failure) is kept.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] or [`Error::ResultTooLarge`] for bad input (nothing written;
    /// an oversized result rolls the transaction back); [`Error::Unavailable`] when the
    /// database failed underneath (everything rolled back, or, for a failed commit, unknown);
    /// [`Error::LeaseLost`] if the completion was refused (only possible if the handler itself
    /// changed the idem table); [`Error::Backend`] otherwise.
    pub async fn transactional<F>(
        &self,
        req: &AcquireRequest,
        retention: Duration,
        handler: F,
    ) -> Result<TxOutcome>
    where
        F: for<'a> FnOnce(&'a Transaction<'a>, &'a Lease) -> HandlerFuture<'a> + Send,
    {
        req.validate()?;
        check_retention(retention)?;
        let mut client = self.conn().await?;
        let result = self.run_own(&mut client, req, retention, handler).await;
        if client.is_closed() || matches!(result, Err(Error::Unavailable { .. })) {
            // Dead, timed out or in an unknown protocol state: never hand it out again.
            drop(Object::take(client));
        }
        result
    }

    /// [`transactional`](Self::transactional) inside a transaction you opened: runs in a
    /// savepoint of `tx`, and leaves the commit to you. `tx` stays usable whatever happens
    /// (unless its connection died).
    ///
    /// `tx` may be on any connection to the same database, pooled by this store or not (with
    /// `deadpool-postgres`, pass `&mut *transaction`).
    ///
    /// # Errors
    /// As [`transactional`](Self::transactional).
    pub async fn transactional_in<F>(
        &self,
        tx: &mut Transaction<'_>,
        req: &AcquireRequest,
        retention: Duration,
        handler: F,
    ) -> Result<TxOutcome>
    where
        F: for<'a> FnOnce(&'a Transaction<'a>, &'a Lease) -> HandlerFuture<'a> + Send,
    {
        req.validate()?;
        check_retention(retention)?;
        let limit = self.inner.op_timeout;
        let sp = bounded(limit, tx.savepoint("idem_transactional")).await?;
        let lease = match self.acquire_in(&sp, None, req).await {
            Ok(AcquireOutcome::Acquired { lease, .. }) => lease,
            Ok(other) => {
                bounded(limit, sp.rollback()).await?;
                return Ok(TxOutcome::NotRun(other));
            }
            Err(e) => {
                let _ = bounded(limit, sp.rollback()).await;
                return Err(e);
            }
        };
        match handler(&sp, &lease).await {
            Ok(result) => {
                if let Err(e) = self.finish_in(&sp, None, &lease, &result, retention).await {
                    let _ = bounded(limit, sp.rollback()).await;
                    return Err(e);
                }
                bounded(limit, sp.commit()).await?;
                Ok(TxOutcome::Executed { result, lease })
            }
            Err(failure) => {
                if sp.client().is_closed() {
                    return Err(Error::unavailable(STORE, failure));
                }
                bounded(limit, sp.rollback()).await?;
                let client = self.conn().await?;
                let recorded = self
                    .record_failure(
                        &client,
                        &client.statement_cache,
                        req,
                        failure.message(),
                        failure.is_retryable(),
                        retention,
                    )
                    .await;
                if matches!(recorded, Err(Error::Unavailable { .. })) {
                    drop(Object::take(client));
                }
                Ok(TxOutcome::HandlerFailed {
                    error: storable_error(&failure.message, self.limits().max_error_len),
                    retryable: failure.retryable,
                    recorded: recorded?,
                })
            }
        }
    }

    async fn run_own<F>(
        &self,
        client: &mut Object,
        req: &AcquireRequest,
        retention: Duration,
        handler: F,
    ) -> Result<TxOutcome>
    where
        F: for<'a> FnOnce(&'a Transaction<'a>, &'a Lease) -> HandlerFuture<'a> + Send,
    {
        let limit = self.inner.op_timeout;
        let tx = bounded(limit, client.transaction()).await?;
        let cache = tx.statement_cache.clone();
        let lease = match self.acquire_in(&tx, Some(&cache), req).await? {
            AcquireOutcome::Acquired { lease, .. } => lease,
            other => {
                bounded(limit, tx.rollback()).await?;
                return Ok(TxOutcome::NotRun(other));
            }
        };
        let (error, retryable) = match handler(&tx, &lease).await {
            Ok(result) => {
                // On error `tx` is dropped here, which rolls it back.
                self.finish_in(&tx, Some(&cache), &lease, &result, retention)
                    .await?;
                match bounded(limit, tx.commit()).await {
                    Ok(()) => return Ok(TxOutcome::Executed { result, lease }),
                    // Lost connection during commit: outcome unknown.
                    Err(e @ Error::Unavailable { .. }) => return Err(e),
                    // The server refused the commit (a deferred constraint of the business
                    // writes, say): it rolled back; count the attempt like a handler error.
                    Err(e) => (e.to_string(), true),
                }
            }
            Err(failure) => {
                if tx.client().is_closed() {
                    return Err(Error::unavailable(STORE, failure));
                }
                bounded(limit, tx.rollback()).await?;
                (failure.message, failure.retryable)
            }
        };
        let cache = client.statement_cache.clone();
        let recorded = self
            .record_failure(client, &cache, req, &error, retryable, retention)
            .await?;
        Ok(TxOutcome::HandlerFailed {
            error: storable_error(&error, self.limits().max_error_len),
            retryable,
            recorded,
        })
    }

    /// The acquire statement inside a transaction, pipelined between saving and restoring
    /// `lock_timeout`.
    async fn acquire_in(
        &self,
        tx: &Transaction<'_>,
        cache: Option<&StatementCache>,
        req: &AcquireRequest,
    ) -> Result<AcquireOutcome> {
        let limit = self.inner.op_timeout;
        let stmt = &self.inner.sql.acquire;
        // Prepare first, so that the three pipelined requests are sent in order.
        let prepared = match cache {
            Some(cache) => Some(
                bounded(
                    limit,
                    cache.prepare_typed(tx.client(), &stmt.sql, stmt.types),
                )
                .await?,
            ),
            None => None,
        };
        let args = AcquireArgs::new(req);
        let params = args.params(req, &self.inner.lock_timeout_ms);
        for _ in 0..MAX_ROUNDS {
            let save = tx.batch_execute(SAVE_LOCK_TIMEOUT);
            let acquire = async {
                match &prepared {
                    Some(prepared) => tx.query(prepared, &params).await,
                    None => tx.query_typed(&stmt.sql, &typed(&params, stmt.types)).await,
                }
            };
            let restore = tx.batch_execute(RESTORE_LOCK_TIMEOUT);
            let all = async { futures::join!(save, acquire, restore) };
            let (saved, acquired, restored) = tokio::time::timeout(limit, all)
                .await
                .map_err(|_| Error::unavailable(STORE, ClientTimeout(limit)))?;
            let rows = match acquired.map_err(map_pg) {
                Ok(rows) => rows,
                Err(e) if is_lock_timeout(&e) => return Ok(self.locked_outcome()),
                Err(e) => return Err(e),
            };
            saved.map_err(map_pg)?;
            restored.map_err(map_pg)?;
            if let Some(outcome) = acquire_outcome(rows.first(), req)? {
                return Ok(outcome);
            }
        }
        Err(Error::unavailable(STORE, Contention(MAX_ROUNDS)))
    }

    /// The fenced completion inside the transaction.
    async fn finish_in(
        &self,
        tx: &Transaction<'_>,
        cache: Option<&StatementCache>,
        lease: &Lease,
        result: &Bytes,
        retention: Duration,
    ) -> Result<()> {
        self.limits().check_result(result)?;
        let token = lease.token.get() as i64;
        let retention_us = micros(retention);
        let result: &[u8] = result;
        let params: [&(dyn ToSql + Sync); 5] = [
            &lease.key.namespace().as_str(),
            &lease.key.id(),
            &token,
            &result,
            &retention_us,
        ];
        let rows = tx_query(
            tx,
            cache,
            &self.inner.sql.complete,
            &params,
            self.inner.op_timeout,
        )
        .await?;
        let row = rows.first();
        let done = row
            .map(|r| r.try_get::<_, bool>("done"))
            .transpose()
            .map_err(|e| Error::corrupt(STORE, lease.key.to_string(), e.to_string()))?;
        if done == Some(true) {
            return Ok(());
        }
        // Our own transaction holds the row: nobody can have moved it, unless the handler did.
        let current = row
            .and_then(|r| r.try_get::<_, Option<i64>>("current_token").ok().flatten())
            .map(|t| idem_core::FencingToken::new(t as u64));
        Err(Error::LeaseLost {
            key: lease.key.clone(),
            presented: lease.token,
            current,
        })
    }

    /// Counts a failed attempt after the transaction that held it rolled back: one statement, in
    /// autocommit, applied only if the key is still acquirable. Returns whether it was applied.
    ///
    /// The statement waits at most `lock_timeout` on a row locked by an open transaction. A lock
    /// timeout is a definite outcome, not an unavailable store: someone else holds the key now
    /// (their state will stand), and the attempt was not counted, so it returns `Ok(false)`.
    async fn record_failure(
        &self,
        client: &Client,
        cache: &StatementCache,
        req: &AcquireRequest,
        error: &str,
        retryable: bool,
        retention: Duration,
    ) -> Result<bool> {
        let stmt = &self.inner.sql.record_failure;
        let error = storable_error(error, self.limits().max_error_len);
        let fingerprint: Option<&[u8]> = req.fingerprint.as_ref().map(|f| &f.as_bytes()[..]);
        let retention_us = micros(retention);
        let max_attempts = i64::from(req.max_attempts);
        let params: [&(dyn ToSql + Sync); 9] = [
            &req.key.namespace().as_str(),
            &req.key.id(),
            &fingerprint,
            &req.owner,
            &error,
            &retryable,
            &retention_us,
            &max_attempts,
            &self.inner.lock_timeout_ms,
        ];
        let run = async {
            let prepared = cache.prepare_typed(client, &stmt.sql, stmt.types).await?;
            client.execute(&prepared, &params).await
        };
        match bounded(self.inner.op_timeout, run).await {
            Ok(n) => Ok(n > 0),
            Err(e) if is_lock_timeout(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }
}
