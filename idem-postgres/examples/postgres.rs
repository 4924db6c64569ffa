//! The PostgreSQL store in a few lines: plain mode, then transactional mode.
//!
//! ```text
//! scripts/services.sh postgres
//! IDEM_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/test cargo run -p idem-postgres --example postgres
//! ```

use std::time::Duration;

use idem_core::{AcquireOutcome, AcquireRequest, Bytes, Fingerprint, IdempotencyStore, Namespace};
use idem_postgres::{HandlerError, PostgresConfig, PostgresStore, SweeperConfig, TxOutcome};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let store =
        PostgresStore::connect(PostgresConfig::new(&url)?.with_schema("idem_example")).await?;
    let report = store.migrate().await?;
    println!(
        "schema at version {} (applied now: {:?})",
        report.version, report.applied
    );
    let sweeper = store.spawn_sweeper(SweeperConfig::default());
    let retention = Duration::from_secs(24 * 3600);
    let ns = Namespace::new("example.payments")?;
    let run = rand_suffix();

    // Plain mode: acquire, work, complete; a duplicate gets the stored result.
    let payload = br#"{"order": 42, "amount": 1250}"#;
    let req = AcquireRequest::new(ns.key(format!("order-42-{run}"))?, "worker-1")
        .with_fingerprint(Fingerprint::of(payload));
    if let AcquireOutcome::Acquired { lease, .. } = store.acquire(&req).await? {
        println!("acquired with token {}", lease.token);
        store
            .complete(&lease, Bytes::from_static(b"charged"), retention)
            .await?;
    }
    println!("duplicate: {:?}", store.acquire(&req).await?);

    // Transactional mode: the business insert and the completion commit together.
    let client = store.pool().get().await?;
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS idem_example.ledger \
             (entry text PRIMARY KEY, amount bigint NOT NULL, fence bigint NOT NULL)",
        )
        .await?;
    drop(client);
    let req = AcquireRequest::new(ns.key(format!("order-43-{run}"))?, "worker-1");
    for delivery in 1..=2 {
        let outcome = store
            .transactional(&req, retention, |tx, lease| {
                Box::pin(async move {
                    tx.execute(
                        "INSERT INTO idem_example.ledger (entry, amount, fence) VALUES ($1, $2, $3)",
                        &[&lease.key.id(), &1250i64, &(lease.token.get() as i64)],
                    )
                    .await?;
                    if lease.key.id().is_empty() {
                        return Err(HandlerError::terminal("unreachable in this example"));
                    }
                    Ok(Bytes::from_static(b"booked"))
                })
            })
            .await?;
        match outcome {
            TxOutcome::Executed { result, lease } => {
                println!(
                    "delivery {delivery}: executed under token {} -> {result:?}",
                    lease.token
                )
            }
            TxOutcome::NotRun(other) => println!("delivery {delivery}: not run ({other:?})"),
            other => println!("delivery {delivery}: {other:?}"),
        }
    }
    println!("record: {:?}", store.get(&req.key).await?.map(|r| r.state));
    println!("swept {} expired records", sweeper.shutdown().await);
    Ok(())
}

/// A per-run suffix so the example can run repeatedly against the same database.
fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}
