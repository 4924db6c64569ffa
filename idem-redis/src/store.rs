//! [`RedisStore`]: the store trait on Redis.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::{
    AcquireOutcome, AcquireRequest, Completion, Error, Failure, FailureKind, IdempotencyKey,
    IdempotencyStore, Lease, Limits, ListQuery, Page, Record, Result, TransactionalStore,
    check_lease_ttl,
};
use redis::Value;
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::Slot;

use crate::codec::{self, Fenced};
use crate::config::RedisConfig;
use crate::conn::{Call, Conn, topology_may_have_changed};
use crate::scripts::{LuaScript, SCRIPTS, lua_scripts};
use crate::slots::SlotMap;
use crate::writes::{self, RedisWrites};

/// The least time left that a single call refused unrun by the node the store's slot map named
/// is sent again for, through the driver's routing.
const MIN_FALLBACK: Duration = Duration::from_millis(10);

/// An [`IdempotencyStore`] on Redis: one packed string per key, one Lua script per transition, on a
/// single server or a Redis Cluster.
///
/// See the [crate docs](crate) for the storage layout, the clock, the token scheme and the
/// cluster notes. Cloning is cheap and shares the connection.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    conn: Conn,
    config: RedisConfig,
    /// Requests the operations sent: see [`RedisStore::requests_sent`].
    sent: AtomicU64,
    /// A cluster's slot map as the store last read it (`None` before the first batch, after a
    /// call met a key the map placed on the wrong primary, and after a call timed out).
    slot_map: Mutex<SlotMapCache>,
    /// Set once a call on a cluster met an error that may mean the topology changed (a timeout,
    /// a lost connection, `MOVED`, ...: see `after_error`): from then on single calls go first
    /// to the primary the store's own slot map names, since the driver's map, which a timeout
    /// does not refresh, may still name a primary that was failed over while cut off.
    single_calls_by_map: AtomicBool,
    /// A background read of the slot map is under way (at most one at a time).
    reading_slot_map: AtomicBool,
}

/// The slot map a cluster store holds, and how many times one was dropped: a read that began
/// before a drop may have seen the cluster before the change that had it dropped, so it does
/// not become the held map (its caller still uses it once).
#[derive(Default)]
struct SlotMapCache {
    map: Option<Arc<SlotMap>>,
    drops: u64,
}

impl SlotMapCache {
    fn drop_map(&mut self) {
        self.map = None;
        self.drops += 1;
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("conn", &self.inner.conn)
            .field("config", &self.inner.config)
            .field("requests_sent", &self.requests_sent())
            .finish()
    }
}

