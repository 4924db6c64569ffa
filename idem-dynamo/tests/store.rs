//! Behaviour specific to the DynamoDB store: the item layout, the table helper, error mapping,
//! size limits at their worst case, corrupt items and client clock skew.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Error, FailureKind, Fingerprint, IdempotencyKey,
    IdempotencyStore, Lease, LostLease, MAX_ID_LEN, MAX_NAMESPACE_LEN, MAX_OWNER_LEN, ManualClock,
    Namespace, RecordState, StateKind,
};
use idem_dynamo::aws_sdk_dynamodb::types::AttributeValue;
use idem_dynamo::aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
};
use idem_dynamo::{DynamoStore, MAX_RESULT_LEN, SdkFailure};

const RETENTION: Duration = Duration::from_secs(3600);

fn namespace() -> Namespace {
    Namespace::new(format!("st-{}", uuid::Uuid::new_v4().simple())).unwrap()
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

async fn raw_item(
    store: &DynamoStore,
    pk: &str,
) -> std::collections::HashMap<String, AttributeValue> {
    store
        .client()
        .get_item()
        .table_name(store.table())
        .key("pk", AttributeValue::S(pk.to_owned()))
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item
        .unwrap_or_else(|| panic!("no item {pk:?}"))
}

fn number(item: &std::collections::HashMap<String, AttributeValue>, name: &str) -> u64 {
    match item.get(name) {
        Some(AttributeValue::N(n)) => n.parse().unwrap(),
        other => panic!("{name} should be a number, got {other:?}"),
    }
}

#[tokio::test]
async fn item_layout_follows_the_docs() {
    let Some(store) = common::store().await else {
        return;
    };
    let ns = namespace();
    let key = ns.key("order:42 ünï").unwrap();
    let pk = format!("{ns}:order:42 ünï");
    let l = lease(&store, &request(&key, "w1")).await;

    let item = raw_item(&store, &pk).await;
    assert_eq!(item["state"], AttributeValue::S("in_progress".into()));
    assert_eq!(item["namespace"], AttributeValue::S(ns.to_string()));
    assert_eq!(item["id"], AttributeValue::S("order:42 ünï".into()));
    assert_eq!(number(&item, "token"), l.token.get());
    assert_eq!(number(&item, "attempts"), 1);
    assert!(item.contains_key("lease_expires_us") && item.contains_key("fingerprint"));
    for absent in ["expires_us", "ttl", "result", "error", "final_attempts"] {
        assert!(
            !item.contains_key(absent),
            "{absent} while in progress: {item:?}"
        );
    }

    store
        .complete(&l, Bytes::from_static(b"ok"), RETENTION)
        .await
        .unwrap();
    let item = raw_item(&store, &pk).await;
    assert_eq!(item["state"], AttributeValue::S("completed".into()));
    let expires_us = number(&item, "expires_us");
    assert_eq!(number(&item, "ttl"), expires_us.div_ceil(1_000_000));
    assert_eq!(number(&item, "final_attempts"), 1);
    assert!(item.contains_key("final_created_us") && item.contains_key("final_fingerprint"));
    for absent in ["attempts", "created_us", "fingerprint", "lease_expires_us"] {
        assert!(
            !item.contains_key(absent),
            "{absent} once completed: {item:?}"
        );
    }
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.attempts, 1);
    assert_eq!(record.fingerprint, Some(Fingerprint::of("payload")));
}

#[tokio::test]
async fn table_helper_is_idempotent_and_enables_ttl() {
    if !common::server() {
        return;
    }
    let table = format!("idem-helper-{}", uuid::Uuid::new_v4().simple());
    let store = DynamoStore::connect(common::config(&table)).await.unwrap();
    let created = store.create_table_if_missing().await;
    assert!(
        matches!(created, Ok(true)),
        "is DynamoDB running at {}? {created:?}",
        common::endpoint()
    );
    assert!(!store.create_table_if_missing().await.unwrap());
    let ttl = store
        .client()
        .describe_time_to_live()
        .table_name(&table)
        .send()
        .await
        .unwrap();
    let description = ttl.time_to_live_description().unwrap();
    assert_eq!(description.attribute_name(), Some("ttl"));
    store
        .client()
        .delete_table()
        .table_name(&table)
        .send()
        .await
        .unwrap();
}

