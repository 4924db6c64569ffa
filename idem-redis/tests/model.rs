//! The differential model test (`idem_conformance::model`) against a standalone Redis and a Redis
//! Cluster: random histories of acquires, heartbeats, completions, failures, releases, reads and
//! deletes, every answer compared with the reference state machine's. Redis judges leases on its
//! own clock, so waits sleep past short real leases.
//!
//! `IDEM_MODEL_HISTORIES` sets how many histories each test runs (default 500).

mod common;

use std::sync::Arc;

use idem_conformance::model::{self, ModelConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn standalone_matches_the_model() {
    let Some(store) = common::standalone().await else {
        return;
    };
    let config = ModelConfig::real_time();
    let histories = config.histories;
    let report = model::check(Arc::new(store), config).await;
    assert_eq!(report.histories, u64::from(histories));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_matches_the_model() {
    let Some(store) = common::cluster().await else {
        return;
    };
    let config = ModelConfig::real_time();
    let histories = config.histories;
    let report = model::check(Arc::new(store), config).await;
    assert_eq!(report.histories, u64::from(histories));
}
