//! In-transaction mode: the acquisition, the handler's own statements and the completion commit
//! or roll back together, in one database transaction, driven by the executor's types.
//!
//! For a handler whose effects are writes to the same PostgreSQL database, this gives an
//! exactly-once *effect*: there is no moment at which the business writes are committed but the
//! key is not completed, or the other way round. Unlike
//! [`complete_with`](idem_core::TransactionalStore::complete_with) (the handler returns its
//! statements, which run after it, with the completion), the handler here runs *inside* the
//! transaction: it can read what it is about to change (`SELECT ... FOR UPDATE`), branch on it and
//! write, all under the transaction's locks. See the [crate docs](crate#transactional-effects)
//! for the two side by side.
//!
//! # Driven by the executor
//!
//! An [`InTransaction`] wraps a [`TransactionalExecutor`] over the store and takes everything
//! from it: the configuration ([`ExecutorConfig`]: namespace, owner, attempts, retention, retry
//! delay, result size), key extraction ([`KeySource`](idem_executor::KeySource), including the
//! missing-key policy), the fingerprint ([`FingerprintPolicy`](idem_executor::FingerprintPolicy)),
//! the codec of typed results ([`Codec`]), the handler's error ([`HandlerError`]: retryable by
//! default and with `?`, or terminal), the [`Outcome`] (and so
//! [`BrokerAction::of`](idem_executor::BrokerAction::of)), the [`ExecutorError`]s and the
//! executor's [metric names](idem_executor::metric_names) and `idem` tracing span. The same
//! executor also runs handlers of the other shape, `executor().run(..)` returning a
//! [`Commit`](idem_executor::Commit) of [`PgWrites`](crate::PgWrites).
//!
//! ```no_run
//! # async fn demo(store: idem_postgres::PostgresStore) -> Result<(), Box<dyn std::error::Error>> {
//! use idem_executor::{BrokerAction, ExecutorConfig, HandlerError, Outcome, RawMessage};
//!
//! let payments = store.in_transaction(ExecutorConfig::new("payments"))?;
//! let msg = RawMessage::new(r#"{"amount": 1250}"#).with_header("idempotency-key", "order-42");
//! let result = payments
//!     .run(&msg, |tx, lease| {
//!         Box::pin(async move {
//!             let row = tx
//!                 .query_one("SELECT balance FROM accounts WHERE id = $1 FOR UPDATE", &[&"alice"])
//!                 .await?;
//!             let balance: i64 = row.get(0);
//!             if balance < 1250 {
//!                 return Err(HandlerError::terminal("insufficient funds"));
//!             }
//!             tx.execute(
//!                 "INSERT INTO payments (id, amount, fence) VALUES ($1, $2, $3)",
//!                 &[&lease.key.id(), &1250i64, &(lease.token.get() as i64)],
//!             )
//!             .await?;
//!             Ok(format!("paid with token {}", lease.token))
//!         })
//!     })
//!     .await;
//! match &result {
//!     Ok(Outcome::Executed(receipt) | Outcome::Replayed(receipt)) => println!("{receipt}"),
//!     other => println!("{other:?}"),
//! }
//! let _action = BrokerAction::of(&result); // ack, retry later, or dead-letter
//! # Ok(()) }
//! ```
//!
//! # Semantics
//!
//! [`InTransaction::run`] reads the key and fingerprint of the message, takes a pooled
//! connection and, in ONE transaction:
//!
//! 1. sets the transaction's `idle_in_transaction_session_timeout`
//!    ([`transaction_idle_timeout`](crate::PostgresConfig::transaction_idle_timeout)) and acquires
//!    the key (the same single statement as [`IdempotencyStore::acquire`], waiting at most
//!    [`lock_timeout`](crate::PostgresConfig::lock_timeout) on a row another transaction holds),
//!    pipelined: one round trip after `BEGIN`;
//! 2. when the key was acquired, runs the handler with the transaction and the lease, so its
//!    statements join the transaction (the lease's token is there for fencing other systems);
//! 3. encodes the handler's value with the executor's codec and records the completion (the
//!    fenced `complete` statement);
//! 4. commits.
//!
//! **The lease in this mode.** The record written by the acquisition is not visible to anyone
//! until the commit, and the commit completes it: no other worker ever sees it in progress, so the
//! lease's expiry (the executor's `lease_ttl`, still written in the row) never lets anyone take the
//! key over. What keeps the key is the **row lock** the acquisition holds until the transaction
//! ends: a duplicate waits at most `lock_timeout` on it and answers `InProgress`, for as long as
//! the transaction lives. So no heartbeat is needed, and what bounds a holder is the transaction
//! deadline: `transaction_idle_timeout` (server side: the session is ended when the transaction
//! sits idle that long) and [`transaction_timeout`](crate::PostgresConfig::transaction_timeout)
//! (client side: the bound on the handler, after which the call cancels the running statement,
//! closes the connection and records a retryable failure). Either way the transaction rolls back
//! and the key is free again within the bound. The executor's `heartbeat_interval`,
//! `in_progress_wait` and `effect_refused` do not apply here.
//!
//! What happens when things go wrong:
//!
//! | event | effect | outcome |
//! |---|---|---|
//! | the key is not acquirable (duplicate, conflict, exhausted, terminal failure) | nothing written, handler not run | [`Outcome::Replayed`] (decoded), [`Outcome::Conflict`], [`Outcome::Exhausted`], [`Outcome::Failed`], [`Outcome::ResultNotStored`] |
//! | a concurrent duplicate holds the key in its own open transaction | this call waits at most `lock_timeout` | [`Outcome::InProgress`] (owner [`UNCOMMITTED_OWNER`](crate::UNCOMMITTED_OWNER), `retry_after` = `lock_timeout`) |
//! | the handler returns a [`HandlerError`] | the transaction rolls back (business writes and acquisition), then ONE statement outside it records the failed attempt, retryable or terminal, so poison messages still reach `Exhausted` | [`Outcome::Retry`], [`Outcome::Exhausted`] (retryable, last attempt), [`Outcome::Failed`] (terminal) |
//! | the handler **panics** | caught; rolled back; recorded as a retryable failure (`handler panicked: ...`), as the executor does: a handler that always panics ends `Exhausted` after `max_attempts` | [`Outcome::Retry`] with `panicked: true`, then [`Outcome::Exhausted`] |
//! | the handler outlasts `transaction_timeout` (it awaits something forever, or runs a slow statement) | its future is dropped, its running statement cancelled, the connection closed: rolled back; recorded as a retryable failure | [`Outcome::Retry`] / [`Outcome::Exhausted`] |
//! | the transaction sits idle longer than `transaction_idle_timeout` | the server ends the session: rolled back, the key free at once; the handler's next statement fails | whatever the handler then returns (a `?` on that error: [`Outcome::Retry`]) |
//! | the handler's value cannot be stored (over `max_result_len`, or it does not encode) | rolled back: the effect did not happen; recorded as a terminal failure | [`Outcome::NotCommitted`] with [`CommitRefusal::ResultNotStorable`] |
//! | the server refuses the `COMMIT` (a deferred constraint of the business writes) | rolled back; recorded as a retryable failure | [`Outcome::Retry`] / [`Outcome::Exhausted`] |
//! | between the rollback and the recording, another worker took or finished the key | its state stands, nothing recorded | [`Outcome::LeaseLost`] |
//! | the process crashes, the connection is killed, or the future is dropped, anywhere before commit | PostgreSQL rolls everything back; the key is as it was; no attempt is counted (nothing survives to count it) | [`ExecutorError::Store`] if the call is still there to return |
//! | the commit itself fails on a lost connection | the outcome is unknown: a redelivery answers `Replayed` if it committed, or runs again if not | [`ExecutorError::Store`] at [`StoreStage::Complete`] |
//!
//! A handler that *crashes* the process every time is therefore retried without bound (each crash
//! rolls back its own acquisition); combine with a delivery-count limit in the consumer (Kafka,
//! SQS and RabbitMQ all have one) if such poison messages are possible.
//!
//! Business statements run with the connection's `statement_timeout` and the session's
//! `lock_timeout` (the acquire's lock timeout is put back after it).
//!
//! # With a transaction you opened
//!
//! [`InTransaction::run_in`] does the same inside a savepoint of your transaction, so your earlier
//! statements stay and you decide when to commit: the completion becomes visible with your commit
//! and vanishes with your rollback. A handler failure rolls back to the savepoint (your
//! transaction stays usable) and the failed attempt is recorded on a separate connection from the
//! store's pool (so if your transaction holds a connection of that same pool, leave at least one
//! other free). `transaction_timeout` bounds the handler there too (its statement is cancelled and
//! the savepoint rolled back); `transaction_idle_timeout` is not set, since it would end *your*
//! session: set `idle_in_transaction_session_timeout` yourself if you want one.
//!
//! # For runners
//!
//! A broker runner calls [`InTransaction::handle`] once per message with a registered
//! [`TxHandler`] (message in, [`Outcome`] out) and maps the result with
//! [`BrokerAction::of`](idem_executor::BrokerAction::of), exactly as it does with
//! [`Executor::handle`](idem_executor::Executor::handle):
//!
//! ```no_run
//! # use idem_executor::{BrokerAction, HandlerError, Message, RawMessage};
//! # use idem_postgres::{InTransaction, TxHandler, tx_handler};
//! async fn deliver<H: TxHandler<RawMessage, String>>(
//!     mode: &InTransaction,
//!     handler: &H,
//!     msg: RawMessage,
//! ) -> BrokerAction {
//!     BrokerAction::of(&mode.handle(msg, handler).await)
//! }
//! # async fn demo(mode: InTransaction) {
//! let handler = tx_handler(|msg: RawMessage, tx, lease| {
//!     Box::pin(async move {
//!         let body: &[u8] = msg.payload();
//!         tx.execute("INSERT INTO inbox (id, body) VALUES ($1, $2)", &[&lease.key.id(), &body])
//!             .await?;
//!         Ok::<_, HandlerError>(String::from("stored"))
//!     })
//! });
//! let _ = deliver(&mode, &handler, RawMessage::new("{}").with_header("idempotency-key", "m-1")).await;
//! # }
//! ```

