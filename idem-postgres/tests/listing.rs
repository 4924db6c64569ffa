//! `PostgresStore::list` beyond C26: listing one state among many reads the listing index, not
//! the table (shown by `EXPLAIN (FORMAT JSON)`), and pages cross states without losing or
//! repeating a record.

mod common;

use std::collections::BTreeMap;

use idem_core::{IdempotencyStore, ListQuery, Namespace, Status};
use idem_postgres::PostgresStore;
use serde_json::Value;

/// Every node of a plan, depth first.
fn nodes<'a>(plan: &'a Value, out: &mut Vec<&'a Value>) {
    out.push(plan);
    if let Some(children) = plan.get("Plans").and_then(Value::as_array) {
        for child in children {
            nodes(child, out);
        }
    }
}

/// Inserts `count` records of `state` (ids `<prefix>00001`...) into `ns` behind the store's back.
async fn insert(schema: &str, table: &str, ns: &str, state: &str, prefix: &str, count: i32) {
    let admin = common::admin().await;
    let (result, error) = match state {
        "completed" => ("'\\x00'::bytea", "NULL"),
        _ => ("NULL", "'declined'"),
    };
    admin
        .execute(
            &format!(
                "INSERT INTO \"{schema}\".\"{table}\" (namespace, id, state, token, owner, \
                 attempts, result, error, created_at, updated_at, expires_at) \
                 SELECT $1::text, $2::text || lpad(g::text, 5, '0'), $3::text, g, 'w', 1, \
                 {result}, {error}, now(), now(), now() + interval '1 day' \
                 FROM generate_series(1, $4::integer) g"
            ),
            &[&ns, &prefix, &state, &count],
        )
        .await
        .unwrap();
}

async fn store(table: &str) -> Option<(PostgresStore, String)> {
    let schema = common::fresh_schema();
    let store = common::store_with(common::config(&schema).with_table(table)).await?;
    Some((store, schema))
}

#[tokio::test]
async fn one_state_among_many_reads_the_listing_index_not_the_table() {
    let Some((store, schema)) = store("big").await else {
        return;
    };
    let ns = Namespace::new("orders").unwrap();
    insert(&schema, "big", ns.as_str(), "completed", "c", 50_000).await;
    insert(&schema, "big", ns.as_str(), "failed_terminal", "t", 20).await;
    insert(&schema, "big", "other", "failed_terminal", "o", 5_000).await;
    common::admin()
        .await
        .batch_execute(&format!("ANALYZE \"{schema}\".\"big\""))
        .await
        .unwrap();

    let query = ListQuery::new(ns.clone()).with_statuses([Status::FailedTerminal]);
    let plan: Value = serde_json::from_str(&store.explain_list(&query).await.unwrap()).unwrap();
    let root = &plan[0]["Plan"];
    let mut all = Vec::new();
    nodes(root, &mut all);
    let types: Vec<&str> = all
        .iter()
        .filter_map(|n| n.get("Node Type").and_then(Value::as_str))
        .collect();
    eprintln!("plan of the failed-terminal listing: {types:?}");
    assert!(
        !all.iter()
            .any(|n| n.get("Node Type").and_then(Value::as_str) == Some("Seq Scan")),
        "a sequential scan: {plan:#}"
    );
    assert!(
        all.iter()
            .any(|n| n.get("Index Name").and_then(Value::as_str) == Some("big_list_idx")),
        "the listing index is not read: {plan:#}"
    );

    // Listing the big state is an ordered walk of the index too: each page stops at its limit.
    let completed = ListQuery::new(ns.clone()).with_statuses([Status::Completed]);
    let plan: Value = serde_json::from_str(&store.explain_list(&completed).await.unwrap()).unwrap();
    let mut all = Vec::new();
    nodes(&plan[0]["Plan"], &mut all);
    let types: Vec<&str> = all
        .iter()
        .filter_map(|n| n.get("Node Type").and_then(Value::as_str))
        .collect();
    eprintln!("plan of the completed listing: {types:?}");
    assert!(
        !types.contains(&"Seq Scan") && !types.contains(&"Sort"),
        "{plan:#}"
    );

    // And the listing finds them, in pages.
    let mut found = Vec::new();
    let mut query = query.with_limit(8);
    loop {
        let page = store.list(&query).await.unwrap();
        found.extend(page.records.iter().map(|r| r.key.id().to_owned()));
        match page.next {
            None => break,
            next => query = query.with_cursor(next),
        }
    }
    let want: Vec<String> = (1..=20).map(|i| format!("t{i:05}")).collect();
    assert_eq!(found, want);
}

