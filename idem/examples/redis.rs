//! Deduplicating a message handler with Redis.
//!
//! ```text
//! scripts/services.sh redis        # a local Redis on 127.0.0.1:6379
//! cargo run -p idem --features redis --example redis [redis://127.0.0.1:6379]
//! ```
//!
//! Delivers the same message three times; the work runs once and the duplicates get the stored
//! result back.

use std::time::Duration;

use idem::redis::{RedisConfig, RedisStore};
use idem::{AcquireOutcome, AcquireRequest, Bytes, Fingerprint, IdempotencyStore, Namespace};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "redis://127.0.0.1:6379".to_owned());
    let config = RedisConfig::default().with_prefix("idem-example:");
    let store = RedisStore::connect_with(&url, config).await?;

    let ns = Namespace::new("payments")?;
    let message_id = format!("order-{}", std::process::id());
    let payload = br#"{"order": 42, "amount": "10.00"}"#;

    for delivery in 1..=3 {
        let req = AcquireRequest::new(ns.key(&message_id)?, "example-worker")
            .with_fingerprint(Fingerprint::of(payload))
            .with_lease_ttl(Duration::from_secs(30));
        match store.acquire(&req).await? {
            AcquireOutcome::Acquired { lease, .. } => {
                println!(
                    "delivery {delivery}: running the work (token {})",
                    lease.token
                );
                let result = Bytes::from_static(b"charged 10.00");
                store
                    .complete(&lease, result, Duration::from_secs(3600))
                    .await?;
            }
            AcquireOutcome::Replayed { result } => {
                println!(
                    "delivery {delivery}: duplicate, stored result {:?}",
                    String::from_utf8_lossy(&result)
                );
            }
            other => println!("delivery {delivery}: {}", other.name()),
        }
    }

    let record = store.get(&ns.key(&message_id)?).await?.expect("stored");
    println!(
        "record: {} after {} attempt(s), kept until {:?}",
        record.state.name(),
        record.attempts,
        record.expires_at
    );
    store.delete(&ns.key(&message_id)?).await?;
    Ok(())
}