use std::any::Any;
use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::{Object, StatementCache};
use futures::FutureExt;
use idem_core::{
    AcquireOutcome, AcquireRequest, Error, FailureKind, Fingerprint, IdempotencyKey,
    IdempotencyStore, Lease, Result, StateKind,
};
use idem_executor::{
    Codec, CommitRefusal, ConfigError, Executor, ExecutorConfig, ExecutorError, HandlerError,
    JsonCodec, Message, Outcome, StoreStage, TransactionalExecutor, metric_names,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::time::Instant;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{CancelToken, Client, Row, Transaction};
use tracing::{Instrument, Span, field};

use crate::error::{Contention, STORE, is_untranslatable, map_pg, map_store_pg, untranslatable};
use crate::sql::{Names, Stmt};
use crate::store::{
    AcquireArgs, MAX_ROUNDS, PostgresStore, acquire_outcome, failed_state, fenced_outcome,
    is_lock_timeout, micros,
};

/// The future a handler of the in-transaction mode returns: its result, or why it failed. Boxed
/// because it borrows the transaction and the lease it is given.
pub type HandlerFuture<'a, T> =
    Pin<Box<dyn Future<Output = std::result::Result<T, HandlerError>> + Send + 'a>>;

/// A handler registered once with a runner and called for every message whose key the
/// in-transaction mode acquired: the message, the transaction its statements join, and the
/// lease (key, attempt, token). The counterpart of [`idem_executor::Handler`] for
/// [`InTransaction::handle`].
///
/// The returned future borrows the transaction and the lease, not the handler: clone what it
/// needs from `self` (clients, configuration) into it. Build one from a closure with
/// [`tx_handler`], or implement it on a type of your own.
pub trait TxHandler<M, T>: Send + Sync {
    /// Handles one message inside the transaction.
    fn call<'a>(&self, msg: M, tx: &'a Transaction<'a>, lease: &'a Lease) -> HandlerFuture<'a, T>;
}

