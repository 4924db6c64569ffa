//! Native batches: one statement (one round trip) per batch, counted by the test proxy; a key
//! that appears twice costs one more round; a key locked by an open transaction makes the batch
//! answer every item by its single statement, with the single-call outcomes.
//!
//! C24 (in `conformance.rs`) checks that every batch gives the single-call outcomes.

mod common;

use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    AcquireOutcome, AcquireRequest, Completion, Failure, FailureKind, IdempotencyStore, Lease,
    Namespace,
};
use idem_postgres::{PostgresStore, UNCOMMITTED_OWNER};

const RETENTION: Duration = Duration::from_secs(60);

fn namespace() -> Namespace {
    Namespace::new(format!("batch-{:08x}", rand::random::<u32>())).unwrap()
}

fn requests(ns: &Namespace, n: usize) -> Vec<AcquireRequest> {
    (0..n)
        .map(|i| AcquireRequest::new(ns.key(format!("key-{i}")).unwrap(), "worker"))
        .collect()
}

fn leases(outcomes: &[idem_core::Result<AcquireOutcome>]) -> Vec<Lease> {
    outcomes
        .iter()
        .filter_map(|o| match o {
            Ok(AcquireOutcome::Acquired { lease, .. }) => Some(lease.clone()),
            _ => None,
        })
        .collect()
}

/// Acquires, fails, re-acquires, releases, re-acquires and completes `reqs` in batches.
async fn cycle(store: &PostgresStore, reqs: &[AcquireRequest]) -> Vec<idem_core::Result<()>> {
    let ls = leases(&store.acquire_many(reqs).await.expect("acquire_many"));
    let failures: Vec<_> = ls
        .iter()
        .map(|l| Failure::new(l.clone(), "transient", FailureKind::Retryable))
        .collect();
    let mut out = store
        .fail_many(&failures, RETENTION)
        .await
        .expect("fail_many");
    let ls = leases(&store.acquire_many(reqs).await.expect("acquire_many"));
    out.extend(store.release_many(&ls).await.expect("release_many"));
    let ls = leases(&store.acquire_many(reqs).await.expect("acquire_many"));
    let completions: Vec<_> = ls
        .into_iter()
        .map(|l| Completion::new(l, Bytes::from_static(b"done")))
        .collect();
    out.extend(
        store
            .complete_many(&completions, RETENTION)
            .await
            .expect("complete_many"),
    );
    out
}

