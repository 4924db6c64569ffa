//! The whole `idem-conformance` suite (C01-C24), C26 (listing) against DynamoDB (Local by default; see
//! `tests/common/mod.rs` for the endpoint variable), and C25 (transactional effects) on
//! `DynamoStore`'s `TransactWriteItems` completion. Skipped with one line when nothing answers
//! there (a failure with `CI` set).

mod common;

use std::sync::Arc;

use idem_conformance::{Config, Harness};
use idem_core::DynStore;
use idem_dynamo::DynamoStore;

async fn harness() -> Option<Harness> {
    let store = common::store().await?;
    // C23: the requests this store instance (and its clones) sent, counted by the SDK
    // interceptor behind `DynamoStore::requests`, SDK retries included.
    let requests = store.requests().clone();
    Some(
        Harness::new(Arc::new(store), Config::real_time())
            .with_unreachable(|| async {
                Ok(Arc::new(common::unreachable_store().await?) as DynStore)
            })
            .with_silent(|addr| async move {
                let config =
                    common::config(common::table()).with_endpoint_url(format!("http://{addr}"));
                Ok(Arc::new(DynamoStore::connect(config).await?) as DynStore)
            })
            .with_round_trips(move || requests.total()),
    )
}

/// C26 (the operator listing, one `Scan` per page) on a table of its own: a `Scan` reads the
/// whole table, and the shared one fills up with the other scenarios' records while C26's
/// timings run.
async fn listing_harness() -> Option<Harness> {
    let table = format!("{}-c26", common::table());
    let store = common::store_with(common::config(&table)).await?;
    Some(Harness::new(Arc::new(store), Config::real_time()))
}

idem_conformance::conformance_tests!(harness, listing: listing_harness);

/// C25: the handler's writes are actions of the completion's `TransactWriteItems`, here on the
/// test process's effects table.
mod transactional {
    use async_trait::async_trait;
    use idem_conformance::effects::{EffectProbe, c25_transactional_effects};
    use idem_dynamo::{DynamoStore, DynamoWrites, MAX_WRITES};

    use super::*;
    use crate::common::EffectTable;

    struct Probe(EffectTable);

    #[async_trait]
    impl EffectProbe<DynamoStore> for Probe {
        fn set(&self, name: &str, value: &[u8]) -> DynamoWrites {
            DynamoWrites::new().put(self.0.put(name, value))
        }

        fn refused(&self, name: &str) -> Option<DynamoWrites> {
            Some(
                DynamoWrites::new()
                    .put(self.0.put(name, b"refused"))
                    .condition_check(self.0.exists(&format!("{name}:never-written"))),
            )
        }

        fn too_many(&self, name: &str) -> Option<DynamoWrites> {
            let writes = (0..MAX_WRITES).fold(DynamoWrites::new(), |w, i| {
                w.put(self.0.put(&format!("{name}:{i}"), b""))
            });
            Some(writes.put(self.0.put(name, b"too many")))
        }

        async fn read(&self, name: &str) -> Option<Vec<u8>> {
            self.0.read(name).await
        }
    }

    #[tokio::test]
    async fn c25_transactional_effects_system_clock() {
        let Some(store) = common::store().await else {
            return;
        };
        let h = Harness::new(Arc::new(store.clone()), Config::real_time());
        c25_transactional_effects(&h, &store, &Probe(EffectTable::new().await)).await;
    }

    #[tokio::test]
    async fn c25_transactional_effects_manual_clock() {
        let Some((store, clock)) = common::manual_store().await else {
            return;
        };
        let h = Harness::new(Arc::new(store.clone()), Config::manual_time(clock));
        c25_transactional_effects(&h, &store, &Probe(EffectTable::new().await)).await;
    }
}
