//! `RedisStore::drop_namespace`, on one server and on a Redis Cluster: every record and
//! tombstone of the namespace goes (over several `SCAN` pages, on every primary), nothing else
//! does: not another namespace, not another prefix the pattern would match unescaped, not a key
//! under the namespace's pattern that is not an idem record.

mod common;

use std::time::Duration;

use common::{Admin, cluster, cluster_nodes, random_prefix, standalone, url};
use idem_core::{AcquireOutcome, AcquireRequest, Bytes, IdempotencyStore, Namespace};
use idem_redis::{RedisConfig, RedisStore};

const RETENTION: Duration = Duration::from_secs(3600);
/// More than one `SCAN` page of the store (500 keys a call).
const COMPLETED: usize = 1_200;

async fn complete(store: &RedisStore, ns: &Namespace, id: &str) {
    let key = ns.key(id).unwrap();
    let AcquireOutcome::Acquired { lease, .. } =
        store.acquire(&AcquireRequest::new(key, "w")).await.unwrap()
    else {
        panic!("{id} not acquired");
    };
    store
        .complete(&lease, Bytes::from_static(b"ok"), RETENTION)
        .await
        .unwrap();
}

/// The same server or cluster as `store`, with another prefix.
async fn sibling(store: &RedisStore, prefix: String) -> RedisStore {
    let config = RedisConfig::default().with_prefix(prefix);
    if store.is_cluster() {
        RedisStore::connect_cluster_with(cluster_nodes(), config)
            .await
            .unwrap()
    } else {
        RedisStore::connect_with(&url(), config).await.unwrap()
    }
}

async fn drops_every_record_and_tombstone_and_nothing_else(probe: RedisStore) {
    // `base*:` as the prefix: unescaped, the pattern `base*:ns:*` would match `basex:ns:...`.
    let base = random_prefix();
    let base = base.trim_end_matches(':');
    let store = sibling(&probe, format!("{base}*[a]:")).await;
    let other_prefix = sibling(&probe, format!("{base}x[a]:")).await;
    let ns = Namespace::new("ns").unwrap();
    let other_ns = Namespace::new("ns2").unwrap();

    for i in 0..COMPLETED {
        complete(&store, &ns, &format!("done-{i}")).await;
    }
    let AcquireOutcome::Acquired { .. } = store
        .acquire(&AcquireRequest::new(ns.key("held").unwrap(), "w"))
        .await
        .unwrap()
    else {
        panic!("held not acquired");
    };
    complete(&store, &ns, "deleted").await;
    assert!(store.delete(&ns.key("deleted").unwrap()).await.unwrap());
    complete(&store, &other_ns, "kept").await;
    complete(&other_prefix, &ns, "kept").await;

    // Keys under the namespace's pattern that are not idem records.
    let mut admin = Admin::of(&store).await;
    let prefix = &store.config().prefix;
    let text_key = format!("{prefix}ns:user-text");
    let hash_key = format!("{prefix}ns:user-hash");
    admin
        .query::<()>(redis::cmd("SET").arg(&text_key).arg("hello"))
        .await;
    admin
        .query::<()>(redis::cmd("HSET").arg(&hash_key).arg("f").arg("v"))
        .await;
    let tombstone = String::from_utf8(store.storage_key(&ns.key("deleted").unwrap())).unwrap();
    assert!(admin.exists(&tombstone).await, "delete left a tombstone");

    let removed = store.drop_namespace(&ns).await.unwrap();
    // Every completed record, the one in progress and the tombstone.
    assert_eq!(removed, COMPLETED as u64 + 2);

    for id in ["done-0", "done-599", "done-1199", "held"] {
        assert_eq!(store.get(&ns.key(id).unwrap()).await.unwrap(), None, "{id}");
    }
    assert!(!admin.exists(&tombstone).await, "the tombstone is gone too");
    assert!(
        store
            .get(&other_ns.key("kept").unwrap())
            .await
            .unwrap()
            .is_some()
    );
    assert!(
        other_prefix
            .get(&ns.key("kept").unwrap())
            .await
            .unwrap()
            .is_some(),
        "another prefix matched by the unescaped pattern is untouched"
    );
    assert_eq!(admin.get(&text_key).await.as_deref(), Some(&b"hello"[..]));
    assert!(admin.exists(&hash_key).await);

    // A clean slate: a former key starts again at attempt 1; nothing is left to drop.
    let AcquireOutcome::Acquired { lease, .. } = store
        .acquire(&AcquireRequest::new(ns.key("done-0").unwrap(), "w"))
        .await
        .unwrap()
    else {
        panic!("done-0 not acquired after the drop");
    };
    assert_eq!(lease.attempt, 1);
    store.release(&lease).await.unwrap();
    assert_eq!(store.drop_namespace(&ns).await.unwrap(), 1);
    assert_eq!(store.drop_namespace(&ns).await.unwrap(), 0);

    for s in [&store, &other_prefix] {
        s.drop_namespace(&ns).await.unwrap();
        s.drop_namespace(&other_ns).await.unwrap();
    }
    admin.query::<()>(redis::cmd("UNLINK").arg(&text_key)).await;
    admin.query::<()>(redis::cmd("UNLINK").arg(&hash_key)).await;
}

#[tokio::test]
async fn standalone_drops_every_record_and_tombstone_and_nothing_else() {
    let Some(store) = standalone().await else {
        return;
    };
    drops_every_record_and_tombstone_and_nothing_else(store).await;
}

#[tokio::test]
async fn cluster_drops_every_record_and_tombstone_and_nothing_else() {
    let Some(store) = cluster().await else {
        return;
    };
    drops_every_record_and_tombstone_and_nothing_else(store).await;
}

#[test]
fn the_driver_is_re_exported() {
    // The same `redis` as the store's: a connection manager built with it is accepted.
    fn accepts(_: fn(idem_redis::redis::aio::ConnectionManager, RedisConfig) -> RedisStore) {}
    accepts(RedisStore::from_connection_manager);
}