#[tokio::test]
async fn one_round_trip_per_batch() {
    let Some((store, proxy)) = common::proxied_store(|c| c).await else {
        return;
    };
    // Warm-up: every batch statement is prepared once per connection.
    let warm = cycle(&store, &requests(&namespace(), 2)).await;
    assert!(warm.iter().all(Result::is_ok), "{warm:?}");

    let ns = namespace();
    let reqs = requests(&ns, 100);
    let counters = &proxy.counters;
    let step = |what: &'static str| {
        let before = counters.requests();
        move |expected: u64| {
            let sent = counters.requests() - before;
            assert_eq!(sent, expected, "{what}: round trips");
        }
    };
    let check = step("acquire_many of 100 fresh keys");
    let out = store.acquire_many(&reqs).await.expect("acquire_many");
    check(1);
    let ls = leases(&out);
    assert_eq!(ls.len(), 100, "{out:?}");

    let check = step("fail_many of 100");
    let failures: Vec<_> = ls
        .iter()
        .map(|l| Failure::new(l.clone(), "transient", FailureKind::Retryable))
        .collect();
    let done = store.fail_many(&failures, RETENTION).await.expect("fail");
    check(1);
    assert!(done.iter().all(Result::is_ok), "{done:?}");

    let ls = leases(&store.acquire_many(&reqs).await.expect("acquire_many"));
    let check = step("release_many of 100");
    let done = store.release_many(&ls).await.expect("release");
    check(1);
    assert!(done.iter().all(Result::is_ok), "{done:?}");

    let ls = leases(&store.acquire_many(&reqs).await.expect("acquire_many"));
    let check = step("complete_many of 100");
    let completions: Vec<_> = ls
        .iter()
        .map(|l| Completion::new(l.clone(), Bytes::from_static(b"done")))
        .collect();
    let done = store
        .complete_many(&completions, RETENTION)
        .await
        .expect("complete");
    check(1);
    assert!(done.iter().all(Result::is_ok), "{done:?}");

    let check = step("acquire_many of 100 duplicates");
    let out = store.acquire_many(&reqs).await.expect("duplicates");
    check(1);
    assert!(
        out.iter()
            .all(|o| matches!(o, Ok(AcquireOutcome::Replayed { .. }))),
        "{out:?}"
    );

    // The same key twice: a second round, so two statements; the second sees the first.
    let twice_ns = namespace();
    let twice = AcquireRequest::new(twice_ns.key("k").unwrap(), "worker");
    let mut with_twice = requests(&twice_ns, 10);
    with_twice.push(twice.clone());
    with_twice.push(twice);
    let check = step("acquire_many with one key twice");
    let out = store.acquire_many(&with_twice).await.expect("twice");
    check(2);
    assert!(
        matches!(out[10], Ok(AcquireOutcome::Acquired { .. })),
        "{:?}",
        out[10]
    );
    assert!(
        matches!(&out[11], Ok(AcquireOutcome::InProgress { owner, .. }) if owner == "worker"),
        "the second finds the first's lease: {:?}",
        out[11]
    );

    // Invalid items cost nothing.
    let check = step("acquire_many of invalid requests");
    let out = store
        .acquire_many(&[AcquireRequest::new(ns.key("bad").unwrap(), "")])
        .await
        .expect("batch");
    check(0);
    assert!(out[0].is_err());
}

/// A key locked by an open transaction: the batch statement stops at the lock timeout and every
/// item of the batch gets its single statement's answer (the locked key `InProgress` with the
/// uncommitted owner, the others as usual).
#[tokio::test]
async fn a_locked_key_falls_back_to_single_statements() {
    let Some(store) = common::store_with(
        common::config(common::run_schema()).with_lock_timeout(Duration::from_millis(200)),
    )
    .await
    else {
        return;
    };
    let ns = namespace();
    let held = ns.key("held").unwrap();
    // A released record: acquiring it again has to lock its row.
    let lease = match store
        .acquire(&AcquireRequest::new(held.clone(), "worker"))
        .await
        .unwrap()
    {
        AcquireOutcome::Acquired { lease, .. } => lease,
        other => panic!("{other:?}"),
    };
    store.release(&lease).await.unwrap();

    let mut admin = common::admin().await;
    let tx = admin.transaction().await.unwrap();
    tx.execute(
        &format!(
            "SELECT 1 FROM {} WHERE namespace = $1 AND id = $2 FOR UPDATE",
            store.qualified_table()
        ),
        &[&ns.as_str(), &"held"],
    )
    .await
    .unwrap();

    let reqs = vec![
        AcquireRequest::new(ns.key("a").unwrap(), "worker"),
        AcquireRequest::new(held.clone(), "worker"),
        AcquireRequest::new(ns.key("b").unwrap(), "worker"),
    ];
    let out = store.acquire_many(&reqs).await.expect("batch");
    tx.rollback().await.unwrap();
    assert!(
        matches!(out[0], Ok(AcquireOutcome::Acquired { .. })),
        "{:?}",
        out[0]
    );
    assert!(
        matches!(&out[1], Ok(AcquireOutcome::InProgress { owner, .. }) if owner == UNCOMMITTED_OWNER),
        "{:?}",
        out[1]
    );
    assert!(
        matches!(out[2], Ok(AcquireOutcome::Acquired { .. })),
        "{:?}",
        out[2]
    );
    // Once the lock is gone, the key is acquired as usual.
    let again = store.acquire_many(&reqs[1..2]).await.expect("batch");
    assert!(
        matches!(&again[0], Ok(AcquireOutcome::Acquired { lease, .. }) if lease.attempt == 1),
        "{:?}",
        again[0]
    );
}
