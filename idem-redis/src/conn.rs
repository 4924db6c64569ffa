//! The connection behind a store (one server or a cluster) and the mapping of driver errors.

use std::borrow::Cow;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use idem_core::{Error, TimedOut};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::SingleNodeRoutingInfo;
use redis::{ErrorKind, RedisError, Script, ServerErrorKind, ToRedisArgs, Value};

use crate::config::RedisConfig;
use crate::slots::Primary;

/// The store's name on one server, in errors, metrics and logs.
pub(crate) const STANDALONE: &str = "redis";
/// The store's name on a Redis Cluster.
pub(crate) const CLUSTER: &str = "redis-cluster";

/// One server (auto-reconnecting multiplexed connection) or a Redis Cluster. Both are cheap to
/// clone and pipeline concurrent requests.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Single(_) => f.write_str("Single"),
            Self::Cluster(_) => f.write_str("Cluster"),
        }
    }
}

impl Conn {
    /// Connects to one server.
    pub(crate) async fn single(url: &str, config: &RedisConfig) -> Result<Self, Error> {
        #[cfg(feature = "tls")]
        install_crypto_provider();
        #[cfg(feature = "tls")]
        let client = match &config.tls_root_cert {
            Some(pem) => redis::Client::build_with_tls(url, certificates(pem)),
            None => redis::Client::open(url),
        };
        #[cfg(not(feature = "tls"))]
        let client = redis::Client::open(url);
        let client = client.map_err(|e| invalid_url(url, e))?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.connect_timeout))
            .set_response_timeout(Some(config.response_timeout))
            .set_number_of_retries(config.retries as usize)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(500));
        let connect = ConnectionManager::new_with_config(client, manager_config);
        let manager = bounded(STANDALONE, config.operation_timeout, connect)
            .await
            .map_err(|e| config_error(url, e))?;
        if refuse_cluster_node(&manager, url, config.operation_timeout).await? {
            warn_if_evicting(&mut manager.clone(), STANDALONE, config.operation_timeout).await;
        }
        Ok(Self::Single(manager))
    }

    /// Connects to a cluster through any of `nodes`.
    pub(crate) async fn cluster(nodes: &[String], config: &RedisConfig) -> Result<Self, Error> {
        #[cfg(feature = "tls")]
        install_crypto_provider();
        if nodes.is_empty() {
            return Err(Error::invalid("url", "a cluster needs at least one node"));
        }
        let builder = ClusterClientBuilder::new(nodes.iter().map(String::as_str));
        #[cfg(feature = "tls")]
        let builder = match &config.tls_root_cert {
            Some(pem) => builder.certs(certificates(pem)),
            None => builder,
        };
        let client = builder
            .connection_timeout(config.connect_timeout)
            .response_timeout(config.response_timeout)
            .overall_response_timeout(Some(config.operation_timeout))
            // The driver spends one retry budget on everything: redirections, but also resending
            // a request after a response timeout or a dropped connection, when the first send
            // may have run. A resent transition would then see its own effect (an acquire
            // finding itself as owner). So the driver never retries; `Conn::invoke` retries
            // only the refusals that prove the script did not run, and follows MOVED/ASK itself.
            .retries(0)
            .build()
            .map_err(|e| invalid_url(&nodes.join(","), e))?;
        let connect = client.get_async_connection();
        let conn = bounded(CLUSTER, config.operation_timeout, connect)
            .await
            .map_err(|e| config_error(&nodes.join(","), e))?;
        warn_if_evicting(&mut conn.clone(), CLUSTER, config.operation_timeout).await;
        Ok(Self::Cluster(conn))
    }

    /// `redis` or `redis-cluster`.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::Single(_) => STANDALONE,
            Self::Cluster(_) => CLUSTER,
        }
    }

    /// Loads every script into the server's script cache (`SCRIPT LOAD`; on a cluster, on every
    /// node, replicas included, so a promoted replica has them too), so that the first call of
    /// each is one `EVALSHA`. Best effort: a node that did not take them (down, or an ACL without
    /// `SCRIPT`) gets each script in full on its first call instead (`EVAL` after `NOSCRIPT`).
    pub(crate) async fn preload(&self, sources: &[&str], timeout: Duration) {
        let loaded = match self {
            Self::Single(c) => {
                let mut pipe = redis::pipe();
                for source in sources {
                    pipe.cmd("SCRIPT").arg("LOAD").arg(*source);
                }
                bounded(STANDALONE, timeout, pipe.exec_async(&mut c.clone())).await
            }
            Self::Cluster(c) => {
                let mut conn = c.clone();
                let load_all = async move {
                    for source in sources {
                        // The driver sends a keyless SCRIPT LOAD to every node.
                        redis::cmd("SCRIPT")
                            .arg("LOAD")
                            .arg(*source)
                            .exec_async(&mut conn)
                            .await?;
                    }
                    Ok(())
                };
                bounded(CLUSTER, timeout, load_all).await
            }
        };
        if let Err(e) = loaded {
            tracing::warn!(
                store = self.name(),
                error = %e,
                "could not preload the idem scripts; each will be sent in full on its first call"
            );
        }
    }

    /// Runs a script within `timeout`: `EVALSHA`, then `EVAL` with the full source (which also
    /// caches it) when the node answers `NOSCRIPT`. Adds every request sent to `sent`.
    ///
    /// A refusal that proves the script did not run is retried up to `retries` times. On one
    /// server that is a refused connection (the connection manager hands the error of its last
    /// failed reconnect to the next call, and only then reconnects: without a retry the first
    /// call after an outage would fail although the server is back), `LOADING`, `BUSY`, `OOM`,
    /// ..., each after a short wait. On a cluster also MOVED and ASK, at once on the node they
    /// name, and TRYAGAIN, CLUSTERDOWN, ... after a short wait. Timeouts and dropped connections
    /// are never retried: the script may have run.
    pub(crate) async fn invoke(
        &self,
        call: &Call<'_>,
        timeout: Duration,
        retries: u32,
        sent: &AtomicU64,
    ) -> Result<Value, Error> {
        match self {
            Self::Single(c) => {
                bounded(
                    STANDALONE,
                    timeout,
                    single_invoke(c.clone(), call, retries, sent),
                )
                .await
            }
            Self::Cluster(c) => {
                bounded(
                    CLUSTER,
                    timeout,
                    cluster_invoke(c.clone(), call, retries, sent),
                )
                .await
            }
        }
    }
}

