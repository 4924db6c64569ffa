//! `complete_with`: the handler's writes and the completion in one `TransactWriteItems`. Requests
//! counted by operation; bad writes refused before sending; a failed condition refuses all; a
//! zombie writes nothing. The effects go to the test process's effects table
//! (`tests/common/mod.rs`).

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::EffectTable;
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Error, IdempotencyKey, IdempotencyStore, Lease,
    LostLease, Namespace, RecordState, StateKind, TransactionalStore,
};
use idem_dynamo::aws_sdk_dynamodb::types::{AttributeValue, Update};
use idem_dynamo::{DynamoStore, DynamoWrites, MAX_WRITES};

const RETENTION: Duration = Duration::from_secs(3600);

fn key(id: &str) -> IdempotencyKey {
    Namespace::new(format!("tx-{}", uuid::Uuid::new_v4().simple()))
        .unwrap()
        .key(id)
        .unwrap()
}

/// An effect name of this key's own.
fn effect(key: &IdempotencyKey, what: &str) -> String {
    format!("{key}/{what}")
}

async fn lease(store: &DynamoStore, key: &IdempotencyKey, owner: &str, ttl: Duration) -> Lease {
    let req = AcquireRequest::new(key.clone(), owner).with_lease_ttl(ttl);
    match store.acquire(&req).await.unwrap() {
        AcquireOutcome::Acquired { lease, .. } => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

fn transactions(n: u64) -> BTreeMap<String, u64> {
    BTreeMap::from([("TransactWriteItems".to_owned(), n)])
}

/// Runs `f` and returns what it sent, by operation.
async fn counted<T>(store: &DynamoStore, f: impl AsyncFnOnce() -> T) -> (T, BTreeMap<String, u64>) {
    store.requests().reset();
    let out = f().await;
    (out, store.requests().snapshot())
}

/// The record is still in progress under `lease`.
async fn still_in_progress(store: &DynamoStore, lease: &Lease) {
    let record = store.get(&lease.key).await.unwrap().expect("the record");
    assert_eq!(
        (record.state, record.token),
        (RecordState::InProgress, lease.token),
        "a refused completion leaves the record in progress"
    );
}

async fn completed_with(store: &DynamoStore, key: &IdempotencyKey, result: &'static [u8]) {
    let record = store.get(key).await.unwrap().expect("the record");
    assert_eq!(
        record.state,
        RecordState::Completed {
            result: Bytes::from_static(result)
        }
    );
}

/// After refused writes, valid ones (appending the lease's token to `list`) complete the record.
async fn valid_writes_still_complete(store: &DynamoStore, fx: &EffectTable, l: &Lease, list: &str) {
    store
        .complete_with(
            l,
            Bytes::from_static(b"ok"),
            RETENTION,
            DynamoWrites::new().update(fx.append(list, l.token.get())),
        )
        .await
        .unwrap();
    completed_with(store, &l.key, b"ok").await;
}

#[tokio::test]
async fn a_transactional_completion_is_one_request_and_a_resend_applies_nothing() {
    let Some(store) = common::store().await else {
        return;
    };
    let fx = EffectTable::new().await;
    let k = key("one");
    let l = lease(&store, &k, "a", Duration::from_secs(30)).await;
    let (value, list) = (effect(&k, "value"), effect(&k, "list"));
    let writes = || {
        DynamoWrites::new()
            .put(fx.put(&value, b"charged"))
            .update(fx.append(&list, l.token.get()))
    };

    let (r, sent) = counted(&store, async || {
        store
            .complete_with(&l, Bytes::from_static(b"ok"), RETENTION, writes())
            .await
    })
    .await;
    r.unwrap();
    assert_eq!(
        sent,
        transactions(1),
        "one TransactWriteItems, nothing else"
    );
    assert_eq!(fx.read(&value).await.as_deref(), Some(&b"charged"[..]));
    assert_eq!(fx.tokens(&list).await.unwrap(), vec![l.token.get()]);
    completed_with(&store, &k, b"ok").await;

    // Re-sent by the caller (after a lost answer): a new request, refused by the completion's
    // condition, whose ALL_OLD item shows this very completion done: Ok, in that one request,
    // with nothing applied again; with other writes just the same.
    for again in [
        writes(),
        DynamoWrites::new()
            .put(fx.put(&value, b"twice"))
            .update(fx.append(&list, l.token.get())),
    ] {
        let (r, sent) = counted(&store, async || {
            store
                .complete_with(&l, Bytes::from_static(b"ok"), RETENTION, again)
                .await
        })
        .await;
        r.expect("a re-sent completion is Ok");
        assert_eq!(sent, transactions(1));
        assert_eq!(fx.read(&value).await.as_deref(), Some(&b"charged"[..]));
        assert_eq!(
            fx.tokens(&list).await.unwrap(),
            vec![l.token.get()],
            "applied once"
        );
    }

    // Other result bytes: refused, saying the record is completed, in one request.
    let (r, sent) = counted(&store, async || {
        store
            .complete_with(&l, Bytes::from_static(b"ko"), RETENTION, writes())
            .await
    })
    .await;
    assert!(
        matches!(
            r,
            Err(Error::LeaseLost {
                why: LostLease::NotInProgress {
                    state: StateKind::Completed
                },
                ..
            })
        ),
        "{r:?}"
    );
    assert_eq!(sent, transactions(1));
    assert_eq!(fx.tokens(&list).await.unwrap(), vec![l.token.get()]);
    completed_with(&store, &k, b"ok").await;

    // No writes at all: a completion through the transaction, still one request.
    let bare = key("bare");
    let l = lease(&store, &bare, "a", Duration::from_secs(30)).await;
    let (r, sent) = counted(&store, async || {
        store
            .complete_with(
                &l,
                Bytes::from_static(b"ok"),
                RETENTION,
                DynamoWrites::new(),
            )
            .await
    })
    .await;
    r.unwrap();
    assert_eq!(sent, transactions(1));
    completed_with(&store, &bare, b"ok").await;
}

/// With a clock that stands still, a re-send is the same request but for its writes: the same
/// `ClientRequestToken` with other parameters, which DynamoDB refuses with
/// `IdempotentParameterMismatch`; the store sends it once more with a fresh token, and the
/// completion's condition finds it done.
#[tokio::test]
async fn a_token_reused_with_other_writes_is_sent_once_more() {
    let Some((store, _clock)) = common::manual_store().await else {
        return;
    };
    let fx = EffectTable::new().await;
    let k = key("mismatch");
    let l = lease(&store, &k, "a", Duration::from_secs(30)).await;
    let list = effect(&k, "list");
    let writes = |what: &str| {
        DynamoWrites::new()
            .update(fx.append(&list, l.token.get()))
            .put(fx.put(&effect(&k, what), b"x"))
    };
    store
        .complete_with(&l, Bytes::from_static(b"ok"), RETENTION, writes("first"))
        .await
        .unwrap();
    let (r, sent) = counted(&store, async || {
        store
            .complete_with(&l, Bytes::from_static(b"ok"), RETENTION, writes("second"))
            .await
    })
    .await;
    r.expect("the same completion with other writes is a replay");
    assert_eq!(sent, transactions(2), "the mismatch, then the re-send");
    assert_eq!(fx.tokens(&list).await.unwrap(), vec![l.token.get()]);
    assert_eq!(fx.read(&effect(&k, "second")).await, None);
    completed_with(&store, &k, b"ok").await;

    // The same request again (the SDK's retry of a lost answer): DynamoDB answers success
    // for the token without applying anything.
    let (r, sent) = counted(&store, async || {
        store
            .complete_with(&l, Bytes::from_static(b"ok"), RETENTION, writes("first"))
            .await
    })
    .await;
    r.unwrap();
    assert_eq!(sent, transactions(1));
    assert_eq!(fx.tokens(&list).await.unwrap(), vec![l.token.get()]);
}

#[tokio::test]
async fn a_zombie_writes_nothing() {
    let Some((store, clock)) = common::manual_store().await else {
        return;
    };
    let fx = EffectTable::new().await;
    let k = key("zombie");
    let list = effect(&k, "list");
    let zombie = lease(&store, &k, "a", Duration::from_secs(1)).await;
    clock.advance(Duration::from_secs(2));
    let holder = lease(&store, &k, "b", Duration::from_secs(30)).await;

    let (r, sent) = counted(&store, async || {
        store
            .complete_with(
                &zombie,
                Bytes::from_static(b"zombie"),
                RETENTION,
                DynamoWrites::new().update(fx.append(&list, zombie.token.get())),
            )
            .await
    })
    .await;
    assert!(
        matches!(&r, Err(Error::LeaseLost { why: LostLease::Superseded { current }, .. }) if *current == holder.token),
        "{r:?}"
    );
    assert_eq!(sent, transactions(1), "refused in the one request");
    assert_eq!(fx.tokens(&list).await.unwrap(), Vec::<u64>::new());
    still_in_progress(&store, &holder).await;

    store
        .complete_with(
            &holder,
            Bytes::from_static(b"ok"),
            RETENTION,
            DynamoWrites::new().update(fx.append(&list, holder.token.get())),
        )
        .await
        .unwrap();
    // The zombie again, now that the holder completed: still nothing.
    let r = store
        .complete_with(
            &zombie,
            Bytes::from_static(b"ok"),
            RETENTION,
            DynamoWrites::new().update(fx.append(&list, zombie.token.get())),
        )
        .await;
    assert!(
        matches!(&r, Err(Error::LeaseLost { why: LostLease::Superseded { current }, .. }) if *current == holder.token),
        "{r:?}"
    );
    assert_eq!(fx.tokens(&list).await.unwrap(), vec![holder.token.get()]);
}

#[tokio::test]
async fn too_many_writes_are_refused_before_sending() {
    let Some(store) = common::store().await else {
        return;
    };
    let fx = EffectTable::new().await;
    let k = key("many");
    let l = lease(&store, &k, "a", Duration::from_secs(30)).await;
    let writes = |n: usize| {
        (0..n).fold(DynamoWrites::new(), |w, i| {
            w.put(fx.put(&effect(&k, &i.to_string()), b"x"))
        })
    };

    let (r, sent) = counted(&store, async || {
        store
            .complete_with(
                &l,
                Bytes::from_static(b"ok"),
                RETENTION,
                writes(MAX_WRITES + 1),
            )
            .await
    })
    .await;
    assert!(
        matches!(&r, Err(Error::InvalidInput { field: "writes", reason }) if reason.contains("at most 99")),
        "{r:?}"
    );
    assert_eq!(sent, BTreeMap::new(), "nothing sent");
    for i in [0, MAX_WRITES] {
        assert_eq!(fx.read(&effect(&k, &i.to_string())).await, None);
    }
    still_in_progress(&store, &l).await;

    // The most there may be: DynamoDB's 100 actions with the completion.
    let (r, sent) = counted(&store, async || {
        store
            .complete_with(&l, Bytes::from_static(b"ok"), RETENTION, writes(MAX_WRITES))
            .await
    })
    .await;
    r.expect("99 writes and the completion fit one transaction");
    assert_eq!(sent, transactions(1));
    for i in [0, MAX_WRITES - 1] {
        assert_eq!(
            fx.read(&effect(&k, &i.to_string())).await.as_deref(),
            Some(&b"x"[..])
        );
    }
    completed_with(&store, &k, b"ok").await;
}

#[tokio::test]
async fn a_write_on_the_records_own_item_is_refused_before_sending() {
    let Some(store) = common::store().await else {
        return;
    };
    let fx = EffectTable::new().await;
    let k = key("own");
    let l = lease(&store, &k, "a", Duration::from_secs(30)).await;
    let value = effect(&k, "value");
    let own = Update::builder()
        .table_name(store.table())
        .key(
            "pk",
            AttributeValue::S(format!("{}:{}", k.namespace(), k.id())),
        )
        .update_expression("SET #state = :done")
        .expression_attribute_names("#state", "state")
        .expression_attribute_values(":done", AttributeValue::S("completed".to_owned()))
        .build()
        .unwrap();

    let (r, sent) = counted(&store, async || {
        store
            .complete_with(
                &l,
                Bytes::from_static(b"ok"),
                RETENTION,
                DynamoWrites::new().put(fx.put(&value, b"x")).update(own),
            )
            .await
    })
    .await;
    assert!(
        matches!(&r, Err(Error::InvalidInput { field: "writes", reason }) if reason.contains("write 1 is on the record's own item")),
        "{r:?}"
    );
    assert_eq!(sent, BTreeMap::new(), "nothing sent");
    assert_eq!(fx.read(&value).await, None);
    still_in_progress(&store, &l).await;

    // Another key of the store's own table is the handler's to write.
    let other = effect(&k, "elsewhere");
    let beside = idem_dynamo::aws_sdk_dynamodb::types::Put::builder()
        .table_name(store.table())
        .item("pk", AttributeValue::S(other.clone()))
        .build()
        .unwrap();
    store
        .complete_with(
            &l,
            Bytes::from_static(b"ok"),
            RETENTION,
            DynamoWrites::new().put(fx.put(&value, b"x")).put(beside),
        )
        .await
        .expect("the record is still completable");
    assert_eq!(fx.read(&value).await.as_deref(), Some(&b"x"[..]));
    completed_with(&store, &k, b"ok").await;
}

#[tokio::test]
async fn a_failing_condition_refuses_the_whole_completion() {
    let Some(store) = common::store().await else {
        return;
    };
    let fx = EffectTable::new().await;
    let k = key("refused");
    let l = lease(&store, &k, "a", Duration::from_secs(30)).await;
    let (value, list, missing) = (
        effect(&k, "value"),
        effect(&k, "list"),
        effect(&k, "missing"),
    );

    let (r, sent) = counted(&store, async || {
        store
            .complete_with(
                &l,
                Bytes::from_static(b"ok"),
                RETENTION,
                DynamoWrites::new()
                    .put(fx.put(&value, b"x"))
                    .condition_check(fx.exists(&missing))
                    .update(fx.append(&list, l.token.get())),
            )
            .await
    })
    .await;
    assert!(
        matches!(&r, Err(Error::EffectRefused { store: "dynamo", index: 1, reason }) if reason.contains("ConditionalCheckFailed")),
        "{r:?}"
    );
    assert_eq!(sent, transactions(1));
    assert_eq!(fx.read(&value).await, None, "nothing written");
    assert_eq!(fx.tokens(&list).await.unwrap(), Vec::<u64>::new());
    still_in_progress(&store, &l).await;

    // A write's own condition (a Put that must create its item) counts the same.
    let taken = effect(&k, "taken");
    fx.write(&taken, b"before").await;
    let r = store
        .complete_with(
            &l,
            Bytes::from_static(b"ok"),
            RETENTION,
            DynamoWrites::new()
                .update(fx.append(&list, l.token.get()))
                .put(fx.put_new(&taken, b"again")),
        )
        .await;
    assert!(
        matches!(&r, Err(Error::EffectRefused { index: 1, .. })),
        "{r:?}"
    );
    assert_eq!(fx.read(&taken).await.as_deref(), Some(&b"before"[..]));
    assert_eq!(fx.tokens(&list).await.unwrap(), Vec::<u64>::new());
    still_in_progress(&store, &l).await;

    // Completable afterwards, with writes whose conditions hold.
    store
        .complete_with(
            &l,
            Bytes::from_static(b"ok"),
            RETENTION,
            DynamoWrites::new()
                .put(fx.put(&value, b"x"))
                .condition_check(fx.exists(&taken))
                .update(fx.append(&list, l.token.get())),
        )
        .await
        .unwrap();
    assert_eq!(fx.read(&value).await.as_deref(), Some(&b"x"[..]));
    assert_eq!(fx.tokens(&list).await.unwrap(), vec![l.token.get()]);
    completed_with(&store, &k, b"ok").await;
}

/// Writes DynamoDB refuses by request validation, whatever the records say: two actions on
/// one item, an item over 400 KB, an update whose operand has the wrong type. Every try would
/// be refused the same way, so they are invalid writes (refused as a whole, nothing written,
/// the lease still held), not a store error to retry.
#[tokio::test]
async fn writes_dynamodb_refuses_as_invalid_are_invalid_writes() {
    let Some(store) = common::store().await else {
        return;
    };
    let fx = EffectTable::new().await;
    let k = key("invalid");
    let l = lease(&store, &k, "a", Duration::from_secs(30)).await;
    let (value, list, big) = (effect(&k, "value"), effect(&k, "list"), effect(&k, "big"));
    // `value` holds bytes; adding a number to it is refused when the update is applied.
    fx.write(&value, b"bytes").await;
    let wrong_type = Update::builder()
        .table_name(fx.name())
        .key("pk", AttributeValue::S(value.clone()))
        .update_expression("SET #v = #v + :one")
        .expression_attribute_names("#v", "value")
        .expression_attribute_values(":one", AttributeValue::N("1".to_owned()))
        .build()
        .unwrap();
    let cases = [
        (
            "two actions on one item",
            DynamoWrites::new()
                .put(fx.put(&value, b"x"))
                .update(fx.append(&value, 1)),
        ),
        (
            "an item over 400 KB",
            DynamoWrites::new()
                .update(fx.append(&list, 1))
                .put(fx.put(&big, &vec![7u8; 410 * 1024])),
        ),
        (
            "an operand of the wrong type",
            DynamoWrites::new()
                .update(fx.append(&list, 1))
                .update(wrong_type.clone()),
        ),
    ];
    for (what, writes) in cases {
        let (r, sent) = counted(&store, async || {
            store
                .complete_with(&l, Bytes::from_static(b"ok"), RETENTION, writes)
                .await
        })
        .await;
        assert!(
            matches!(&r, Err(Error::InvalidInput { field: "writes", reason }) if reason.contains("Validation")),
            "{what}: {r:?}"
        );
        assert_eq!(sent, transactions(1), "{what}: sent once, not retried");
        still_in_progress(&store, &l).await;
    }
    assert_eq!(fx.read(&value).await.as_deref(), Some(&b"bytes"[..]));
    assert_eq!(fx.tokens(&list).await.unwrap(), Vec::<u64>::new());
    assert_eq!(fx.read(&big).await, None, "nothing written");
    valid_writes_still_complete(&store, &fx, &l, &list).await;
}

/// A write to a table that does not exist is `NotSetUp` naming that table, not the store's: the
/// store's table is looked up to tell them apart. Nothing is written; the lease still completes.
#[tokio::test]
async fn a_write_to_a_missing_table_names_that_table() {
    let Some(store) = common::store().await else {
        return;
    };
    let fx = EffectTable::new().await;
    let k = key("missing-table");
    let l = lease(&store, &k, "a", Duration::from_secs(30)).await;
    let list = effect(&k, "list");
    let missing = format!("idem-no-such-table-{}", uuid::Uuid::new_v4().simple());
    let mut put = fx.put(&effect(&k, "elsewhere"), b"x");
    put.table_name = missing.clone();
    let writes = DynamoWrites::new().update(fx.append(&list, 1)).put(put);
    let r = store
        .complete_with(&l, Bytes::from_static(b"ok"), RETENTION, writes)
        .await;
    match &r {
        Err(Error::NotSetUp {
            missing: what, fix, ..
        }) => {
            assert!(what.contains(&missing), "{r:?}");
            assert!(!what.contains(&format!("{:?}", store.table())), "{r:?}");
            assert!(!fix.contains("create_table_if_missing"), "{r:?}");
        }
        other => panic!("expected NotSetUp, got {other:?}"),
    }
    still_in_progress(&store, &l).await;
    assert_eq!(fx.tokens(&list).await.unwrap(), Vec::<u64>::new());
    valid_writes_still_complete(&store, &fx, &l, &list).await;
}
