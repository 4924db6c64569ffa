#![doc = include_str!("../README.md")]

mod batch;
mod codec;
mod config;
mod conn;
mod drop;
mod list;
mod scripts;
mod slots;
mod store;

/// Decoders reached by the fuzz targets in `fuzz/` (only with `--cfg fuzzing`).
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing;
mod writes;

pub use batch::lua_batch_scripts;
pub use config::{DEFAULT_PREFIX, RedisConfig};
pub use scripts::{LuaScript, lua_scripts};
pub use store::RedisStore;
pub use writes::{MAX_WRITES, RedisWrites};

/// The Redis client crate, re-exported so users name the same version (for
/// [`RedisStore::from_connection_manager`], say).
pub use redis;
