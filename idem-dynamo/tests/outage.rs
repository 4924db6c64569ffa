//! The store-outage fault test of issue 12 on a private DynamoDB Local (`-sharedDb -dbPath` on
//! a port of its own, never the shared server): 2,000 keys × 3 deliveries by default, so that CI
//! stays bounded (DynamoDB Local serves a few hundred transactions a second here: 10,000 keys
//! take 5 to 9 minutes); `IDEM_OUTAGE_KEYS=10000` runs the full size. Workers that
//! crash and stall past their lease, and the server killed with
//! `SIGKILL` and restarted twice per run, once with the effect committed by `complete_with` in
//! the completion's `TransactWriteItems` and once written outside the store. The driver
//! (`idem_conformance::outage`) prints the table and asserts 0 lost keys, 0 duplicate effects
//! and 0 zombie writes for the transactional path.
//!
//! Needs `java` and the jar that `scripts/services.sh dynamo` installs; skipped with one line
//! without them (a failure with `CI` set).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use common::{EffectTable, PrivateDynamo};
use idem_conformance::outage::{Effects, Outage, OutagePlan, run_both};
use idem_core::{FencingToken, IdempotencyKey, Result};
use idem_dynamo::{DynamoStore, DynamoWrites};

struct KillDynamo(Arc<PrivateDynamo>);

#[async_trait]
impl Outage for KillDynamo {
    async fn kill(&self) {
        self.0.kill();
    }

    async fn restart(&self) {
        self.0.restart().await;
    }
}

/// Each key's effect: a list in the effects table that every application appends its token to.
struct Appended(EffectTable);

#[async_trait]
impl Effects<DynamoStore> for Appended {
    fn apply(&self, key: &IdempotencyKey, token: FencingToken) -> DynamoWrites {
        DynamoWrites::new().update(self.0.append(&key.to_string(), token.get()))
    }

    async fn applied(&self, key: &IdempotencyKey) -> Result<Vec<FencingToken>> {
        let tokens = self.0.tokens(&key.to_string()).await?;
        Ok(tokens.into_iter().map(FencingToken::new).collect())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_dynamodb_duplicates_nothing_on_the_transactional_path() {
    let Some(server) = PrivateDynamo::start().await else {
        return;
    };
    let server = Arc::new(server);
    let store = DynamoStore::connect(server.config("idem-outage"))
        .await
        .expect("the store");
    store
        .create_table_if_missing()
        .await
        .expect("the records table");
    let effects = EffectTable::on(server.config("idem-outage-effects")).await;
    // Leases of a second: DynamoDB Local on this kind of machine answers in tens of
    // milliseconds under the workers' load, and takes seconds to warm up after a restart.
    let mut plan = OutagePlan::default().with_lease_ttl(Duration::from_secs(1));
    if std::env::var_os("IDEM_OUTAGE_KEYS").is_none() {
        plan = plan.with_keys(2_000);
    }
    let started = Instant::now();
    let (tx, outside) = run_both(
        "dynamo (DynamoDB Local, -sharedDb -dbPath, SIGKILL)",
        &plan,
        Arc::new(store),
        Arc::new(KillDynamo(server.clone())),
        Arc::new(Appended(effects)),
    )
    .await;
    println!(
        "both runs in {:.1} s; duplicate effects outside the store: {}",
        started.elapsed().as_secs_f64(),
        outside.duplicate_effects
    );
    assert_eq!(tx.deliveries, plan.keys * plan.deliveries);
}
