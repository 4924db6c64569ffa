#![doc = include_str!("../README.md")]

mod batch;
mod config;
mod counter;
mod error;
mod expr;
mod item;
mod list;
mod store;

/// Decoders reached by the fuzz targets in `fuzz/` (only with `--cfg fuzzing`).
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing;
mod table;
mod transact;

pub use config::{DEFAULT_TABLE, DynamoConfig, MAX_ERROR_LEN, MAX_RESULT_LEN};
pub use counter::RequestCounter;
pub use error::SdkFailure;
pub use store::DynamoStore;
pub use transact::{DynamoWrites, MAX_TRANSACT_ITEMS, MAX_WRITES};

/// The SDK crates this store is built on, re-exported so that callers building an
/// [`SdkConfig`](aws_config::SdkConfig) for [`DynamoStore::from_sdk_config`] use the same versions.
pub use {aws_config, aws_sdk_dynamodb};

/// The store's name in errors and metrics.
pub(crate) const STORE: &str = "dynamo";
