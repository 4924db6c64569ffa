//! A guided tour on the embedded `MemoryStore`: a duplicate replayed, a crashed holder taken
//! over, and the zombie's late write refused. Time is a `ManualClock`, so nothing sleeps.
//!
//! Run it with `cargo run -p idem --example walkthrough`.

use std::sync::Arc;
use std::time::Duration;

use idem::{
    AcquireOutcome, AcquireRequest, Bytes, Error, Fingerprint, IdempotencyStore, ManualClock,
    MemoryStore, Namespace,
};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Error> {
    let clock = Arc::new(ManualClock::default());
    let store = MemoryStore::with_clock(clock.clone());
    let payments = Namespace::new("payments")?;
    let lease = Duration::from_secs(30);
    let retention = Duration::from_secs(24 * 3600);

    println!("1. A duplicate delivery is replayed, not re-run");
    let key = payments.key("charge-1001")?;
    let payload = br#"{"card":"4242","amount":1999}"#;
    let req = |owner: &str| {
        AcquireRequest::new(key.clone(), owner)
            .with_fingerprint(Fingerprint::of(payload))
            .with_lease_ttl(lease)
    };
    let AcquireOutcome::Acquired { lease: held, .. } = store.acquire(&req("worker-a")).await?
    else {
        unreachable!("a fresh key is acquired");
    };
    println!(
        "   worker-a acquired {key} (attempt {}, token {})",
        held.attempt, held.token
    );
    println!("   worker-a charges the card and records the receipt");
    store
        .complete(&held, Bytes::from_static(b"receipt r-77"), retention)
        .await?;
    match store.acquire(&req("worker-b")).await? {
        AcquireOutcome::Replayed { result } => println!(
            "   the broker redelivers to worker-b: replayed {:?}, card not charged again",
            String::from_utf8_lossy(&result)
        ),
        other => unreachable!("{other:?}"),
    }

    println!("\n2. A crashed holder is taken over after its lease expires");
    let key = payments.key("charge-1002")?;
    let req = |owner: &str| AcquireRequest::new(key.clone(), owner).with_lease_ttl(lease);
    let AcquireOutcome::Acquired { lease: zombie, .. } = store.acquire(&req("worker-a")).await?
    else {
        unreachable!("a fresh key is acquired");
    };
    println!(
        "   worker-a acquired {key} (token {}) and then stalled",
        zombie.token
    );
    if let AcquireOutcome::InProgress { owner, retry_after } =
        store.acquire(&req("worker-b")).await?
    {
        println!("   worker-b sees it in progress by {owner}, retry after {retry_after:?}");
    }
    clock.advance(lease + Duration::from_secs(1));
    println!(
        "   ... {:?} pass on the store's clock",
        lease + Duration::from_secs(1)
    );
    let AcquireOutcome::Acquired {
        lease: fresh,
        takeover,
    } = store.acquire(&req("worker-b")).await?
    else {
        unreachable!("an expired lease is taken over");
    };
    println!(
        "   worker-b took over: takeover={takeover}, attempt {}, token {} (higher than {})",
        fresh.attempt, fresh.token, zombie.token
    );
    store
        .complete(&fresh, Bytes::from_static(b"receipt r-78"), retention)
        .await?;
    println!("   worker-b completed it");

    println!("\n3. The zombie wakes up and tries to write: refused");
    match store
        .complete(&zombie, Bytes::from_static(b"stale receipt"), retention)
        .await
    {
        Err(e @ Error::LeaseLost { .. }) => println!("   worker-a's late completion: {e}"),
        other => unreachable!("{other:?}"),
    }
    let record = store.get(&key).await?.expect("the record exists");
    println!(
        "   the record still holds worker-b's result: state {}, token {}, attempts {}",
        record.state.name(),
        record.token,
        record.attempts
    );
    Ok(())
}
