//! The operator's listing on Redis: `SCAN` with the namespace's key pattern on every primary.
//!
//! Each step is one `EVALSHA` of a read-only script (`list.lua`) on one node: one `SCAN` with
//! `MATCH {prefix}{namespace}:*` and a `COUNT`, then every key it returned decoded by the same
//! prelude as `get` (tombstones and records past retention left out), with the server clock's
//! time. The Rust side applies [`ListQuery::matches`] at that time and pages.
//!
//! The cursor (text) holds the node's position in the list of primaries (ordered by the first
//! slot each serves, plus a digest of that map on a cluster), the node's `SCAN` cursor, and,
//! when a step found more matches than the page had room for, a digest of that step's keys and
//! the last key returned: the next call repeats the step and skips the keys up to that one when
//! the step returns the same keys, or lists the whole step again (repeats, never losses) when
//! it does not (the node rehashed in between).

use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_core::{Cursor, Error, ListQuery, Page, Record, Result};
use redis::{ErrorKind, RedisError, Script, ServerErrorKind, Value};
use sha2::{Digest, Sha256};

use crate::codec;
use crate::config::RedisConfig;
use crate::conn::{Conn, bounded};
use crate::slots::{Primary, SlotMap};

/// About how many keys (of every namespace) one [`list`] call visits at most before it returns
/// a page (possibly with fewer records than the limit, even none) and a cursor to go on from.
pub(crate) const MAX_KEYS_PER_CALL: usize = 100_000;

/// The script, with the flags that let it read keys of any slot of the node it runs on.
static SCRIPT: LazyLock<(String, Script)> = LazyLock::new(|| {
    let source = format!(
        "#!lua flags=no-writes,allow-cross-slot-keys\n{}\n{}",
        include_str!("lua/common.lua"),
        include_str!("lua/list.lua")
    );
    let script = Script::new(&source);
    (source, script)
});

/// Where a listing goes on: which node, where its `SCAN` is, and how much of a step was
/// already returned.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Position {
    /// Digest of the cluster's slot map (empty on one server).
    topology: String,
    node: usize,
    scan: u64,
    /// The step at `scan` was cut: the digest of its keys and the last key returned.
    cut: Option<(String, Vec<u8>)>,
}

impl Position {
    fn start(topology: &str) -> Self {
        Self {
            topology: topology.to_owned(),
            node: 0,
            scan: 0,
            cut: None,
        }
    }

    /// `r1.<topology>.<node>.<scan>[.<digest>.<hex of the last key>]`
    fn encode(&self) -> Cursor {
        let mut text = format!("r1.{}.{}.{}", self.topology, self.node, self.scan);
        if let Some((digest, after)) = &self.cut {
            text.push('.');
            text.push_str(digest);
            text.push('.');
            text.push_str(&hex::encode(after));
        }
        Cursor::new(text)
    }

    fn decode(cursor: &Cursor) -> Result<Self> {
        let bad = || Error::invalid("cursor", "is not a cursor of this store");
        let parts: Vec<&str> = cursor.as_str().split('.').collect();
        let (topology, node, scan, cut) = match parts.as_slice() {
            ["r1", t, n, s] => (*t, *n, *s, None),
            ["r1", t, n, s, d, a] => (*t, *n, *s, Some((*d, *a))),
            _ => return Err(bad()),
        };
        let hexish = |s: &str| s.bytes().all(|b| b.is_ascii_hexdigit());
        if !hexish(topology) {
            return Err(bad());
        }
        let cut = match cut {
            None => None,
            Some((digest, after)) if hexish(digest) && !digest.is_empty() => {
                Some((digest.to_owned(), hex::decode(after).map_err(|_| bad())?))
            }
            Some(_) => return Err(bad()),
        };
        Ok(Self {
            topology: topology.to_owned(),
            node: node.parse().map_err(|_| bad())?,
            scan: scan.parse().map_err(|_| bad())?,
            cut,
        })
    }
}

/// A node to scan: the server itself, or a cluster primary's address.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Node {
    Single,
    Primary(Primary),
}