/// A [`TxHandler`] made of a closure (see [`tx_handler`]).
#[derive(Clone, Copy)]
pub struct FnTxHandler<F>(F);

impl<F> fmt::Debug for FnTxHandler<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnTxHandler")
    }
}

/// Makes a [`TxHandler`] of a closure `|msg, tx, lease| Box::pin(async move { ... })`. (A
/// closure whose future borrows its arguments needs this function's signature to be typed; it
/// cannot implement the trait by itself.)
pub fn tx_handler<M, T, F>(f: F) -> FnTxHandler<F>
where
    F: for<'a> Fn(M, &'a Transaction<'a>, &'a Lease) -> HandlerFuture<'a, T> + Send + Sync,
{
    FnTxHandler(f)
}

impl<M, T, F> TxHandler<M, T> for FnTxHandler<F>
where
    F: for<'a> Fn(M, &'a Transaction<'a>, &'a Lease) -> HandlerFuture<'a, T> + Send + Sync,
{
    fn call<'a>(&self, msg: M, tx: &'a Transaction<'a>, lease: &'a Lease) -> HandlerFuture<'a, T> {
        (self.0)(msg, tx, lease)
    }
}

/// The in-transaction mode of one consumer: a [`TransactionalExecutor`] over the store, whose
/// configuration, key source, fingerprint policy and codec it uses. Cheap to clone. See the
/// [module docs](self).
pub struct InTransaction<C = JsonCodec> {
    executor: TransactionalExecutor<PostgresStore, C>,
}

impl<C> Clone for InTransaction<C> {
    fn clone(&self) -> Self {
        Self {
            executor: self.executor.clone(),
        }
    }
}

impl<C> fmt::Debug for InTransaction<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InTransaction")
            .field("namespace", self.executor.namespace())
            .field("owner", &self.executor.owner())
            .field("store", self.executor.transactional_store())
            .finish()
    }
}

impl PostgresStore {
    /// The [in-transaction mode](crate::transactional) with this executor configuration and the
    /// JSON codec (for another codec, build the executor with
    /// [`Executor::transactional_builder`] and pass it to [`InTransaction::new`]).
    ///
    /// # Errors
    /// A [`ConfigError`] naming the bad field, as [`Executor::transactional`]: among others it
    /// refuses [`MissingKeyPolicy::PassThrough`](idem_executor::MissingKeyPolicy::PassThrough)
    /// and [`StoreErrorPolicy::FailOpen`](idem_executor::StoreErrorPolicy::FailOpen).
    pub fn in_transaction(&self, config: ExecutorConfig) -> Result<InTransaction, ConfigError> {
        Ok(InTransaction::new(Executor::transactional(
            Arc::new(self.clone()),
            config,
        )?))
    }
}

/// What the handler came to.
enum Handled<T> {
    Value(T),
    Error(HandlerError),
    Panicked(String),
    /// It outlasted `transaction_timeout`.
    TimedOut,
}

/// A failure to record after the rollback.
struct Failure {
    error: String,
    kind: FailureKind,
    panicked: bool,
    refusal: Option<CommitRefusal>,
}

impl Failure {
    fn new(error: String, kind: FailureKind) -> Self {
        Self {
            error,
            kind,
            panicked: false,
            refusal: None,
        }
    }
}

/// How a call on a transaction of its own ended: with its outcome, or with a failure to record
/// once the transaction is rolled back (on the same connection, or on a fresh one when that one
/// must be closed).
enum Ended<T> {
    Done(std::result::Result<Outcome<T>, ExecutorError>),
    Record {
        failure: Failure,
        /// The connection must be closed first (it is dead, or a timed-out handler's statement
        /// may still hold it).
        close: bool,
    },
}

impl<C: Codec> InTransaction<C> {
    /// The mode over `executor`'s store, configuration and codec.
    pub fn new(executor: TransactionalExecutor<PostgresStore, C>) -> Self {
        Self { executor }
    }

    /// The executor: its configuration, and its own [`run`](Executor::run) for handlers that
    /// return their statements ([`Commit`](idem_executor::Commit) of [`PgWrites`](crate::PgWrites)).
    pub fn executor(&self) -> &TransactionalExecutor<PostgresStore, C> {
        &self.executor
    }

    /// The store.
    pub fn store(&self) -> &PostgresStore {
        self.executor.transactional_store()
    }

