//! A Redis Cluster primary that stops answering is failed over to its replica, and the store
//! follows: its single calls and its batches reach the slots' new primary once the cluster has
//! moved them, instead of waiting on the old one forever.
//!
//! The primary is stopped with `SIGSTOP`, as a node cut off by the network: its connections stay
//! open and nothing answers on them (a node that died would refuse connections, which the store
//! already takes as a moved slot). The driver's own slot map is not refreshed by a timeout, so
//! this is the store's doing: a call that timed out has it read the map again, and single calls
//! go by that map from then on. The cluster is private: three primaries and three replicas on
//! free loopback ports, `cluster-node-timeout` 500 ms, so the replica takes over within seconds.
mod common;

use std::collections::HashSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::PrivateRedis;
use idem_core::{AcquireOutcome, AcquireRequest, Error, IdempotencyStore, Namespace};
use idem_redis::RedisStore;
use redis::aio::MultiplexedConnection;
use redis::cluster_routing::Slot;

const SUITE: &str = "redis cluster failover (private servers)";

/// How long the whole test may wait for the cluster to form, to fail over, and for the store
/// to follow.
const PATIENCE: Duration = Duration::from_secs(30);

/// Six private servers made one cluster by `redis-cli --cluster create`; killed on drop.
struct PrivateCluster {
    nodes: Vec<PrivateRedis>,
}

impl PrivateCluster {
    fn start() -> Option<Self> {
        if !common::programs(SUITE, &["redis-server", "redis-cli"]) {
            return None;
        }
        let nodes: Vec<PrivateRedis> = (0..6)
            .map(|_| common::start_cluster_node(&["--cluster-node-timeout", "500"]))
            .collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdout(Stdio::null())
            .status()
            .expect("redis-cli runs");
        assert!(created.success(), "redis-cli --cluster create failed");
        Some(Self { nodes })
    }

    fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(PrivateRedis::url).collect()
    }

    fn node(&self, port: u16) -> &PrivateRedis {
        self.nodes
            .iter()
            .find(|n| n.port == port)
            .expect("a node of this cluster")
    }
}

async fn connect(port: u16) -> MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// The text node `port` answers to `command arg`; `None` when it does not answer.
async fn text(port: u16, command: &str, arg: &str) -> Option<String> {
    redis::cmd(command)
        .arg(arg)
        .query_async(&mut connect(port).await)
        .await
        .ok()
}

/// A primary as `CLUSTER NODES` lists it: its port, its replica's port, its slot ranges.
struct Primary {
    port: u16,
    replica: u16,
    ranges: Vec<(u16, u16)>,
}

impl Primary {
    fn slots(&self) -> HashSet<Slot> {
        self.ranges
            .iter()
            .flat_map(|&(a, b)| (a..=b).filter_map(Slot::new))
            .collect()
    }
}

/// A node as `CLUSTER NODES` lists it.
struct Node {
    id: String,
    port: u16,
    primary: bool,
    /// The id of the primary it replicates (replicas only).
    replicates: Option<String>,
    ranges: Vec<(u16, u16)>,
}

/// The cluster's nodes as node `port` sees them; `None` while the cluster is not in state ok.
async fn nodes(port: u16) -> Option<Vec<Node>> {
    if !text(port, "CLUSTER", "INFO")
        .await?
        .contains("cluster_state:ok")
    {
        return None;
    }
    let listing = text(port, "CLUSTER", "NODES").await?;
    let parse = |line: &str| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let port = f[1]
            .split('@')
            .next()
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.parse().ok())
            .expect("a node address");
        let ranges = common::slots::slot_ranges(&f);
        Node {
            id: f[0].to_owned(),
            port,
            primary: f[2].contains("master"),
            replicates: (f[3] != "-").then(|| f[3].to_owned()),
            ranges,
        }
    };
    Some(listing.lines().map(parse).collect())
}

/// The cluster's three primaries with their replica, as node `port` sees them; `None` until
/// each has one and the 16,384 slots are served.
async fn primaries(port: u16) -> Option<Vec<Primary>> {
    let nodes = nodes(port).await?;
    let mut out = Vec::new();
    for p in nodes.iter().filter(|n| n.primary) {
        let replica = nodes
            .iter()
            .find(|r| r.replicates.as_deref() == Some(p.id.as_str()))?;
        out.push(Primary {
            port: p.port,
            replica: replica.port,
            ranges: p.ranges.clone(),
        });
    }
    let served: usize = out
        .iter()
        .flat_map(|p| &p.ranges)
        .map(|&(a, b)| usize::from(b - a) + 1)
        .sum();
    (out.len() == 3 && served == 16384).then_some(out)
}

/// Polls `ready` every 100 ms until it answers `Some`, for at most [`PATIENCE`].
async fn wait_for<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    mut ready: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Some(value) = ready().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `op`'s answer, sent again while it is `Unavailable` (the calls here are safe to re-send),
/// for at most [`PATIENCE`].
async fn retrying<T, F: std::future::Future<Output = idem_core::Result<T>>>(
    what: &str,
    mut op: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + PATIENCE;
    loop {
        match op().await {
            Ok(value) => return value,
            Err(e) if e.is_retryable() && Instant::now() < deadline => {}
            Err(e) => panic!("{what}: {e:?}"),
        }
    }
}