impl Conn {
    /// `call` on the cluster primary `primary` (`EVALSHA`, then `EVAL` after `NOSCRIPT`),
    /// within `timeout`. Never retried. The error says whether the script surely did not run
    /// ([`did_not_run`]: the call may be sent again elsewhere).
    pub(crate) async fn invoke_on(
        &self,
        primary: &Primary,
        call: &Call<'_>,
        timeout: Duration,
        sent: &AtomicU64,
    ) -> Result<Value, (Error, bool)> {
        let Self::Cluster(c) = self else {
            return Err((
                Error::backend(
                    STANDALONE,
                    "a call routed to a cluster node on a single server",
                ),
                true,
            ));
        };
        let mut c = c.clone();
        let run = async {
            count(sent);
            let first = c
                .route_command(call.evalsha(), primary.route())
                .await
                .and_then(Value::extract_error);
            match first {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    count(sent);
                    c.route_command(call.eval(), primary.route())
                        .await
                        .and_then(Value::extract_error)
                }
                other => other,
            }
        };
        match tokio::time::timeout(timeout, run).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => {
                let unrun = did_not_run(&e);
                Err((map_error(CLUSTER, e), unrun))
            }
            Err(_) => Err((Error::timed_out(CLUSTER, timeout), false)),
        }
    }
}

/// One script call: the script, its keys (the record's first: the call is routed by it) and its
/// arguments.
pub(crate) struct Call<'a> {
    script: &'a Script,
    source: &'a str,
    keys: Vec<&'a [u8]>,
    /// Arguments, borrowed where the caller's bytes outlive the call (a batch's items), so that
    /// they are copied once, into the command.
    args: Vec<Cow<'a, [u8]>>,
}

