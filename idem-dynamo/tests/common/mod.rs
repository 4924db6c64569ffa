//! What every test of this crate needs: the endpoint, a table of its own, and stores on it.
//!
//! The endpoint comes from `IDEM_DYNAMO_ENDPOINT` (default `http://127.0.0.1:8000`, where
//! `scripts/services.sh dynamo` runs DynamoDB Local). Point it at LocalStack
//! (`IDEM_DYNAMO_ENDPOINT=http://localhost:4566`) to run the same tests there. Credentials are
//! dummies and the region is `us-east-1`; every test process uses its own random table, so runs
//! never collide. A missing server fails the test: it never skips.

#![allow(dead_code, unreachable_pub)]

use std::sync::{Arc, OnceLock};

use idem_core::ManualClock;
use idem_dynamo::{DynamoConfig, DynamoStore};

/// The variable naming the endpoint.
pub const ENDPOINT_VAR: &str = "IDEM_DYNAMO_ENDPOINT";
/// Where `scripts/services.sh dynamo` runs DynamoDB Local.
pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:8000";
/// An endpoint where nothing listens.
pub const DEAD_ENDPOINT: &str = "http://127.0.0.1:1";

pub fn endpoint() -> String {
    std::env::var(ENDPOINT_VAR).unwrap_or_else(|_| DEFAULT_ENDPOINT.to_owned())
}

/// This test process's table.
pub fn table() -> &'static str {
    static TABLE: OnceLock<String> = OnceLock::new();
    TABLE.get_or_init(|| format!("idem-test-{}", uuid::Uuid::new_v4().simple()))
}

/// Options for `table` on the test endpoint.
pub fn config(table: &str) -> DynamoConfig {
    DynamoConfig::new(table)
        .with_endpoint_url(endpoint())
        .with_region("us-east-1")
        // DynamoDB Local 3 accepts any key id made of letters and digits only.
        .with_static_credentials("idemtest", "idemtest")
}

/// A store on this process's table, created if missing. Panics with directions when the server
/// does not answer.
pub async fn store_with(config: DynamoConfig) -> DynamoStore {
    let store = DynamoStore::connect(config)
        .await
        .unwrap_or_else(|e| panic!("building the DynamoDB store failed: {e:?}"));
    if let Err(e) = store.create_table_if_missing().await {
        panic!(
            "DynamoDB at {} could not prepare the test table: {e} ({e:?}). Is it running? \
             Start DynamoDB Local with `scripts/services.sh dynamo`, or set {ENDPOINT_VAR} to a \
             DynamoDB endpoint (LocalStack: http://localhost:4566).",
            endpoint()
        );
    }
    store.requests().reset();
    store
}

pub async fn store() -> DynamoStore {
    store_with(config(table())).await
}

/// A store on a clock the test moves, and that clock.
pub async fn manual_store() -> (DynamoStore, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::default());
    let store = store_with(config(table()).with_clock(clock.clone())).await;
    (store, clock)
}

/// A store pointed at an endpoint where nothing listens (building it sends no request).
pub async fn unreachable_store() -> idem_core::Result<DynamoStore> {
    DynamoStore::connect(config(table()).with_endpoint_url(DEAD_ENDPOINT)).await
}