    /// Processes one message: reads its key and fingerprint as the executor's configuration
    /// says, then acquires the key, runs `handler` and records its completion in one transaction
    /// on a pooled connection, and commits. See the [module docs](self) for every outcome.
    ///
    /// `handler` runs at most once, and only when this call acquired the key. Its `Ok` value is
    /// stored through the executor's codec and returned as [`Outcome::Executed`]; duplicates get
    /// it back decoded as [`Outcome::Replayed`].
    ///
    /// # Errors
    /// [`ExecutorError`]: a message without a usable key, a store failure (the handler did not
    /// run, or ran and nothing was committed, or, at the commit, the outcome is unknown), or a
    /// stored result that does not decode.
    pub async fn run<M, T, F>(&self, msg: &M, handler: F) -> Result<Outcome<T>, ExecutorError>
    where
        M: Message,
        T: Serialize + DeserializeOwned + Send,
        F: for<'a> FnOnce(&'a Transaction<'a>, &'a Lease) -> HandlerFuture<'a, T> + Send,
    {
        let prepared = self.prepare(msg);
        self.process(prepared, None, handler).await
    }

    /// [`run`](Self::run) inside a transaction you opened: runs in a savepoint of `tx`, and leaves
    /// the commit to you. `tx` stays usable whatever happens (unless its connection died).
    ///
    /// `tx` may be on any connection to the same database, pooled by this store or not (with
    /// `deadpool-postgres`, pass `&mut *transaction`).
    ///
    /// # Errors
    /// As [`run`](Self::run).
    pub async fn run_in<M, T, F>(
        &self,
        tx: &mut Transaction<'_>,
        msg: &M,
        handler: F,
    ) -> Result<Outcome<T>, ExecutorError>
    where
        M: Message,
        T: Serialize + DeserializeOwned + Send,
        F: for<'a> FnOnce(&'a Transaction<'a>, &'a Lease) -> HandlerFuture<'a, T> + Send,
    {
        let prepared = self.prepare(msg);
        self.process(prepared, Some(tx), handler).await
    }

    /// The entry point of a broker runner: [`run`](Self::run) with a registered [`TxHandler`],
    /// which is given the message itself (moved in once its key and fingerprint are read).
    ///
    /// # Errors
    /// As [`run`](Self::run).
    pub async fn handle<M, H, T>(&self, msg: M, handler: &H) -> Result<Outcome<T>, ExecutorError>
    where
        M: Message + Send,
        H: TxHandler<M, T>,
        T: Serialize + DeserializeOwned + Send,
    {
        let prepared = self.prepare(&msg);
        self.process(prepared, None, move |tx, lease| {
            handler.call(msg, tx, lease)
        })
        .await
    }

    /// Like [`run`](Self::run) for a caller that extracted the key id and computed the
    /// fingerprint itself (`None`: no conflict detection).
    ///
    /// # Errors
    /// As [`run`](Self::run); [`ExecutorError::InvalidKey`] when `id` is not a valid key id.
    pub async fn run_with_key<T, F>(
        &self,
        id: &str,
        fingerprint: Option<Fingerprint>,
        handler: F,
    ) -> Result<Outcome<T>, ExecutorError>
    where
        T: Serialize + DeserializeOwned + Send,
        F: for<'a> FnOnce(&'a Transaction<'a>, &'a Lease) -> HandlerFuture<'a, T> + Send,
    {
        let prepared = self
            .executor
            .namespace()
            .key(id)
            .map(|key| (key, fingerprint))
            .map_err(ExecutorError::InvalidKey);
        self.process(prepared, None, handler).await
    }

    /// The key and fingerprint of `msg`, by the executor's key source, missing-key policy (a
    /// transactional executor only rejects) and fingerprint policy.
    fn prepare<M: Message>(
        &self,
        msg: &M,
    ) -> Result<(IdempotencyKey, Option<Fingerprint>), ExecutorError> {
        let msg: &dyn Message = msg;
        let config = self.executor.config();
        let id = config
            .key_source
            .extract(msg)?
            .ok_or(ExecutorError::MissingKey)?;
        let key = self
            .executor
            .namespace()
            .key(id)
            .map_err(ExecutorError::InvalidKey)?;
        Ok((key, config.fingerprint.compute(msg)?))
    }

    /// Runs a prepared message in its span, then records the outcome on the span and in the
    /// metrics.
    async fn process<T, F>(
        &self,
        prepared: Result<(IdempotencyKey, Option<Fingerprint>), ExecutorError>,
        caller: Option<&mut Transaction<'_>>,
        handler: F,
    ) -> Result<Outcome<T>, ExecutorError>
    where
        T: Serialize + DeserializeOwned + Send,
        F: for<'a> FnOnce(&'a Transaction<'a>, &'a Lease) -> HandlerFuture<'a, T> + Send,
    {
        let span = tracing::info_span!(
            "idem",
            namespace = %self.executor.namespace(),
            mode = "in_transaction",
            key = field::Empty,
            attempt = field::Empty,
            token = field::Empty,
            outcome = field::Empty,
        );
        let run = async {
            let (key, fingerprint) = prepared?;
            Span::current().record("key", key.id());
            let config = self.executor.config();
            let req = AcquireRequest::new(key, self.executor.owner())
                .with_fingerprint(fingerprint)
                .with_lease_ttl(config.lease_ttl)
                .with_max_attempts(config.max_attempts);
            match caller {
                None => self.own(&req, handler).await,
                Some(tx) => self.in_caller(tx, &req, handler).await,
            }
        };
        let result = run.instrument(span.clone()).await;
        self.observe(&result, &span);
        result
    }

    /// [`run`](Self::run) on a transaction of its own.
    async fn own<T, F>(
        &self,
        req: &AcquireRequest,
        handler: F,
    ) -> std::result::Result<Outcome<T>, ExecutorError>
    where
        T: Serialize + DeserializeOwned + Send,
        F: for<'a> FnOnce(&'a Transaction<'a>, &'a Lease) -> HandlerFuture<'a, T> + Send,
    {
        let store = self.store();
        let started = Instant::now();
        let mut client = store
            .conn()
            .await
            .map_err(|e| self.store_error(StoreStage::Acquire, false, e))?;
        match self.own_on(&mut client, req, started, handler).await {
            Ended::Done(result) => {
                let unavailable = matches!(
                    &result,
                    Err(ExecutorError::Store {
                        source: Error::Unavailable { .. },
                        ..
                    })
                );
                if unavailable || client.is_closed() {
                    // Dead, timed out or in an unknown protocol state: never hand it out again.
                    drop(Object::take(client));
                }
                result
            }
            Ended::Record { failure, close } => {
                if close || client.is_closed() {
                    // Closing it ends its transaction on the server, which frees the key.
                    drop(Object::take(client));
                    self.record_apart(req, failure).await
                } else {
                    self.record(&client, req, failure).await
                }
            }
        }
    }

    async fn own_on<T, F>(
        &self,
        client: &mut Object,
        req: &AcquireRequest,
        started: Instant,
        handler: F,
    ) -> Ended<T>
    where
        T: Serialize + DeserializeOwned + Send,
        F: for<'a> FnOnce(&'a Transaction<'a>, &'a Lease) -> HandlerFuture<'a, T> + Send,
    {
        let store = self.store();
        let limit = store.inner.op_timeout;
        let acquire_error = |e| Ended::Done(Err(self.store_error(StoreStage::Acquire, false, e)));
        let cancel = client.cancel_token();
        let tx = match bounded(limit, client.transaction()).await {
            Ok(tx) => tx,
            Err(e) => return acquire_error(e),
        };
        let cache = tx.statement_cache.clone();
        let (lease, takeover) = match store.acquire_in(&tx, Some(&cache), req, true).await {
            Ok(AcquireOutcome::Acquired { lease, takeover }) => (lease, takeover),
            Ok(other) => {
                if let Err(e) = bounded(limit, tx.rollback()).await {
                    return acquire_error(e);
                }
                return Ended::Done(self.not_acquired(other, &req.key));
            }
            Err(e) => return acquire_error(e),
        };
        self.leased(&lease, takeover);
        let handled = self.call(&tx, &lease, started, &cancel, handler).await;
        let (failure, close) = match handled {
            Handled::Value(value) => {
                let bytes = match self.encode(&value) {
                    Ok(bytes) => bytes,
                    Err(refusal) => {
                        let close = bounded(limit, tx.rollback()).await.is_err();
                        return Ended::Record {
                            failure: not_committed(refusal),
                            close,
                        };
                    }
                };
                let retention = self.executor.config().retention;
                match store
                    .finish_in(&tx, Some(&cache), &lease, &bytes, retention)
                    .await
                {
                    Ok(()) => {}
                    // Only the handler itself can have moved the record under this row lock.
                    Err(e) if e.is_lease_lost() => {
                        tracing::warn!(error = %e, "completion refused: the handler changed the record");
                        drop(tx); // rolls back
                        return Ended::Done(Ok(self.lease_lost()));
                    }
                    // `tx` is dropped, which rolls it back (or the connection is dropped).
                    Err(e) => {
                        return Ended::Done(Err(self.store_error(StoreStage::Complete, true, e)));
                    }
                }
                match bounded(limit, tx.commit()).await {
                    Ok(()) => return Ended::Done(Ok(Outcome::Executed(value))),
                    // Lost connection during the commit: the outcome is unknown.
                    Err(e @ Error::Unavailable { .. }) => {
                        return Ended::Done(Err(self.store_error(StoreStage::Complete, true, e)));
                    }
                    // The server refused the commit (a deferred constraint of the business
                    // writes, say) and rolled back: the attempt counts like a handler error.
                    Err(e) => (
                        Failure::new(
                            format!("the commit was refused: {e}"),
                            FailureKind::Retryable,
                        ),
                        false,
                    ),
                }
            }
            Handled::Error(e) => {
                let close = bounded(limit, tx.rollback()).await.is_err();
                (Failure::new(e.message(), kind_of(&e)), close)
            }
            Handled::Panicked(message) => {
                self.count(metric_names::PANICS);
                let close = bounded(limit, tx.rollback()).await.is_err();
                (
                    Failure {
                        panicked: true,
                        ..Failure::new(panicked(&message), FailureKind::Retryable)
                    },
                    close,
                )
            }
            Handled::TimedOut => {
                // The statement it ran, if any, is cancelled; closing the connection ends the
                // transaction on the server whatever state it is in.
                drop(tx);
                (
                    Failure::new(self.timed_out_text(), FailureKind::Retryable),
                    true,
                )
            }
        };
        Ended::Record { failure, close }
    }

    /// [`run_in`](Self::run_in): in a savepoint of the caller's transaction.
    async fn in_caller<T, F>(
        &self,
        tx: &mut Transaction<'_>,
        req: &AcquireRequest,
        handler: F,
    ) -> std::result::Result<Outcome<T>, ExecutorError>
    where
        T: Serialize + DeserializeOwned + Send,
        F: for<'a> FnOnce(&'a Transaction<'a>, &'a Lease) -> HandlerFuture<'a, T> + Send,
    {
        let store = self.store();
        let started = Instant::now();
        let limit = store.inner.op_timeout;
        let acquire_error = |e| self.store_error(StoreStage::Acquire, false, e);
        let cancel = tx.cancel_token();
        let sp = bounded(limit, tx.savepoint("idem_transactional"))
            .await
            .map_err(acquire_error)?;
        let (lease, takeover) = match store.acquire_in(&sp, None, req, false).await {
            Ok(AcquireOutcome::Acquired { lease, takeover }) => (lease, takeover),
            Ok(other) => {
                bounded(limit, sp.rollback()).await.map_err(acquire_error)?;
                return self.not_acquired(other, &req.key);
            }
            Err(e) => {
                let _ = bounded(limit, sp.rollback()).await;
                return Err(acquire_error(e));
            }
        };
        self.leased(&lease, takeover);
        let handled = self.call(&sp, &lease, started, &cancel, handler).await;
        let failure = match handled {
            Handled::Value(value) => match self.encode(&value) {
                Err(refusal) => not_committed(refusal),
                Ok(bytes) => {
                    let retention = self.executor.config().retention;
                    if let Err(e) = store.finish_in(&sp, None, &lease, &bytes, retention).await {
                        let _ = bounded(limit, sp.rollback()).await;
                        if e.is_lease_lost() {
                            tracing::warn!(error = %e, "completion refused: the handler changed the record");
                            return Ok(self.lease_lost());
                        }
                        return Err(self.store_error(StoreStage::Complete, true, e));
                    }
                    bounded(limit, sp.commit())
                        .await
                        .map_err(|e| self.store_error(StoreStage::Complete, true, e))?;
                    return Ok(Outcome::Executed(value));
                }
            },
            Handled::Error(e) => Failure::new(e.message(), kind_of(&e)),
            Handled::Panicked(message) => {
                self.count(metric_names::PANICS);
                Failure {
                    panicked: true,
                    ..Failure::new(panicked(&message), FailureKind::Retryable)
                }
            }
            Handled::TimedOut => Failure::new(self.timed_out_text(), FailureKind::Retryable),
        };
        if !sp.client().is_closed() {
            bounded(limit, sp.rollback())
                .await
                .map_err(|e| self.store_error(StoreStage::Fail, true, e))?;
        }
        self.record_apart(req, failure).await
    }

    /// Runs the handler on `tx`, catching a panic, bounded by what remains of
    /// `transaction_timeout`. When the bound passes, the handler's future is dropped and the
    /// statement it was running, if any, is cancelled.
    async fn call<T, F>(
        &self,
        tx: &Transaction<'_>,
        lease: &Lease,
        started: Instant,
        cancel: &CancelToken,
        handler: F,
    ) -> Handled<T>
    where
        F: for<'a> FnOnce(&'a Transaction<'a>, &'a Lease) -> HandlerFuture<'a, T> + Send,
    {
        let timeout = self.store().inner.config.transaction_timeout;
        let run = AssertUnwindSafe(async move { handler(tx, lease).await }).catch_unwind();
        match tokio::time::timeout_at(started + timeout, run).await {
            Ok(Ok(Ok(value))) => Handled::Value(value),
            Ok(Ok(Err(e))) => Handled::Error(e),
            Ok(Err(payload)) => Handled::Panicked(panic_message(&*payload)),
            Err(_) => {
                tracing::warn!(
                    ?timeout,
                    "transaction deadline passed: handler dropped, its statement cancelled"
                );
                self.store().cancel(cancel).await;
                Handled::TimedOut
            }
        }
    }

    /// The stored result of a key the acquire did not take, as the executor reports it.
    fn not_acquired<T: DeserializeOwned>(
        &self,
        outcome: AcquireOutcome,
        key: &IdempotencyKey,
    ) -> std::result::Result<Outcome<T>, ExecutorError> {
        Ok(match outcome {
            AcquireOutcome::Replayed { result } => self
                .executor
                .codec()
                .decode(&result)
                .map(Outcome::Replayed)
                .map_err(|source| ExecutorError::Decode {
                    key: key.clone(),
                    source,
                })?,
            AcquireOutcome::InProgress { owner, retry_after } => {
                Outcome::InProgress { owner, retry_after }
            }
            AcquireOutcome::Conflict => Outcome::Conflict,
            AcquireOutcome::Exhausted {
                attempts,
                last_error,
            } => Outcome::Exhausted {
                attempts,
                last_error,
            },
            AcquireOutcome::Failed {
                error,
                kind: FailureKind::ResultNotStored,
            } => Outcome::ResultNotStored { error },
            AcquireOutcome::Failed { error, .. } => Outcome::Failed { error },
            other => {
                return Err(self.store_error(
                    StoreStage::Acquire,
                    false,
                    Error::backend(STORE, format!("unknown acquire outcome {:?}", other.name())),
                ));
            }
        })
    }

    /// Records the lease on the span, and counts a takeover.
    fn leased(&self, lease: &Lease, takeover: bool) {
        let span = Span::current();
        span.record("attempt", lease.attempt);
        span.record("token", lease.token.get());
        if takeover {
            self.count(metric_names::TAKEOVERS);
            tracing::info!(attempt = lease.attempt, "took over an expired lease");
        }
    }

    /// The handler's value as stored bytes, or why it cannot be stored.
    fn encode<T: Serialize>(&self, value: &T) -> std::result::Result<Bytes, CommitRefusal> {
        let max = self.executor.max_result_len();
        match self.executor.codec().encode(value) {
            Ok(bytes) if bytes.len() <= max => Ok(Bytes::from(bytes)),
            Ok(bytes) => Err(CommitRefusal::ResultNotStorable {
                reason: format!(
                    "the result of {} bytes is over the limit of {max} bytes",
                    bytes.len()
                ),
            }),
            Err(e) => Err(CommitRefusal::ResultNotStorable {
                reason: format!("the result does not encode: {e}"),
            }),
        }
    }

    fn lease_lost<T>(&self) -> Outcome<T> {
        Outcome::LeaseLost {
            retry_after: self.executor.config().retry_delay,
        }
    }

    fn store_error(&self, stage: StoreStage, handler_ran: bool, source: Error) -> ExecutorError {
        // A key the database cannot hold: an invalid key, dead-lettered, as the executor does.
        if stage == StoreStage::Acquire
            && matches!(source, Error::InvalidInput { field: "key", .. })
        {
            return ExecutorError::InvalidKey(source);
        }
        ExecutorError::Store {
            stage,
            handler_ran,
            retry_after: self.executor.config().retry_delay,
            source,
        }
    }

    fn timed_out_text(&self) -> String {
        format!(
            "transaction deadline passed: the handler did not finish within {:?}              (transaction_timeout); rolled back",
            self.store().inner.config.transaction_timeout
        )
    }

    /// Records a failed attempt on a pooled connection of its own.
    async fn record_apart<T>(
        &self,
        req: &AcquireRequest,
        failure: Failure,
    ) -> std::result::Result<Outcome<T>, ExecutorError> {
        let client = self
            .store()
            .conn()
            .await
            .map_err(|e| self.store_error(StoreStage::Fail, true, e))?;
        let result = self.record(&client, req, failure).await;
        if matches!(
            &result,
            Err(ExecutorError::Store {
                source: Error::Unavailable { .. },
                ..
            })
        ) || client.is_closed()
        {
            drop(Object::take(client));
        }
        result
    }

    /// Records a failed attempt (outside the rolled-back transaction) and reports it as the
    /// executor does: [`Outcome::Retry`], [`Outcome::Exhausted`] (a retryable failure that used
    /// the last attempt), [`Outcome::Failed`], [`Outcome::NotCommitted`], or
    /// [`Outcome::LeaseLost`] when the key moved on meanwhile and nothing was recorded.
    async fn record<T>(
        &self,
        client: &Object,
        req: &AcquireRequest,
        failure: Failure,
    ) -> std::result::Result<Outcome<T>, ExecutorError> {
        let config = self.executor.config();
        let store = self.store();
        // Whatever the handler said, the failure must be storable: NUL escaped, cut to the limit.
        let mut error = store.limits().fit_error(&failure.error).into_owned();
        let record = |error: &str| {
            let error = error.to_owned();
            async move {
                store
                    .record_failure(
                        client,
                        &client.statement_cache,
                        req,
                        &error,
                        failure.kind,
                        config.retention,
                    )
                    .await
            }
        };
        let mut recorded = record(&error).await;
        if let Err(Error::InvalidInput { field: "error", .. }) = &recorded {
            // The database cannot hold a character of the text: the failure must be recorded
            // (its attempt counted), so it is written again in ASCII, as the executor does.
            error = store.limits().fit_error_ascii(&error);
            tracing::warn!(%error, "the store refused the failure's text: recorded in ASCII");
            recorded = record(&error).await;
        }
        let recorded = recorded.map_err(|e| self.store_error(StoreStage::Fail, true, e))?;
        let Some(attempts) = recorded else {
            tracing::warn!("failure not recorded: another worker holds or finished the key");
            return Ok(self.lease_lost());
        };
        Ok(match (failure.kind, failure.refusal) {
            (FailureKind::Retryable, _) if attempts >= config.max_attempts => Outcome::Exhausted {
                attempts,
                last_error: Some(error),
            },
            (kind, Some(refusal)) => Outcome::NotCommitted {
                refusal,
                kind,
                attempt: attempts,
                error,
                retry_after: config.retry_delay,
            },
            (FailureKind::Retryable, None) => {
                self.count(metric_names::RETRYABLE_FAILURES);
                Outcome::Retry {
                    attempt: attempts,
                    error,
                    panicked: failure.panicked,
                    retry_after: config.retry_delay,
                }
            }
            (_, None) => Outcome::Failed { error },
        })
    }

    /// Increments the executor's counter `name`, labelled with the namespace.
    fn count(&self, name: &'static str) {
        metrics::counter!(name, "namespace" => self.executor.namespace().as_str().to_owned())
            .increment(1);
    }

    /// Records the outcome on the span, counts it under the executor's metric names, and logs it.
    fn observe<T>(&self, result: &std::result::Result<Outcome<T>, ExecutorError>, span: &Span) {
        match result {
            Ok(outcome) => {
                let name = outcome.name();
                span.record("outcome", name);
                let counter = match outcome {
                    Outcome::Executed(_) => Some(metric_names::EXECUTED),
                    Outcome::Replayed(_) => Some(metric_names::REPLAYED),
                    Outcome::InProgress { .. } => Some(metric_names::IN_PROGRESS),
                    Outcome::Conflict => Some(metric_names::CONFLICTS),
                    Outcome::Exhausted { .. } => Some(metric_names::EXHAUSTED),
                    Outcome::Failed { .. } => Some(metric_names::FAILED),
                    Outcome::ResultNotStored { .. } => Some(metric_names::RESULT_NOT_STORED),
                    Outcome::LeaseLost { .. } => Some(metric_names::LEASE_LOST),
                    Outcome::NotCommitted { .. } => Some(metric_names::NOT_COMMITTED),
                    // Counted as `RETRYABLE_FAILURES` when recorded.
                    _ => None,
                };
                if let Some(counter) = counter {
                    self.count(counter);
                }
                match outcome {
                    Outcome::Executed(_) | Outcome::Replayed(_) | Outcome::InProgress { .. } => {
                        tracing::debug!(parent: span, outcome = name, "message processed");
                    }
                    Outcome::Retry { error, .. } => {
                        tracing::warn!(parent: span, outcome = name, %error, "handler failed, will retry");
                    }
                    Outcome::Exhausted { last_error, .. } => tracing::warn!(
                        parent: span,
                        outcome = name,
                        last_error,
                        "poison message: attempts exhausted"
                    ),
                    _ => tracing::warn!(parent: span, outcome = name, "message processed"),
                }
            }
            Err(e) => {
                span.record("outcome", "error");
                if matches!(e, ExecutorError::Store { .. }) {
                    self.count(metric_names::STORE_ERRORS);
                }
                tracing::warn!(parent: span, error = %e, "message not processed");
            }
        }
    }
}

