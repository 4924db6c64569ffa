//! The shared conformance suite (C01-C20) against a standalone Redis and a Redis Cluster.
//!
//! Endpoints: `IDEM_REDIS_URL` (default `redis://127.0.0.1:6379`) and `IDEM_REDIS_CLUSTER_NODES`
//! (default `redis://127.0.0.1:7001,redis://127.0.0.1:7002,redis://127.0.0.1:7003`);
//! `scripts/services.sh redis redis-cluster` starts both. A missing server fails the tests.
//! Every harness uses a fresh random key prefix, so runs sharing a server never collide.

mod common;

use std::sync::Arc;

use idem_conformance::{Config, Harness};
use idem_core::DynStore;

mod standalone {
    use super::*;

    async fn harness() -> Harness {
        let store: DynStore = Arc::new(common::standalone().await);
        Harness::new(store, Config::real_time())
            .with_unreachable(|| async { Ok(Arc::new(common::unreachable().await?) as DynStore) })
    }

    idem_conformance::conformance_tests!(harness);
}

mod cluster {
    use super::*;

    async fn harness() -> Harness {
        let store: DynStore = Arc::new(common::cluster().await);
        Harness::new(store, Config::real_time()).with_unreachable(|| async {
            Ok(Arc::new(common::unreachable_cluster().await?) as DynStore)
        })
    }

    idem_conformance::conformance_tests!(harness);
}
