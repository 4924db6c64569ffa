//! A Redis Cluster of one shard (one node serving all 16,384 slots, as ElastiCache or MemoryDB
//! "cluster mode enabled" with one shard): `RedisStore::connect` refuses it, since such a node
//! refuses (`CROSSSLOT`) the one script over keys of several slots that a batch or
//! `complete_with` sends on one server; `RedisStore::connect_cluster` serves it, batches and
//! `complete_with` included.
//!
//! The node is private (a free loopback port, its own data directory, killed on drop, panics
//! included): the shared servers (6379, 7001-7003) are never touched.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::PrivateRedis;
use idem_core::{
    AcquireOutcome, AcquireRequest, Completion, Error, IdempotencyStore, Lease, Namespace,
    RecordState, TransactionalStore,
};
use idem_redis::{RedisStore, RedisWrites};
use redis::cluster_routing::Slot;

const SUITE: &str = "redis single-shard cluster (private server)";

const RETENTION: Duration = Duration::from_secs(60);

/// How long the node may take to serve every slot.
const PATIENCE: Duration = Duration::from_secs(20);

/// A private node in cluster mode that serves every slot itself (`cluster_state:ok`); `None`
/// (the test skips) when `redis-server` is missing outside CI. Killed on drop.
async fn single_shard_cluster() -> Option<PrivateRedis> {
    if !common::programs(SUITE, &["redis-server"]) {
        return None;
    }
    let node = common::start_cluster_node(&[]);
    let mut admin = redis::Client::open(node.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("admin connection to the private node");
    let added: String = redis::cmd("CLUSTER")
        .arg("ADDSLOTSRANGE")
        .arg(0)
        .arg(16383)
        .query_async(&mut admin)
        .await
        .expect("CLUSTER ADDSLOTSRANGE 0 16383");
    assert_eq!(added, "OK");
    let deadline = Instant::now() + PATIENCE;
    loop {
        let info: String = redis::cmd("CLUSTER")
            .arg("INFO")
            .query_async(&mut admin)
            .await
            .expect("CLUSTER INFO");
        if info.lines().any(|l| l.trim() == "cluster_state:ok") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the private node is not cluster_state:ok after {PATIENCE:?}: {info}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Some(node)
}

fn leases(outcomes: &[idem_core::Result<AcquireOutcome>]) -> Vec<Lease> {
    outcomes
        .iter()
        .map(|o| match o {
            Ok(AcquireOutcome::Acquired { lease, .. }) => lease.clone(),
            other => panic!("expected Acquired, got {other:?}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_shard_cluster_is_refused_by_connect_and_served_by_connect_cluster() {
    let Some(node) = single_shard_cluster().await else {
        return;
    };

    // One server's connection: refused, saying to connect as a cluster.
    match RedisStore::connect(&node.url()).await {
        Err(Error::InvalidInput { field, reason }) => {
            assert_eq!(field, "url");
            assert!(reason.contains("cluster_enabled:1"), "{reason}");
            assert!(reason.contains("CROSSSLOT"), "{reason}");
            assert!(reason.contains("connect_cluster"), "{reason}");
            assert!(reason.contains("redis+cluster://"), "{reason}");
        }
        Err(other) => panic!("expected a refused url, got {other:?}"),
        Ok(_) => panic!("expected a refused url, got a store"),
    }

    // A cluster connection through that one node serves batches over several slots.
    let store = RedisStore::connect_cluster_with([node.url()], common::config())
        .await
        .expect("connect_cluster to a single-node cluster");
    let ns = Namespace::new("single-shard").unwrap();
    let reqs: Vec<AcquireRequest> = ["a", "b", "c", "d", "e", "f", "g", "h"]
        .into_iter()
        .map(|id| AcquireRequest::new(ns.key(id).unwrap(), "worker"))
        .collect();
    let slots: HashSet<Slot> = reqs
        .iter()
        .map(|r| Slot::for_key(store.storage_key(&r.key)))
        .collect();
    assert!(slots.len() > 1, "the keys must lie in several slots");

    let acquired = store.acquire_many(&reqs).await.expect("acquire_many");
    let held = leases(&acquired);
    let completions: Vec<Completion> = held[..6]
        .iter()
        .map(|l| Completion::new(l.clone(), Bytes::from_static(b"done")))
        .collect();
    let done = store
        .complete_many(&completions, RETENTION)
        .await
        .expect("complete_many");
    assert!(done.iter().all(Result::is_ok), "{done:?}");
    let released = store.release_many(&held[6..]).await.expect("release_many");
    assert!(released.iter().all(Result::is_ok), "{released:?}");
    for (i, req) in reqs.iter().enumerate() {
        let record = store.get(&req.key).await.unwrap().expect("the record");
        let expected = if i < 6 {
            RecordState::Completed {
                result: Bytes::from_static(b"done"),
            }
        } else {
            RecordState::Released
        };
        assert_eq!(record.state, expected, "{:?}", req.key);
    }

    // complete_with: a write in another slot is refused before sending, one in the record's
    // slot is applied.
    let key = ns.key("with-writes").unwrap();
    let lease = match store
        .acquire(&AcquireRequest::new(key.clone(), "worker"))
        .await
    {
        Ok(AcquireOutcome::Acquired { lease, .. }) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    };
    let record_slot = Slot::for_key(store.storage_key(&key));
    let elsewhere = (0..)
        .map(|n| format!("idem-single-shard-other-{n}"))
        .find(|k| Slot::for_key(k.as_bytes()) != record_slot)
        .unwrap();
    let r = store
        .complete_with(
            &lease,
            Bytes::from_static(b"r"),
            RETENTION,
            RedisWrites::new().set(elsewhere, "x"),
        )
        .await;
    assert!(
        matches!(
            r,
            Err(Error::InvalidInput {
                field: "writes",
                ..
            })
        ),
        "{r:?}"
    );
    let receipt = store.effect_key(&key, ":receipt").unwrap();
    store
        .complete_with(
            &lease,
            Bytes::from_static(b"r"),
            RETENTION,
            RedisWrites::new().set(receipt, "paid"),
        )
        .await
        .expect("complete_with in the record's slot");

    drop(store);
    drop(node);
}
