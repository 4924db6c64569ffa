#![doc = include_str!("../README.md")]

mod codec;
mod config;
mod conn;
mod drop;
mod scripts;
mod store;
mod writes;

pub use config::{DEFAULT_PREFIX, RedisConfig};
pub use scripts::{LuaScript, lua_scripts};
pub use store::RedisStore;
pub use writes::{MAX_WRITES, RedisWrites};

/// The Redis client crate, re-exported so users name the same version (for
/// [`RedisStore::from_connection_manager`], say).
pub use redis;