impl<'a> Call<'a> {
    pub(crate) fn new(script: &'a Script, source: &'a str, key: &'a [u8]) -> Self {
        Self {
            script,
            source,
            keys: vec![key],
            args: Vec::new(),
        }
    }

    /// A call without declared keys (its keys go among the arguments), sent to a node by
    /// address ([`Conn::invoke_on`]).
    pub(crate) fn keyless(script: &'a Script, source: &'a str) -> Self {
        Self {
            script,
            source,
            keys: Vec::new(),
            args: Vec::new(),
        }
    }

    /// Declares one more key (`KEYS[n]`).
    pub(crate) fn key(&mut self, key: &'a [u8]) -> &mut Self {
        self.keys.push(key);
        self
    }

    pub(crate) fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Self {
        self.args
            .extend(arg.to_redis_args().into_iter().map(Cow::Owned));
        self
    }

    /// One more argument, borrowed (no copy until the command is built).
    pub(crate) fn arg_ref(&mut self, arg: &'a [u8]) -> &mut Self {
        self.args.push(Cow::Borrowed(arg));
        self
    }

    /// `EVALSHA sha numkeys keys... args...`
    fn evalsha(&self) -> redis::Cmd {
        self.command("EVALSHA", self.script.get_hash())
    }

    /// `EVAL source numkeys keys... args...`, for a node that does not have the script cached.
    fn eval(&self) -> redis::Cmd {
        self.command("EVAL", self.source)
    }

    fn command(&self, name: &str, script: &str) -> redis::Cmd {
        let mut cmd = redis::cmd(name);
        cmd.arg(script).arg(self.keys.len());
        for key in &self.keys {
            cmd.arg(*key);
        }
        for arg in &self.args {
            cmd.arg(arg.as_ref());
        }
        cmd
    }
}

fn count(sent: &AtomicU64) {
    sent.fetch_add(1, Ordering::Relaxed);
}

/// `EVALSHA`, and `EVAL` after `NOSCRIPT` (the script was not cached: it did not run).
async fn script(
    conn: &mut impl ConnectionLike,
    call: &Call<'_>,
    sent: &AtomicU64,
) -> Result<Value, RedisError> {
    count(sent);
    match call.evalsha().query_async(conn).await {
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            count(sent);
            call.eval().query_async(conn).await
        }
        other => other,
    }
}

/// How long to wait before retry `attempt` (from 0) of a call refused unrun.
fn unrun_wait(attempt: u32) -> Duration {
    Duration::from_millis(20u64.saturating_mul(1 << attempt.min(5)).min(500))
}

/// The script on one server, sent again (waits as [`unrun_wait`]'s) while its failure proves it
/// did not run.
async fn single_invoke(
    conn: ConnectionManager,
    call: &Call<'_>,
    retries: u32,
    sent: &AtomicU64,
) -> Result<Value, RedisError> {
    let waits = ExponentialBuilder::default()
        .with_min_delay(unrun_wait(0))
        .with_max_delay(unrun_wait(u32::MAX))
        .with_max_times(retries as usize);
    (|| {
        let mut conn = conn.clone();
        async move { script(&mut conn, call, sent).await }
    })
    .retry(waits)
    .when(did_not_run)
    .await
}

/// Where a refusal sent the call next.
enum Next {
    /// The slot's map: route by key again, after a wait.
    Wait,
    /// The node a MOVED (`asking` false) or ASK (`asking` true) named.
    Node {
        host: String,
        port: u16,
        asking: bool,
    },
}

