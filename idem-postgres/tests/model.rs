//! The differential model test (`idem_conformance::model`) against PostgreSQL: random histories
//! of acquires, heartbeats, completions, failures, releases, reads and deletes, every answer
//! compared with the reference state machine's. PostgreSQL judges leases on its own clock
//! (`now()`), so waits sleep past short real leases.
//!
//! `IDEM_MODEL_HISTORIES` sets how many histories the test runs (default 500).

mod common;

use std::sync::Arc;

use idem_conformance::model::{self, ModelConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_matches_the_model() {
    let Some(store) = common::store().await else {
        return;
    };
    let config = ModelConfig::real_time();
    let histories = config.histories;
    let report = model::check(Arc::new(store), config).await;
    assert_eq!(report.histories, u64::from(histories));
}
