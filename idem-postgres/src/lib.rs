#![doc = include_str!("../README.md")]

mod complete_with;
mod config;
mod drop;
mod error;
mod schema;
mod sql;
mod store;
mod sweeper;
#[cfg(feature = "tls")]
mod tls;
pub mod transactional;
mod writes;

pub use config::{DEFAULT_SCHEMA, DEFAULT_TABLE, MAX_SCHEMA_LEN, MAX_TABLE_LEN, PostgresConfig};
pub use error::Contention;
pub use schema::{MigrationReport, SCHEMA_VERSION, ddl};
pub use store::{PostgresStore, Transition, UNCOMMITTED_OWNER};
pub use sweeper::{Sweeper, SweeperConfig};
pub use transactional::{FnTxHandler, HandlerFuture, InTransaction, TxHandler, tx_handler};
pub use writes::{MAX_PARAMS, MAX_WRITES, Params, PgParam, PgWrites, param};

/// The driver and pool crates, re-exported so users name the same versions.
pub use deadpool_postgres;
pub use tokio_postgres;
