//! The whole `idem-conformance` suite (C01-C20) against DynamoDB (Local by default; see
//! `tests/common/mod.rs` for the endpoint variable).

mod common;

use std::sync::Arc;

use idem_conformance::{Config, Harness};
use idem_core::DynStore;

async fn harness() -> Harness {
    let store = common::store().await;
    Harness::new(Arc::new(store), Config::real_time())
        .with_unreachable(|| async { Ok(Arc::new(common::unreachable_store().await?) as DynStore) })
}

idem_conformance::conformance_tests!(harness);
