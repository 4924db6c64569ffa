//! `RedisStore::list` beyond C26, on a server and on a cluster: many records in small pages (a
//! `SCAN` step cut across pages), tombstones and other namespaces left out, a value that is not
//! a record reported as corrupt, and cursors of another store or of nothing refused.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Cursor, Error, IdempotencyStore, ListQuery, Namespace,
    Status,
};
use idem_redis::RedisStore;

fn ns() -> Namespace {
    Namespace::new(format!("l-{}", uuid::Uuid::new_v4().simple())).unwrap()
}

async fn completed(store: &RedisStore, ns: &Namespace, id: &str) {
    let req = AcquireRequest::new(ns.key(id).unwrap(), "lister");
    let AcquireOutcome::Acquired { lease, .. } = store.acquire(&req).await.unwrap() else {
        panic!("{id}: not acquired");
    };
    store
        .complete(&lease, Bytes::from_static(b"r"), Duration::from_secs(600))
        .await
        .unwrap();
}

/// Every page of `query`: how many times each id was listed, and how many pages it took.
async fn all_pages(store: &RedisStore, query: ListQuery) -> (BTreeMap<String, usize>, usize) {
    let mut query = query;
    let mut seen = BTreeMap::new();
    for pages in 1..=10_000 {
        let page = store.list(&query).await.unwrap();
        assert!(page.records.len() <= query.limit);
        for r in &page.records {
            *seen.entry(r.key.id().to_owned()).or_insert(0) += 1;
        }
        match page.next {
            None => return (seen, pages),
            next => query = query.with_cursor(next),
        }
    }
    panic!("no end after 10,000 pages");
}

/// Follows the pages of `query` until one fails.
async fn list_until_error(store: &RedisStore, query: ListQuery) -> Error {
    let mut query = query;
    loop {
        match store.list(&query).await {
            Err(e) => return e,
            Ok(page) => match page.next {
                None => panic!("the listing ended without an error"),
                next => query = query.with_cursor(next),
            },
        }
    }
}

async fn many_records_in_small_pages(store: RedisStore) {
    let ns = ns();
    let other = ns.clone();
    let elsewhere = self::ns();
    for i in 0..300 {
        completed(&store, &ns, &format!("k{i:03}")).await;
    }
    completed(&store, &elsewhere, "k000").await;
    // A deleted record leaves a tombstone under the pattern: never listed.
    store.delete(&ns.key("k299").unwrap()).await.unwrap();
    let (seen, pages) = all_pages(&store, ListQuery::new(other).with_limit(7)).await;
    assert_eq!(seen.len(), 299, "every live record, nothing else");
    assert!(!seen.contains_key("k299"), "a tombstone was listed");
    // SCAN steps of about 100 keys hold more matches than a page of 7, so steps are cut across
    // pages. A cut step goes on where it stopped, or is listed again when the node rehashed in
    // between (other tests write to the same server): repeats, never losses.
    assert!(pages >= 299 / 7, "{pages} pages");
    let listed: usize = seen.values().sum();
    eprintln!("299 records listed {listed} times in {pages} pages of 7");
    // Filters apply while scanning.
    let (none, _) = all_pages(
        &store,
        ListQuery::new(ns.clone()).with_statuses([Status::InProgress]),
    )
    .await;
    assert!(none.is_empty(), "{none:?}");
}

async fn corrupt_values_and_bad_cursors(store: RedisStore) {
    let ns = ns();
    completed(&store, &ns, "good").await;
    let bad_key = format!("{}{}:bad", store.config().prefix, ns.as_str());
    let mut admin = common::Admin::of(&store).await;
    admin
        .query::<()>(redis::cmd("SET").arg(&bad_key).arg("not a record"))
        .await;
    let err = list_until_error(&store, ListQuery::new(ns.clone())).await;
    assert!(
        matches!(&err, Error::CorruptRecord { key, .. } if *key == bad_key),
        "{err:?}"
    );
    admin.query::<()>(redis::cmd("DEL").arg(&bad_key)).await;
    let (seen, _) = all_pages(&store, ListQuery::new(ns.clone())).await;
    assert_eq!(seen.len(), 1);

    for cursor in ["", "r1..0", "m1.0.0.0", "r1.0.x.0", "r1.zz.0.0.ab.0"] {
        let err = store
            .list(&ListQuery::new(ns.clone()).with_cursor(Some(Cursor::new(cursor))))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidInput {
                    field: "cursor",
                    ..
                }
            ),
            "{cursor:?}: {err:?}"
        );
    }
    // A cursor made for another slot map (or for one server, on a cluster) is refused.
    let foreign = if store.is_cluster() {
        "r1..0.0"
    } else {
        "r1.0123456789abcdef.0.0"
    };
    let err = store
        .list(&ListQuery::new(ns).with_cursor(Some(Cursor::new(foreign))))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidInput {
                field: "cursor",
                ..
            }
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn standalone_lists_many_records_in_small_pages() {
    if let Some(store) = common::standalone().await {
        many_records_in_small_pages(store).await;
    }
}

#[tokio::test]
async fn cluster_lists_many_records_in_small_pages() {
    if let Some(store) = common::cluster().await {
        many_records_in_small_pages(store).await;
    }
}

#[tokio::test]
async fn standalone_reports_corrupt_values_and_refuses_bad_cursors() {
    if let Some(store) = common::standalone().await {
        corrupt_values_and_bad_cursors(store).await;
    }
}

#[tokio::test]
async fn cluster_reports_corrupt_values_and_refuses_bad_cursors() {
    if let Some(store) = common::cluster().await {
        corrupt_values_and_bad_cursors(store).await;
    }
}