async fn cluster_invoke(
    mut conn: ClusterConnection,
    call: &Call<'_>,
    retries: u32,
    sent: &AtomicU64,
) -> Result<Value, RedisError> {
    let mut next: Option<Next> = None;
    let mut attempt = 0u32;
    loop {
        let result = match next.take() {
            None => script(&mut conn, call, sent).await,
            Some(Next::Wait) => {
                tokio::time::sleep(unrun_wait(attempt)).await;
                script(&mut conn, call, sent).await
            }
            Some(Next::Node { host, port, asking }) => {
                // One request: ASKING (for ASK) and the full script, pipelined to that node.
                let mut pipe = redis::pipe();
                if asking {
                    pipe.cmd("ASKING");
                }
                pipe.add_command(call.eval());
                let route = SingleNodeRoutingInfo::ByAddress { host, port };
                let offset = usize::from(asking);
                count(sent);
                conn.route_pipeline(pipe, offset, 1, route).await.and_then(
                    |mut values| match values.pop() {
                        Some(value) => value.extract_error(),
                        None => Err(RedisError::from((
                            ErrorKind::UnexpectedReturnType,
                            "no reply to a redirected script",
                        ))),
                    },
                )
            }
        };
        let err = match result {
            Ok(value) => return Ok(value),
            Err(err) => err,
        };
        if attempt >= retries || !did_not_run(&err) {
            return Err(err);
        }
        attempt += 1;
        next = Some(redirect(&err).unwrap_or(Next::Wait));
    }
}

/// The node a MOVED or ASK refusal names.
fn redirect(err: &RedisError) -> Option<Next> {
    let asking = err.kind() == ErrorKind::Server(ServerErrorKind::Ask);
    let (addr, _slot) = err.redirect_node()?;
    let (host, port) = addr.rsplit_once(':')?;
    Some(Next::Node {
        host: host.to_owned(),
        port: port.parse().ok()?,
        asking,
    })
}

/// Refusals the server (or the driver, before sending) answers instead of running the script:
/// retrying them cannot run a transition twice.
pub(crate) fn did_not_run(e: &RedisError) -> bool {
    e.is_connection_refusal()
        || matches!(
            e.kind(),
            ErrorKind::ClusterConnectionNotFound
                | ErrorKind::Server(
                    ServerErrorKind::BusyLoading
                        | ServerErrorKind::MasterDown
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::ClusterDown
                        | ServerErrorKind::ReadOnly
                        | ServerErrorKind::Moved
                        | ServerErrorKind::Ask
                )
        )
        || matches!(e.code(), Some("OOM" | "BUSY"))
}

pub(crate) async fn bounded<T>(
    store: &'static str,
    timeout: Duration,
    fut: impl Future<Output = Result<T, RedisError>>,
) -> Result<T, Error> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(result) => result.map_err(|e| map_error(store, e)),
        Err(_) => Err(Error::timed_out(store, timeout)),
    }
}

/// A configuration the driver refused only when connecting (such as `#insecure` TLS, which this
/// crate does not enable) is bad input, not a server failure.
fn config_error(url: &str, e: Error) -> Error {
    match e {
        // A cluster connection to a single server: the address is wrong, as the other way round.
        Error::Backend { source, .. }
            if source
                .downcast_ref::<RedisError>()
                .is_some_and(|re| re.to_string().contains("cluster support disabled")) =>
        {
            Error::invalid(
                "url",
                "this address is a single Redis server (cluster support disabled): connect with \
                 RedisStore::connect (redis:// in the CLI)",
            )
        }
        Error::Backend { store, source }
            if source
                .downcast_ref::<RedisError>()
                .is_some_and(|re| re.kind() == ErrorKind::InvalidClientConfig) =>
        {
            match source.downcast::<RedisError>() {
                Ok(re) => invalid_url(url, *re),
                Err(source) => Error::Backend { store, source },
            }
        }
        other => other,
    }
}

#[cfg(feature = "tls")]
fn certificates(pem: &[u8]) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(pem.to_vec()),
    }
}

fn invalid_url(url: &str, e: RedisError) -> Error {
    // The URL may hold a password: name only its scheme.
    let scheme = url.split("://").next().unwrap_or("?");
    let hint = if cfg!(feature = "tls") || !scheme.eq_ignore_ascii_case("rediss") {
        ""
    } else {
        "; rediss:// needs this crate's `tls` feature"
    };
    Error::invalid(
        "url",
        format!("cannot use this {scheme}:// address ({e}){hint}"),
    )
}

