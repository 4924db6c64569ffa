//! [`RedisStore`]: the store trait on Redis.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::{
    AcquireOutcome, AcquireRequest, Error, IdempotencyKey, IdempotencyStore, Lease, Limits, Record,
    Result, check_lease_ttl, check_retention,
};
use redis::Value;
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;

use crate::codec::{self, Fenced};
use crate::config::RedisConfig;
use crate::conn::{Call, Conn, STORE};
use crate::scripts::{LuaScript, SCRIPTS};

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
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("conn", &self.inner.conn)
            .field("config", &self.inner.config)
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
    /// [`Error::InvalidInput`] (field `url`) for an address the driver cannot use;
    /// [`Error::Unavailable`] when the server cannot be reached within the configured timeouts.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(url, RedisConfig::default()).await
    }

    /// Connects to one Redis server with `config`. See [`RedisStore::connect`].
    ///
    /// # Errors
    /// As [`RedisStore::connect`].
    pub async fn connect_with(url: &str, config: RedisConfig) -> Result<Self> {
        let conn = Conn::single(url, &config).await?;
        Ok(Self::from_conn(conn, config))
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
        Ok(Self::from_conn(conn, config))
    }

    /// A store over a connection manager the application built itself (its own TLS, auth or
    /// retry settings). [`RedisConfig::operation_timeout`] still bounds every operation.
    pub fn from_connection_manager(manager: ConnectionManager, config: RedisConfig) -> Self {
        Self::from_conn(Conn::Single(manager), config)
    }

    /// A store over a cluster connection the application built itself. Build it with
    /// `retries(0)`: the driver's retries also re-send a script after a response timeout or a
    /// dropped connection, when the first send may have run (the store retries and follows
    /// `MOVED`/`ASK` itself).
    pub fn from_cluster_connection(conn: ClusterConnection, config: RedisConfig) -> Self {
        Self::from_conn(Conn::Cluster(conn), config)
    }

    fn from_conn(conn: Conn, config: RedisConfig) -> Self {
        Self {
            inner: Arc::new(Inner { conn, config }),
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &RedisConfig {
        &self.inner.config
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
    async fn run(&self, key: &[u8], call: &Call<'_>) -> Result<Value> {
        let config = &self.inner.config;
        let result = self
            .inner
            .conn
            .invoke(call, config.operation_timeout, config.retries)
            .await;
        match result {
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
                Err(Error::corrupt(STORE, String::from_utf8_lossy(key), reason))
            }
            other => other,
        }
    }

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
        let reply = self.run(&key, &call).await?;
        match codec::fenced(&reply).map_err(|b| codec::corrupt(&key, b))? {
            Fenced::Applied(extra) => Ok(extra),
            Fenced::Lost(current) => Err(Error::LeaseLost {
                key: lease.key.clone(),
                presented: lease.token,
                current,
            }),
        }
    }
}

#[async_trait]
impl IdempotencyStore for RedisStore {
    fn name(&self) -> &'static str {
        STORE
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
        codec::acquire_outcome(&reply, &req.key, &req.owner).map_err(|b| codec::corrupt(&key, b))
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        check_lease_ttl(ttl)?;
        let end = self
            .fenced(&SCRIPTS.extend, lease, |inv| {
                inv.arg(codec::millis(ttl));
            })
            .await?;
        let expires_at =
            codec::lease_end(end).map_err(|b| codec::corrupt(&self.storage_key(&lease.key), b))?;
        Ok(Lease {
            expires_at,
            ..lease.clone()
        })
    }

    async fn complete(&self, lease: &Lease, result: Bytes, retention: Duration) -> Result<()> {
        check_retention(retention)?;
        self.inner.config.limits.check_result(&result)?;
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
        retryable: bool,
        retention: Duration,
    ) -> Result<()> {
        check_retention(retention)?;
        self.inner.config.limits.check_error(error)?;
        self.fenced(&SCRIPTS.fail, lease, |inv| {
            inv.arg(error.as_bytes())
                .arg(if retryable { "1" } else { "0" })
                .arg(codec::millis(retention));
        })
        .await
        .map(drop)
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.fenced(&SCRIPTS.release, lease, |_| {}).await.map(drop)
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        let storage_key = self.storage_key(key);
        let call = SCRIPTS.get.call(&storage_key);
        let reply = self.run(&storage_key, &call).await?;
        codec::record(&reply, key).map_err(|b| codec::corrupt(&storage_key, b))
    }

    /// Replaces the record with a tombstone that holds only its token and expires after 7 days,
    /// so that the next acquisition's token is above the deleted one whatever the server clock
    /// did (see the [crate docs](crate#fencing-tokens)). A tombstone reads as no record.
    async fn delete(&self, key: &IdempotencyKey) -> Result<bool> {
        let storage_key = self.storage_key(key);
        let call = SCRIPTS.delete.call(&storage_key);
        match self.run(&storage_key, &call).await? {
            Value::Int(n) => Ok(n == 1),
            other => Err(codec::corrupt(
                &storage_key,
                codec::Bad(format!("unexpected delete reply {other:?}")),
            )),
        }
    }

    /// A no-op returning 0: every finished record carries its retention as the key's own expiry
    /// (`SET ... PXAT`), so Redis removes it by itself; records in progress or released have no
    /// retention deadline.
    async fn purge_expired(&self, _limit: usize) -> Result<u64> {
        Ok(0)
    }
}