/// A result that cannot be stored: nothing is committed, recorded as a terminal failure.
fn not_committed(refusal: CommitRefusal) -> Failure {
    Failure {
        error: format!("nothing committed: {refusal}"),
        kind: FailureKind::Terminal,
        panicked: false,
        refusal: Some(refusal),
    }
}

fn kind_of(e: &HandlerError) -> FailureKind {
    if e.is_terminal() {
        FailureKind::Terminal
    } else {
        FailureKind::Retryable
    }
}

/// The error recorded for a handler that panicked with `message` (the executor's words).
fn panicked(message: &str) -> String {
    format!("handler panicked: {message}")
}

/// The message of a panic payload.
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_owned()
    }
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
        Err(_) => Err(Error::timed_out(STORE, limit)),
    }
}

/// [`bounded`] for one of the store's own statements: a missing or outdated schema is
/// [`Error::NotSetUp`].
async fn bounded_store<T>(
    limit: Duration,
    names: &Names,
    fut: impl Future<Output = std::result::Result<T, tokio_postgres::Error>>,
) -> Result<T> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r.map_err(|e| map_store_pg(e, names)),
        Err(_) => Err(Error::timed_out(STORE, limit)),
    }
}

fn typed<'p>(
    params: &[&'p (dyn ToSql + Sync)],
    types: &[Type],
) -> Vec<(&'p (dyn ToSql + Sync), Type)> {
    params.iter().copied().zip(types.iter().cloned()).collect()
}

