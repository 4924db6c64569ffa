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
//! One Redis string per idempotency key, at `{prefix}{namespace}:{id}` (prefix
//! [`DEFAULT_PREFIX`], `idem:`, by default). A namespace holds only `[A-Za-z0-9._-]`, so the first
//! `:` after the prefix ends it and the mapping is unambiguous; the id is stored as is, readable
//! by operators. The value packs the record:
//!
//! | bytes | holds |
//! |---|---|
//! | 1 | head: `128 + state + 8` (fingerprint present) `+ 16` (created offset present) `+ 32` (lease present); state 0 in progress, 1 released, 2 completed, 3 failed retryable, 4 failed terminal, 7 tombstone; 64 is reserved |
//! | 8 | fencing token, unsigned big-endian |
//! | varint | attempts |
//! | zigzag varint | `updated_at − base`, in ms, where `base = token / 1000` |
//! | zigzag varint | `base − created_at`, in ms; only with flag 16 (absent when 0: on a first acquisition, unless its token had to be above the clock) |
//! | zigzag varint | lease end `− base`, in ms; flag 32, present exactly while in progress |
//! | 32 | fingerprint; only with flag 8 (absent when the caller opted out) |
//! | varint, then that many | owner of the last acquisition |
//! | the rest | the stored result (completed) or error (failed); empty otherwise. It has no length of its own (a byte more per record): Redis keeps values whole, and a value cut inside it by someone else cannot be told from a shorter result |
//!
//! Varints are unsigned LEB128 (7 bits a byte, least significant first); a zigzag varint holds a
//! signed `n` as `2n` when `n ≥ 0`, else `−2n − 1` (the encoding of Protocol Buffers' `sint64`).
//! A head byte is 128 to 191, never the first byte of UTF-8 text, so no text value is mistaken
//! for a record; a value that does not decode, or a key of another type, is reported as
//! [`CorruptRecord`](idem_core::Error::CorruptRecord) and left untouched. A **tombstone**, left
//! by [`delete`](idem_core::IdempotencyStore::delete), is the head byte 135 and the token, nothing
//! else (see [Fencing tokens](#fencing-tokens)).
//!
//! The retention deadline (`expires_at`) is not in the value: it is the key's own expiry, set with
//! `SET ... PXAT` by `complete` and `fail` and read back with `PEXPIRETIME`, so Redis itself
//! removes finished records and [`purge_expired`](idem_core::IdempotencyStore::purge_expired)
//! is a no-op. Records in progress or released carry no expiry (the contract keeps them until
//! they finish, so a poison message's attempt count is never lost). A key at or past its
//! deadline is treated as absent by every script, even in the millisecond before Redis drops it.
//!
//! The record is packed because idempotency keys are many and every byte of them stays in
//! memory for the whole retention. A hash would cost a field name and listpack framing per
//! field (152 bytes for the record below), and any result over 64 bytes would turn it into a
//! full hash table. `MEMORY USAGE` of a completed record with an empty result, a fingerprint, a
//! storage key of up to 30 bytes, an owner id of up to 15 bytes, completed on its first attempt
//! within 8 s of the acquisition, is **136 bytes**: a value of at most 60 bytes, plus 72 bytes of
//! per-key Redis overhead (object header, dictionary entry, key string). Without a fingerprint it
//! is 104 bytes. Allocations come in size classes, so each byte past those 60 can move the
//! record to the next class: a later attempt adds 1 to 3 bytes (the creation offset), a slower
//! handler 1 (the update offset), and a 36-byte owner or a UUID id makes it 168 bytes.
//! The benchmark `redis_bench` prints the figures.
//!
//! # Clock
//!
//! Every script reads the server clock (`TIME`) and judges leases and retention on it, never on
//! the consumer's clock; all times are whole milliseconds. Lease lengths and retentions are
//! truncated to whole milliseconds (the core checks they are at least 1 ms).
//!
//! # Fencing tokens
//!
//! A new token is `max(previous + 1, server time in microseconds)`. While the key exists the
//! `previous + 1` term makes tokens strictly increasing, whatever the clock does.
//!
//! `delete` does not remove the key: it replaces the record with a tombstone, holding only the
//! token, that expires after **7 days**. Every script treats a tombstone as
//! an absent record (`get` returns `None`, `delete` returns `false`, `extend` / `complete` /
//! `fail` / `release` are `LeaseLost` with no current token, and `acquire` starts a fresh record
//! at attempt 1), but `acquire` still takes its token as `previous`, so the first token after a
//! delete is above the deleted one even if the server clock stepped back meanwhile.
//!
//! A record whose retention ended (or a tombstone after its 7 days) is removed by Redis entirely;
//! after that only the time term keeps tokens above every earlier one, which holds as long as the
//! server clock does not step back by more than the time since the earlier token was issued (at
//! least the retention, or 7 days after a delete). On a cluster, the same holds across a failover
//! when the nodes' clocks agree to within that margin (NTP-synchronised hosts do). Tokens stay
//! below 2^53, so Lua's numbers hold them exactly.
//!
//! # Replayed transitions
//!
//! A transition whose reply was lost (a response timeout, a dropped connection) may have run; a
//! caller, or a layer below it, may send it again with the same lease. `complete`, `fail` and
//! `release` are therefore replay-safe: when the record carries the lease's token and is already
//! exactly in the state the call would produce (completed with the same result; failed with the
//! same error and the same retryable flag; released), the call succeeds again without changing
//! anything. Any other call with a lease that is no longer in progress is `LeaseLost`, as the
//! contract requires: a lease can still finish its record only once, and only one way.
//! `acquire` is not replay-safe (a re-sent acquire finds the caller's own lease and answers
//! `InProgress`), which is why the store never re-sends a request that may have run (see
//! [Connections, timeouts and errors](#connections-timeouts-and-errors)).
//!
//! # Cluster
//!
//! Every script touches exactly one key, `KEYS[1]`, so the same scripts run unchanged on a
//! Redis Cluster: the driver routes each call by the key's slot, and the store follows `MOVED`
//! (to the node named, with the full script, and the driver refreshes its slot map) and `ASK`
//! (`ASKING` then the script on the importing node) during resharding and failovers.
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
//! - `redis-cli --scan --pattern 'idem:payments:*'` lists a namespace, `PEXPIRETIME` shows a
//!   record's retention deadline; read records with the store's
//!   [`get`](idem_core::IdempotencyStore::get) (the value is packed, see the layout above).
//! - Remove records with the store's `delete`, not `DEL`: a plain `DEL` leaves no tombstone, so
//!   the next token relies on the server clock alone.
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
//!   / redirect errors, `OOM` (over `maxmemory`) and `BUSY` (a long script running) map to
//!   `Unavailable` (retryable: the operation may or may not have taken effect); other server
//!   errors map to `Backend`; a value that is not a record is `CorruptRecord`.
//! - Nothing that may have run is sent twice. On one server the connection manager reconnects
//!   but never re-sends a request. On a cluster the driver is built with no retries at all (its
//!   one retry budget would also re-send a script after a response timeout or a dropped
//!   connection); the store itself retries, up to [`RedisConfig::retries`] times within the
//!   operation timeout, only the refusals that prove the script did not run: `MOVED` and `ASK`
//!   (followed at once), and `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `LOADING`, `READONLY`,
//!   `OOM`, `BUSY` and refused connections (after a short wait). A cluster connection passed to
//!   [`RedisStore::from_cluster_connection`] should be built with `retries(0)` for the same
//!   reason.
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
