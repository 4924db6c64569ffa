//! The differential model test (`idem_conformance::model`) against DynamoDB (Local by default;
//! see `tests/common/mod.rs` for the endpoint variable): random histories of acquires,
//! heartbeats, completions, failures, releases, reads and deletes, every answer compared with
//! the reference state machine's. The store takes its time from a clock the test moves (its
//! conditions compare times the client sends), so waits advance it and nothing sleeps.
//!
//! `IDEM_MODEL_HISTORIES` sets how many histories the test runs (default 500).

mod common;

use std::sync::Arc;

use idem_conformance::model::{self, ModelConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dynamo_matches_the_model() {
    let Some((store, clock)) = common::manual_store().await else {
        return;
    };
    let config = ModelConfig::manual_time(clock);
    let histories = config.histories;
    let report = model::check(Arc::new(store), config).await;
    assert_eq!(report.histories, u64::from(histories));
}
