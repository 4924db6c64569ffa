//! Requests counted, not assumed: the SDK interceptor behind `DynamoStore::requests` counts every
//! request by operation, and these tests pin the cost of each path.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Error, FailureKind, Fingerprint, IdempotencyKey,
    IdempotencyStore, Lease, LostLease, Namespace, StateKind,
};
use idem_dynamo::DynamoStore;

const RETENTION: Duration = Duration::from_secs(3600);

fn key(id: &str) -> IdempotencyKey {
    Namespace::new(format!("req-{}", uuid::Uuid::new_v4().simple()))
        .unwrap()
        .key(id)
        .unwrap()
}

fn request(key: &IdempotencyKey, owner: &str) -> AcquireRequest {
    AcquireRequest::new(key.clone(), owner)
        .with_fingerprint(Fingerprint::of("payload"))
        .with_lease_ttl(Duration::from_secs(30))
        .with_max_attempts(3)
}

async fn lease(store: &DynamoStore, req: &AcquireRequest) -> Lease {
    match store.acquire(req).await.unwrap() {
        AcquireOutcome::Acquired { lease, .. } => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

fn updates(n: u64) -> BTreeMap<String, u64> {
    BTreeMap::from([("UpdateItem".to_owned(), n)])
}

/// Runs `f` and returns what it sent, by operation.
async fn counted<T>(store: &DynamoStore, f: impl AsyncFnOnce() -> T) -> (T, BTreeMap<String, u64>) {
    store.requests().reset();
    let out = f().await;
    (out, store.requests().snapshot())
}

#[tokio::test]
async fn fresh_message_costs_two_requests_and_a_duplicate_one() {
    let Some(store) = common::store().await else {
        return;
    };
    let key = key("fresh");
    let ((), sent) = counted(&store, async || {
        let lease = lease(&store, &request(&key, "a")).await;
        store
            .complete(&lease, Bytes::from_static(b"ok"), RETENTION)
            .await
            .unwrap();
    })
    .await;
    assert_eq!(sent, updates(2), "fresh message: acquire + complete");

    let (out, sent) = counted(&store, async || store.acquire(&request(&key, "b")).await).await;
    assert!(
        matches!(out, Ok(AcquireOutcome::Replayed { .. })),
        "{out:?}"
    );
    assert_eq!(sent, updates(1), "duplicate: one request, no GetItem");
}

#[tokio::test]
async fn busy_conflict_and_terminal_cost_one_request() {
    let Some(store) = common::store().await else {
        return;
    };
    let busy = key("busy");
    lease(&store, &request(&busy, "a")).await;
    let (out, sent) = counted(&store, async || store.acquire(&request(&busy, "b")).await).await;
    assert!(
        matches!(out, Ok(AcquireOutcome::InProgress { .. })),
        "{out:?}"
    );
    assert_eq!(sent, updates(1), "busy");

    let req = request(&busy, "b").with_fingerprint(Fingerprint::of("other"));
    let (out, sent) = counted(&store, async || store.acquire(&req).await).await;
    assert!(matches!(out, Ok(AcquireOutcome::Conflict)), "{out:?}");
    assert_eq!(sent, updates(1), "conflict");

    let terminal = key("terminal");
    let l = lease(&store, &request(&terminal, "a")).await;
    let (out, sent) = counted(&store, async || {
        store
            .fail(&l, "declined", FailureKind::Terminal, RETENTION)
            .await
    })
    .await;
    out.unwrap();
    assert_eq!(sent, updates(1), "fail");
    let (out, sent) = counted(&store, async || {
        store.acquire(&request(&terminal, "b")).await
    })
    .await;
    assert!(matches!(out, Ok(AcquireOutcome::Failed { .. })), "{out:?}");
    assert_eq!(sent, updates(1), "terminal failure replayed");
}

#[tokio::test]
async fn reacquisitions_cost_one_request() {
    let Some((store, clock)) = common::manual_store().await else {
        return;
    };
    // Takeover of an expired lease.
    let crashed = key("crashed");
    lease(&store, &request(&crashed, "a")).await;
    clock.advance(Duration::from_secs(31));
    let (out, sent) = counted(&store, async || {
        store.acquire(&request(&crashed, "b")).await
    })
    .await;
    assert!(
        matches!(out, Ok(AcquireOutcome::Acquired { takeover: true, ref lease } ) if lease.attempt == 2),
        "{out:?}"
    );
    assert_eq!(sent, updates(1), "takeover");

    // Release, then re-acquire.
    let released = key("released");
    let l = lease(&store, &request(&released, "a")).await;
    let (out, sent) = counted(&store, async || store.release(&l).await).await;
    out.unwrap();
    assert_eq!(sent, updates(1), "release");
    let (out, sent) = counted(&store, async || {
        store.acquire(&request(&released, "b")).await
    })
    .await;
    assert!(
        matches!(out, Ok(AcquireOutcome::Acquired { takeover: false, ref lease }) if lease.attempt == 1),
        "{out:?}"
    );
    assert_eq!(sent, updates(1), "re-acquire after release");

    // Retryable failure, then retry; heartbeat.
    let retried = key("retried");
    let l = lease(&store, &request(&retried, "a")).await;
    let (out, sent) = counted(&store, async || {
        store.extend(&l, Duration::from_secs(30)).await
    })
    .await;
    out.unwrap();
    assert_eq!(sent, updates(1), "extend");
    store
        .fail(&l, "timeout", FailureKind::Retryable, RETENTION)
        .await
        .unwrap();
    let (out, sent) = counted(&store, async || {
        store.acquire(&request(&retried, "b")).await
    })
    .await;
    assert!(
        matches!(out, Ok(AcquireOutcome::Acquired { takeover: false, ref lease }) if lease.attempt == 2),
        "{out:?}"
    );
    assert_eq!(sent, updates(1), "retry after a retryable failure");

    // Exhausted.
    let poison = key("poison");
    let req = request(&poison, "a").with_max_attempts(1);
    let l = lease(&store, &req).await;
    store
        .fail(&l, "boom", FailureKind::Retryable, RETENTION)
        .await
        .unwrap();
    let (out, sent) = counted(&store, async || store.acquire(&req).await).await;
    assert!(
        matches!(out, Ok(AcquireOutcome::Exhausted { .. })),
        "{out:?}"
    );
    assert_eq!(sent, updates(1), "exhausted");
}

#[tokio::test]
async fn past_retention_costs_one_request_except_a_stale_retryable_failure() {
    let Some((store, clock)) = common::manual_store().await else {
        return;
    };
    let done = key("done");
    let l = lease(&store, &request(&done, "a")).await;
    store
        .complete(&l, Bytes::from_static(b"old"), Duration::from_secs(1))
        .await
        .unwrap();
    clock.advance(Duration::from_secs(2));
    let (out, sent) = counted(&store, async || store.acquire(&request(&done, "b")).await).await;
    assert!(
        matches!(out, Ok(AcquireOutcome::Acquired { ref lease, .. }) if lease.attempt == 1 && lease.token > l.token),
        "{out:?}"
    );
    assert_eq!(sent, updates(1), "completed record past retention");

    // The documented exception: the refused first write shows the case, a second one re-creates.
    let stale = key("stale-retryable");
    let l = lease(&store, &request(&stale, "a")).await;
    store
        .fail(
            &l,
            "timeout",
            FailureKind::Retryable,
            Duration::from_secs(1),
        )
        .await
        .unwrap();
    clock.advance(Duration::from_secs(2));
    let (out, sent) = counted(&store, async || store.acquire(&request(&stale, "b")).await).await;
    assert!(
        matches!(out, Ok(AcquireOutcome::Acquired { ref lease, takeover: false }) if lease.attempt == 1 && lease.token > l.token),
        "{out:?}"
    );
    assert_eq!(sent, updates(2), "failed-retryable record past retention");
}

#[tokio::test]
async fn operator_calls_are_one_request_each() {
    let Some(store) = common::store().await else {
        return;
    };
    let key = key("operator");
    lease(&store, &request(&key, "a")).await;
    let (record, sent) = counted(&store, async || store.get(&key).await).await;
    assert!(record.unwrap().is_some());
    assert_eq!(sent, BTreeMap::from([("GetItem".to_owned(), 1)]));
    let (deleted, sent) = counted(&store, async || store.delete(&key).await).await;
    assert!(deleted.unwrap());
    assert_eq!(
        sent,
        updates(1),
        "delete leaves a tombstone: one UpdateItem"
    );
    let (purged, sent) = counted(&store, async || store.purge_expired(100).await).await;
    assert_eq!(purged.unwrap(), 0);
    assert_eq!(
        sent,
        BTreeMap::from([("DescribeTable".to_owned(), 1)]),
        "purge is DynamoDB's TTL's job: it only checks the table is there"
    );
}

#[tokio::test]
async fn bad_input_sends_nothing() {
    let Some(store) = common::store().await else {
        return;
    };
    let key = key("bad");
    let l = lease(&store, &request(&key, "a")).await;
    let too_big = Bytes::from(vec![0u8; store.limits().max_result_len + 1]);
    let (out, sent) = counted(&store, async || {
        (
            store.acquire(&request(&key, "")).await.is_err(),
            store.complete(&l, too_big, RETENTION).await.is_err(),
            store.extend(&l, Duration::ZERO).await.is_err(),
            store
                .fail(&l, "x", FailureKind::Retryable, Duration::ZERO)
                .await
                .is_err(),
            store
                .fail(&l, "nul\0byte", FailureKind::Terminal, RETENTION)
                .await
                .is_err(),
        )
    })
    .await;
    assert_eq!(out, (true, true, true, true, true));
    assert!(
        sent.is_empty(),
        "rejected input must not reach DynamoDB: {sent:?}"
    );
}

#[tokio::test]
async fn replayed_and_refused_transitions_cost_one_request() {
    let Some(store) = common::store().await else {
        return;
    };
    let not_in = |state| LostLease::NotInProgress { state };

    let done = key("replayed-complete");
    let l = lease(&store, &request(&done, "a")).await;
    store
        .complete(&l, Bytes::from_static(b"ok"), RETENTION)
        .await
        .unwrap();
    let (out, sent) = counted(&store, async || {
        store
            .complete(&l, Bytes::from_static(b"ok"), RETENTION)
            .await
    })
    .await;
    out.expect("the same completion again is Ok");
    assert_eq!(sent, updates(1), "a replayed complete: no read first");
    let (out, sent) = counted(&store, async || {
        store
            .complete(&l, Bytes::from_static(b"other"), RETENTION)
            .await
    })
    .await;
    assert!(
        matches!(&out, Err(Error::LeaseLost { why, .. }) if *why == not_in(StateKind::Completed)),
        "{out:?}"
    );
    assert_eq!(sent, updates(1), "a refused complete");

    let failed = key("replayed-fail");
    let l = lease(&store, &request(&failed, "a")).await;
    let kind = FailureKind::ResultNotStored;
    store.fail(&l, "too big", kind, RETENTION).await.unwrap();
    let (out, sent) = counted(&store, async || {
        store.fail(&l, "too big", kind, RETENTION).await
    })
    .await;
    out.expect("the same failure again is Ok");
    assert_eq!(sent, updates(1), "a replayed fail");
    let (out, sent) = counted(&store, async || {
        store
            .fail(&l, "too big", FailureKind::Terminal, RETENTION)
            .await
    })
    .await;
    assert!(
        matches!(&out, Err(Error::LeaseLost { why, .. }) if *why == not_in(StateKind::Failed(kind))),
        "{out:?}"
    );
    assert_eq!(sent, updates(1), "a fail of another kind");

    let released = key("replayed-release");
    let l = lease(&store, &request(&released, "a")).await;
    store.release(&l).await.unwrap();
    let (out, sent) = counted(&store, async || store.release(&l).await).await;
    out.expect("a release again is Ok");
    assert_eq!(sent, updates(1), "a replayed release");
    assert_eq!(
        store.get(&released).await.unwrap().unwrap().attempts,
        0,
        "the attempt was given back once"
    );
}