/// Runs `stmt` (one of the store's statements) on `tx`: prepared through `cache` when there is
/// one, otherwise as one `query_typed` round trip (parse, bind and execute together).
async fn tx_query(
    tx: &Transaction<'_>,
    cache: Option<&StatementCache>,
    stmt: &Stmt,
    params: &[&(dyn ToSql + Sync)],
    limit: Duration,
    names: &Names,
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
    bounded_store(limit, names, run).await
}

impl PostgresStore {
    /// The acquire statement inside a transaction, pipelined between saving and restoring
    /// `lock_timeout`; in a transaction of the mode's own (`own`), the save also sets the
    /// transaction's `idle_in_transaction_session_timeout`.
    async fn acquire_in(
        &self,
        tx: &Transaction<'_>,
        cache: Option<&StatementCache>,
        req: &AcquireRequest,
        own: bool,
    ) -> Result<AcquireOutcome> {
        let limit = self.inner.op_timeout;
        let stmt = &self.inner.sql.acquire;
        // Prepare first, so that the three pipelined requests are sent in order.
        let prepared = match cache {
            Some(cache) => Some(
                bounded_store(
                    limit,
                    &self.inner.names,
                    cache.prepare_typed(tx.client(), &stmt.sql, stmt.types),
                )
                .await?,
            ),
            None => None,
        };
        let save: Cow<'_, str> = if own {
            Cow::Owned(format!(
                "SELECT set_config('idle_in_transaction_session_timeout', '{}', true); {SAVE_LOCK_TIMEOUT}",
                self.inner.config.transaction_idle_timeout.as_millis()
            ))
        } else {
            Cow::Borrowed(SAVE_LOCK_TIMEOUT)
        };
        let args = AcquireArgs::new(req);
        let params = args.params(req, &self.inner.lock_timeout_ms);
        for _ in 0..MAX_ROUNDS {
            let save = tx.batch_execute(&save);
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
                .map_err(|_| Error::timed_out(STORE, limit))?;
            let rows = match acquired.map_err(|e| map_store_pg(e, &self.inner.names)) {
                Ok(rows) => rows,
                Err(e) if is_lock_timeout(&e) => return Ok(self.locked_outcome()),
                Err(e) if is_untranslatable(&e) => return Err(self.key_refused(req, e).await),
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
        self.limits().check_complete(result, retention)?;
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
            &self.inner.names,
        )
        .await?;
        // Our own transaction holds the row: nobody can have moved it, unless the handler did
        // (then the statement's snapshot, taken after the handler's writes, shows what it did).
        match fenced_outcome(rows.first(), lease)? {
            Some(done) => done.map(drop),
            None => Err(Error::lease_lost(
                lease,
                Some((lease.token, StateKind::InProgress)),
            )),
        }
    }