#[tokio::test]
async fn pages_cross_states_without_losses_or_repeats() {
    let Some((store, schema)) = store("mixed").await else {
        return;
    };
    let ns = Namespace::new("mixed").unwrap();
    insert(&schema, "mixed", ns.as_str(), "completed", "c", 23).await;
    insert(&schema, "mixed", ns.as_str(), "failed_terminal", "t", 11).await;
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut query = ListQuery::new(ns.clone()).with_limit(5);
    let mut pages = 0;
    loop {
        pages += 1;
        let page = store.list(&query).await.unwrap();
        assert!(page.records.len() <= 5);
        for r in &page.records {
            *seen.entry(r.key.id().to_owned()).or_default() += 1;
        }
        match page.next {
            None => break,
            next => query = query.with_cursor(next),
        }
    }
    assert_eq!(seen.len(), 34, "{seen:?}");
    assert!(seen.values().all(|&n| n == 1), "{seen:?}");
    assert!(pages >= 7, "{pages}");
    // Two statuses from two states, in small pages.
    let mut query = ListQuery::new(ns)
        .with_statuses([Status::FailedTerminal, Status::Completed])
        .with_limit(4);
    let mut count = 0;
    loop {
        let page = store.list(&query).await.unwrap();
        count += page.records.len();
        match page.next {
            None => break,
            next => query = query.with_cursor(next),
        }
    }
    assert_eq!(count, 34);
}

/// A page that ends with the last matching record carries no cursor, also when the page fills
/// exactly at the end of a state and the later states hold nothing wanted; a page with more
/// after it (in its state or a later one) does.
#[tokio::test]
async fn a_cursor_only_when_a_record_follows() {
    let Some((store, schema)) = store("exact").await else {
        return;
    };
    let ns = Namespace::new("exact").unwrap();
    insert(&schema, "exact", ns.as_str(), "completed", "c", 6).await;
    insert(&schema, "exact", ns.as_str(), "failed_terminal", "t", 3).await;
    let page = |query: ListQuery| {
        let store = store.clone();
        async move { store.list(&query).await.unwrap() }
    };
    let all = page(ListQuery::new(ns.clone()).with_limit(9)).await;
    assert_eq!((all.records.len(), all.next.is_none()), (9, true));
    // Full at the end of `completed`: `failed_terminal` follows.
    let first = page(ListQuery::new(ns.clone()).with_limit(6)).await;
    assert_eq!(first.records.len(), 6);
    assert!(first.next.is_some(), "failed_terminal records follow");
    let rest = page(
        ListQuery::new(ns.clone())
            .with_limit(6)
            .with_cursor(first.next),
    )
    .await;
    assert_eq!((rest.records.len(), rest.next.is_none()), (3, true));
    // Full at the end of `completed` with nothing wanted after it.
    let completed = page(
        ListQuery::new(ns.clone())
            .with_statuses([Status::Completed])
            .with_limit(6),
    )
    .await;
    assert_eq!(
        (completed.records.len(), completed.next.is_none()),
        (6, true)
    );
    // Full inside a state.
    let part = page(ListQuery::new(ns).with_limit(5)).await;
    assert_eq!((part.records.len(), part.next.is_some()), (5, true));
}
