//! `PostgresStore::drop_namespace`: every record of the namespace goes (over several batches),
//! no other namespace's, and tokens stay strictly increasing afterwards (the sequence is kept).

mod common;

use std::time::Duration;

use idem_core::{AcquireOutcome, AcquireRequest, Bytes, IdempotencyStore, Namespace};

const RETENTION: Duration = Duration::from_secs(3600);
/// More than one batch of the drop (10,000 rows a statement).
const RECORDS: i64 = 10_500;

#[tokio::test]
async fn drops_every_record_of_the_namespace_and_no_other() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let ns = Namespace::new(format!("drop-{}", rand::random::<u32>())).unwrap();
    let other = Namespace::new(format!("drop-other-{}", rand::random::<u32>())).unwrap();

    // Most records written directly (the store's statements would take a while for 10,500),
    // then a few through the store: one completed, one in progress, one failed.
    admin
        .execute(
            &format!(
                "INSERT INTO {t} (namespace, id, state, token, owner, attempts, result, \
                                 created_at, updated_at, expires_at) \
                 SELECT $1::text, 'bulk-' || i, 'completed', nextval($2::text::regclass), 'w', 1, \
                        '\\x6f6b'::bytea, now(), now(), now() + interval '1 hour' \
                 FROM generate_series(1, $3::bigint) AS i",
                t = store.qualified_table()
            ),
            &[
                &ns.as_str(),
                &format!(
                    "\"{}\".\"{}_token_seq\"",
                    store.config().schema,
                    store.config().table
                ),
                &RECORDS,
            ],
        )
        .await
        .expect("bulk records");
    let mut last_token = 0;
    for (i, namespace) in [&ns, &ns, &ns, &other].into_iter().enumerate() {
        let key = namespace.key(format!("k{i}")).unwrap();
        let AcquireOutcome::Acquired { lease, .. } =
            store.acquire(&AcquireRequest::new(key, "w")).await.unwrap()
        else {
            panic!("k{i} not acquired");
        };
        last_token = last_token.max(lease.token.get());
        match i {
            0 | 3 => store
                .complete(&lease, Bytes::from_static(b"ok"), RETENTION)
                .await
                .unwrap(),
            1 => {}
            _ => store
                .fail(&lease, "no", idem_core::FailureKind::Terminal, RETENTION)
                .await
                .unwrap(),
        }
    }

    let removed = store.drop_namespace(&ns).await.unwrap();
    assert_eq!(removed, RECORDS as u64 + 3);
    let left: i64 = admin
        .query_one(
            &format!(
                "SELECT count(*) FROM {} WHERE namespace = $1",
                store.qualified_table()
            ),
            &[&ns.as_str()],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
    assert!(
        store
            .get(&other.key("k3").unwrap())
            .await
            .unwrap()
            .is_some()
    );

    // A former key starts again at attempt 1, with a token above every earlier one.
    let AcquireOutcome::Acquired { lease, .. } = store
        .acquire(&AcquireRequest::new(ns.key("k0").unwrap(), "w"))
        .await
        .unwrap()
    else {
        panic!("k0 not acquired after the drop");
    };
    assert_eq!(lease.attempt, 1);
    assert!(lease.token.get() > last_token);
    assert_eq!(store.drop_namespace(&ns).await.unwrap(), 1);
    assert_eq!(store.drop_namespace(&ns).await.unwrap(), 0);
    store.drop_namespace(&other).await.unwrap();
}
