#![doc = include_str!("../README.md")]

mod backend;
mod options;
mod store;

pub use backend::{CREATE_TABLE, SqliteBackend, TABLE};
pub use options::{Offload, SqliteOptions, Synchronous};
pub use store::SqliteStore;
