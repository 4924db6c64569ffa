//! The shared conformance suite (C01-C23, and C25 for the transactional completion) against a
//! standalone Redis and a Redis Cluster.
//!
//! Endpoints: `IDEM_REDIS_URL` (default `redis://127.0.0.1:6379`) and `IDEM_REDIS_CLUSTER_NODES`
//! (default `redis://127.0.0.1:7001,redis://127.0.0.1:7002,redis://127.0.0.1:7003`);
//! `scripts/services.sh redis redis-cluster` starts both. A missing server skips its suite with
//! one line (fails with `CI` set). Every harness uses a fresh random key prefix, so runs sharing
//! a server never collide.
//!
//! C23 counts round trips with [`RedisStore::requests_sent`](idem_redis::RedisStore::requests_sent):
//! the requests this harness's store sent, whatever other tests send to the same server.

mod common;

use std::sync::Arc;

use idem_conformance::{Config, Harness};
use idem_core::DynStore;
use idem_redis::RedisStore;

/// C25's effects: Redis strings under the record's hash tag (so they are in its slot on a
/// cluster), read back over a plain connection.
mod transactional {
    use async_trait::async_trait;
    use idem_conformance::effects::{EffectProbe, c25_transactional_effects};
    use idem_core::Namespace;
    use idem_redis::{MAX_WRITES, RedisWrites};

    use super::*;

    struct Probe(RedisStore);

    impl Probe {
        /// The key of effect `name` (`<namespace>:<id>`): C25 runs on the record `tx` of that
        /// namespace, so the effect goes under that record's hash tag.
        fn key(&self, name: &str) -> String {
            let (ns, _) = name
                .split_once(':')
                .expect("C25 names effects <namespace>:<id>");
            let record = Namespace::new(ns).unwrap().key("tx").unwrap();
            self.0.effect_key(&record, &format!(":{name}")).unwrap()
        }
    }

    #[async_trait]
    impl EffectProbe<RedisStore> for Probe {
        fn set(&self, name: &str, value: &[u8]) -> RedisWrites {
            RedisWrites::new().set(self.key(name), value)
        }

        fn refused(&self, name: &str) -> Option<RedisWrites> {
            Some(
                RedisWrites::new()
                    .set(self.key(name), "refused")
                    .require_eq(self.key(&format!("{name}:never-written")), "something"),
            )
        }

        fn too_many(&self, name: &str) -> Option<RedisWrites> {
            let writes = (0..MAX_WRITES).fold(RedisWrites::new(), |w, i| {
                w.set(self.key(&format!("{name}:{i}")), "")
            });
            Some(writes.set(self.key(name), "too many"))
        }

        async fn read(&self, name: &str) -> Option<Vec<u8>> {
            common::Admin::of(&self.0).await.get(&self.key(name)).await
        }
    }

    async fn c25(store: RedisStore) {
        let h = super::harness(store.clone());
        c25_transactional_effects(&h, &store, &Probe(store.clone())).await;
    }

    #[tokio::test]
    async fn c25_transactional_effects_standalone() {
        let Some(store) = common::standalone().await else {
            return;
        };
        c25(store).await;
    }

    #[tokio::test]
    async fn c25_transactional_effects_cluster() {
        let Some(store) = common::cluster().await else {
            return;
        };
        c25(store).await;
    }
}

fn harness(store: RedisStore) -> Harness {
    let counted = store.clone();
    Harness::new(Arc::new(store), Config::real_time())
        .with_round_trips(move || counted.requests_sent())
}

mod standalone {
    use super::*;

    async fn harness() -> Option<Harness> {
        let store = common::standalone().await?;
        Some(
            super::harness(store)
                .with_unreachable(|| async {
                    Ok(Arc::new(common::unreachable().await?) as DynStore)
                })
                .with_silent(|addr| async move {
                    let store = RedisStore::connect(&format!("redis://{addr}")).await?;
                    Ok(Arc::new(store) as DynStore)
                }),
        )
    }

    /// C26 lists whole databases: it gets one of its own (see `common::LISTING_DB`).
    async fn listing_harness() -> Option<Harness> {
        Some(super::harness(common::standalone_listing().await?))
    }

    idem_conformance::conformance_tests!(harness, listing: listing_harness);
}

mod cluster {
    use super::*;

    async fn harness() -> Option<Harness> {
        let store = common::cluster().await?;
        Some(
            super::harness(store)
                .with_unreachable(|| async {
                    Ok(Arc::new(common::unreachable_cluster().await?) as DynStore)
                })
                .with_silent(|addr| async move {
                    let store = RedisStore::connect_cluster([format!("redis://{addr}")]).await?;
                    Ok(Arc::new(store) as DynStore)
                }),
        )
    }

    idem_conformance::conformance_tests!(harness);
}