/// The `maxmemory-policy` values a server may answer (`CONFIG GET maxmemory-policy`, on a
/// cluster the node's that answers), other than `noeviction`.
fn evicting_policies(reply: &Value) -> Vec<String> {
    let mut found = Vec::new();
    let mut strings = Vec::new();
    collect_strings(reply, &mut strings);
    for s in strings {
        if s != "maxmemory-policy" && s != "noeviction" && !found.contains(&s) {
            found.push(s);
        }
    }
    found
}

fn collect_strings(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::BulkString(b) => out.push(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => out.push(s.clone()),
        Value::Array(items) | Value::Set(items) => {
            items.iter().for_each(|v| collect_strings(v, out));
        }
        Value::Map(pairs) => pairs.iter().for_each(|(k, v)| {
            collect_strings(k, out);
            collect_strings(v, out);
        }),
        _ => {}
    }
}

/// Warns (a `tracing` warning, once per connect) when the server may evict keys under memory
/// pressure: with a `maxmemory-policy` other than `noeviction`, Redis may drop a finished
/// record before its retention ends (a forgotten completion: the work runs again), or under
/// `allkeys-*` one in progress. A server that refuses `CONFIG` (managed services often do) or
/// does not answer in time is not judged: nothing is said but a debug line.
async fn warn_if_evicting<C: ConnectionLike + Send>(
    conn: &mut C,
    store: &'static str,
    timeout: Duration,
) {
    let mut get = redis::cmd("CONFIG");
    get.arg("GET").arg("maxmemory-policy");
    match bounded(store, timeout, get.query_async::<Value>(conn)).await {
        Ok(reply) => {
            for policy in evicting_policies(&reply) {
                tracing::warn!(
                    store,
                    maxmemory_policy = %policy,
                    "the Redis server may evict keys (maxmemory-policy {policy}): an evicted \
                     record is a forgotten completion, and its work runs again; set \
                     maxmemory-policy noeviction"
                );
            }
        }
        Err(e) => {
            tracing::debug!(error = %e, "CONFIG GET maxmemory-policy refused; the eviction policy is not checked");
        }
    }
}

/// Refuses a server that runs in cluster mode (`INFO cluster` says `cluster_enabled:1`), however
/// its slots are spread. With several primaries one connection to one node would see only that
/// node's keys (a listing would silently miss the rest, and every other key would answer
/// `MOVED`); even a node that serves every slot (a single-shard cluster, such as ElastiCache or
/// MemoryDB "cluster mode enabled" with one shard) refuses with `CROSSSLOT` a script whose
/// declared keys lie in several hash slots, which a batch and `complete_with` send on one
/// server. A server that refuses `INFO` (an ACL, a renamed command, a proxy) or answers in a way
/// not understood cannot be told apart and is let through: this guard never stops a setup it
/// cannot judge.
///
/// Returns whether the server answered `INFO` at all (one that did not is asked nothing more
/// at connect).
async fn refuse_cluster_node(
    manager: &ConnectionManager,
    url: &str,
    timeout: Duration,
) -> Result<bool, Error> {
    let mut conn = manager.clone();
    let mut info = redis::cmd("INFO");
    info.arg("cluster");
    let enabled = match bounded(STANDALONE, timeout, info.query_async::<String>(&mut conn)).await {
        Ok(info) => info.lines().any(|line| line.trim() == "cluster_enabled:1"),
        Err(e) => {
            tracing::debug!(error = %e, "INFO cluster refused; cannot tell whether this is a cluster node");
            return Ok(false);
        }
    };
    if !enabled {
        return Ok(true);
    }
    let scheme = url.split("://").next().unwrap_or("?");
    Err(Error::invalid(
        "url",
        format!(
            "this {scheme}:// address is a Redis Cluster node (cluster_enabled:1), even if it \
             serves every slot: a cluster node refuses (CROSSSLOT) a script over keys of several \
             hash slots, which batches and complete_with send on one server; connect with \
             RedisStore::connect_cluster (redis+cluster:// in the CLI)"
        ),
    ))
}

