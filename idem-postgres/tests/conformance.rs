//! The shared conformance suite (C01-C20) against PostgreSQL.

mod common;

use std::sync::Arc;
use std::time::Duration;

use idem_conformance::{Config, Harness};
use idem_core::DynStore;
use idem_postgres::{PostgresConfig, PostgresStore};

async fn harness() -> Harness {
    let store = common::store().await;
    Harness::new(Arc::new(store), Config::real_time()).with_unreachable(|| async {
        // Nothing listens on port 1.
        let config = PostgresConfig::new("postgres://postgres@127.0.0.1:1/test")?
            .with_connect_timeout(Duration::from_secs(1))
            .with_pool_wait_timeout(Duration::from_secs(1));
        Ok(Arc::new(PostgresStore::connect(config).await?) as DynStore)
    })
}

idem_conformance::conformance_tests!(harness);
