//! Behaviour of `RedisStore` on a real server and on a real cluster, beyond the shared suite:
//! the stored layout, token monotonicity, hostile keys on the cluster, timeouts.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Error, Fingerprint, IdempotencyStore, Lease, Namespace,
    RecordState,
};
use idem_redis::RedisStore;

fn ns() -> Namespace {
    Namespace::new(format!("t-{}", uuid::Uuid::new_v4().simple())).unwrap()
}

async fn acquired(store: &RedisStore, req: &AcquireRequest) -> Lease {
    match store.acquire(req).await {
        Ok(AcquireOutcome::Acquired { lease, .. }) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

const HOUR: Duration = Duration::from_secs(3600);

async fn lifecycle(store: RedisStore) {
    let ns = ns();
    let key = ns.key("order-1").unwrap();
    let fp = Fingerprint::of("payload");
    let req = AcquireRequest::new(key.clone(), "w1")
        .with_fingerprint(fp)
        .with_lease_ttl(Duration::from_millis(200))
        .with_max_attempts(3);

    let first = acquired(&store, &req).await;
    assert_eq!(first.attempt, 1);
    // Busy while the lease lives.
    let busy = store.acquire(&req.clone().with_fingerprint(None)).await;
    assert!(
        matches!(&busy, Ok(AcquireOutcome::InProgress { owner, retry_after }) if owner == "w1" && *retry_after <= Duration::from_millis(200)),
        "{busy:?}"
    );
    // A different fingerprint conflicts; a missing one does not.
    let conflict = store
        .acquire(&req.clone().with_fingerprint(Fingerprint::of("other")))
        .await;
    assert!(
        matches!(conflict, Ok(AcquireOutcome::Conflict)),
        "{conflict:?}"
    );

    // Heartbeat, then crash: takeover with a higher token, the zombie is fenced.
    let first = store
        .extend(&first, Duration::from_millis(100))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let second = match store.acquire(&req).await {
        Ok(AcquireOutcome::Acquired { lease, takeover }) => {
            assert!(takeover);
            lease
        }
        other => panic!("expected a takeover, got {other:?}"),
    };
    assert!(second.token > first.token);
    assert_eq!(second.attempt, 2);
    let zombie = store.complete(&first, Bytes::from_static(b"x"), HOUR).await;
    assert!(
        matches!(&zombie, Err(Error::LeaseLost { current: Some(t), .. }) if *t == second.token),
        "{zombie:?}"
    );

    // Release gives the attempt back; the next acquisition is attempt 2 again, no takeover.
    store.release(&second).await.unwrap();
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Released);
    assert_eq!(record.attempts, 1);
    assert_eq!(record.lease_expires_at, None);
    let third = match store.acquire(&req).await {
        Ok(AcquireOutcome::Acquired { lease, takeover }) => {
            assert!(!takeover);
            lease
        }
        other => panic!("{other:?}"),
    };
    assert_eq!(third.attempt, 2);

    // Retryable failure, then attempts run out.
    store.fail(&third, "boom", true, HOUR).await.unwrap();
    let fourth = acquired(&store, &req).await;
    assert_eq!(fourth.attempt, 3);
    store.fail(&fourth, "boom again", true, HOUR).await.unwrap();
    for _ in 0..2 {
        let r = store.acquire(&req).await;
        assert!(
            matches!(&r, Ok(AcquireOutcome::Exhausted { attempts: 3, last_error: Some(e) }) if e == "boom again"),
            "{r:?}"
        );
    }
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.fingerprint, Some(fp));
    assert_eq!(record.owner, "w1");
    assert!(record.expires_at.is_some());
    assert!(record.created_at <= record.updated_at);

    // Operator delete: a fresh acquisition with a token higher than all before.
    assert!(store.delete(&key).await.unwrap());
    assert!(!store.delete(&key).await.unwrap());
    let fifth = acquired(&store, &req).await;
    assert_eq!(fifth.attempt, 1);
    assert!(fifth.token > fourth.token);

    // Completion with an empty result replays an empty result; retention expiry frees the key.
    store
        .complete(&fifth, Bytes::new(), Duration::from_millis(150))
        .await
        .unwrap();
    let replay = store.acquire(&req).await;
    assert!(
        matches!(&replay, Ok(AcquireOutcome::Replayed { result }) if result.is_empty()),
        "{replay:?}"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(store.get(&key).await.unwrap(), None);
    let sixth = acquired(&store, &req).await;
    assert_eq!(sixth.attempt, 1);
    assert!(sixth.token > fifth.token);

    // Terminal failure is replayed and never re-run.
    store.fail(&sixth, "", false, HOUR).await.unwrap();
    let r = store.acquire(&req).await;
    assert!(
        matches!(&r, Ok(AcquireOutcome::Failed { error }) if error.is_empty()),
        "{r:?}"
    );
}

async fn bad_input_sends_nothing(store: RedisStore) {
    let key = ns().key("k").unwrap();
    let bad = AcquireRequest::new(key.clone(), "");
    assert!(matches!(
        store.acquire(&bad).await,
        Err(Error::InvalidInput { field: "owner", .. })
    ));
    let lease = acquired(&store, &AcquireRequest::new(key.clone(), "w")).await;
    let big = Bytes::from(vec![0u8; store.config().limits.max_result_len + 1]);
    assert!(matches!(
        store.complete(&lease, big, HOUR).await,
        Err(Error::ResultTooLarge { .. })
    ));
    assert!(matches!(
        store.complete(&lease, Bytes::new(), Duration::ZERO).await,
        Err(Error::InvalidInput {
            field: "retention",
            ..
        })
    ));
    assert!(matches!(
        store.extend(&lease, Duration::ZERO).await,
        Err(Error::InvalidInput {
            field: "lease_ttl",
            ..
        })
    ));
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::InProgress);
}