#[tokio::test]
async fn a_table_whose_ttl_is_on_another_attribute_is_not_set_up() {
    if !common::server() {
        return;
    }
    let table = format!("idem-ttl-{}", uuid::Uuid::new_v4().simple());
    let store = DynamoStore::connect(common::config(&table)).await.unwrap();
    let client = store.client();
    client
        .create_table()
        .table_name(&table)
        .billing_mode(idem_dynamo::aws_sdk_dynamodb::types::BillingMode::PayPerRequest)
        .attribute_definitions(
            idem_dynamo::aws_sdk_dynamodb::types::AttributeDefinition::builder()
                .attribute_name("pk")
                .attribute_type(idem_dynamo::aws_sdk_dynamodb::types::ScalarAttributeType::S)
                .build()
                .unwrap(),
        )
        .key_schema(
            idem_dynamo::aws_sdk_dynamodb::types::KeySchemaElement::builder()
                .attribute_name("pk")
                .key_type(idem_dynamo::aws_sdk_dynamodb::types::KeyType::Hash)
                .build()
                .unwrap(),
        )
        .send()
        .await
        .unwrap();
    client
        .update_time_to_live()
        .table_name(&table)
        .time_to_live_specification(
            idem_dynamo::aws_sdk_dynamodb::types::TimeToLiveSpecification::builder()
                .attribute_name("expires_at")
                .enabled(true)
                .build()
                .unwrap(),
        )
        .send()
        .await
        .unwrap();
    let r = store.create_table_if_missing().await;
    client
        .delete_table()
        .table_name(&table)
        .send()
        .await
        .unwrap();
    match r {
        Err(Error::NotSetUp { missing, fix, .. }) => {
            assert!(missing.contains("\"expires_at\""), "{missing}");
            assert!(fix.contains("AttributeName=ttl"), "{fix}");
        }
        other => panic!("expected NotSetUp, got {other:?}"),
    }
}

#[tokio::test]
async fn a_missing_table_is_not_set_up_and_says_how_to_create_it() {
    // Make sure the server answers at all, so that this checks the mapping.
    if !common::server() {
        return;
    }
    let table = format!("idem-missing-{}", uuid::Uuid::new_v4().simple());
    let store = DynamoStore::connect(common::config(&table)).await.unwrap();
    let key = namespace().key("k").unwrap();
    let lease = Lease {
        key: key.clone(),
        owner: "a".to_owned(),
        token: idem_core::FencingToken::new(1),
        attempt: 1,
        expires_at: std::time::SystemTime::now(),
    };
    let results = [
        (
            "acquire",
            store.acquire(&request(&key, "a")).await.map(|_| ()),
        ),
        ("get", store.get(&key).await.map(|_| ())),
        (
            "complete",
            store
                .complete(&lease, Bytes::from_static(b"ok"), RETENTION)
                .await,
        ),
        ("delete", store.delete(&key).await.map(|_| ())),
    ];
    for (operation, r) in results {
        let Err(err) = r else {
            panic!("{operation} on a missing table succeeded");
        };
        assert!(!err.is_retryable(), "{operation}: {err:?}");
        let Error::NotSetUp { missing, fix, .. } = &err else {
            panic!("{operation}: expected NotSetUp, got {err:?}");
        };
        assert!(missing.contains(&format!("{table:?}")), "{missing}");
        assert!(missing.contains("us-east-1"), "{missing}");
        assert!(fix.contains("create_table_if_missing"), "{fix}");
        assert!(
            fix.contains(&format!("aws dynamodb create-table --table-name {table}")),
            "{fix}"
        );
        let text = err.to_string();
        assert!(
            text.starts_with("dynamo store is not set up: table") && text.contains(&table),
            "{text}"
        );
    }
    // The helper's advice works: the store is usable once the table exists.
    assert!(store.create_table_if_missing().await.unwrap());
    assert!(matches!(
        store.acquire(&request(&key, "a")).await,
        Ok(AcquireOutcome::Acquired { .. })
    ));
    store
        .client()
        .delete_table()
        .table_name(&table)
        .send()
        .await
        .unwrap();
}