/// `count` fresh acquire requests, ids from `next` on, whose records live in `slots`.
fn requests_in(
    slots: &HashSet<Slot>,
    store: &RedisStore,
    ns: &Namespace,
    next: &mut u64,
    count: usize,
) -> Vec<AcquireRequest> {
    let mut out = Vec::new();
    while out.len() < count {
        *next += 1;
        let key = ns.key(format!("k{next}")).unwrap();
        if slots.contains(&Slot::for_key(store.storage_key(&key))) {
            out.push(AcquireRequest::new(key, "worker"));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_follows_a_failover_away_from_a_primary_that_stopped_answering() {
    let Some(cluster) = PrivateCluster::start() else {
        return;
    };
    let first = cluster.nodes[0].port;
    let before = wait_for("the cluster to form", || primaries(first)).await;
    let replicas = before.iter().map(|p| p.replica).collect::<Vec<_>>();
    // Every replica has its primary's data link up, so that it is allowed to take over.
    for port in replicas {
        wait_for("a replica's link to its primary", || async move {
            text(port, "INFO", "replication")
                .await?
                .contains("master_link_status:up")
                .then_some(())
        })
        .await;
    }

    let config = common::config()
        .with_response_timeout(Duration::from_millis(500))
        .with_operation_timeout(Duration::from_secs(1));
    let store = RedisStore::connect_cluster_with(cluster.urls(), config)
        .await
        .unwrap();
    let ns = Namespace::new("failover").unwrap();
    let stopped = &before[0];
    let slots = stopped.slots();
    let mut next = 0u64;

    // Before: a batch over the primary's slots answers (and the store has read the slot map).
    let reqs = requests_in(&slots, &store, &ns, &mut next, 20);
    for outcome in store.acquire_many(&reqs).await.unwrap() {
        assert!(
            matches!(outcome, Ok(AcquireOutcome::Acquired { .. })),
            "{outcome:?}"
        );
    }

    cluster.node(stopped.port).pause();
    let new_primary = stopped.replica;
    wait_for("the replica to take over", || async move {
        let mut conn = connect(new_primary).await;
        let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut conn).await.ok()?;
        matches!(role.first(), Some(redis::Value::BulkString(r)) if r == b"master").then_some(())
    })
    .await;
    // Every node that is not stopped serves the slots from the replica now.
    for node in &cluster.nodes {
        if node.port == stopped.port {
            continue;
        }
        let port = node.port;
        wait_for("the nodes to agree on the new primary", || async move {
            let now = nodes(port).await?;
            now.iter()
                .any(|n| n.port == new_primary && n.primary && n.ranges == stopped.ranges)
                .then_some(())
        })
        .await;
    }

    // After: the store may time out while it still sends to the stopped node, but within the
    // test's patience a single call goes through on the new primary, and then a whole batch.
    // Single calls come first: batches read the map on their own path, which would hide a
    // single call that does not follow by itself.
    let failed_over = Instant::now();
    let mut timed_out = Vec::new();
    let lease = loop {
        let req = requests_in(&slots, &store, &ns, &mut next, 1).remove(0);
        match store.acquire(&req).await {
            Ok(AcquireOutcome::Acquired { lease, .. }) => break lease,
            answered => {
                assert!(
                    matches!(answered, Err(Error::Unavailable { .. })),
                    "{answered:?}"
                );
                assert!(
                    failed_over.elapsed() < PATIENCE,
                    "{} single calls after the failover, the last still answered {answered:?}",
                    timed_out.len() + 1
                );
                timed_out.push(req);
            }
        }
    };
    let singles_took = failed_over.elapsed();
    // The fenced transitions and the replay go through the new primary too. (A re-send of a
    // completion that may have run is safe: it answers as applied.)
    retrying("extend", || store.extend(&lease, Duration::from_secs(30))).await;
    retrying("complete", || {
        store.complete(&lease, Bytes::from_static(b"done"), Duration::from_secs(60))
    })
    .await;
    let req = AcquireRequest::new(lease.key.clone(), "worker");
    let again = retrying("replay", || store.acquire(&req)).await;
    assert!(
        matches!(&again, AcquireOutcome::Replayed { result } if result == "done"),
        "{again:?}"
    );
    // A call that timed out is never sent again: the acquisitions that timed out against the
    // stopped node left nothing on the new primary.
    for req in &timed_out {
        let record = retrying("get", || store.get(&req.key)).await;
        assert!(
            record.is_none(),
            "a timed-out acquire was re-sent: {record:?}"
        );
    }

    let mut batches = 0;
    loop {
        batches += 1;
        let reqs = requests_in(&slots, &store, &ns, &mut next, 20);
        let answered = store.acquire_many(&reqs).await;
        let all_acquired = answered.as_ref().is_ok_and(|outcomes| {
            outcomes
                .iter()
                .all(|o| matches!(o, Ok(AcquireOutcome::Acquired { .. })))
        });
        if all_acquired {
            break;
        }
        assert!(
            failed_over.elapsed() < PATIENCE,
            "{batches} batches after the failover, the last still answered {answered:?}"
        );
    }
    println!(
        "the store followed the failover: {} single calls timed out ({singles_took:?}), then \
         {batches} batch(es)",
        timed_out.len()
    );
    cluster.node(stopped.port).resume();
}
