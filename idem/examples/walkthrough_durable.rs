//! The walkthrough's durable variant: records in a SQLite file survive the process. Run it
//! twice: the first run charges three payments; the second finds them completed in the file and
//! replays the stored receipts instead of charging again.
//!
//! `cargo run -p idem --features sqlite --example walkthrough_durable [path]` (default:
//! `idem-walkthrough.db` in the system's temporary directory; delete it to start over).

use std::time::Duration;

use idem::sqlite::SqliteStore;
use idem::{AcquireOutcome, AcquireRequest, Bytes, Error, IdempotencyStore, Namespace};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Error> {
    let path = std::env::args()
        .nth(1)
        .map(Into::into)
        .unwrap_or_else(|| std::env::temp_dir().join("idem-walkthrough.db"));
    let store = SqliteStore::open(&path).await?;
    println!("records in {}", path.display());
    let payments = Namespace::new("payments")?;
    let (mut charged, mut replayed) = (0, 0);
    for id in ["charge-1001", "charge-1002", "charge-1003"] {
        let request = AcquireRequest::new(payments.key(id)?, "walkthrough");
        match store.acquire(&request).await? {
            AcquireOutcome::Acquired { lease, .. } => {
                let receipt = format!("receipt for {id} (token {})", lease.token);
                println!("{id}: charged the card, {receipt}");
                store
                    .complete(&lease, Bytes::from(receipt), Duration::from_secs(86_400))
                    .await?;
                charged += 1;
            }
            AcquireOutcome::Replayed { result } => {
                println!(
                    "{id}: already charged in an earlier run; replayed {}",
                    String::from_utf8_lossy(&result)
                );
                replayed += 1;
            }
            other => println!("{id}: {}", other.name()),
        }
    }
    println!("{charged} charged, {replayed} replayed");
    Ok(())
}
