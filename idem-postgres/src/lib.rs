//! The PostgreSQL store of `idem`: [`PostgresStore`], an
//! [`IdempotencyStore`](idem_core::IdempotencyStore) with one SQL statement per transition, a
//! crate-owned versioned schema, a batched retention sweeper, and a
//! [transactional mode](transactional) that commits the business writes and the idempotency
//! record together.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_core::{AcquireOutcome, AcquireRequest, Bytes, IdempotencyStore, Namespace};
//! use idem_postgres::{PostgresConfig, PostgresStore};
//!
//! # async fn demo() -> idem_core::Result<()> {
//! let store = PostgresStore::connect(PostgresConfig::new("postgres://app@127.0.0.1/app")?).await?;
//! store.migrate().await?; // once, at deploy time or start-up
//!
//! let key = Namespace::new("payments")?.key("order-42")?;
//! match store.acquire(&AcquireRequest::new(key, "worker-1")).await? {
//!     AcquireOutcome::Acquired { lease, .. } => {
//!         // ... do the work ...
//!         store.complete(&lease, Bytes::from_static(b"ok"), Duration::from_secs(86_400)).await?;
//!     }
//!     other => println!("not this time: {}", other.name()),
//! }
//! # Ok(()) }
//! ```
//!
//! # Table layout
//!
//! [`PostgresStore::migrate`] creates (in the configured schema, `idem` by default, and table,
//! `records` by default; [`ddl`] prints it for any names):
//!
//! ```sql
//! CREATE SCHEMA IF NOT EXISTS "idem";
//! CREATE SEQUENCE IF NOT EXISTS "idem"."records_token_seq" AS bigint MINVALUE 1 NO CYCLE;
//! CREATE TABLE IF NOT EXISTS "idem"."records" (
//!     namespace        text        NOT NULL,
//!     id               text        NOT NULL,
//!     state            text        NOT NULL CHECK (state IN ('in_progress', 'released',
//!                                     'completed', 'failed_retryable', 'failed_terminal')),
//!     fingerprint      bytea       CHECK (octet_length(fingerprint) = 32),   -- SHA-256 or NULL
//!     token            bigint      NOT NULL CHECK (token > 0),               -- fencing token
//!     owner            text        NOT NULL,
//!     attempts         integer     NOT NULL CHECK (attempts >= 0),
//!     lease_expires_at timestamptz CHECK ((state = 'in_progress') = (lease_expires_at IS NOT NULL)),
//!     result           bytea       CHECK ((state = 'completed') = (result IS NOT NULL)),
//!     error            text        CHECK ((state LIKE 'failed%') = (error IS NOT NULL)),
//!     created_at       timestamptz NOT NULL,
//!     updated_at       timestamptz NOT NULL,
//!     expires_at       timestamptz CHECK ((state IN ('in_progress', 'released')) = (expires_at IS NULL)),
//!     PRIMARY KEY (namespace, id));
//! CREATE INDEX IF NOT EXISTS "records_expires_at_idx" ON "idem"."records" (expires_at)
//!     WHERE expires_at IS NOT NULL;
//! -- bookkeeping: which schema versions were applied
//! CREATE TABLE IF NOT EXISTS "idem"."records_migrations" (
//!     version integer PRIMARY KEY, description text NOT NULL,
//!     applied_at timestamptz NOT NULL DEFAULT now());
//! ```
//!
//! The raw key id is stored as it came (`text`), so operators can read it; the namespace is a
//! separate column of the primary key. `expires_at` is the retention deadline: `NULL` while the
//! record is in progress or released (such records are kept until finished, so the attempt count
//! of a poison message is never lost). Schema and table names must be plain identifiers
//! (`^[a-z_][a-z0-9_]*$`, schema at most 63 bytes and not `pg_*`, table at most 48 so the derived
//! names fit), are validated before any statement runs, and are double-quoted in SQL. Keys,
//! owners, results and errors are only ever bound parameters.
//!
//! Migrations run in one transaction under a `pg_advisory_xact_lock`, so several processes may
//! call `migrate` at once; each version is applied once and recorded in `<table>_migrations`.
//!
//! # Tokens
//!
//! Every acquisition takes `nextval` of the table's sequence. Sequence values are never handed
//! out twice, not even by rolled-back transactions, so tokens are strictly increasing per key
//! over its whole life, across deletes, expiry and purges. (They are also increasing across keys,
//! which the contract allows.)
//!
//! When an acquisition overwrites an existing record (a takeover, a retry, a re-acquisition past
//! retention) its token is drawn in `ON CONFLICT ... DO UPDATE SET`, that is after it holds the
//! row lock, so it is greater than the token of any holder that had the row locked meanwhile,
//! including a holder in [transactional mode](transactional) that handed its token to another
//! system and then rolled back. A freshly inserted record keeps the token drawn before its insert: if that
//! insert waited on a concurrent, still uncommitted insert of the same key which then rolled back,
//! the new record's token may be smaller than that rolled-back one (which was never committed).
//!
//! # Clock
//!
//! Leases and retention are judged on the server's clock, read once per statement as
//! `clock_timestamp()` in a materialized CTE and used for every comparison and every timestamp
//! that statement writes. Not `now()`: `now()` is the start of the *transaction*, and in
//! [transactional mode](transactional) the completion is written after the handler ran, possibly
//! seconds later; in a transaction you opened yourself the acquire could even run long after
//! `BEGIN`. With `now()` such a statement would judge other workers' leases against a stale
//! instant and start leases and retention in the past. `clock_timestamp()` is the real time at
//! the statement, in autocommit and inside transactions alike. (The sweeper compares against the
//! same instant through an InitPlan, so its range scan still uses the index.)
//!
//! # Round trips
//!
//! Each transition is one statement, sent as one prepared-statement execution (statements are
//! prepared once per connection and cached by `deadpool-postgres`):
//!
//! - **acquire** is `WITH clk, old AS (SELECT ... ctid ...), up AS (INSERT ... SELECT ... WHERE
//!   <acquirable per old> ON CONFLICT (namespace, id) DO UPDATE ... WHERE <the locked row is the
//!   version old read> AND <acquirable> RETURNING ...) SELECT <up and old>`. When it wrote, the
//!   caller holds the key; when it did not, `old` is the record as it stood, and the outcome
//!   (replay, busy, conflict, exhausted, terminal failure) is classified from it by the reference
//!   rules of [`idem_core::machine`]. A duplicate therefore costs one round trip and takes no
//!   lock and writes nothing.
//! - **extend / complete / fail / release** are `UPDATE ... WHERE namespace, id, token =
//!   $token AND state = 'in_progress' AND <not past retention>`, in a CTE whose outer query also
//!   returns the current token, so `LeaseLost` needs no second query.
//!
//! Under READ COMMITTED a statement's snapshot and the row it locks can differ when another
//! writer commits in between (for instance 64 workers racing to insert the same fresh key). The
//! statements detect that (the insert wrote nothing although `old` said it should have, or a
//! fenced update matched nothing although the snapshot still showed the lease as current) and
//! run again; only the losers of such a race pay a second round trip, and correctness never
//! depends on the snapshot: every write is guarded by conditions on the locked row itself.
//!
//! # Errors
//!
//! SQLSTATEs meaning "try again later" (serialization failure `40001`, deadlock `40P01`, lock
//! timeout `55P03`, statement timeout `57014`, admin shutdown `57P01` and the rest of class `57P`,
//! class `08` connection failures, class `53` resources) and lost or refused connections map to
//! the retryable [`Error::Unavailable`](idem_core::Error::Unavailable); other server errors to
//! [`Error::Backend`](idem_core::Error::Backend), a row that does not decode to
//! [`Error::CorruptRecord`](idem_core::Error::CorruptRecord). The driver error is kept as the
//! source. A dead server fails fast: `connect_timeout` bounds opening a connection,
//! `pool_wait_timeout` waiting for one, and every statement has a server-side
//! `statement_timeout` plus a client-side bound one second longer after which the connection is
//! dropped. Inputs are validated before any statement is sent.
//!
//! # Retention sweeper
//!
//! Expired records are already invisible; [`PostgresStore::purge_expired`](idem_core::IdempotencyStore::purge_expired)
//! reclaims them in bounded `FOR UPDATE SKIP LOCKED` batches, [`PostgresStore::sweep`] loops over
//! batches and [`PostgresStore::spawn_sweeper`] runs sweeps periodically in a tokio task. Several
//! sweepers can run at once.
//!
//! # TLS
//!
//! With the crate feature `tls`, `PostgresConfig::with_tls` takes a rustls `ClientConfig`
//! (and `with_tls_webpki_roots` builds one trusting the Mozilla roots); `sslmode` in the
//! connection string decides whether TLS is required.
//!
//! # Testing
//!
//! The tests use the server at `IDEM_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`; `scripts/services.sh postgres` starts one), each run
//! in its own randomly named schema.

mod config;
mod error;
mod schema;
mod sql;
mod store;
mod sweeper;
#[cfg(feature = "tls")]
mod tls;
pub mod transactional;

pub use config::{DEFAULT_SCHEMA, DEFAULT_TABLE, MAX_SCHEMA_LEN, MAX_TABLE_LEN, PostgresConfig};
pub use error::{ClientTimeout, Contention};
pub use schema::{MigrationReport, SCHEMA_VERSION, ddl};
pub use store::{PostgresStore, Transition, UNCOMMITTED_OWNER};
pub use sweeper::{Sweeper, SweeperConfig};
pub use transactional::{HandlerError, HandlerFuture, TxOutcome};

/// The driver and pool crates, re-exported so users name the same versions.
pub use deadpool_postgres;
pub use tokio_postgres;