/// Whether `e` (an error [`map_error`] made, or a timeout) may mean that the cluster moved a
/// slot or failed a node over: no answer in time, a connection refused, dropped or missing, or
/// a node that says it no longer serves the key (`MOVED`, `ASK`, `CLUSTERDOWN`, `READONLY`,
/// `MASTERDOWN`: a primary turned replica). A node that answers it is loading, busy, out of
/// memory or asks to try again is still where the map says.
pub(crate) fn topology_may_have_changed(e: &Error) -> bool {
    let Error::Unavailable { source, .. } = e else {
        return false;
    };
    if source.downcast_ref::<TimedOut>().is_some() {
        return true;
    }
    source.downcast_ref::<RedisError>().is_some_and(|re| {
        re.is_io_error()
            || re.is_timeout()
            || re.is_connection_refusal()
            || re.is_connection_dropped()
            || matches!(
                re.kind(),
                ErrorKind::ClusterConnectionNotFound
                    | ErrorKind::Server(
                        ServerErrorKind::ClusterDown
                            | ServerErrorKind::Moved
                            | ServerErrorKind::Ask
                            | ServerErrorKind::ReadOnly
                            | ServerErrorKind::MasterDown
                    )
            )
    })
}

/// Maps a driver error: anything that says the server could not be reached or is not serving
/// (I/O, timeouts, refused or dropped connections, cluster down or reconfiguring, loading, read
/// only after a failover, out of memory, busy with a long script) is [`Error::Unavailable`];
/// everything else is [`Error::Backend`].
pub(crate) fn map_error(store: &'static str, e: RedisError) -> Error {
    if not_resp(&e) {
        // Most often the URL names another kind of server (an AMQP or HTTP port), whose
        // greeting the driver reports as "Incompatible type - Parse error": retrying will not
        // make it Redis.
        Error::backend(
            store,
            format!(
                "the reply is not the Redis protocol (is it a Redis server at that address?): {e}"
            ),
        )
    } else if is_unavailable(&e) {
        Error::unavailable(store, e)
    } else {
        Error::backend(store, e)
    }
}

/// A reply that is not RESP. The cluster driver reports it, met on every node it was given, as
/// an I/O error (`Failed to create initial connections`) naming the parse error in its detail.
fn not_resp(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Parse || e.detail().is_some_and(|d| d.contains("Parse error"))
}

fn is_unavailable(e: &RedisError) -> bool {
    !login_refused(e) && is_outage(e)
}

/// A refused login (a wrong password or user) is no outage, on one server as on a cluster,
/// whose driver reports a login refused by every node as an I/O error (`Failed to create
/// initial connections`) that names `AuthenticationFailed` only in its detail.
fn login_refused(e: &RedisError) -> bool {
    e.kind() == ErrorKind::AuthenticationFailed
        || e.code() == Some("WRONGPASS")
        || e.detail()
            .is_some_and(|d| d.contains("AuthenticationFailed") || d.contains("WRONGPASS"))
}

fn is_outage(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_cluster_error()
        || matches!(
            e.kind(),
            ErrorKind::ClusterConnectionNotFound
                | ErrorKind::Server(
                    ServerErrorKind::BusyLoading
                        | ServerErrorKind::MasterDown
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::ClusterDown
                        | ServerErrorKind::ReadOnly
                        | ServerErrorKind::Moved
                        | ServerErrorKind::Ask
                )
        )
        // `OOM command not allowed when used memory > 'maxmemory'` and `BUSY Redis is busy
        // running a script`: the server refused the command and may take it again later.
        || matches!(e.code(), Some("OOM" | "BUSY"))
}