    /// Counts a failed attempt after the transaction that held it rolled back: one statement, in
    /// autocommit, applied only if the key is still acquirable. Returns the attempts recorded, or
    /// `None` when it was not applied.
    ///
    /// The statement waits at most `lock_timeout` on a row locked by an open transaction. A lock
    /// timeout is a definite outcome, not an unavailable store: someone else holds the key now
    /// (their state will stand), and the attempt was not counted, so it returns `Ok(None)`.
    async fn record_failure(
        &self,
        client: &Client,
        cache: &StatementCache,
        req: &AcquireRequest,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<Option<u32>> {
        let stmt = &self.inner.sql.record_failure;
        let state = failed_state(kind);
        let fingerprint: Option<&[u8]> = req.fingerprint.as_ref().map(|f| &f.as_bytes()[..]);
        let retention_us = micros(retention);
        let max_attempts = i64::from(req.max_attempts);
        let params: [&(dyn ToSql + Sync); 9] = [
            &req.key.namespace().as_str(),
            &req.key.id(),
            &fingerprint,
            &req.owner,
            &error,
            &state,
            &retention_us,
            &max_attempts,
            &self.inner.lock_timeout_ms,
        ];
        let run = async {
            let prepared = cache.prepare_typed(client, &stmt.sql, stmt.types).await?;
            client.query(&prepared, &params).await
        };
        match bounded_store(self.inner.op_timeout, &self.inner.names, run).await {
            Ok(rows) => match rows.first() {
                None => Ok(None),
                Some(row) => {
                    let attempts: i32 = row.try_get(0).map_err(|e| {
                        Error::corrupt(STORE, req.key.to_string(), format!("attempts: {e}"))
                    })?;
                    Ok(Some(u32::try_from(attempts).unwrap_or(0)))
                }
            },
            Err(e) if is_lock_timeout(&e) => Ok(None),
            Err(e) if is_untranslatable(&e) => Err(untranslatable("error", &e)),
            Err(e) => Err(e),
        }
    }
}
