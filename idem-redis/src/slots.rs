//! A Redis Cluster's slot map (`CLUSTER SLOTS`): which primary serves which hash slot. The
//! listing scans every primary; a cluster batch sends one script call per primary.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use idem_core::{Error, Result};
use redis::Value;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo, Slot};

use crate::config::RedisConfig;
use crate::conn::{Conn, bounded};

/// A primary's address.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Primary {
    pub(crate) host: String,
    pub(crate) port: u16,
}

impl Primary {
    /// The route of a command sent to this primary.
    pub(crate) fn route(&self) -> RoutingInfo {
        RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
            host: self.host.clone(),
            port: self.port,
        })
    }
}

/// The slot ranges of a cluster and the primaries serving them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SlotMap {
    /// (first slot, last slot, index in `primaries`), ordered by first slot.
    ranges: Vec<(u16, u16, usize)>,
    /// The primaries, ordered by the first slot each serves.
    primaries: Vec<Primary>,
    /// Every covered slot's primary (index in `primaries`).
    by_slot: HashMap<Slot, usize>,
}

impl SlotMap {
    /// Reads the map from the cluster.
    pub(crate) async fn fetch(conn: &Conn, config: &RedisConfig, sent: &AtomicU64) -> Result<Self> {
        let store = conn.name();
        let Conn::Cluster(c) = conn else {
            return Err(Error::backend(store, "CLUSTER SLOTS on a single server"));
        };
        sent.fetch_add(1, Ordering::Relaxed);
        let mut c = c.clone();
        let reply: Value = bounded(
            store,
            config.operation_timeout,
            redis::cmd("CLUSTER").arg("SLOTS").query_async(&mut c),
        )
        .await?;
        Self::parse(&reply)
            .map_err(|why| Error::backend(store, format!("unexpected CLUSTER SLOTS reply: {why}")))
    }

    fn parse(reply: &Value) -> std::result::Result<Self, String> {
        let Value::Array(entries) = reply else {
            return Err(format!("{reply:?}"));
        };
        let mut slots: Vec<(u16, u16, Primary)> = Vec::new();
        for entry in entries {
            let Value::Array(items) = entry else {
                return Err(format!("{entry:?}"));
            };
            let [
                Value::Int(first),
                Value::Int(last),
                Value::Array(primary),
                ..,
            ] = items.as_slice()
            else {
                return Err(format!("range {items:?}"));
            };
            let [host, Value::Int(port), ..] = primary.as_slice() else {
                return Err(format!("node {primary:?}"));
            };
            let host = match host {
                Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                Value::SimpleString(s) => s.clone(),
                other => return Err(format!("host {other:?}")),
            };
            let slot = |n: i64| u16::try_from(n).ok().filter(|&s| s < 16384);
            let (Some(first), Some(last)) = (slot(*first), slot(*last)) else {
                return Err(format!("slots {first}-{last}"));
            };
            let port = u16::try_from(*port).map_err(|_| format!("port {port}"))?;
            slots.push((first, last, Primary { host, port }));
        }
        slots.sort_by_key(|(first, _, _)| *first);
        let mut primaries: Vec<Primary> = Vec::new();
        let mut ranges = Vec::with_capacity(slots.len());
        for (first, last, primary) in slots {
            let at = match primaries.iter().position(|p| *p == primary) {
                Some(at) => at,
                None => {
                    primaries.push(primary);
                    primaries.len() - 1
                }
            };
            ranges.push((first, last, at));
        }
        let by_slot = ranges
            .iter()
            .flat_map(|&(first, last, at)| {
                (first..=last).filter_map(move |n| Some((Slot::new(n)?, at)))
            })
            .collect();
        Ok(Self {
            ranges,
            primaries,
            by_slot,
        })
    }

    /// The primaries, ordered by the first slot each serves.
    pub(crate) fn primaries(&self) -> &[Primary] {
        &self.primaries
    }

    /// The index (in [`primaries`](Self::primaries)) of the primary serving `slot`; `None` for
    /// a slot no range covers.
    pub(crate) fn primary_of(&self, slot: Slot) -> Option<usize> {
        self.by_slot.get(&slot).copied()
    }

    /// Each range as `first-last@host:port`, in order: what the listing's cursor digests.
    pub(crate) fn describe(&self) -> Vec<String> {
        self.ranges
            .iter()
            .map(|(a, b, p)| {
                let p = &self.primaries[*p];
                format!("{a}-{b}@{}:{}", p.host, p.port)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(host: &str, port: i64) -> Value {
        Value::Array(vec![
            Value::BulkString(host.as_bytes().to_vec()),
            Value::Int(port),
            Value::BulkString(b"id".to_vec()),
        ])
    }

    fn range(first: i64, last: i64, host: &str, port: i64) -> Value {
        Value::Array(vec![Value::Int(first), Value::Int(last), node(host, port)])
    }

    fn at(map: &SlotMap, n: u16) -> Option<usize> {
        map.primary_of(Slot::new(n).unwrap())
    }

    #[test]
    fn slots_map_to_their_primary() {
        let reply = Value::Array(vec![
            range(10923, 16383, "h", 3),
            range(0, 5460, "h", 1),
            range(5461, 10000, "h", 2),
            range(10001, 10922, "h", 1),
        ]);
        let map = SlotMap::parse(&reply).unwrap();
        let ports: Vec<u16> = map.primaries().iter().map(|p| p.port).collect();
        assert_eq!(ports, [1, 2, 3]);
        assert_eq!(at(&map, 0), Some(0));
        assert_eq!(at(&map, 5460), Some(0));
        assert_eq!(at(&map, 5461), Some(1));
        assert_eq!(at(&map, 10001), Some(0));
        assert_eq!(at(&map, 16383), Some(2));
        assert_eq!(map.describe()[0], "0-5460@h:1");
    }

    #[test]
    fn uncovered_slots_have_no_primary_and_bad_replies_are_refused() {
        let map = SlotMap::parse(&Value::Array(vec![range(100, 200, "h", 1)])).unwrap();
        assert_eq!(at(&map, 99), None);
        assert_eq!(at(&map, 201), None);
        assert_eq!(at(&map, 150), Some(0));
        assert!(SlotMap::parse(&Value::Int(1)).is_err());
        assert!(SlotMap::parse(&Value::Array(vec![range(0, 16384, "h", 1)])).is_err());
        assert!(SlotMap::parse(&Value::Array(vec![range(0, 1, "h", 70_000)])).is_err());
    }
}
