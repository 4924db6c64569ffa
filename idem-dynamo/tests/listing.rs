//! `DynamoStore::list`: a paginated `Scan` that misses no record across pages, skips other
//! namespaces, tombstones and records past retention, filters by status, and refuses foreign
//! cursors. Skipped with one line when nothing answers at the endpoint (a failure with `CI`).

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Cursor, Error, IdempotencyStore, Lease, ListQuery,
    Namespace, Status,
};
use idem_dynamo::DynamoStore;

fn namespace() -> Namespace {
    Namespace::new(format!("list-{}", uuid::Uuid::new_v4().simple())).unwrap()
}

async fn acquire(store: &DynamoStore, ns: &Namespace, id: &str) -> Lease {
    let req = AcquireRequest::new(ns.key(id).unwrap(), "lister");
    match store.acquire(&req).await.unwrap() {
        AcquireOutcome::Acquired { lease, .. } => lease,
        other => panic!("{id}: {other:?}"),
    }
}

/// Every page of `query`, followed to the end: the ids listed (with repeats) and the page count.
async fn list_all(store: &DynamoStore, query: ListQuery) -> (Vec<String>, usize) {
    let (mut ids, mut pages, mut cursor) = (Vec::new(), 0, None);
    loop {
        let page = store
            .list(&query.clone().with_cursor(cursor))
            .await
            .unwrap();
        pages += 1;
        assert!(page.records.len() <= query.limit, "a page over the limit");
        ids.extend(page.records.iter().map(|r| r.key.id().to_owned()));
        match page.next {
            Some(next) => cursor = Some(next),
            None => return (ids, pages),
        }
    }
}

/// A few hundred records of one namespace among others' records, listed 37 at a time: every
/// one appears exactly once (nothing changes meanwhile), no record of another namespace does,
/// and the status filter keeps exactly the completed ones.
#[tokio::test]
async fn pages_miss_no_record() {
    let Some(store) = common::store().await else {
        return;
    };
    let (ns, other) = (namespace(), namespace());
    let mut want = BTreeSet::new();
    let mut completed = BTreeSet::new();
    for i in 0..300 {
        let id = format!("k{i:03}");
        let lease = acquire(&store, &ns, &id).await;
        if i % 3 == 0 {
            store
                .complete(&lease, Bytes::from_static(b"ok"), Duration::from_secs(3600))
                .await
                .unwrap();
            completed.insert(id.clone());
        }
        want.insert(id);
    }
    for i in 0..50 {
        acquire(&store, &other, &format!("o{i}")).await;
    }
    // Deleted: a tombstone, never listed.
    acquire(&store, &ns, "deleted").await;
    assert!(store.delete(&ns.key("deleted").unwrap()).await.unwrap());

    let (ids, pages) = list_all(&store, ListQuery::new(ns.clone()).with_limit(37)).await;
    assert!(pages > 1, "the listing must span pages: {pages}");
    let listed: BTreeSet<String> = ids.iter().cloned().collect();
    assert_eq!(listed.len(), ids.len(), "a record listed twice");
    assert_eq!(listed, want);

    let query = ListQuery::new(ns.clone())
        .with_limit(50)
        .with_statuses([Status::Completed]);
    let (ids, _) = list_all(&store, query).await;
    assert_eq!(ids.into_iter().collect::<BTreeSet<_>>(), completed);
}

/// A record past retention is not listed, though its item is still in the table.
#[tokio::test]
async fn past_retention_is_not_listed() {
    let Some((store, clock)) = common::manual_store().await else {
        return;
    };
    let ns = namespace();
    let lease = acquire(&store, &ns, "old").await;
    store
        .complete(&lease, Bytes::from_static(b"x"), Duration::from_secs(1))
        .await
        .unwrap();
    acquire(&store, &ns, "live").await;
    clock.advance(Duration::from_secs(2));
    let (ids, _) = list_all(&store, ListQuery::new(ns)).await;
    assert_eq!(ids, ["live"]);
}

/// A cursor this store did not hand out is `InvalidInput` for field `cursor`; nothing is read.
#[tokio::test]
async fn foreign_cursor_is_invalid_input() {
    let Some(store) = common::store().await else {
        return;
    };
    for text in ["", "42", "ns:id", "dyn1-zz"] {
        let query = ListQuery::new(namespace()).with_cursor(Some(Cursor::new(text)));
        let err = store.list(&query).await.unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidInput {
                    field: "cursor",
                    ..
                }
            ),
            "{text:?}: {err:?}"
        );
    }
}
