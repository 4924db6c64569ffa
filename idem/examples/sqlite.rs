//! Records that survive a restart: run it twice. The first run handles three payments; the
//! second finds them completed in the database file and replays the stored receipts instead of
//! charging again.
//!
//! `cargo run -p idem --features sqlite --example sqlite [path]` (default: `idem-example.db` in the
//! system's temporary directory; delete the file to start over).

use std::time::Duration;

use idem::sqlite::SqliteStore;
use idem::{AcquireOutcome, AcquireRequest, Bytes, IdempotencyStore, Namespace};

#[tokio::main]
async fn main() -> idem::Result<()> {
    let path = std::env::args()
        .nth(1)
        .map(Into::into)
        .unwrap_or_else(|| std::env::temp_dir().join("idem-example.db"));
    let store = SqliteStore::open(&path).await?;
    println!("store: {}", path.display());
    let payments = Namespace::new("payments")?;
    for id in ["charge-1001", "charge-1002", "charge-1003"] {
        let request = AcquireRequest::new(payments.key(id)?, "example-worker");
        match store.acquire(&request).await? {
            AcquireOutcome::Acquired { lease, .. } => {
                let receipt = format!("receipt for {id}, token {}", lease.token);
                println!("{id}: charged ({receipt})");
                store
                    .complete(&lease, Bytes::from(receipt), Duration::from_secs(86_400))
                    .await?;
            }
            AcquireOutcome::Replayed { result } => {
                println!(
                    "{id}: already charged, replayed: {}",
                    String::from_utf8_lossy(&result)
                );
            }
            other => println!("{id}: {}", other.name()),
        }
    }
    Ok(())
}
