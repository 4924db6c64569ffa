//! The DynamoDB store end to end: a message, its duplicate, a conflicting reuse of its key.
//!
//! ```text
//! scripts/services.sh dynamo          # DynamoDB Local on 127.0.0.1:8000
//! cargo run -p idem --features dynamo --example dynamo
//! ```
//!
//! `IDEM_DYNAMO_ENDPOINT` points it elsewhere (LocalStack: `http://localhost:4566`). Against
//! real DynamoDB, drop the endpoint and the static credentials and let the default AWS
//! configuration (environment, profile, instance role) decide.

use std::time::Duration;

use idem::dynamo::{DynamoConfig, DynamoStore};
use idem::{AcquireOutcome, AcquireRequest, Bytes, Fingerprint, IdempotencyStore, Namespace};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let endpoint = std::env::var("IDEM_DYNAMO_ENDPOINT")
        .unwrap_or_else(|_| "http://127.0.0.1:8000".to_owned());
    let store = DynamoStore::connect(
        DynamoConfig::new("idem-example")
            .with_endpoint_url(&endpoint)
            .with_region("us-east-1")
            .with_static_credentials("example", "example"),
    )
    .await?;
    if store.create_table_if_missing().await? {
        println!("created table {} on {endpoint}", store.table());
    }

    let payments = Namespace::new("payments")?;
    let key = payments.key(format!("order-{}", std::process::id()))?;
    let payload = br#"{"order":42,"amount":1000,"currency":"EUR"}"#;
    let request = AcquireRequest::new(key.clone(), "worker-1")
        .with_fingerprint(Fingerprint::of(payload))
        .with_lease_ttl(Duration::from_secs(30));

    // First delivery: we hold the key, do the work, and store its result.
    match store.acquire(&request).await? {
        AcquireOutcome::Acquired { lease, .. } => {
            println!("acquired {key} with fencing token {}", lease.token);
            let receipt = Bytes::from_static(b"charged: receipt 7f3a");
            store
                .complete(&lease, receipt, Duration::from_secs(24 * 3600))
                .await?;
        }
        other => println!("first delivery: {}", other.name()),
    }

    // Redelivery of the same message: the stored result comes back, the work does not run.
    match store.acquire(&request).await? {
        AcquireOutcome::Replayed { result } => {
            println!("duplicate replayed: {}", String::from_utf8_lossy(&result));
        }
        other => println!("duplicate: {}", other.name()),
    }

    // The same key with a different payload: a conflict, never a silent replay.
    let reused = request
        .clone()
        .with_fingerprint(Fingerprint::of(b"another payload"));
    println!(
        "key reused for another payload: {}",
        store.acquire(&reused).await?.name()
    );

    println!(
        "requests sent by operation: {:?}",
        store.requests().snapshot()
    );
    let record = store.get(&key).await?.expect("the record exists");
    println!(
        "record: state {}, attempts {}, token {}",
        record.state.name(),
        record.attempts,
        record.token
    );
    Ok(())
}