#[tokio::test]
async fn a_table_of_another_shape_shows_what_dynamodb_said() {
    if !common::server() {
        return;
    }
    // A table keyed on `id` instead of `pk`: DynamoDB refuses every request with a
    // ValidationException, whose code and message must reach the error's Display.
    let table = format!("idem-shape-{}", uuid::Uuid::new_v4().simple());
    let store = DynamoStore::connect(common::config(&table)).await.unwrap();
    store
        .client()
        .create_table()
        .table_name(&table)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("id")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .unwrap(),
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("id")
                .key_type(KeyType::Hash)
                .build()
                .unwrap(),
        )
        .billing_mode(BillingMode::PayPerRequest)
        .send()
        .await
        .unwrap();
    let key = namespace().key("k").unwrap();
    let r = store.acquire(&request(&key, "a")).await;
    let Err(err @ Error::Backend { .. }) = r else {
        panic!("expected Backend, got {r:?}");
    };
    assert!(!err.is_retryable());
    let text = err.to_string();
    assert!(
        text.starts_with("dynamo store error: UpdateItem: ValidationException: ")
            && text.contains("(HTTP 400"),
        "{text}"
    );
    let Error::Backend { source, .. } = &err else {
        unreachable!()
    };
    let failure = source.downcast_ref::<SdkFailure>().expect("an SdkFailure");
    assert_eq!(failure.code(), Some("ValidationException"));
    assert!(
        failure.message().is_some_and(|m| text.contains(m)),
        "{failure:?}"
    );
    store
        .client()
        .delete_table()
        .table_name(&table)
        .send()
        .await
        .unwrap();
}

#[tokio::test]
async fn failure_kinds_are_kept_in_the_state_attribute() {
    let Some(store) = common::store().await else {
        return;
    };
    let ns = namespace();
    for kind in FailureKind::ALL {
        let id = format!("failed-{kind}");
        let key = ns.key(&id).unwrap();
        let l = lease(&store, &request(&key, "a")).await;
        store.fail(&l, "declined", kind, RETENTION).await.unwrap();
        let item = raw_item(&store, &format!("{ns}:{id}")).await;
        assert_eq!(
            item["state"],
            AttributeValue::S(StateKind::Failed(kind).name().to_owned()),
            "{item:?}"
        );
        // Final failures move the live attributes, like a completion; a retryable one keeps them.
        assert_eq!(
            item.contains_key("attempts"),
            kind.is_retryable(),
            "{item:?}"
        );
        assert_eq!(
            item.contains_key("final_attempts"),
            !kind.is_retryable(),
            "{item:?}"
        );
        let record = store.get(&key).await.unwrap().unwrap();
        assert_eq!(
            record.state,
            RecordState::Failed {
                error: "declined".to_owned(),
                kind
            }
        );
        let out = store.acquire(&request(&key, "b")).await.unwrap();
        if kind.is_retryable() {
            assert!(matches!(out, AcquireOutcome::Acquired { .. }), "{out:?}");
        } else {
            assert_eq!(
                out,
                AcquireOutcome::Failed {
                    error: "declined".to_owned(),
                    kind
                }
            );
        }
    }
    // An empty error text is a text like any other (DynamoDB keeps empty strings).
    let key = ns.key("failed-empty").unwrap();
    let l = lease(&store, &request(&key, "a")).await;
    store
        .fail(&l, "", FailureKind::Terminal, RETENTION)
        .await
        .unwrap();
    assert_eq!(
        store.acquire(&request(&key, "b")).await.unwrap(),
        AcquireOutcome::Failed {
            error: String::new(),
            kind: FailureKind::Terminal
        }
    );
}

