//! A store opened by a relative path keeps to its file when the process later changes its
//! working directory (a daemon moving to `/`): every connection, the read connections opened
//! later on demand included, opens the file `open` opened.
//!
//! In a file of its own, so in a process of its own, with one test: changing the working
//! directory would move the relative paths of any test running beside it.

use std::path::Path;

use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, IdempotencyKey, IdempotencyStore, Namespace,
};
use idem_sqlite::{SqliteOptions, SqliteStore};

const RETENTION: std::time::Duration = std::time::Duration::from_secs(3600);

fn key() -> IdempotencyKey {
    Namespace::new("payments").unwrap().key("c1").unwrap()
}

async fn complete(store: &SqliteStore, result: &'static [u8]) {
    match store.acquire(&AcquireRequest::new(key(), "w")).await {
        Ok(AcquireOutcome::Acquired { lease, .. }) => store
            .complete(&lease, Bytes::from_static(result), RETENTION)
            .await
            .unwrap(),
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Acquires the key 64 times at once on `store`, and once more on `fresh` (which keeps no idle
/// read connection, so its every read opens one): each must replay `paid`.
async fn all_replay_paid(store: &SqliteStore, fresh: &SqliteStore, dir: &str) {
    let calls = (0..64).map(|i| {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .acquire(&AcquireRequest::new(key(), format!("w{i}")))
                .await
        })
    });
    let mut wrong = Vec::new();
    for call in futures::future::join_all(calls).await {
        match call.unwrap() {
            Ok(AcquireOutcome::Replayed { result }) if result == "paid" => {}
            other => wrong.push(format!("{other:?}")),
        }
    }
    match fresh.acquire(&AcquireRequest::new(key(), "w")).await {
        Ok(AcquireOutcome::Replayed { result }) if result == "paid" => {}
        other => wrong.push(format!("no idle reader: {other:?}")),
    }
    assert!(
        wrong.is_empty(),
        "working directory {dir}: {} of 65 calls did not replay the store's own record: {wrong:?}",
        wrong.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_connection_opens_the_file_open_opened_whatever_the_working_directory() {
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let [a, b, c] = ["a", "b", "c"].map(|d| {
        let dir = root.path().join(d);
        std::fs::create_dir(&dir).unwrap();
        dir
    });
    let started_in = std::env::current_dir().unwrap();

    std::env::set_current_dir(&a).unwrap();
    let store = SqliteStore::open("idem.db").await.unwrap();
    let fresh = SqliteStore::open_with("idem.db", SqliteOptions::default().with_readers(0))
        .await
        .unwrap();
    complete(&store, b"paid").await;

    // A directory without the file: a read connection opened from there found none.
    std::env::set_current_dir(&c).unwrap();
    all_replay_paid(&store, &fresh, "without idem.db").await;

    // A directory with another idem.db holding the same key: a read connection opened from
    // there answered from the other database.
    std::env::set_current_dir(&b).unwrap();
    let other = SqliteStore::open("idem.db").await.unwrap();
    complete(&other, b"other").await;
    all_replay_paid(&store, &fresh, "with another idem.db").await;

    std::env::set_current_dir(started_in).unwrap();
    let opened = std::fs::canonicalize(&a).unwrap().join("idem.db");
    assert_eq!(store.backend().path(), opened);
    assert!(Path::new(&opened).is_absolute());
    assert!(
        !c.join("idem.db").exists(),
        "nothing created where the process moved to"
    );
}
