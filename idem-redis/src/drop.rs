//! [`RedisStore::drop_namespace`]: removes every record of a namespace, tombstones included.

use std::future::Future;
use std::pin::Pin;
use std::sync::LazyLock;
use std::time::Duration;

use idem_core::{Error, IdempotencyStore, Namespace, Result};
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
use redis::{Script, Value};
use tokio::task::JoinSet;

use crate::conn::{Call, Conn, map_error};
use crate::store::RedisStore;

/// Keys asked of `SCAN` per call (a hint: a call may return more or fewer).
const SCAN_COUNT: usize = 500;

/// Removes `KEYS[1]` when it holds an idem record or tombstone: a string of at least 9 bytes
/// (head and token) whose head byte is 128 to 191 with a state other than the reserved 6 (see the
/// storage layout in the crate docs). Anything else (a key of another type, a value written by
/// someone else) is left alone. Answers 1 when it removed the key, else 0.
const DROP_RECORD: &str = r"
if redis.call('TYPE', KEYS[1])['ok'] ~= 'string' then return 0 end
if redis.call('STRLEN', KEYS[1]) < 9 then return 0 end
local head = string.byte(redis.call('GETRANGE', KEYS[1], 0, 0))
if head < 128 or head > 191 or head % 8 == 6 then return 0 end
redis.call('UNLINK', KEYS[1])
return 1
";

static DROP_SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(DROP_RECORD));

/// The `SCAN` pattern of every storage key of `namespace`: the prefix with the glob characters
/// escaped, the namespace (which holds none), `:` and `*`.
pub(crate) fn namespace_pattern(prefix: &str, namespace: &Namespace) -> Vec<u8> {
    let mut pattern = Vec::with_capacity(prefix.len() + namespace.as_str().len() + 2);
    for &b in prefix.as_bytes() {
        if matches!(b, b'*' | b'?' | b'[' | b']' | b'\\') {
            pattern.push(b'\\');
        }
        pattern.push(b);
    }
    pattern.extend_from_slice(namespace.as_str().as_bytes());
    pattern.extend_from_slice(b":*");
    pattern
}

fn scan_cmd(cursor: u64, pattern: &[u8]) -> redis::Cmd {
    let mut cmd = redis::cmd("SCAN");
    cmd.arg(cursor)
        .arg("MATCH")
        .arg(pattern)
        .arg("COUNT")
        .arg(SCAN_COUNT)
        .arg("TYPE")
        .arg("string");
    cmd
}

/// `fut` within `timeout`, its error mapped.
async fn bounded(
    store: &'static str,
    timeout: Duration,
    fut: Pin<Box<dyn Future<Output = redis::RedisResult<Value>> + Send + '_>>,
) -> Result<Value> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(result) => result.map_err(|e| map_error(store, e)),
        Err(_) => Err(Error::timed_out(store, timeout)),
    }
}

/// A `SCAN` reply: the next cursor and the keys.
fn scan_reply(store: &'static str, value: Value) -> Result<(u64, Vec<Vec<u8>>)> {
    redis::from_redis_value::<(u64, Vec<Vec<u8>>)>(value).map_err(|e| map_error(store, e.into()))
}

