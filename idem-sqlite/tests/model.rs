//! The differential model test (`idem_conformance::model`) against SQLite: random histories of
//! acquires, heartbeats, completions, failures, releases, reads and deletes, every answer
//! compared with the reference state machine's, on a clock the test moves.
//!
//! `IDEM_MODEL_HISTORIES` sets how many histories the test runs (default 500).

mod common;

use std::sync::Arc;

use common::db_path;
use idem_conformance::model::{self, ModelConfig};
use idem_core::ManualClock;
use idem_sqlite::{SqliteOptions, SqliteStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_matches_the_model() {
    let clock = Arc::new(ManualClock::default());
    let options = SqliteOptions::default().with_clock(clock.clone());
    let store = SqliteStore::open_with(db_path("model"), options)
        .await
        .expect("open");
    let config = ModelConfig::manual_time(clock);
    let histories = config.histories;
    let report = model::check(Arc::new(store), config).await;
    assert_eq!(report.histories, u64::from(histories));
}