/// The `MATCH` pattern of a namespace's keys: the prefix with the glob's special characters
/// escaped, the namespace (which holds none), `:*`.
pub(crate) fn pattern(prefix: &str, namespace: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(prefix.len() + namespace.len() + 2);
    for b in prefix.bytes() {
        if matches!(b, b'*' | b'?' | b'[' | b']' | b'\\') {
            out.push(b'\\');
        }
        out.push(b);
    }
    out.extend_from_slice(namespace.as_bytes());
    out.extend_from_slice(b":*");
    out
}

fn digest<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> String {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
    hex::encode(&hasher.finalize()[..8])
}

/// One page of `query` (see the module docs).
pub(crate) async fn list(
    conn: &Conn,
    config: &RedisConfig,
    sent: &AtomicU64,
    query: &ListQuery,
) -> Result<Page> {
    query.validate()?;
    let store = conn.name();
    let given = query.cursor.as_ref().map(Position::decode).transpose()?;
    let (nodes, topology) = nodes(conn, config, sent).await?;
    let mut pos = match given {
        Some(pos) if pos.topology != topology => {
            return Err(Error::invalid(
                "cursor",
                "the cluster's slot map changed since this listing began (a failover or a \
                 resharding); start the listing again",
            ));
        }
        Some(pos) if pos.node > nodes.len() => {
            return Err(Error::invalid("cursor", "is not a cursor of this store"));
        }
        Some(pos) => pos,
        None => Position::start(&topology),
    };
    let prefix = format!("{}{}:", config.prefix, query.namespace.as_str());
    let pattern = pattern(&config.prefix, query.namespace.as_str());
    // Keys visited per step: a page's worth of matches, up to four pages' (a step cut across
    // pages is read again by the next page).
    let count = query.limit.saturating_mul(4).clamp(100, 1000);
    let mut records: Vec<Record> = Vec::new();
    for _ in 0..MAX_KEYS_PER_CALL / count {
        let Some(node) = nodes.get(pos.node) else {
            return Ok(Page::new(records, None));
        };
        let reply = step(conn, config, sent, node, pos.scan, &pattern, count).await?;
        let (next_scan, now, mut entries) = parse_step(store, &reply)?;
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let step_digest = digest(entries.iter().map(|(k, _)| k.as_slice()));
        let skip_to = match &pos.cut {
            Some((d, after)) if *d == step_digest => Some(after.clone()),
            _ => None,
        };
        let mut found: Vec<(Vec<u8>, Record)> = Vec::new();
        for (storage_key, entry) in entries {
            if skip_to.as_ref().is_some_and(|after| storage_key <= *after) {
                continue;
            }
            if let Some(record) = decode(store, query, &prefix, &storage_key, &entry)?
                && query.matches(&record, now)
            {
                found.push((storage_key, record));
            }
        }
        let room = query.limit - records.len();
        if found.len() > room {
            found.truncate(room);
            let after = found.last().map(|(k, _)| k.clone()).unwrap_or_default();
            records.extend(found.into_iter().map(|(_, r)| r));
            pos.cut = Some((step_digest, after));
            return Ok(Page::new(records, Some(pos.encode())));
        }
        records.extend(found.into_iter().map(|(_, r)| r));
        pos.cut = None;
        if next_scan == 0 {
            pos.node += 1;
            pos.scan = 0;
        } else {
            pos.scan = next_scan;
        }
        if pos.node >= nodes.len() {
            return Ok(Page::new(records, None));
        }
        if records.len() == query.limit {
            break;
        }
    }
    Ok(Page::new(records, Some(pos.encode())))
}