impl RedisStore {
    /// Removes every record of `namespace`, **tombstones included**, and returns how many keys
    /// it removed: a clean slate for a throwaway namespace (tests, demos, a replay environment).
    ///
    /// **Not for a namespace in use.** Everything the store knew about its keys goes: stored
    /// results (a duplicate delivered afterwards runs the handler again), attempt counts and
    /// exhausted or terminally failed keys (a poison message runs again), and leases (a worker
    /// holding one gets [`LeaseLost`](idem_core::Error::LeaseLost) with the record gone when it
    /// finishes). Unlike [`delete`](IdempotencyStore::delete), which leaves a tombstone holding
    /// the key's token, nothing is left: the next token of a key rests on the server clock alone
    /// (see [Fencing tokens](crate#fencing-tokens)), as after a tombstone expired, so it is
    /// below an earlier one if the server clock has stepped back since.
    ///
    /// It walks the key space with `SCAN` (`MATCH {prefix}{namespace}:*`, `TYPE string`; on a
    /// Redis Cluster, on every primary), and removes each key found with a small script that
    /// `UNLINK`s it only when it holds an idem record or tombstone (any other key under that
    /// pattern is left alone). The namespace and the keys are sent as arguments, never in script
    /// text. Records written while it runs may or may not be removed. Each request is bounded
    /// by [`operation_timeout`](crate::RedisConfig::operation_timeout); the whole call is not.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_redis::RedisStore) -> idem_core::Result<()> {
    /// use idem_core::Namespace;
    ///
    /// let removed = store.drop_namespace(&Namespace::new("demo-payments")?).await?;
    /// println!("{removed} records removed");
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::Unavailable`] or [`Error::Backend`] when a request fails. Part of the namespace may
    /// have been removed by then; calling again removes the rest.
    pub async fn drop_namespace(&self, namespace: &Namespace) -> Result<u64> {
        let pattern = namespace_pattern(&self.config().prefix, namespace);
        let store = self.name();
        let timeout = self.config().operation_timeout;
        let bounded = |fut| bounded(store, timeout, fut);
        let mut removed = 0;
        match self.conn_and_counter().0 {
            Conn::Single(manager) => {
                let mut cursor = 0;
                loop {
                    let mut conn = manager.clone();
                    let cmd = scan_cmd(cursor, &pattern);
                    let reply = bounded(Box::pin(async move {
                        cmd.query_async::<Value>(&mut conn).await
                    }))
                    .await?;
                    let (next, keys) = scan_reply(store, reply)?;
                    removed += self.drop_records(keys).await?;
                    if next == 0 {
                        return Ok(removed);
                    }
                    cursor = next;
                }
            }
            Conn::Cluster(cluster) => {
                // The first page of every primary, then each primary's own cursor.
                let mut conn = cluster.clone();
                let cmd = scan_cmd(0, &pattern);
                let reply = bounded(Box::pin(async move {
                    conn.route_command(
                        cmd,
                        RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None)),
                    )
                    .await
                }))
                .await?;
                let Value::Map(pages) = reply else {
                    return Err(Error::backend(
                        store,
                        std::io::Error::other(format!("unexpected SCAN reply: {reply:?}")),
                    ));
                };
                for (node, page) in pages {
                    let node: String =
                        redis::from_redis_value(node).map_err(|e| map_error(store, e.into()))?;
                    let (host, port) = node
                        .rsplit_once(':')
                        .and_then(|(h, p)| Some((h.to_owned(), p.parse::<u16>().ok()?)))
                        .ok_or_else(|| {
                            Error::backend(
                                store,
                                std::io::Error::other(format!("unexpected node address {node:?}")),
                            )
                        })?;
                    if let Value::ServerError(e) = page {
                        return Err(map_error(store, e.into()));
                    }
                    let (mut cursor, keys) = scan_reply(store, page)?;
                    removed += self.drop_records(keys).await?;
                    while cursor != 0 {
                        let mut conn = cluster.clone();
                        let cmd = scan_cmd(cursor, &pattern);
                        let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                            host: host.clone(),
                            port,
                        });
                        let reply =
                            bounded(Box::pin(
                                async move { conn.route_command(cmd, route).await },
                            ))
                            .await?;
                        let (next, keys) = scan_reply(store, reply)?;
                        removed += self.drop_records(keys).await?;
                        cursor = next;
                    }
                }
                Ok(removed)
            }
        }
    }

    /// Runs the drop script on every key, concurrently (the connection pipelines them); returns
    /// how many it removed, or the first error once all have answered.
    async fn drop_records(&self, keys: Vec<Vec<u8>>) -> Result<u64> {
        let mut calls = JoinSet::new();
        for key in keys {
            let store = self.clone();
            calls.spawn(async move {
                let call = Call::new(&DROP_SCRIPT, DROP_RECORD, &key);
                let reply = store.send(&key, &call).await?;
                Ok::<_, Error>(matches!(reply, Value::Int(1)))
            });
        }
        let mut removed = 0;
        let mut first_error = None;
        while let Some(joined) = calls.join_next().await {
            match joined {
                Ok(Ok(true)) => removed += 1,
                Ok(Ok(false)) => {}
                Ok(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                Err(panicked) => {
                    first_error.get_or_insert(Error::backend(self.name(), panicked));
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(removed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pattern_escapes_the_prefix_and_ends_at_the_namespace() {
        let ns = Namespace::new("pay.ments-1").unwrap();
        assert_eq!(namespace_pattern("idem:", &ns), b"idem:pay.ments-1:*");
        assert_eq!(
            namespace_pattern("a*b?[c]\\{t}:", &ns),
            b"a\\*b\\?\\[c\\]\\\\{t}:pay.ments-1:*"
        );
    }
}
