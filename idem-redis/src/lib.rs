#![doc = include_str!("../README.md")]

mod batch;
mod codec;
mod config;
mod conn;
mod scripts;
mod store;
mod writes;

pub use batch::lua_batch_scripts;
pub use config::{DEFAULT_PREFIX, RedisConfig};
pub use scripts::{LuaScript, lua_scripts};
pub use store::RedisStore;
pub use writes::{MAX_WRITES, RedisWrites};
