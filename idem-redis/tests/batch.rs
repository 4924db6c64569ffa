//! Native batches: one script call per batch on one server, one per hash slot on a cluster
//! (counted with `RedisStore::requests_sent`), invalid items answered without a round trip, the
//! same key twice handled in order, and a corrupt record failing only its own item.
//!
//! C24 (in `conformance.rs`) checks that every batch gives the single-call outcomes.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    AcquireOutcome, AcquireRequest, Completion, Error, Failure, FailureKind, IdempotencyStore,
    Lease, Namespace,
};
use idem_redis::RedisStore;
use redis::cluster_routing::Slot;

const RETENTION: Duration = Duration::from_secs(60);

fn requests(ns: &Namespace, ids: impl IntoIterator<Item = String>) -> Vec<AcquireRequest> {
    ids.into_iter()
        .map(|id| AcquireRequest::new(ns.key(id).unwrap(), "worker"))
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

/// How many requests `op` sent.
async fn counted<T>(store: &RedisStore, op: impl Future<Output = T>) -> (T, u64) {
    let before = store.requests_sent();
    let out = op.await;
    (out, store.requests_sent() - before)
}

/// The slot groups a batch of `reqs` makes on a cluster.
fn slots(store: &RedisStore, reqs: &[AcquireRequest]) -> u64 {
    let slots: HashSet<Slot> = reqs
        .iter()
        .map(|r| Slot::for_key(store.storage_key(&r.key)))
        .collect();
    slots.len() as u64
}

/// Every batch operation on `reqs` (all fresh, all valid) sends `expected` requests, and one
/// invalid request more sends nothing more.
async fn one_call_per_group(store: &RedisStore, reqs: Vec<AcquireRequest>, expected: u64) {
    let ns = reqs[0].key.namespace().clone();
    let mut with_invalid = reqs.clone();
    with_invalid.push(AcquireRequest::new(ns.key("invalid").unwrap(), ""));
    let (acquired, sent) = counted(store, store.acquire_many(&with_invalid)).await;
    let acquired = acquired.expect("acquire_many");
    assert_eq!(sent, expected, "acquire_many: requests sent");
    assert!(
        matches!(
            acquired.last(),
            Some(Err(Error::InvalidInput { field: "owner", .. }))
        ),
        "{:?}",
        acquired.last()
    );
    let ls = leases(&acquired);
    assert_eq!(
        ls.len(),
        reqs.len(),
        "every valid key acquired: {acquired:?}"
    );

    let (done, sent) = counted(store, store.release_many(&ls)).await;
    assert!(done.expect("release_many").iter().all(Result::is_ok));
    assert_eq!(sent, expected, "release_many: requests sent");

    let again = store.acquire_many(&reqs).await.expect("acquire_many again");
    let ls = leases(&again);
    let failures: Vec<_> = ls
        .iter()
        .map(|l| Failure::new(l.clone(), "transient", FailureKind::Retryable))
        .collect();
    let (done, sent) = counted(store, store.fail_many(&failures, RETENTION)).await;
    assert!(done.expect("fail_many").iter().all(Result::is_ok));
    assert_eq!(sent, expected, "fail_many: requests sent");

    let again = store.acquire_many(&reqs).await.expect("acquire_many again");
    let completions: Vec<_> = leases(&again)
        .into_iter()
        .map(|l| Completion::new(l, Bytes::from_static(b"done")))
        .collect();
    let (done, sent) = counted(store, store.complete_many(&completions, RETENTION)).await;
    assert!(done.expect("complete_many").iter().all(Result::is_ok));
    assert_eq!(sent, expected, "complete_many: requests sent");

    let (replayed, sent) = counted(store, store.acquire_many(&reqs)).await;
    assert!(
        replayed
            .expect("duplicates")
            .iter()
            .all(|o| matches!(o, Ok(AcquireOutcome::Replayed { .. }))),
        "every key is a duplicate now"
    );
    assert_eq!(sent, expected, "acquire_many of duplicates: requests sent");

    let only_invalid = vec![AcquireRequest::new(ns.key("invalid").unwrap(), "")];
    let (out, sent) = counted(store, store.acquire_many(&only_invalid)).await;
    assert!(matches!(
        out.expect("batch")[0],
        Err(Error::InvalidInput { .. })
    ));
    assert_eq!(sent, 0, "a batch of invalid items sends nothing");
}

#[tokio::test]
async fn standalone_batch_is_one_request() {
    let Some(store) = common::standalone().await else {
        return;
    };
    let ns = Namespace::new("batch").unwrap();
    let reqs = requests(&ns, (0..99).map(|i| format!("key-{i}")));
    one_call_per_group(&store, reqs, 1).await;
}

#[tokio::test]
async fn cluster_batch_is_one_request_per_slot() {
    let Some(store) = common::cluster().await else {
        return;
    };
    let ns = Namespace::new("batch").unwrap();
    // Ids sharing a hash tag share a slot: three tags, three requests per batch.
    let tagged = requests(
        &ns,
        (0..99).map(|i| format!("{{tenant-{}}}:msg-{i}", i % 3)),
    );
    assert_eq!(slots(&store, &tagged), 3);
    one_call_per_group(&store, tagged, 3).await;
    // Untagged ids: one request per slot they fall in.
    let spread = requests(&ns, (0..40).map(|i| format!("spread-{i}")));
    let expected = slots(&store, &spread);
    assert!(expected > 3, "40 keys fall in more than 3 slots");
    one_call_per_group(&store, spread, expected).await;
}

/// The same key twice in one batch: the items run in order, as single calls would.
async fn same_key_twice(store: &RedisStore) {
    let ns = Namespace::new("twice").unwrap();
    let key = ns.key("k").unwrap();
    let req = AcquireRequest::new(key.clone(), "worker");
    let out = store
        .acquire_many(&[req.clone(), req.clone()])
        .await
        .expect("batch");
    let lease = match &out[0] {
        Ok(AcquireOutcome::Acquired { lease, .. }) => lease.clone(),
        other => panic!("the first is acquired, got {other:?}"),
    };
    assert!(
        matches!(&out[1], Ok(AcquireOutcome::InProgress { owner, .. }) if owner == "worker"),
        "the second finds the first's lease: {:?}",
        out[1]
    );
    // Two completions of one lease: the second is a replay (Ok); a different result is refused.
    let done = store
        .complete_many(
            &[
                Completion::new(lease.clone(), Bytes::from_static(b"a")),
                Completion::new(lease.clone(), Bytes::from_static(b"a")),
                Completion::new(lease.clone(), Bytes::from_static(b"b")),
            ],
            RETENTION,
        )
        .await
        .expect("batch");
    assert!(done[0].is_ok() && done[1].is_ok(), "{done:?}");
    assert!(
        matches!(done[2], Err(Error::LeaseLost { .. })),
        "{:?}",
        done[2]
    );
}

#[tokio::test]
async fn same_key_twice_runs_in_order() {
    if let Some(store) = common::standalone().await {
        same_key_twice(&store).await;
    }
    if let Some(store) = common::cluster().await {
        same_key_twice(&store).await;
    }
}

/// A value that is not a record fails its own item (`CorruptRecord`); the other items of the
/// batch are answered as usual and the bad value is left as it was.
async fn corrupt_item(store: &RedisStore) {
    let ns = Namespace::new("corrupt").unwrap();
    let reqs = requests(&ns, ["before", "bad", "after"].map(String::from));
    let bad_key = String::from_utf8(store.storage_key(&reqs[1].key)).unwrap();
    let mut admin = common::Admin::of(store).await;
    admin
        .query::<()>(redis::cmd("SET").arg(&bad_key).arg("not a record"))
        .await;
    let out = store.acquire_many(&reqs).await.expect("batch");
    assert!(
        matches!(out[0], Ok(AcquireOutcome::Acquired { .. })),
        "{:?}",
        out[0]
    );
    assert!(
        matches!(&out[1], Err(Error::CorruptRecord { key, .. }) if *key == bad_key),
        "{:?}",
        out[1]
    );
    assert!(
        matches!(out[2], Ok(AcquireOutcome::Acquired { .. })),
        "{:?}",
        out[2]
    );
    assert_eq!(
        admin.get(&bad_key).await.as_deref(),
        Some(&b"not a record"[..])
    );
}

#[tokio::test]
async fn a_corrupt_record_fails_only_its_item() {
    if let Some(store) = common::standalone().await {
        corrupt_item(&store).await;
    }
    if let Some(store) = common::cluster().await {
        corrupt_item(&store).await;
    }
}

#[tokio::test]
async fn batch_scripts_are_the_single_scripts_in_a_loop() {
    let singles = idem_redis::lua_scripts();
    for batch in idem_redis::lua_batch_scripts() {
        let name = batch.name.strip_suffix("_many").expect("a batch name");
        let single = singles.iter().find(|s| s.name == name).expect("its single");
        // The batch holds the single script's whole body, unchanged.
        let source = &single.source;
        let own = &source[source.find(&format!("-- {name}(")).expect("body header")..];
        assert!(batch.source.contains(own), "{} embeds {name}", batch.name);
        assert_eq!(batch.sha1().len(), 40);
    }
}
