//! Writes a small set of demonstration records, the way consumers would, into the store a URL
//! names, so that `idem` has something to show:
//!
//! ```text
//! cargo run -p idem-cli --example seed -- sqlite:///tmp/idem-demo.db payments
//! idem --store sqlite:///tmp/idem-demo.db stats payments
//! ```
//!
//! It takes the same store URLs as `idem` (not `memory:`, which would vanish with it). The
//! namespace gets: completed records (a JSON result, a binary one), a terminal and a retryable
//! failure, an exhausted poison message, a live lease, and a lease whose holder "crashed" (a
//! one-second lease, expired by the time you look).

#![allow(dead_code, unreachable_pub, missing_docs)]

#[path = "../src/failure.rs"]
mod failure;
#[path = "../src/open.rs"]
mod open;
#[path = "../src/store_url.rs"]
mod store_url;

use std::time::Duration;

use idem_core::{AcquireOutcome, AcquireRequest, Bytes, FailureKind, IdempotencyStore, Namespace};

const DAY: Duration = Duration::from_secs(86_400);

async fn acquire(
    store: &dyn IdempotencyStore,
    ns: &Namespace,
    id: &str,
    owner: &str,
    lease: Duration,
) -> idem_core::Lease {
    let req = AcquireRequest::new(ns.key(id).expect("a valid id"), owner).with_lease_ttl(lease);
    match store.acquire(&req).await {
        Ok(AcquireOutcome::Acquired { lease, .. }) => lease,
        other => panic!("{id}: expected a fresh key, got {other:?} (seed a new namespace)"),
    }
}

async fn seed(store: &dyn IdempotencyStore, ns: &Namespace) -> idem_core::Result<()> {
    let minute = Duration::from_secs(60);
    let lease = acquire(store, ns, "order-1001", "billing-7f9c", minute).await;
    store
        .complete(
            &lease,
            Bytes::from_static(br#"{"charge":"ch_3PQx","amount":1250}"#),
            DAY,
        )
        .await?;
    let lease = acquire(store, ns, "order-1002", "billing-7f9c", minute).await;
    store
        .complete(
            &lease,
            Bytes::from_static(&[0x08, 0x96, 0x01, 0x12, 0x02, 0xff, 0x00]),
            DAY,
        )
        .await?;
    let lease = acquire(store, ns, "order-1003", "billing-2b41", minute).await;
    store
        .fail(
            &lease,
            "card declined: insufficient funds",
            FailureKind::Terminal,
            DAY,
        )
        .await?;
    let lease = acquire(store, ns, "order-1004", "billing-2b41", minute).await;
    store
        .fail(
            &lease,
            "payment gateway timed out after 5s",
            FailureKind::Retryable,
            DAY,
        )
        .await?;
    for attempt in 1..=5 {
        let req = AcquireRequest::new(ns.key("order-1005")?, "billing-2b41");
        let AcquireOutcome::Acquired { lease, .. } = store.acquire(&req).await? else {
            panic!("order-1005: attempt {attempt} was not acquired");
        };
        store
            .fail(
                &lease,
                "schema error: missing field `currency`",
                FailureKind::Retryable,
                DAY,
            )
            .await?;
    }
    acquire(
        store,
        ns,
        "order-1006",
        "billing-7f9c",
        Duration::from_secs(600),
    )
    .await;
    acquire(
        store,
        ns,
        "order-1007",
        "billing-0d13",
        Duration::from_secs(1),
    )
    .await;
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, namespace] = args.as_slice() else {
        eprintln!("usage: seed STORE_URL NAMESPACE");
        return std::process::ExitCode::from(2);
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let result = runtime.block_on(async {
        let url = store_url::StoreUrl::parse(url).map_err(|e| e.to_string())?;
        let opened = Box::pin(open::open(&url, Duration::from_secs(10), true))
            .await
            .map_err(|e| e.message().to_owned())?;
        open::set_up(&opened, Duration::from_secs(30))
            .await
            .map_err(|e| e.message().to_owned())?;
        let ns = Namespace::new(namespace).map_err(|e| e.to_string())?;
        seed(opened.store(), &ns).await.map_err(|e| e.to_string())
    });
    match result {
        Ok(()) => {
            println!("seeded namespace {namespace}: order-1001 .. order-1007");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("seed: {e}");
            std::process::ExitCode::from(1)
        }
    }
}