/// The entry of one key: `None` for nothing to list, else the record.
fn decode(
    store: &'static str,
    query: &ListQuery,
    prefix: &str,
    storage_key: &[u8],
    entry: &Value,
) -> Result<Option<Record>> {
    let corrupt =
        |reason: String| Error::corrupt(store, String::from_utf8_lossy(storage_key), reason);
    match entry {
        Value::Int(0) => Ok(None),
        Value::BulkString(why) => Err(corrupt(reason(&String::from_utf8_lossy(why)))),
        Value::SimpleString(why) => Err(corrupt(reason(why))),
        Value::Array(_) => {
            let id = storage_key
                .strip_prefix(prefix.as_bytes())
                .and_then(|id| std::str::from_utf8(id).ok())
                .ok_or_else(|| corrupt("the key is not a key of this namespace".to_owned()))?;
            let key = query
                .namespace
                .key(id)
                .map_err(|e| corrupt(format!("the key's id is not valid: {e}")))?;
            codec::record(entry, &key).map_err(|codec::Bad(why)| corrupt(why))
        }
        other => Err(corrupt(format!("unexpected list entry {other:?}"))),
    }
}

/// The reason in an `IDEMCORRUPT <reason>` entry.
fn reason(entry: &str) -> String {
    entry
        .strip_prefix("IDEMCORRUPT ")
        .unwrap_or(entry)
        .to_owned()
}

type Step = (u64, SystemTime, Vec<(Vec<u8>, Value)>);

fn parse_step(store: &'static str, reply: &Value) -> Result<Step> {
    let bad = |why: String| Error::backend(store, format!("unexpected list reply: {why}"));
    let Value::Array(items) = reply else {
        return Err(bad(format!("{reply:?}")));
    };
    let [cursor, now, entries] = items.as_slice() else {
        return Err(bad(format!("{} elements, not 3", items.len())));
    };
    let cursor: u64 = match cursor {
        Value::BulkString(b) => std::str::from_utf8(b).ok().and_then(|s| s.parse().ok()),
        Value::Int(i) => u64::try_from(*i).ok(),
        _ => None,
    }
    .ok_or_else(|| bad(format!("cursor {cursor:?}")))?;
    let now = match now {
        Value::Int(ms) => u64::try_from(*ms)
            .ok()
            .map(|ms| UNIX_EPOCH + Duration::from_millis(ms)),
        _ => None,
    }
    .ok_or_else(|| bad(format!("time {now:?}")))?;
    let Value::Array(entries) = entries else {
        return Err(bad(format!("entries {entries:?}")));
    };
    let mut out = Vec::with_capacity(entries.len() / 2);
    for pair in entries.chunks(2) {
        match pair {
            [Value::BulkString(key), entry] => out.push((key.clone(), entry.clone())),
            other => return Err(bad(format!("entry {other:?}"))),
        }
    }
    Ok((cursor, now, out))
}

fn note_sent(sent: &AtomicU64) {
    sent.fetch_add(1, Ordering::Relaxed);
}

/// The nodes to scan, in order, and the digest of the slot map (empty on one server): the
/// primaries of `CLUSTER SLOTS`, ordered by the first slot each serves.
async fn nodes(conn: &Conn, config: &RedisConfig, sent: &AtomicU64) -> Result<(Vec<Node>, String)> {
    if !matches!(conn, Conn::Cluster(_)) {
        return Ok((vec![Node::Single], String::new()));
    }
    let map = SlotMap::fetch(conn, config, sent).await?;
    let nodes = map.primaries().iter().cloned().map(Node::Primary).collect();
    let described = map.describe();
    let topology = digest(described.iter().map(|s| s.as_bytes()));
    Ok((nodes, topology))
}