/// Ids that are hash tags of one another, or carry several tags, or characters that mean
/// something to Redis, Lua or a shell: each is its own record, and each round-trips.
const HOSTILE: &[&str] = &[
    "{",
    "}",
    "{}",
    "}{",
    "{a}",
    "a",
    "{a}b",
    "b{a}",
    "{{a}}",
    "{a}{b}",
    "{b}{a}",
    "{a",
    "a}",
    "x:{a}:y",
    ":",
    "::",
    "a:b",
    "*",
    "a*",
    "?[]^-",
    " ",
    "a b",
    "a\nb",
    "\r\n",
    "'",
    "\"",
    "it's \"quoted\"",
    "%s%d%%",
    "\\",
    "]]..'x'--",
    "ünïcödé ключ 键 🔑",
    "{ключ}",
    "idem:",
    "KEYS[1]",
];

async fn hostile_keys(store: RedisStore) {
    let ns = ns();
    let mut tokens = HashSet::new();
    for (i, id) in HOSTILE.iter().enumerate() {
        let key = ns.key(id).unwrap();
        let lease = acquired(
            &store,
            &AcquireRequest::new(key.clone(), format!("owner {id}")),
        )
        .await;
        assert!(tokens.insert((id, lease.token)));
        store
            .complete(&lease, Bytes::from(format!("result #{i} for {id}")), HOUR)
            .await
            .unwrap_or_else(|e| panic!("complete {id:?}: {e}"));
    }
    for (i, id) in HOSTILE.iter().enumerate() {
        let key = ns.key(id).unwrap();
        let r = store
            .acquire(&AcquireRequest::new(key.clone(), "again"))
            .await;
        let expected = format!("result #{i} for {id}");
        assert!(
            matches!(&r, Ok(AcquireOutcome::Replayed { result }) if result == expected.as_bytes()),
            "{id:?}: {r:?}"
        );
        let record = store.get(&key).await.unwrap().expect("stored");
        assert_eq!(record.key.id(), *id);
        assert_eq!(record.owner, format!("owner {id}"));
    }
    // Another namespace sees none of them.
    let fresh = Namespace::new(format!("{}-2", ns.as_str())).unwrap();
    for id in HOSTILE {
        let key = fresh.key(id).unwrap();
        assert_eq!(store.get(&key).await.unwrap(), None, "{id:?}");
    }
    // Deleting one leaves its hash-tag relatives alone.
    assert!(store.delete(&ns.key("{a}").unwrap()).await.unwrap());
    for id in ["a", "{a}b", "b{a}", "{{a}}"] {
        assert!(
            store.get(&ns.key(id).unwrap()).await.unwrap().is_some(),
            "{id:?}"
        );
    }
}

async fn unreachable_is_unavailable_quickly(
    connect: impl Future<Output = idem_core::Result<RedisStore>>,
) {
    let started = Instant::now();
    let r = connect.await;
    assert!(
        matches!(r, Err(Error::Unavailable { store: "redis", .. })),
        "{r:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

mod standalone {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lifecycle() {
        super::lifecycle(common::standalone().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_input_sends_nothing() {
        super::bad_input_sends_nothing(common::standalone().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hostile_keys() {
        super::hostile_keys(common::standalone().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unreachable_is_unavailable_quickly() {
        super::unreachable_is_unavailable_quickly(common::unreachable()).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_url_is_invalid_input() {
        let r = RedisStore::connect("http://127.0.0.1:6379").await;
        assert!(
            matches!(r, Err(Error::InvalidInput { field: "url", .. })),
            "{r:?}"
        );
    }
}

mod cluster {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lifecycle() {
        super::lifecycle(common::cluster().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_input_sends_nothing() {
        super::bad_input_sends_nothing(common::cluster().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hostile_keys() {
        let store = common::cluster().await;
        assert!(store.is_cluster());
        super::hostile_keys(store.clone()).await;

        // The ids above spread over several slots, and ids sharing a hash tag share a slot
        // (Redis' rule, which the driver's routing follows) while staying distinct records.
        let nodes = common::cluster_nodes();
        let mut admin = redis::cluster::ClusterClient::new(nodes)
            .unwrap()
            .get_async_connection()
            .await
            .unwrap();
        let ns = Namespace::new("slots").unwrap();
        let mut slots = HashMap::new();
        for id in HOSTILE {
            let slot: u16 = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(store.storage_key(&ns.key(id).unwrap()))
                .query_async(&mut admin)
                .await
                .unwrap();
            slots.insert(*id, slot);
        }
        let distinct: HashSet<u16> = slots.values().copied().collect();
        assert!(distinct.len() > 10, "{slots:?}");
        for id in ["{a}b", "b{a}", "x:{a}:y", "{a}{b}"] {
            assert_eq!(slots[id], slots["{a}"], "{id:?}");
        }
        assert_ne!(slots["{b}{a}"], slots["{a}"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unreachable_is_unavailable_quickly() {
        super::unreachable_is_unavailable_quickly(common::unreachable_cluster()).await;
    }
}
