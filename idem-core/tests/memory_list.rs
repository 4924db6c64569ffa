//! `MemoryStore::list` reads only the wanted states' records: listing one state among many
//! looks at that state's records and no others (`MemoryStore::records_examined`).

use std::time::Duration;

use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, FailureKind, IdempotencyStore, ListQuery, MemoryStore,
    Namespace, Status,
};

async fn finish(store: &MemoryStore, ns: &Namespace, id: &str, terminal: bool) {
    let req = AcquireRequest::new(ns.key(id).unwrap(), "w");
    let AcquireOutcome::Acquired { lease, .. } = store.acquire(&req).await.unwrap() else {
        panic!("{id}");
    };
    let day = Duration::from_secs(86_400);
    if terminal {
        store
            .fail(&lease, "declined", FailureKind::Terminal, day)
            .await
            .unwrap();
    } else {
        store.complete(&lease, Bytes::new(), day).await.unwrap();
    }
}

#[tokio::test]
async fn one_state_among_many_examines_only_that_state() {
    let store = MemoryStore::new();
    let ns = Namespace::new("orders").unwrap();
    let other = Namespace::new("other").unwrap();
    for i in 0..5_000 {
        finish(&store, &ns, &format!("c{i:05}"), false).await;
    }
    for i in 0..1_000 {
        finish(&store, &other, &format!("t{i:05}"), true).await;
    }
    for i in 0..12 {
        finish(&store, &ns, &format!("t{i:05}"), true).await;
    }
    // The index follows every transition: these two leave the terminal state again.
    store.delete(&ns.key("t00000").unwrap()).await.unwrap();
    let lease = match store
        .acquire(&AcquireRequest::new(ns.key("t00001").unwrap(), "w"))
        .await
        .unwrap()
    {
        AcquireOutcome::Failed { .. } => None,
        other => Some(other),
    };
    assert_eq!(lease, None, "a terminal failure is replayed, not re-run");

    let before = store.records_examined();
    let mut query = ListQuery::new(ns.clone())
        .with_statuses([Status::FailedTerminal])
        .with_limit(5);
    let mut ids = Vec::new();
    loop {
        let page = store.list(&query).await.unwrap();
        ids.extend(page.records.iter().map(|r| r.key.id().to_owned()));
        match page.next {
            None => break,
            next => query = query.with_cursor(next),
        }
    }
    let examined = store.records_examined() - before;
    let want: Vec<String> = (1..12).map(|i| format!("t{i:05}")).collect();
    assert_eq!(ids, want);
    println!(
        "listing 11 failed-terminal records among {} examined {examined} records",
        store.len()
    );
    // Three pages, each reading the terminal failures after its cursor: at most 3 x 11, never
    // the 5,000 completed records or the other namespace's 1,000.
    assert!(examined <= 3 * 11, "{examined} records examined");

    // Every status at once, one page: the namespace's records only, and in each shard and state
    // no more than the page needs (64 shards, 1,001 each at most).
    let before = store.records_examined();
    let page = store
        .list(&ListQuery::new(ns).with_limit(idem_core::MAX_PAGE))
        .await
        .unwrap();
    assert_eq!(page.records.len(), 1_000);
    let examined = store.records_examined() - before;
    assert!(examined <= 5_011, "{examined}");
}