/// rustls needs one process-wide crypto provider; install ring's unless the application chose one.
#[cfg(feature = "tls")]
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race with another installer is fine: some provider is then in place.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_errors_that_may_mean_a_moved_slot_have_the_map_read_again() {
        let server = |kind: ServerErrorKind| {
            map_error(CLUSTER, RedisError::from((ErrorKind::Server(kind), "x")))
        };
        let io = |kind: std::io::ErrorKind| {
            map_error(CLUSTER, RedisError::from(std::io::Error::from(kind)))
        };
        let changed = [
            Error::timed_out(CLUSTER, Duration::from_secs(1)),
            io(std::io::ErrorKind::TimedOut),
            io(std::io::ErrorKind::ConnectionRefused),
            io(std::io::ErrorKind::ConnectionReset),
            map_error(
                CLUSTER,
                RedisError::from((ErrorKind::ClusterConnectionNotFound, "no connection")),
            ),
            server(ServerErrorKind::Moved),
            server(ServerErrorKind::Ask),
            server(ServerErrorKind::ClusterDown),
            server(ServerErrorKind::ReadOnly),
            server(ServerErrorKind::MasterDown),
        ];
        for e in &changed {
            assert!(topology_may_have_changed(e), "{e:?}");
        }
        let extension = |code: &str| {
            map_error(
                CLUSTER,
                redis::make_extension_error(code.to_owned(), Some("x".to_owned())),
            )
        };
        let unchanged = [
            extension("OOM"),
            extension("BUSY"),
            server(ServerErrorKind::BusyLoading),
            server(ServerErrorKind::TryAgain),
            server(ServerErrorKind::ResponseError),
            extension("IDEMCORRUPT"),
        ];
        for e in &unchanged {
            assert!(!topology_may_have_changed(e), "{e:?}");
        }
    }

    #[test]
    fn io_errors_are_unavailable_and_server_errors_are_backend() {
        let refused = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(matches!(
            map_error(STANDALONE, refused),
            Error::Unavailable { store: "redis", .. }
        ));
        let timeout = RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert!(matches!(
            map_error(STANDALONE, timeout),
            Error::Unavailable { .. }
        ));
        let down = RedisError::from((ErrorKind::Server(ServerErrorKind::ClusterDown), "down"));
        assert!(matches!(
            map_error(CLUSTER, down),
            Error::Unavailable {
                store: "redis-cluster",
                ..
            }
        ));
        let script = RedisError::from((ErrorKind::Server(ServerErrorKind::ResponseError), "boom"));
        assert!(matches!(
            map_error(STANDALONE, script),
            Error::Backend { .. }
        ));
        // complete_with's refusal of a write the user's ACL denies (nothing written).
        let denied = RedisError::from((ErrorKind::Server(ServerErrorKind::NoPerm), "denied"));
        assert!(matches!(map_error(CLUSTER, denied), Error::Backend { .. }));
    }

    #[test]
    fn a_refused_login_is_backend_on_one_server_and_on_a_cluster() {
        let single = RedisError::from((
            ErrorKind::AuthenticationFailed,
            "Password authentication failed",
        ));
        let cluster = RedisError::from((
            ErrorKind::Io,
            "Failed to create initial connections",
            "Io: Password authentication failed - AuthenticationFailed".to_owned(),
        ));
        assert!(cluster.is_io_error());
        let wrongpass = redis::make_extension_error(
            "WRONGPASS".to_owned(),
            Some("invalid username-password pair or user is disabled.".to_owned()),
        );
        for (store, e) in [
            (STANDALONE, single),
            (CLUSTER, cluster),
            (STANDALONE, wrongpass),
        ] {
            assert!(
                matches!(map_error(store, e), Error::Backend { .. }),
                "{store}"
            );
        }
    }

    #[test]
    fn refusals_of_a_server_not_serving_are_unavailable() {
        let extension = |code: &str, detail: &str| {
            redis::make_extension_error(code.to_owned(), Some(detail.to_owned()))
        };
        let oom = extension("OOM", "command not allowed when used memory > 'maxmemory'.");
        let busy = extension("BUSY", "Redis is busy running a script.");
        for e in [oom, busy] {
            assert!(did_not_run(&e), "{e:?}");
            assert!(matches!(
                map_error(STANDALONE, e),
                Error::Unavailable { .. }
            ));
        }
        for kind in [
            ServerErrorKind::BusyLoading,
            ServerErrorKind::TryAgain,
            ServerErrorKind::ClusterDown,
            ServerErrorKind::MasterDown,
            ServerErrorKind::ReadOnly,
            ServerErrorKind::Moved,
            ServerErrorKind::Ask,
        ] {
            let e = RedisError::from((ErrorKind::Server(kind), "refused"));
            assert!(did_not_run(&e), "{e:?}");
            assert!(
                matches!(map_error(STANDALONE, e), Error::Unavailable { .. }),
                "{kind:?}"
            );
        }
        // A script's own error and a corrupt record are neither retried nor unavailable.
        let corrupt = extension("IDEMCORRUPT", "unknown state 5");
        assert!(!did_not_run(&corrupt));
        assert!(matches!(
            map_error(STANDALONE, corrupt),
            Error::Backend { .. }
        ));
    }

    #[test]
    fn ambiguous_failures_are_never_retried() {
        // The request may have reached the server and run: a retry could run it twice.
        for kind in [
            std::io::ErrorKind::TimedOut,
            std::io::ErrorKind::ConnectionReset,
            std::io::ErrorKind::BrokenPipe,
            std::io::ErrorKind::UnexpectedEof,
        ] {
            let e = RedisError::from(std::io::Error::from(kind));
            assert!(!did_not_run(&e), "{kind:?}");
            assert!(
                matches!(map_error(STANDALONE, e), Error::Unavailable { .. }),
                "{kind:?}"
            );
        }
        let refused = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(did_not_run(&refused));
    }

    #[test]
    fn redirections_name_their_node() {
        let moved = RedisError::from((
            ErrorKind::Server(ServerErrorKind::Moved),
            "moved",
            "3999 127.0.0.1:7002".to_owned(),
        ));
        assert!(matches!(
            redirect(&moved),
            Some(Next::Node { host, port: 7002, asking: false }) if host == "127.0.0.1"
        ));
        let ask = RedisError::from((
            ErrorKind::Server(ServerErrorKind::Ask),
            "ask",
            "3999 [::1]:7003".to_owned(),
        ));
        assert!(matches!(
            redirect(&ask),
            Some(Next::Node { host, port: 7003, asking: true }) if host == "[::1]"
        ));
        let down = RedisError::from((ErrorKind::Server(ServerErrorKind::TryAgain), "again"));
        assert!(redirect(&down).is_none());
    }

    #[test]
    fn bad_urls_are_invalid_input_without_secrets() {
        let e = invalid_url(
            "nope://user:secret@host",
            RedisError::from((ErrorKind::InvalidClientConfig, "bad")),
        );
        let text = e.to_string();
        assert!(
            matches!(e, Error::InvalidInput { field: "url", .. }),
            "{e:?}"
        );
        assert!(!text.contains("secret"), "{text}");
    }

    /// A log line alone tells what happened: the store's name and the cause's own words.
    #[test]
    fn messages_name_the_store_and_the_cause() {
        let refused = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(
            map_error(STANDALONE, refused).to_string(),
            "redis store unavailable: connection refused"
        );
        let script = redis::make_extension_error(
            "ERR".to_owned(),
            Some("Error running script (call to f_abc): @user_script:12: bad".to_owned()),
        );
        let text = map_error(CLUSTER, script).to_string();
        assert!(
            text.starts_with("redis-cluster store error: ")
                && text.contains("@user_script:12: bad"),
            "{text}"
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let timed_out = runtime.block_on(bounded::<()>(
            CLUSTER,
            Duration::from_millis(10),
            std::future::pending(),
        ));
        let e = timed_out.unwrap_err();
        assert_eq!(
            e.to_string(),
            "redis-cluster store unavailable: no answer within 10ms"
        );
        assert!(
            matches!(&e, Error::Unavailable { source, .. } if source.downcast_ref::<idem_core::TimedOut>().is_some()),
            "{e:?}"
        );
    }
}