#[tokio::test]
async fn an_unreachable_endpoint_is_unavailable_fast() {
    // No server needed: nothing listens there.
    let store = common::unreachable_store().await.unwrap();
    let key = namespace().key("k").unwrap();
    let started = Instant::now();
    let r = store.acquire(&request(&key, "a")).await;
    assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
    // The Display says what happened, down to the transport's cause.
    let text = r.unwrap_err().to_string();
    assert!(
        text.starts_with("dynamo store unavailable: UpdateItem: dispatch failure: "),
        "{text}"
    );
    assert!(text.len() > "dynamo store unavailable: UpdateItem: dispatch failure: ".len() + 5);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
    // Three attempts: the SDK's retries are counted as the requests they are.
    assert_eq!(store.requests().get("UpdateItem"), 3);
}

/// A random id of exactly [`MAX_ID_LEN`] bytes, mostly two-byte characters.
fn long_id(prefix: &str) -> String {
    let mut id = format!("{prefix}-{}-", uuid::Uuid::new_v4().simple());
    while id.len() + 2 <= MAX_ID_LEN {
        id.push('é');
    }
    while id.len() < MAX_ID_LEN {
        id.push('x');
    }
    id
}

#[tokio::test]
async fn the_largest_result_fits_the_largest_item() {
    let Some(store) = common::store().await else {
        return;
    };
    assert_eq!(store.limits().max_result_len, MAX_RESULT_LEN);
    let ns = Namespace::new("n".repeat(MAX_NAMESPACE_LEN)).unwrap();
    let id = long_id("r");
    let key = ns.key(&id).unwrap();
    let owner = "o".repeat(MAX_OWNER_LEN);
    let l = lease(&store, &request(&key, &owner)).await;
    let result = Bytes::from(vec![0xA5; MAX_RESULT_LEN]);
    store.complete(&l, result.clone(), RETENTION).await.unwrap();
    match store.acquire(&request(&key, &owner)).await.unwrap() {
        AcquireOutcome::Replayed { result: got } => assert_eq!(got, result),
        other => panic!("{other:?}"),
    }
    // The largest error fits too.
    let key2 = ns.key(long_id("e")).unwrap();
    let l = lease(&store, &request(&key2, &owner)).await;
    let error = "e".repeat(store.limits().max_error_len);
    store
        .fail(&l, &error, FailureKind::Terminal, RETENTION)
        .await
        .unwrap();
}

#[tokio::test]
async fn corrupt_items_are_typed_errors() {
    let Some(store) = common::store().await else {
        return;
    };
    let ns = namespace();
    let key = ns.key("corrupt").unwrap();
    store
        .client()
        .put_item()
        .table_name(store.table())
        .item("pk", AttributeValue::S(format!("{ns}:corrupt")))
        .item("state", AttributeValue::S("sleeping".into()))
        .item("token", AttributeValue::N("5".into()))
        .send()
        .await
        .unwrap();
    let r = store.get(&key).await;
    assert!(matches!(r, Err(Error::CorruptRecord { .. })), "{r:?}");
    let r = store.acquire(&request(&key, "a")).await;
    assert!(matches!(r, Err(Error::CorruptRecord { .. })), "{r:?}");
    assert!(store.delete(&key).await.unwrap(), "operators can remove it");
    let l = lease(&store, &request(&key, "a")).await;
    assert_eq!(l.token.get(), 6, "counted on from the tombstone");

    // A token that is not a number is not kept in the tombstone: it would break every acquire.
    let bad = ns.key("bad-token").unwrap();
    store
        .client()
        .put_item()
        .table_name(store.table())
        .item("pk", AttributeValue::S(format!("{ns}:bad-token")))
        .item("state", AttributeValue::S("completed".into()))
        .item("token", AttributeValue::S("seven".into()))
        .send()
        .await
        .unwrap();
    assert!(store.delete(&bad).await.unwrap());
    let item = raw_item(&store, &format!("{ns}:bad-token")).await;
    assert!(!item.contains_key("token"), "{item:?}");
    lease(&store, &request(&bad, "a")).await;
}