impl RedisStore {
    /// Connects to one Redis server (`redis://host:port/db`, or `rediss://` with the `tls`
    /// feature) with the default [`RedisConfig`].
    ///
    /// The connection is multiplexed (concurrent operations share it, pipelined) and reconnects
    /// by itself after a drop.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] (field `url`) for an address the driver cannot use, or for any
    /// node of a Redis Cluster (`INFO cluster` says `cluster_enabled:1`), even one that serves
    /// every slot (a single-shard cluster): a cluster node refuses (`CROSSSLOT`) a script over
    /// keys of several hash slots, which batches and `complete_with` send on one server, so use
    /// [`connect_cluster`](Self::connect_cluster). A server that refuses `INFO` (an ACL, a
    /// proxy) cannot be judged and is let through. [`Error::Unavailable`] when the server cannot
    /// be reached within the configured timeouts.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(url, RedisConfig::default()).await
    }

    /// Connects to one Redis server with `config`. See [`RedisStore::connect`].
    ///
    /// # Errors
    /// As [`RedisStore::connect`].
    pub async fn connect_with(url: &str, config: RedisConfig) -> Result<Self> {
        let conn = Conn::single(url, &config).await?;
        Ok(Self::connected(conn, config).await)
    }

    /// Connects to a Redis Cluster through any of `nodes` (`redis://host:port` each; the rest
    /// of the cluster is discovered) with the default [`RedisConfig`].
    ///
    /// # Errors
    /// [`Error::InvalidInput`] (field `url`) for no node or an address the driver cannot use;
    /// [`Error::Unavailable`] when no node can be reached within the configured timeouts.
    pub async fn connect_cluster<I, S>(nodes: I) -> Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        Self::connect_cluster_with(nodes, RedisConfig::default()).await
    }

    /// Connects to a Redis Cluster with `config`. See [`RedisStore::connect_cluster`].
    ///
    /// # Errors
    /// As [`RedisStore::connect_cluster`].
    pub async fn connect_cluster_with<I, S>(nodes: I, config: RedisConfig) -> Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let nodes: Vec<String> = nodes.into_iter().map(|n| n.as_ref().to_owned()).collect();
        let conn = Conn::cluster(&nodes, &config).await?;
        Ok(Self::connected(conn, config).await)
    }

    /// A store over a connection manager the application built itself (its own TLS, auth or
    /// retry settings). [`RedisConfig::operation_timeout`] still bounds every operation.
    ///
    /// The scripts are not preloaded: each is sent in full on its first call (`EVAL` after the
    /// server answers `NOSCRIPT`), then by SHA. The server is not asked whether it runs in
    /// cluster mode, as [`RedisStore::connect`] does: a manager to a cluster node, even of a
    /// single-shard cluster, belongs in [`RedisStore::from_cluster_connection`] instead.
    pub fn from_connection_manager(manager: ConnectionManager, config: RedisConfig) -> Self {
        Self::from_conn(Conn::Single(manager), config)
    }

    /// A store over a cluster connection the application built itself. Build it with
    /// `retries(0)`: the driver's retries also re-send a script after a response timeout or a
    /// dropped connection, when the first send may have run (the store retries and follows
    /// `MOVED`/`ASK` itself). As with [`RedisStore::from_connection_manager`], the scripts are
    /// not preloaded.
    pub fn from_cluster_connection(conn: ClusterConnection, config: RedisConfig) -> Self {
        Self::from_conn(Conn::Cluster(conn), config)
    }

    fn from_conn(conn: Conn, config: RedisConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                conn,
                config,
                sent: AtomicU64::new(0),
                slot_map: Mutex::new(SlotMapCache::default()),
                single_calls_by_map: AtomicBool::new(false),
                reading_slot_map: AtomicBool::new(false),
            }),
        }
    }

    /// A store over a connection just opened: the scripts are loaded on the server(s) first.
    async fn connected(conn: Conn, config: RedisConfig) -> Self {
        let sources: Vec<&str> = lua_scripts()
            .into_iter()
            .chain(crate::lua_batch_scripts())
            .map(|s| s.source.as_str())
            .collect();
        conn.preload(&sources, config.operation_timeout).await;
        Self::from_conn(conn, config)
    }

    /// How many requests this store's operations have sent to Redis so far, counted as they
    /// are sent and shared by its clones: one `EVALSHA` per operation, one more (`EVAL` with
    /// the full script) when a node answered `NOSCRIPT`, and on a cluster one more per
    /// redirection or retried refusal, and one `CLUSTER SLOTS` each time the store reads the
    /// slot map (for batches, and after a call timed out: that read runs in the background, so
    /// it may be counted between two operations). Connecting (the handshake, loading the
    /// scripts) and the driver's own reconnects and slot-map refreshes are not counted.
    ///
    /// A cheap way to watch round trips per operation (the conformance suite checks one per
    /// transition with it); unlike the server's `INFO commandstats` it sees only this store's
    /// traffic.
    pub fn requests_sent(&self) -> u64 {
        self.inner.sent.load(Ordering::Relaxed)
    }

    /// The configuration in force.
    pub fn config(&self) -> &RedisConfig {
        &self.inner.config
    }

    /// The connection and the request counter, for the operations of other modules.
    pub(crate) fn conn_and_counter(&self) -> (&Conn, &AtomicU64) {
        (&self.inner.conn, &self.inner.sent)
    }

    /// The cluster's slot map: the one last read, or read now (one `CLUSTER SLOTS`, counted in
    /// [`requests_sent`](Self::requests_sent)).
    pub(crate) async fn slot_map(&self) -> Result<Arc<SlotMap>> {
        if let Some(map) = self.cached_slot_map() {
            return Ok(map);
        }
        let inner = &self.inner;
        let drops = self.slot_map_cache().drops;
        let map = Arc::new(SlotMap::fetch(&inner.conn, &inner.config, &inner.sent).await?);
        let mut cache = self.slot_map_cache();
        // Neither over a map read meanwhile (maybe newer), nor after a drop since the read
        // began.
        if cache.map.is_none() && cache.drops == drops {
            cache.map = Some(Arc::clone(&map));
        }
        Ok(map)
    }

    fn slot_map_cache(&self) -> std::sync::MutexGuard<'_, SlotMapCache> {
        self.inner
            .slot_map
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn cached_slot_map(&self) -> Option<Arc<SlotMap>> {
        self.slot_map_cache().map.clone()
    }

    /// Drops the slot map: the next batch reads it again.
    pub(crate) fn forget_slot_map(&self) {
        self.slot_map_cache().drop_map();
    }

    /// After a call on a cluster met an error that may mean the cluster moved a slot or failed
    /// a node over ([`topology_may_have_changed`]; `seen`: the map the call went by, `None`
    /// when the driver routed it): has single calls go by the store's map from now on; drops
    /// the map, unless a newer one was read meanwhile (the first time, whatever map is held:
    /// it is the batches' and may be as old as the driver's); and when none is left, reads it
    /// again in the background. Other errors change nothing.
    pub(crate) fn after_error(&self, e: &Error, seen: Option<&Arc<SlotMap>>) {
        if !topology_may_have_changed(e) {
            return;
        }
        let first = !self.inner.single_calls_by_map.swap(true, Ordering::Relaxed);
        {
            let mut cache = self.slot_map_cache();
            let used = match (cache.map.as_ref(), seen) {
                (Some(current), Some(seen)) => Arc::ptr_eq(current, seen),
                _ => false,
            };
            if first || used {
                cache.drop_map();
            }
            if cache.map.is_some() {
                return;
            }
        }
        self.read_slot_map_later();
    }

    /// Reads the slot map in a task of its own (none when one is under way), so that no
    /// operation waits on it.
    fn read_slot_map_later(&self) {
        /// Clears the flag however the task ends (a runtime shutting down drops it unfinished).
        struct Reading(RedisStore);
        impl Drop for Reading {
            fn drop(&mut self) {
                self.0
                    .inner
                    .reading_slot_map
                    .store(false, Ordering::Release);
            }
        }
        if self.inner.reading_slot_map.swap(true, Ordering::AcqRel) {
            return;
        }
        let reading = Reading(self.clone());
        tokio::spawn(async move {
            let _ = reading.0.slot_map().await;
            drop(reading);
        });
    }

    /// One script on `key`. On a cluster, once a call met an error that may mean the topology
    /// changed (see [`after_error`](Self::after_error)), a single call goes first to the
    /// primary the store's map names, by address; if that node refuses it unrun (the slot
    /// moved, or the driver has no connection to that node yet), or while the map is being
    /// read again, the driver routes it, within what is left of the operation timeout.
    ///
    /// (The driver's own slot map is not refreshed by a timeout: without this, after a primary
    /// that hangs is failed over, its keys would time out until it answers again. In redis-rs
    /// 1.8 the first call by address to a node the driver has no connection to fails unrun with
    /// `ClusterConnectionNotFound`, which also has the driver reconnect from its initial nodes
    /// and read the slots again.)
    pub(crate) async fn send(&self, key: &[u8], call: &Call<'_>) -> Result<Value> {
        let inner = &self.inner;
        let config = &inner.config;
        if !self.is_cluster() {
            return inner
                .conn
                .invoke(call, config.operation_timeout, config.retries, &inner.sent)
                .await;
        }
        let started = Instant::now();
        if inner.single_calls_by_map.load(Ordering::Relaxed) {
            match self.cached_slot_map() {
                Some(map) => {
                    if let Some(p) = map.primary_of(Slot::for_key(key)) {
                        let primary = &map.primaries()[p];
                        let timeout = config.operation_timeout;
                        match inner
                            .conn
                            .invoke_on(primary, call, timeout, &inner.sent)
                            .await
                        {
                            Ok(value) => return Ok(value),
                            Err((e, unrun)) => {
                                self.after_error(&e, Some(&map));
                                // Too little time left for another try: the call surely did
                                // not run, and says why.
                                let left = timeout.saturating_sub(started.elapsed());
                                if !unrun || left < MIN_FALLBACK {
                                    return Err(e);
                                }
                            }
                        }
                    }
                }
                None => self.read_slot_map_later(),
            }
        }
        let timeout = config.operation_timeout.saturating_sub(started.elapsed());
        let result = inner
            .conn
            .invoke(call, timeout, config.retries, &inner.sent)
            .await;
        if let Err(e) = &result {
            self.after_error(e, None);
        }
        result
    }

    /// Whether the store talks to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.inner.conn, Conn::Cluster(_))
    }

    /// The Redis key that holds `key`'s record: `{prefix}{namespace}:{id}`, byte for byte.
    pub fn storage_key(&self, key: &IdempotencyKey) -> Vec<u8> {
        codec::storage_key(&self.inner.config.prefix, key)
    }

    /// Runs one script on `key`. A script that found an undecodable record answers
    /// `IDEMCORRUPT <reason>`, which becomes [`Error::CorruptRecord`].
    pub(crate) async fn run(&self, key: &[u8], call: &Call<'_>) -> Result<Value> {
        match self.send(key, call).await {
            Err(Error::Backend { source, .. })
                if source
                    .downcast_ref::<redis::RedisError>()
                    .is_some_and(|re| re.code() == Some("IDEMCORRUPT")) =>
            {
                let detail = source
                    .downcast_ref::<redis::RedisError>()
                    .and_then(|re| re.detail())
                    .unwrap_or("undecodable record");
                // Redis appends where the error was raised: " script: <sha>, on @user_script:N."
                let reason = detail
                    .split_once(" script: ")
                    .map_or(detail, |(reason, _)| reason)
                    .to_owned();
                Err(Error::corrupt(
                    self.name(),
                    String::from_utf8_lossy(key),
                    reason,
                ))
            }
            other => other,
        }
    }

    /// A decoding failure of `storage_key`'s reply as [`Error::CorruptRecord`].
    fn corrupt(&self, storage_key: &[u8], bad: codec::Bad) -> Error {
        codec::corrupt(self.name(), storage_key, bad)
    }

    /// Runs a fenced script (`extend`, `complete`, `fail`, `release`): one `EVALSHA` whose reply
    /// is either applied (or a replay of what was applied) or a refusal carrying the token and
    /// state the script found, from which [`Error::LeaseLost`] says why.
    async fn fenced(
        &self,
        script: &LuaScript,
        lease: &Lease,
        args: impl FnOnce(&mut Call<'_>),
    ) -> Result<Option<i64>> {
        let key = self.storage_key(&lease.key);
        let mut call = script.call(&key);
        call.arg(lease.token.get());
        args(&mut call);
        self.fenced_call(&key, lease, &call).await
    }

    /// Sends a fenced script's `call` on the record at `key` and reads its reply.
    async fn fenced_call(&self, key: &[u8], lease: &Lease, call: &Call<'_>) -> Result<Option<i64>> {
        let reply = self.run(key, call).await?;
        match codec::fenced(&reply).map_err(|b| self.corrupt(key, b))? {
            Fenced::Applied(extra) => Ok(extra),
            Fenced::Lost(found) => Err(Error::lease_lost(lease, found)),
            Fenced::Refused { index, reason } => Err(Error::EffectRefused {
                store: self.name(),
                index,
                reason,
            }),
        }
    }

    /// The hash tag, braces included, that puts a key in the same Redis Cluster slot as
    /// `key`'s record: the record's own tag when its storage key has one (a `{...}` in the
    /// prefix or the id), else the whole storage key. A key that starts with it is in the
    /// record's slot whatever follows. See [`effect_key`](Self::effect_key).
    ///
    /// With a prefix holding a hash tag (`{idem}:`) that tag is every record's, whatever the id
    /// (Redis hashes by the first tag of a key): this answers it, as it is the slot's, but
    /// [`effect_key`](Self::effect_key) refuses to build keys under it.
    ///
    /// ```
    /// # fn demo(store: &idem_redis::RedisStore) -> idem_core::Result<()> {
    /// use idem_core::Namespace;
    ///
    /// let ns = Namespace::new("payments")?;
    /// // Default prefix `idem:`: the storage key `idem:payments:order-42` has no tag.
    /// assert_eq!(store.hash_tag(&ns.key("order-42")?)?, "{idem:payments:order-42}");
    /// // An id with a tag: every message of alice shares her slot.
    /// assert_eq!(store.hash_tag(&ns.key("{alice}:msg-7")?)?, "{alice}");
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidInput`] (field `key`) when the storage key has no hash tag and holds a
    /// `}` (an id such as `a}b` or `{}x`): no tag can then name its slot. Give such ids a hash
    /// tag of their own.
    pub fn hash_tag(&self, key: &IdempotencyKey) -> Result<String> {
        let storage_key = String::from_utf8_lossy(&self.storage_key(key)).into_owned();
        writes::slot_tag(&storage_key).ok_or_else(|| {
            Error::invalid(
                "key",
                format!(
                    "the storage key {storage_key:?} has no hash tag and holds '}}', so no hash \
                     tag puts another key in its Redis Cluster slot; give the id a hash tag of \
                     its own (such as {{order-42}})"
                ),
            )
        })
    }

    /// A key for the handler's own data in the same Redis Cluster slot as `key`'s record:
    /// [`hash_tag`](Self::hash_tag) followed by `suffix`, for instance
    /// `{idem:payments:order-42}:receipt`. On a cluster every key a
    /// [`RedisWrites`] touches must be in the record's slot; on one server any key will do, but
    /// keys built this way keep working when the store moves to a cluster.
    ///
    /// Data shared by many messages (an account balance) can only be in each message's slot
    /// when the messages' ids carry the same tag: ids `{alice}:msg-1`, `{alice}:msg-2`, ... all
    /// give `effect_key(.., ":balance")` = `{alice}:balance`.
    ///
    /// # Errors
    /// As [`hash_tag`](Self::hash_tag); and [`Error::InvalidInput`] (field `key`) when the
    /// record's hash tag lies in the store's prefix (namespaces hold no braces), such as
    /// `{idem}` under the prefix `{idem}:`: every record then has that tag, whatever its id, so
    /// `effect_key(k, ":receipt")` would be the same key, `{idem}:receipt`, for every record
    /// (and a key under the prefix, which [`complete_with`](TransactionalStore::complete_with)
    /// refuses). Use a prefix without a hash tag, and put the tag in the ids of records that
    /// must share data. Also refused: a key that would start with the prefix anyway (a prefix
    /// that opens a `{` the id closes, such as `{idem:`), which `complete_with` would refuse.
    pub fn effect_key(&self, key: &IdempotencyKey, suffix: &str) -> Result<String> {
        let storage_key = self.storage_key(key);
        // `{prefix}{namespace}:{id}`: a tag whose closing brace comes before the id is the
        // same for every record.
        let id_start = storage_key.len() - key.id().len();
        if let Some(span) = writes::hash_tag_span(&storage_key)
            && span.end < id_start
        {
            return Err(Error::invalid(
                "key",
                format!(
                    "the record's hash tag {{{}}} comes from the store's prefix {:?}, not from \
                     the id, so every record has it and a key built from it would be one key \
                     shared by every record; use a prefix without a hash tag, or, for records \
                     that share data, put the tag in the id (such as {{alice}}:msg-1) under a \
                     prefix without one",
                    String::from_utf8_lossy(&storage_key[span]),
                    self.inner.config.prefix,
                ),
            ));
        }
        let mut out = self.hash_tag(key)?;
        out.push_str(suffix);
        let prefix = &self.inner.config.prefix;
        if !prefix.is_empty() && out.starts_with(prefix.as_str()) {
            // A prefix that opens a tag the id closes (`{idem:`): the key is `{` then the
            // storage key's head, under the prefix.
            return Err(Error::invalid(
                "key",
                format!(
                    "the key {out:?} built on the record's hash tag lies under the store's \
                     prefix {prefix:?}, where records live, so complete_with would refuse it; \
                     use a prefix without a hash tag or braces"
                ),
            ));
        }
        Ok(out)
    }

    /// On a cluster, refuses writes whose keys are not all in the record's slot (the script
    /// may only touch keys of one slot, and Redis would refuse the call as a whole).
    fn check_slots(&self, storage_key: &[u8], writes: &RedisWrites) -> Result<()> {
        if !self.is_cluster() {
            return Ok(());
        }
        let slot = Slot::for_key(storage_key);
        for (index, key) in writes.keys().enumerate() {
            let other = Slot::for_key(key);
            if other != slot {
                return Err(Error::invalid(
                    "writes",
                    format!(
                        "write {index} targets {:?}, in Redis Cluster {other:?}, but the record \
                         {:?} is in {slot:?}; build the key with RedisStore::effect_key, under \
                         the record's hash tag",
                        String::from_utf8_lossy(key),
                        String::from_utf8_lossy(storage_key),
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[async_trait]
impl IdempotencyStore for RedisStore {
    /// `redis` on one server, `redis-cluster` on a Redis Cluster (also the `store` of its
    /// errors).
    fn name(&self) -> &'static str {
        self.inner.conn.name()
    }

    fn limits(&self) -> Limits {
        self.inner.config.limits
    }

    async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome> {
        req.validate()?;
        let key = self.storage_key(&req.key);
        let fingerprint: &[u8] = match &req.fingerprint {
            Some(fp) => fp.as_bytes(),
            None => &[],
        };
        let mut call = SCRIPTS.acquire.call(&key);
        call.arg(req.owner.as_bytes())
            .arg(codec::millis(req.lease_ttl))
            .arg(req.max_attempts)
            .arg(fingerprint);
        let reply = self.run(&key, &call).await?;
        codec::acquire_outcome(&reply, &req.key, &req.owner).map_err(|b| self.corrupt(&key, b))
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        check_lease_ttl(ttl)?;
        let end = self
            .fenced(&SCRIPTS.extend, lease, |inv| {
                inv.arg(codec::millis(ttl));
            })
            .await?;
        let expires_at =
            codec::lease_end(end).map_err(|b| self.corrupt(&self.storage_key(&lease.key), b))?;
        Ok(Lease {
            expires_at,
            ..lease.clone()
        })
    }

    async fn complete(&self, lease: &Lease, result: Bytes, retention: Duration) -> Result<()> {
        self.inner
            .config
            .limits
            .check_complete(&result, retention)?;
        self.fenced(&SCRIPTS.complete, lease, |inv| {
            inv.arg(result.as_ref()).arg(codec::millis(retention));
        })
        .await
        .map(drop)
    }

    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        self.inner.config.limits.check_fail(error, retention)?;
        let state = codec::failed_state(kind).ok_or_else(|| {
            Error::invalid(
                "kind",
                format!("failure kind {kind} is not supported by this version of idem-redis"),
            )
        })?;
        self.fenced(&SCRIPTS.fail, lease, |inv| {
            inv.arg(error.as_bytes())
                .arg(state)
                .arg(codec::millis(retention));
        })
        .await
        .map(drop)
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.fenced(&SCRIPTS.release, lease, |_| {}).await.map(drop)
    }

    /// One script call for the whole batch on one server, one per hash slot on a cluster (see
    /// the [crate docs](crate#batches)).
    async fn acquire_many(&self, reqs: &[AcquireRequest]) -> Result<Vec<Result<AcquireOutcome>>> {
        self.acquire_batch(reqs).await
    }

    /// As [`acquire_many`](IdempotencyStore::acquire_many): one script call per batch (per slot).
    async fn complete_many(
        &self,
        items: &[Completion],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        self.complete_batch(items, retention).await
    }

    /// As [`acquire_many`](IdempotencyStore::acquire_many): one script call per batch (per slot).
    async fn fail_many(&self, items: &[Failure], retention: Duration) -> Result<Vec<Result<()>>> {
        self.fail_batch(items, retention).await
    }

    /// As [`acquire_many`](IdempotencyStore::acquire_many): one script call per batch (per slot).
    async fn release_many(&self, leases: &[Lease]) -> Result<Vec<Result<()>>> {
        self.release_batch(leases).await
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        let storage_key = self.storage_key(key);
        let call = SCRIPTS.get.call(&storage_key);
        let reply = self.run(&storage_key, &call).await?;
        codec::record(&reply, key).map_err(|b| self.corrupt(&storage_key, b))
    }

    /// Replaces the record with a tombstone that holds only its token and expires after 7 days,
    /// so that the next acquisition's token is above the deleted one whatever the server clock
    /// did (see the [crate docs](crate#fencing-tokens)). A tombstone reads as no record.
    async fn delete(&self, key: &IdempotencyKey) -> Result<bool> {
        let storage_key = self.storage_key(key);
        let call = SCRIPTS.delete.call(&storage_key);
        match self.run(&storage_key, &call).await? {
            Value::Int(n) => Ok(n == 1),
            other => Err(self.corrupt(
                &storage_key,
                codec::Bad(format!("unexpected delete reply {other:?}")),
            )),
        }
    }

    /// `SCAN` with the namespace's key pattern on the server, or on every primary of a cluster
    /// (ordered by the slots they serve), one read-only script call per step: see the
    /// [crate docs](crate#listing) for the cost (every key of every namespace is visited once
    /// per full listing), the cursor and what happens when the cluster changes meanwhile.
    async fn list(&self, query: &ListQuery) -> Result<Page> {
        crate::list::list(
            &self.inner.conn,
            &self.inner.config,
            &self.inner.sent,
            query,
        )
        .await
    }

    /// A no-op returning 0: every finished record carries its retention as the key's own expiry
    /// (`SET ... PXAT`), so Redis removes it by itself; records in progress or released have no
    /// retention deadline.
    async fn purge_expired(&self, _limit: usize) -> Result<u64> {
        Ok(0)
    }
}

/// The handler's writes and the completion in ONE `EVALSHA` of a fenced script (see
/// [`RedisWrites`] for the command set, the conditions and the checks, and the
/// [crate docs](crate#transactional-effects)).
#[async_trait]
impl TransactionalStore for RedisStore {
    type Writes = RedisWrites;

    /// The completion's own checks first (`Limits::check_complete`), then the writes' (count,
    /// reserved keys, argument ranges, and on a cluster the record's slot): any failing is
    /// [`Error::InvalidInput`] and nothing is sent. Then one `EVALSHA`: the fence of
    /// [`complete`](IdempotencyStore::complete) (`LeaseLost`, or `Ok` with nothing written for
    /// a replay), the check that the store's user may run every write and the completion
    /// (ACLs: `Backend`, a `NOPERM` reply), the writes' conditions and type checks
    /// (`EffectRefused`), the writes and the completion. No refusal writes anything; after an
    /// ACL or effect refusal the record stays in progress under the lease.
    async fn complete_with(
        &self,
        lease: &Lease,
        result: Bytes,
        retention: Duration,
        writes: RedisWrites,
    ) -> Result<()> {
        let config = &self.inner.config;
        config.limits.check_complete(&result, retention)?;
        let key = self.storage_key(&lease.key);
        writes.check(&key, &config.prefix)?;
        self.check_slots(&key, &writes)?;
        let mut call = SCRIPTS.complete_with.call(&key);
        call.arg(lease.token.get())
            .arg(result.as_ref())
            .arg(codec::millis(retention));
        writes.encode(&mut call);
        self.fenced_call(&key, lease, &call).await.map(drop)
    }
}
