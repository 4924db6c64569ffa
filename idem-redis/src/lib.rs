//! The Redis store of `idem`: [`RedisStore`] implements
//! [`IdempotencyStore`](idem_core::IdempotencyStore) with one Lua script per transition, on a
//! single server or on a Redis Cluster. Needs Redis 7.0 or later (`PEXPIRETIME`, script flags).
//!
//! ```no_run
//! # async fn demo() -> idem_core::Result<()> {
//! use std::time::Duration;
//! use idem_core::{AcquireOutcome, AcquireRequest, Bytes, IdempotencyStore, Namespace};
//! use idem_redis::RedisStore;
//!
//! let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
//! // or: RedisStore::connect_cluster(["redis://127.0.0.1:7001", "redis://127.0.0.1:7002"]).await?
//! let key = Namespace::new("payments")?.key("order-42")?;
//! match store.acquire(&AcquireRequest::new(key, "worker-1")).await? {
//!     AcquireOutcome::Acquired { lease, .. } => {
//!         // ... do the work, then:
//!         store.complete(&lease, Bytes::from_static(b"ok"), Duration::from_secs(86_400)).await?;
//!     }
//!     AcquireOutcome::Replayed { result } => println!("duplicate, stored result {result:?}"),
//!     other => println!("not now: {}", other.name()),
//! }
//! # Ok(()) }
//! ```
//!
//! # Round trips
//!
//! `acquire`, `extend`, `complete`, `fail` and `release` are each one `EVALSHA` of a Lua script,
//! so each is atomic and costs one round trip, whatever the outcome (a duplicate, a busy key and
//! a takeover included). `get` and `delete` are small scripts too (one round trip each), so that
//! they judge retention on the server clock like the transitions. Scripts are sent by SHA; a
//! server that does not know one (after a restart or `SCRIPT FLUSH`) answers `NOSCRIPT` and the
//! driver loads it and retries. Keys, owners, fingerprints, results and errors only ever travel
//! as `KEYS`/`ARGV`, never inside script text.
//!
//! # Storage layout
//!
//! One hash per idempotency key, at `{prefix}{namespace}:{id}` (prefix [`DEFAULT_PREFIX`],
//! `idem:`, by default). A namespace holds only `[A-Za-z0-9._-]`, so the first `:` after the
//! prefix ends it and the mapping is unambiguous; the id is stored as is, readable by operators.
//!
//! | field | holds |
//! |---|---|
//! | `t` | fencing token (integer) |
//! | `s` | `attempts × 10 + state`; state 0 in progress, 1 released, 2 completed, 3 failed retryable, 4 failed terminal (`22` reads "2 attempts, completed") |
//! | `o` | owner of the last acquisition |
//! | `f` | fingerprint, 32 raw bytes; absent when the caller opted out |
//! | `c` | `created_at`, in ms **before** `base = token / 1000`; absent when 0 (a first acquisition, nearly always) |
//! | `u` | `updated_at`, in ms after `base` |
//! | `l` | lease end, in ms after `base`; only while in progress |
//! | `r` | the stored result (completed) or error (failed); absent when empty |
//!
//! The retention deadline (`expires_at`) is not a field: it is the key's own expiry, set with
//! `PEXPIREAT` by `complete` and `fail` and read back with `PEXPIRETIME`, so Redis itself
//! removes finished records and [`purge_expired`](idem_core::IdempotencyStore::purge_expired)
//! is a no-op. Records in progress or released carry no expiry (the contract keeps them until
//! they finish, so a poison message's attempt count is never lost). A key at or past its
//! deadline is treated as absent by every script, even in the millisecond before Redis drops it.
//!
//! Times are stored relative to the token, and state and attempts share one field, because the
//! hash must stay small: every field costs bytes in Redis' listpack encoding, and allocations
//! come in size classes (48, 64, 80, 96 bytes ...). `MEMORY USAGE` of a completed record with an
//! empty result and a key of up to 28 bytes is 72 bytes of per-key Redis overhead (object
//! header, dictionary entry, key string) plus the hash: 120 bytes in all without a fingerprint,
//! 152 bytes with one (its 32 bytes move the hash into the next size class) when the owner id is
//! at most 7 bytes. The benchmark `redis_bench` prints the figures.
//!
//! # Clock
//!
//! Every script reads the server clock (`TIME`) and judges leases and retention on it, never on
//! the consumer's clock; all times are whole milliseconds. Lease lengths and retentions are
//! truncated to whole milliseconds (the core checks they are at least 1 ms).
//!
//! # Fencing tokens
//!
//! A new token is `max(previous + 1, server time in microseconds)`. While the hash exists the
//! `previous + 1` term makes tokens strictly increasing; after the key expired or was deleted the
//! time term keeps them above every earlier token, as long as the server clock does not step back
//! (by more than the time since the earlier token was issued). On a cluster, the same holds across
//! a failover when the nodes' clocks agree to within that margin (NTP-synchronised hosts do).
//! Tokens stay below 2^53, so Lua's numbers hold them exactly.
//!
//! # Cluster
//!
//! Every script touches exactly one key, `KEYS[1]`, so the same scripts run unchanged on a
//! Redis Cluster: the driver routes each call by the key's slot and follows `MOVED`/`ASK`.
//! Hash tags inside ids are harmless: `{`...`}` in an id only chooses the slot of that one key,
//! and two distinct ids are always two distinct keys. Scripts are declared with `#!lua` (no
//! flags), so Redis refuses any access to an undeclared key. Writes go to masters. Redis
//! replication is asynchronous: a failover can lose the last writes the old master acknowledged
//! (a completion, or an acquisition that then runs twice), as with any lock on Redis. Where that
//! window matters, run the handler's own writes through the fencing token.
//!
//! # Operating the server
//!
//! - Set `maxmemory-policy noeviction`: an evicted record is a forgotten completion, and the
//!   work runs again. With `volatile-*` policies finished records may leave before their
//!   retention ends; `allkeys-*` policies may also drop records in progress.
//! - Without persistence (RDB/AOF) a restart forgets every record; tokens stay monotonic (the
//!   clock term) but completed work can run again. Use AOF (`appendfsync everysec` or `always`)
//!   where that matters.
//! - `redis-cli --scan --pattern 'idem:payments:*'` lists a namespace; `HGETALL` shows a record
//!   (see the layout above), `PEXPIRETIME` its retention deadline.
//!
//! # Connections, timeouts and errors
//!
//! - One server: a multiplexed [`ConnectionManager`](redis::aio::ConnectionManager) that
//!   reconnects by itself. A cluster: the driver's async cluster connection. Both pipeline
//!   concurrent operations over few sockets.
//! - TLS: `rediss://` addresses work with the crate feature `tls` (rustls with the ring provider,
//!   installed as the process default unless the application installed one). Servers are
//!   verified against the system's roots, or against a private CA given with
//!   `RedisConfig::with_tls_root_cert`. The driver's `#insecure` mode is not compiled in. For
//!   client certificates or other driver settings, build the connection yourself and use
//!   [`RedisStore::from_connection_manager`] or [`RedisStore::from_cluster_connection`].
//! - [`RedisConfig`] bounds the connect time, each response and each whole operation; an
//!   unreachable server yields [`Error::Unavailable`](idem_core::Error::Unavailable) within
//!   [`RedisConfig::operation_timeout`] (3 s by default), never a hang.
//! - I/O errors, timeouts, refused or dropped connections and cluster-down / loading / read-only
//!   / redirect errors map to `Unavailable` (retryable: the operation may or may not have taken
//!   effect); other server errors map to `Backend`; a hash that cannot be decoded is
//!   `CorruptRecord`.
//! - Inputs are validated before anything is sent: the request, lease length, retention, and
//!   result and error sizes against [`RedisConfig::limits`].

mod codec;
mod config;
mod conn;
mod scripts;
mod store;

pub use config::{DEFAULT_PREFIX, RedisConfig};
pub use conn::TimedOut;
pub use scripts::{LuaScript, lua_scripts};
pub use store::RedisStore;