#[tokio::test]
async fn delete_leaves_a_tombstone_and_tokens_stay_monotonic() {
    let Some((store, clock)) = common::manual_store().await else {
        return;
    };
    let ns = namespace();
    let key = ns.key("tombstone").unwrap();
    let pk = format!("{ns}:tombstone");
    let start = idem_core::Clock::now(&*clock);
    let a = lease(&store, &request(&key, "a")).await;
    store
        .complete(&a, Bytes::from_static(b"ok"), RETENTION)
        .await
        .unwrap();

    assert!(store.delete(&key).await.unwrap(), "a live record was there");
    let item = raw_item(&store, &pk).await;
    let mut names: Vec<&str> = item.keys().map(String::as_str).collect();
    names.sort_unstable();
    assert_eq!(names, ["pk", "token", "ttl"], "{item:?}");
    assert_eq!(number(&item, "token"), a.token.get());
    let week = idem_core::Clock::now(&*clock)
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 7 * 24 * 3600;
    assert!(number(&item, "ttl").abs_diff(week) <= 1, "{item:?}");

    // Absent for every operation.
    assert_eq!(store.get(&key).await.unwrap(), None);
    assert!(
        !store.delete(&key).await.unwrap(),
        "a tombstone is not a record"
    );
    let r = store
        .complete(&a, Bytes::from_static(b"ok"), RETENTION)
        .await;
    assert!(
        matches!(
            r,
            Err(Error::LeaseLost {
                why: LostLease::Gone,
                ..
            })
        ),
        "{r:?}"
    );
    let r = store.release(&a).await;
    assert!(
        matches!(
            r,
            Err(Error::LeaseLost {
                why: LostLease::Gone,
                ..
            })
        ),
        "{r:?}"
    );

    // A client whose clock is an hour behind re-creates the key: fresh, token above the old one.
    clock.set(start - Duration::from_secs(3600));
    let out = store
        .acquire(&request(&key, "b").with_fingerprint(Fingerprint::of("other")))
        .await
        .unwrap();
    let AcquireOutcome::Acquired { lease: b, takeover } = out else {
        panic!("expected a fresh Acquired, got {out:?}");
    };
    assert!(!takeover);
    assert_eq!(b.attempt, 1);
    assert_eq!(
        b.token.get(),
        a.token.get() + 1,
        "counted on from the tombstone"
    );
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::InProgress);
    assert_eq!(record.attempts, 1);
    assert_eq!(record.fingerprint, Some(Fingerprint::of("other")));
    assert!(!raw_item(&store, &pk).await.contains_key("ttl"));

    // Deleting a key that never existed writes nothing.
    let never = ns.key("never").unwrap();
    assert!(!store.delete(&never).await.unwrap());
    let none = store
        .client()
        .get_item()
        .table_name(store.table())
        .key("pk", AttributeValue::S(format!("{ns}:never")))
        .consistent_read(true)
        .send()
        .await
        .unwrap();
    assert!(none.item.is_none(), "{none:?}");
}

#[tokio::test]
async fn a_stale_retryable_failure_starts_over() {
    let Some((store, clock)) = common::manual_store().await else {
        return;
    };
    let key = namespace().key("stale").unwrap();
    let a = lease(&store, &request(&key, "a")).await;
    store
        .fail(
            &a,
            "timeout",
            FailureKind::Retryable,
            Duration::from_secs(1),
        )
        .await
        .unwrap();
    clock.advance(Duration::from_secs(2));
    assert_eq!(store.get(&key).await.unwrap(), None, "past retention");
    // A different fingerprint does not conflict with a record past retention.
    let other = request(&key, "b").with_fingerprint(Fingerprint::of("other"));
    let b = lease(&store, &other).await;
    assert_eq!(b.attempt, 1);
    assert!(b.token > a.token);
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.fingerprint, Some(Fingerprint::of("other")));
    assert_eq!(record.attempts, 1);
    assert_eq!(record.created_at, record.updated_at);
    assert_eq!(record.expires_at, None);
    assert_eq!(record.state, RecordState::InProgress);
}