/// One script call on `node`: `EVALSHA`, then `EVAL` with the source after `NOSCRIPT`.
async fn step(
    conn: &Conn,
    config: &RedisConfig,
    sent: &AtomicU64,
    node: &Node,
    scan: u64,
    pattern: &[u8],
    count: usize,
) -> Result<Value> {
    let (source, script) = &*SCRIPT;
    let command = |name: &str, body: &str| {
        let mut cmd = redis::cmd(name);
        cmd.arg(body).arg(0).arg(scan).arg(pattern).arg(count);
        cmd
    };
    let evalsha = command("EVALSHA", script.get_hash());
    let eval = command("EVAL", source);
    let no_script = |e: &RedisError| e.kind() == ErrorKind::Server(ServerErrorKind::NoScript);
    let store = conn.name();
    let run = async {
        match (conn, node) {
            (Conn::Single(c), _) => {
                let mut c = c.clone();
                note_sent(sent);
                match evalsha.query_async(&mut c).await {
                    Err(e) if no_script(&e) => {
                        note_sent(sent);
                        eval.query_async(&mut c).await
                    }
                    other => other,
                }
            }
            (Conn::Cluster(c), Node::Primary(primary)) => {
                let mut c = c.clone();
                let route = || primary.route();
                note_sent(sent);
                let first = c
                    .route_command(evalsha.clone(), route())
                    .await
                    .and_then(Value::extract_error);
                match first {
                    Err(e) if no_script(&e) => {
                        note_sent(sent);
                        c.route_command(eval.clone(), route())
                            .await
                            .and_then(Value::extract_error)
                    }
                    other => other,
                }
            }
            (Conn::Cluster(_), Node::Single) => Err(RedisError::from((
                ErrorKind::Client,
                "a cluster listing step without a primary's address",
            ))),
        }
    };
    bounded(store, config.operation_timeout, run).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pattern_escapes_the_prefix() {
        assert_eq!(pattern("idem:", "payments"), b"idem:payments:*".to_vec());
        assert_eq!(
            pattern("a*b?[c]\\{t}:", "ns"),
            b"a\\*b\\?\\[c\\]\\\\{t}:ns:*".to_vec()
        );
    }

    #[test]
    fn cursors_round_trip_and_bad_ones_are_refused() {
        let pos = Position {
            topology: "0123abcd".into(),
            node: 2,
            scan: 12345,
            cut: Some(("deadbeef".into(), b"idem:ns:a.b".to_vec())),
        };
        assert_eq!(Position::decode(&pos.encode()).unwrap(), pos);
        let plain = Position::start("");
        assert_eq!(Position::decode(&plain.encode()).unwrap(), plain);
        for bad in [
            "",
            "r1",
            "r1..x.0",
            "r2..0.0",
            "r1..0.0.zz.00",
            "r1..0.0.ab.0",
            "r1.q.0.0",
        ] {
            let e = Position::decode(&Cursor::new(bad)).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::InvalidInput {
                        field: "cursor",
                        ..
                    }
                ),
                "{bad}: {e:?}"
            );
        }
    }

    #[test]
    fn list_replies_decode_and_bad_ones_are_errors() {
        let reply = Value::Array(vec![
            Value::BulkString(b"17".to_vec()),
            Value::Int(1_700_000_000_000),
            Value::Array(vec![
                Value::BulkString(b"idem:ns:a".to_vec()),
                Value::Int(0),
            ]),
        ]);
        let (cursor, now, entries) = parse_step("redis", &reply).unwrap();
        assert_eq!(cursor, 17);
        assert_eq!(now, UNIX_EPOCH + Duration::from_millis(1_700_000_000_000));
        assert_eq!(entries.len(), 1);
        assert!(parse_step("redis", &Value::Nil).is_err());
        let odd = Value::Array(vec![
            Value::BulkString(b"0".to_vec()),
            Value::Int(1),
            Value::Array(vec![Value::BulkString(b"k".to_vec())]),
        ]);
        assert!(parse_step("redis", &odd).is_err());
    }

    #[test]
    fn undecodable_values_are_corrupt_records() {
        let ns = idem_core::Namespace::new("ns").unwrap();
        let query = ListQuery::new(ns);
        let e = decode(
            "redis",
            &query,
            "idem:ns:",
            b"idem:ns:x",
            &Value::BulkString(b"IDEMCORRUPT unknown record format".to_vec()),
        )
        .unwrap_err();
        assert!(
            matches!(&e, Error::CorruptRecord { key, reason, .. } if key == "idem:ns:x" && reason == "unknown record format"),
            "{e:?}"
        );
        assert_eq!(
            decode("redis", &query, "idem:ns:", b"idem:ns:x", &Value::Int(0)).unwrap(),
            None
        );
    }
}
