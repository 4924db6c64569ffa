//! The PostgreSQL store in a few lines: plain mode, then the two transactional shapes: the
//! handler's statements committed with the completion (`complete_with`), and the in-transaction
//! mode (the handler runs inside the transaction).
//!
//! ```text
//! scripts/services.sh postgres
//! IDEM_POSTGRES_URL=postgres://postgres@127.0.0.1:5432/test cargo run -p idem --features postgres --example postgres
//! ```

use std::time::Duration;

use idem::postgres::{PgWrites, PostgresConfig, PostgresStore, SweeperConfig};
use idem::{
    AcquireOutcome, AcquireRequest, Bytes, Fingerprint, IdempotencyStore, Namespace,
    TransactionalStore,
};
use idem::{ExecutorConfig, HandlerError, Outcome, RawMessage};

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

    // The business table of both transactional shapes.
    let client = store.pool().get().await?;
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS idem_example.ledger \
             (entry text PRIMARY KEY, amount bigint NOT NULL, fence bigint NOT NULL)",
        )
        .await?;
    drop(client);

    // `complete_with`: the handler's statements run in the completion's transaction, after it,
    // in one round trip; a lost lease or a re-sent completion runs none of them.
    let req = AcquireRequest::new(ns.key(format!("order-44-{run}"))?, "worker-1");
    if let AcquireOutcome::Acquired { lease, .. } = store.acquire(&req).await? {
        let writes = PgWrites::new().execute(
            "INSERT INTO idem_example.ledger (entry, amount, fence) VALUES ($1, $2, $3)",
            (lease.key.id().to_owned(), 990i64, lease.token.get() as i64),
        );
        store
            .complete_with(
                &lease,
                Bytes::from_static(b"booked"),
                retention,
                writes.clone(),
            )
            .await?;
        // Re-sent after a lost reply: Ok, and the insert does not run again.
        store
            .complete_with(&lease, Bytes::from_static(b"booked"), retention, writes)
            .await?;
    }
    println!(
        "complete_with: {:?}",
        store.get(&req.key).await?.map(|r| r.state)
    );

    // In-transaction mode: the acquisition, the handler's statements and the completion in one
    // transaction, driven by the executor's configuration, key source, codec and outcomes.
    let payments = store.in_transaction(ExecutorConfig::new("example.ledger"))?;
    let msg = RawMessage::new(r#"{"amount": 1250}"#)
        .with_header("idempotency-key", format!("order-43-{run}"));
    for delivery in 1..=2 {
        let outcome = payments
            .run(&msg, |tx, lease| {
                Box::pin(async move {
                    tx.execute(
                        "INSERT INTO idem_example.ledger (entry, amount, fence) VALUES ($1, $2, $3)",
                        &[&lease.key.id(), &1250i64, &(lease.token.get() as i64)],
                    )
                    .await?;
                    if lease.key.id().is_empty() {
                        return Err(HandlerError::terminal("unreachable in this example"));
                    }
                    Ok(format!("booked under token {}", lease.token))
                })
            })
            .await?;
        match outcome {
            Outcome::Executed(receipt) => println!("delivery {delivery}: executed: {receipt}"),
            Outcome::Replayed(receipt) => println!("delivery {delivery}: replayed: {receipt}"),
            other => println!("delivery {delivery}: {}", other.name()),
        }
    }
    let key = payments
        .executor()
        .namespace()
        .key(format!("order-43-{run}"))?;
    println!("record: {:?}", store.get(&key).await?.map(|r| r.state));
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