#[tokio::test]
async fn a_client_clock_ahead_takes_over_and_fencing_holds() {
    // Two consumers on one table; the second one's clock runs a whole lease ahead.
    let Some((slow, _)) = common::manual_store().await else {
        return;
    };
    let fast_clock = Arc::new(ManualClock::default());
    fast_clock.advance(Duration::from_secs(31));
    let Some(fast) =
        common::store_with(common::config(common::table()).with_clock(fast_clock)).await
    else {
        return;
    };
    let key = namespace().key("skew").unwrap();
    let a = lease(&slow, &request(&key, "slow")).await;
    let b = match fast.acquire(&request(&key, "fast")).await.unwrap() {
        AcquireOutcome::Acquired { lease, takeover } => {
            assert!(takeover, "the fast clock sees the lease expired");
            lease
        }
        other => panic!("{other:?}"),
    };
    let r = slow
        .complete(&a, Bytes::from_static(b"late"), RETENTION)
        .await;
    assert!(
        matches!(r, Err(Error::LeaseLost { why: LostLease::Superseded { current }, .. }) if current == b.token),
        "{r:?}"
    );
    fast.complete(&b, Bytes::from_static(b"ok"), RETENTION)
        .await
        .unwrap();
}

#[tokio::test]
async fn config_is_validated_before_connecting() {
    let r = DynamoStore::connect(common::config("x")).await;
    assert!(
        matches!(r, Err(Error::InvalidInput { field: "table", .. })),
        "{r:?}"
    );
}

/// Batches: a key that appears twice is processed in batch order (the second acquire sees the
/// first one's lease; a complete then a release of the same lease: the release is refused as
/// not in progress), and many keys, more than run at once, all get their own outcome in order.
#[tokio::test]
async fn batches_keep_the_order_of_a_key() {
    let Some(store) = common::store().await else {
        return;
    };
    let ns = namespace();
    let mut reqs: Vec<AcquireRequest> = (0..40)
        .map(|i| AcquireRequest::new(ns.key(format!("k{i}")).unwrap(), "batcher"))
        .collect();
    reqs.insert(7, reqs[3].clone());
    let outcomes = store.acquire_many(&reqs).await.unwrap();
    assert_eq!(outcomes.len(), reqs.len());
    let mut leases = Vec::new();
    for (i, (req, outcome)) in reqs.iter().zip(&outcomes).enumerate() {
        match outcome.as_ref().unwrap() {
            AcquireOutcome::Acquired { lease, .. } if i != 7 => {
                assert_eq!(lease.key, req.key, "outcome {i} is another key's");
                leases.push(lease.clone());
            }
            AcquireOutcome::InProgress { owner, .. } if i == 7 => assert_eq!(owner, "batcher"),
            other => panic!("outcome {i}: {other:?}"),
        }
    }
    let first = leases[0].clone();
    let done = store
        .complete_many(
            &[idem_core::Completion::new(first.clone(), "r")],
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert!(done[0].is_ok(), "{done:?}");
    let released = store
        .release_many(&[leases[1].clone(), first.clone(), leases[1].clone()])
        .await
        .unwrap();
    assert!(released[0].is_ok(), "{released:?}");
    assert!(
        matches!(
            &released[1],
            Err(Error::LeaseLost {
                why: LostLease::NotInProgress {
                    state: StateKind::Completed
                },
                ..
            })
        ),
        "{released:?}"
    );
    // A release after the release replays: Ok.
    assert!(released[2].is_ok(), "{released:?}");
}
