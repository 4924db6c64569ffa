//! Native batches: one script call per batch on one server, one per primary on a cluster
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

/// How many primaries serve the keys of `reqs`, asked of the cluster itself (`CLUSTER KEYSLOT`
/// per key, `CLUSTER SLOTS` for the ranges).
async fn primaries(store: &RedisStore, reqs: &[AcquireRequest]) -> u64 {
    let node = common::cluster_nodes()[0].clone();
    let mut conn = redis::Client::open(node)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let ranges: Vec<(i64, i64, Vec<redis::Value>)> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async::<Vec<Vec<redis::Value>>>(&mut conn)
        .await
        .unwrap()
        .into_iter()
        .map(|range| match range.as_slice() {
            [
                redis::Value::Int(a),
                redis::Value::Int(b),
                redis::Value::Array(primary),
                ..,
            ] => (*a, *b, primary[..2].to_vec()),
            other => panic!("CLUSTER SLOTS range {other:?}"),
        })
        .collect();
    let mut serving = HashSet::new();
    for req in reqs {
        let slot: i64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(store.storage_key(&req.key))
            .query_async(&mut conn)
            .await
            .unwrap();
        let (_, _, primary) = ranges
            .iter()
            .find(|(a, b, _)| (*a..=*b).contains(&slot))
            .expect("every slot is served");
        serving.insert(format!("{primary:?}"));
    }
    serving.len() as u64
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
async fn cluster_batch_is_one_request_per_primary() {
    let Some(store) = common::cluster().await else {
        return;
    };
    let ns = Namespace::new("batch").unwrap();
    // The first batch reads the slot map: one request more.
    let warm = requests(&ns, ["warm".to_owned()]);
    let (done, sent) = counted(&store, store.acquire_many(&warm)).await;
    assert!(done.expect("acquire_many")[0].is_ok());
    assert_eq!(sent, 2, "CLUSTER SLOTS, then the primary's call");
    // Ids sharing a hash tag share a slot: three tags, one request per primary serving them.
    let tagged = requests(
        &ns,
        (0..99).map(|i| format!("{{tenant-{}}}:msg-{i}", i % 3)),
    );
    assert_eq!(slots(&store, &tagged), 3);
    let expected = primaries(&store, &tagged).await;
    one_call_per_group(&store, tagged, expected).await;
    // Untagged ids fall in many slots, and still make one request per primary.
    let spread = requests(&ns, (0..40).map(|i| format!("spread-{i}")));
    assert!(
        slots(&store, &spread) > 3,
        "40 keys fall in more than 3 slots"
    );
    let expected = primaries(&store, &spread).await;
    assert_eq!(expected, 3, "40 keys reach every primary");
    one_call_per_group(&store, spread, expected).await;
}

/// Runs `check` on the standalone server, then on the cluster (each when its suite runs).
async fn on_both(check: impl AsyncFn(&RedisStore)) {
    if let Some(store) = common::standalone().await {
        check(&store).await;
    }
    if let Some(store) = common::cluster().await {
        check(&store).await;
    }
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
    on_both(same_key_twice).await;
}

/// A value that is not a record fails its own item (`CorruptRecord`); the other items of the
/// batch are answered as usual and the bad value is left as it was. A key of another type (a
/// list, which the batch's `MGET` reads as absent) among fresh keys, twice: both of its items
/// fail, the list is untouched, and the fresh keys around it are acquired and stored (an
/// acquire batch writes its new records together at the end of the call; one key of another
/// type among them must not cost the others their writes).
async fn corrupt_item(store: &RedisStore) {
    let ns = Namespace::new("corrupt").unwrap();
    let reqs = requests(
        &ns,
        ["before", "bad", "list", "middle", "list", "after"].map(String::from),
    );
    let bad_key = String::from_utf8(store.storage_key(&reqs[1].key)).unwrap();
    let list_key = String::from_utf8(store.storage_key(&reqs[2].key)).unwrap();
    let mut admin = common::Admin::of(store).await;
    admin
        .query::<()>(redis::cmd("SET").arg(&bad_key).arg("not a record"))
        .await;
    admin
        .query::<()>(redis::cmd("RPUSH").arg(&list_key).arg("x"))
        .await;
    let out = store.acquire_many(&reqs).await.expect("batch");
    for i in [0, 3, 5] {
        assert!(
            matches!(out[i], Ok(AcquireOutcome::Acquired { .. })),
            "{i}: {:?}",
            out[i]
        );
        let record = store.get(&reqs[i].key).await.expect("get");
        assert!(
            record.is_some_and(|r| r.state == idem_core::RecordState::InProgress),
            "{i} is stored in progress"
        );
    }
    assert!(
        matches!(&out[1], Err(Error::CorruptRecord { key, .. }) if *key == bad_key),
        "{:?}",
        out[1]
    );
    for i in [2, 4] {
        assert!(
            matches!(&out[i], Err(Error::CorruptRecord { key, .. }) if *key == list_key),
            "{i}: {:?}",
            out[i]
        );
    }
    assert_eq!(
        admin.get(&bad_key).await.as_deref(),
        Some(&b"not a record"[..])
    );
    let list: Vec<String> = admin
        .query(redis::cmd("LRANGE").arg(&list_key).arg(0).arg(-1))
        .await;
    assert_eq!(list, ["x"], "the list is left as it was");
}

/// Items of one batch with their own owners, leases and fingerprints (a batch sends the
/// arguments its items share once): each record holds its own.
async fn own_arguments(store: &RedisStore) {
    let ns = Namespace::new("own-args").unwrap();
    let reqs: Vec<AcquireRequest> = (0..6)
        .map(|i| {
            let req =
                AcquireRequest::new(ns.key(format!("k{i}")).unwrap(), format!("owner-{}", i % 2))
                    .with_lease_ttl(Duration::from_secs(10 + i % 3));
            if i == 4 {
                req
            } else {
                req.with_fingerprint(idem_core::Fingerprint::of(format!("payload-{}", i % 2)))
            }
        })
        .collect();
    let out = store.acquire_many(&reqs).await.expect("batch");
    for (req, outcome) in reqs.iter().zip(&out) {
        let Ok(AcquireOutcome::Acquired { lease, takeover }) = outcome else {
            panic!("{outcome:?}");
        };
        let record = store.get(&req.key).await.expect("get").expect("stored");
        // The lease the batch answered (for a fresh key, rebuilt from the fast path's compact
        // reply) is the one stored.
        assert_eq!(
            (&lease.key, lease.owner.as_str(), lease.attempt, *takeover),
            (&req.key, req.owner.as_str(), 1, false)
        );
        assert_eq!(Some(lease.expires_at), record.lease_expires_at);
        assert_eq!(record.attempts, 1);
        assert_eq!(record.owner, req.owner);
        assert_eq!(record.fingerprint, req.fingerprint);
        let lease_ms = record
            .lease_expires_at
            .expect("in progress")
            .duration_since(record.updated_at)
            .unwrap()
            .as_millis();
        assert_eq!(lease_ms, req.lease_ttl.as_millis(), "{}", req.owner);
        assert_eq!(record.token, lease.token);
    }
}

#[tokio::test]
async fn items_keep_their_own_arguments() {
    on_both(own_arguments).await;
}

#[tokio::test]
async fn a_corrupt_record_fails_only_its_item() {
    on_both(corrupt_item).await;
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

/// A batch whose key's slot moves after the store read the slot map: the primary it is sent to
/// refuses that item before it writes (while the slot migrates, then once it moved), the item
/// goes again through the per-slot path, which follows ASK and MOVED, and the others are
/// answered by their primaries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_follows_a_slot_that_moved() {
    use common::slots::{Migration, masters};
    let Some(store) = common::cluster().await else {
        return;
    };
    let ns = Namespace::new(format!("reshard-{}", uuid::Uuid::new_v4())).unwrap();
    let others: Vec<String> = (0..20).map(|i| format!("stay-{i}")).collect();
    let key = ns.key("moving").unwrap();
    let storage_key = store.storage_key(&key);
    // Reads the slot map.
    let warm = store
        .acquire_many(&requests(&ns, ["warm".to_owned()]))
        .await
        .expect("batch");
    assert!(warm[0].is_ok());

    let mut masters = masters().await;
    let moving = Migration::of(&mut masters, &storage_key).await;
    let batch = |ids: Vec<String>| requests(&ns, ids);
    let mut ids = vec!["moving".to_owned()];
    ids.extend(others[..10].iter().cloned());

    let serving = primaries(&store, &batch(ids.clone())).await;

    // ASK: the slot is migrating and the key is not on its owner.
    moving.begin(&mut masters).await;
    let (asked, asked_sent) = counted(&store, store.acquire_many(&batch(ids))).await;
    // MOVED: the migration finishes; the map the store read is stale.
    moving.finish(&mut masters).await;
    let leases = match &asked {
        Ok(out) => leases(out),
        Err(_) => Vec::new(),
    };
    let moved = store.release_many(&leases).await;
    let mut ids = vec!["moving".to_owned()];
    ids.extend(others[10..].iter().cloned());
    let after = store.acquire_many(&batch(ids)).await;
    let in_new_owner: Option<Vec<u8>> = redis::cmd("GET")
        .arg(&storage_key)
        .query_async(&mut masters[moving.to].1)
        .await
        .unwrap();

    // Put everything back before asserting.
    moving.undo(&mut masters, &storage_key).await;

    let asked = asked.expect("batch while the slot migrates");
    // One call per primary, then the refused item alone: its slot's call, answered ASK, and
    // the call sent to the importing primary.
    assert_eq!(asked_sent, serving + 2, "{asked:?}");
    assert_eq!(leases.len(), 11, "every key acquired: {asked:?}");
    let released = moved.expect("batch after the slot moved");
    assert!(released.iter().all(Result::is_ok), "{released:?}");
    let after = after.expect("batch with the map read again");
    assert!(
        matches!(after[0], Ok(AcquireOutcome::Acquired { .. })),
        "the released key is acquired again: {:?}",
        after[0]
    );
    assert!(after[1..].iter().all(Result::is_ok), "{after:?}");
    assert!(
        in_new_owner.is_some(),
        "the record is on the slot's new primary"
    );
}

/// A store may allow batches larger than one `MGET` (or Lua's `unpack`) takes at once: a batch
/// of 10,000 keys (more than `unpack` returns at once) is read in chunks and answered whole,
/// in one call.
#[tokio::test]
async fn a_batch_larger_than_one_read_is_answered_whole() {
    if common::standalone().await.is_none() {
        return;
    }
    let limits = idem_core::Limits::default().with_max_batch(10_000);
    let store = RedisStore::connect_with(&common::url(), common::config().with_limits(limits))
        .await
        .expect("store");
    let ns = Namespace::new("large").unwrap();
    let reqs = requests(&ns, (0..10_000).map(|i| format!("key-{i}")));
    let (out, sent) = counted(&store, store.acquire_many(&reqs)).await;
    let out = out.expect("batch");
    assert_eq!(sent, 1);
    let ls = leases(&out);
    assert_eq!(ls.len(), 10_000, "every key acquired");
    let completions: Vec<Completion> = ls
        .into_iter()
        .map(|l| Completion::new(l, Bytes::from_static(b"ok")))
        .collect();
    let done = store
        .complete_many(&completions, RETENTION)
        .await
        .expect("batch");
    assert!(done.iter().all(Result::is_ok));
    // Read back through a batch again: every key replays.
    let again = store.acquire_many(&reqs).await.expect("batch");
    assert!(
        again
            .iter()
            .all(|o| matches!(o, Ok(AcquireOutcome::Replayed { .. }))),
        "{:?}",
        again
            .iter()
            .find(|o| !matches!(o, Ok(AcquireOutcome::Replayed { .. })))
    );
}
