//! Behaviour of `RedisStore` on a real server and on a real cluster, beyond the shared suite:
//! the stored layout, token monotonicity, hostile keys on the cluster, timeouts.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Error, FailureKind, Fingerprint, IdempotencyStore,
    Lease, LostLease, Namespace, RecordState, StateKind,
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
        matches!(&zombie, Err(Error::LeaseLost { why: LostLease::Superseded { current }, .. }) if *current == second.token),
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
    store
        .fail(&third, "boom", FailureKind::Retryable, HOUR)
        .await
        .unwrap();
    let fourth = acquired(&store, &req).await;
    assert_eq!(fourth.attempt, 3);
    store
        .fail(&fourth, "boom again", FailureKind::Retryable, HOUR)
        .await
        .unwrap();
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
    store
        .fail(&sixth, "", FailureKind::Terminal, HOUR)
        .await
        .unwrap();
    let r = store.acquire(&req).await;
    assert!(
        matches!(&r, Ok(AcquireOutcome::Failed { error, kind: FailureKind::Terminal }) if error.is_empty()),
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
    name: &str,
) {
    let started = Instant::now();
    let r = connect.await;
    assert!(
        matches!(&r, Err(Error::Unavailable { store, .. }) if *store == name),
        "{r:?}"
    );
    let text = r.unwrap_err().to_string();
    assert!(
        text.starts_with(&format!("{name} store unavailable: ")) && text.len() > name.len() + 30,
        "the message names the store and the cause: {text}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

/// The raw stored value and PTTL of `key`, read over a plain admin connection (cluster-routed on
/// a cluster store).
async fn raw(store: &RedisStore, key: &idem_core::IdempotencyKey) -> (Vec<u8>, i64) {
    let storage_key = store.storage_key(key);
    let mut get = redis::cmd("GET");
    get.arg(&storage_key);
    let mut pttl = redis::cmd("PTTL");
    pttl.arg(&storage_key);
    if store.is_cluster() {
        let mut admin = redis::cluster::ClusterClient::new(common::cluster_nodes())
            .unwrap()
            .get_async_connection()
            .await
            .unwrap();
        (
            get.query_async(&mut admin).await.unwrap(),
            pttl.query_async(&mut admin).await.unwrap(),
        )
    } else {
        let mut admin = redis::Client::open(common::url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        (
            get.query_async(&mut admin).await.unwrap(),
            pttl.query_async(&mut admin).await.unwrap(),
        )
    }
}

/// Runs `cmd` over a plain admin connection (cluster-routed on a cluster store).
async fn admin_query<T: redis::FromRedisValue>(store: &RedisStore, cmd: &redis::Cmd) -> T {
    if store.is_cluster() {
        let mut admin = redis::cluster::ClusterClient::new(common::cluster_nodes())
            .unwrap()
            .get_async_connection()
            .await
            .unwrap();
        cmd.query_async(&mut admin).await.unwrap()
    } else {
        let mut admin = redis::Client::open(common::url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        cmd.query_async(&mut admin).await.unwrap()
    }
}

/// `name()` is `redis` or `redis-cluster`, and so is the `store` of the errors it returns.
async fn names_itself(store: RedisStore, name: &str) {
    assert_eq!(store.name(), name);
    let key = ns().key("not-a-record").unwrap();
    let mut set = redis::cmd("SET");
    set.arg(store.storage_key(&key))
        .arg("some other application's text");
    let () = admin_query(&store, &set).await;
    let r = store.get(&key).await;
    assert!(
        matches!(&r, Err(Error::CorruptRecord { store, reason, .. }) if *store == name && reason.contains("format")),
        "{r:?}"
    );
    let text = r.unwrap_err().to_string();
    assert!(
        text.starts_with(&format!("corrupt record in {name} store for ")),
        "{text}"
    );
}

/// A transition sent again with the same lease (its first reply lost, the request re-sent)
/// finds its own effect and succeeds without writing anything (the stored bytes and expiry stay
/// as they were); any other transition with that lease stays fenced off, saying why.
async fn replayed_transitions_succeed(store: RedisStore) {
    let ns = ns();
    let not_in = |state| LostLease::NotInProgress { state };
    let lost = |r: &idem_core::Result<()>, why: LostLease| matches!(r, Err(Error::LeaseLost { why: w, .. }) if *w == why);

    // complete, twice with the same result: Ok both times, the record unchanged.
    let key = ns.key("complete").unwrap();
    let lease = acquired(&store, &AcquireRequest::new(key.clone(), "w")).await;
    store
        .complete(&lease, Bytes::from_static(b"done"), HOUR)
        .await
        .unwrap();
    let before = raw(&store, &key).await;
    // Another retention does not make it another completion.
    store
        .complete(&lease, Bytes::from_static(b"done"), 2 * HOUR)
        .await
        .unwrap();
    let after = raw(&store, &key).await;
    assert_eq!(after.0, before.0);
    assert!(after.1 <= before.1, "the expiry was not pushed back");
    // A different result, or another transition, is not a replay.
    let completed = not_in(StateKind::Completed);
    let r = store
        .complete(&lease, Bytes::from_static(b"other"), HOUR)
        .await;
    assert!(lost(&r, completed), "{r:?}");
    let r = store.complete(&lease, Bytes::new(), HOUR).await;
    assert!(lost(&r, completed), "{r:?}");
    for kind in FailureKind::ALL {
        let r = store.fail(&lease, "done", kind, HOUR).await;
        assert!(lost(&r, completed), "{r:?}");
    }
    let r = store.release(&lease).await;
    assert!(lost(&r, completed), "{r:?}");
    let r = store.extend(&lease, HOUR).await.map(drop);
    assert!(lost(&r, completed), "{r:?}");
    assert_eq!(raw(&store, &key).await.0, before.0);

    // An empty result replays too.
    let key = ns.key("complete-empty").unwrap();
    let lease = acquired(&store, &AcquireRequest::new(key.clone(), "w")).await;
    store.complete(&lease, Bytes::new(), HOUR).await.unwrap();
    store.complete(&lease, Bytes::new(), HOUR).await.unwrap();
    let r = store.complete(&lease, Bytes::from_static(b"x"), HOUR).await;
    assert!(lost(&r, completed), "{r:?}");

    // fail: the same error and kind replays; another error or kind does not.
    for kind in FailureKind::ALL {
        let key = ns.key(format!("fail-{kind}")).unwrap();
        let lease = acquired(&store, &AcquireRequest::new(key.clone(), "w")).await;
        store.fail(&lease, "boom", kind, HOUR).await.unwrap();
        let before = raw(&store, &key).await.0;
        store.fail(&lease, "boom", kind, HOUR).await.unwrap();
        let failed = not_in(StateKind::Failed(kind));
        for other in FailureKind::ALL.into_iter().filter(|k| *k != kind) {
            let r = store.fail(&lease, "boom", other, HOUR).await;
            assert!(lost(&r, failed), "{kind} then {other}: {r:?}");
        }
        let r = store.fail(&lease, "bang", kind, HOUR).await;
        assert!(lost(&r, failed), "{r:?}");
        let r = store.fail(&lease, "boom ", kind, HOUR).await;
        assert!(lost(&r, failed), "{r:?}");
        let r = store
            .complete(&lease, Bytes::from_static(b"boom"), HOUR)
            .await;
        assert!(lost(&r, failed), "{r:?}");
        let r = store.release(&lease).await;
        assert!(lost(&r, failed), "{r:?}");
        assert_eq!(raw(&store, &key).await.0, before);
    }

    // release: twice is Ok, and the attempt is given back once only.
    let key = ns.key("release").unwrap();
    let lease = acquired(&store, &AcquireRequest::new(key.clone(), "w")).await;
    store.release(&lease).await.unwrap();
    let before = raw(&store, &key).await.0;
    store.release(&lease).await.unwrap();
    assert_eq!(raw(&store, &key).await.0, before);
    let r = store.complete(&lease, Bytes::new(), HOUR).await;
    assert!(lost(&r, not_in(StateKind::Released)), "{r:?}");
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Released);
    assert_eq!(record.attempts, 0);

    // Once a newer lease exists, the old one is fenced off whatever it replays.
    let key = ns.key("superseded").unwrap();
    let req = AcquireRequest::new(key.clone(), "w");
    let first = acquired(&store, &req).await;
    store.release(&first).await.unwrap();
    let second = acquired(&store, &req).await;
    let r = store.release(&first).await;
    assert!(
        lost(
            &r,
            LostLease::Superseded {
                current: second.token
            }
        ),
        "{r:?}"
    );
}

/// `delete` leaves a tombstone holding only the token, honoured by every script.
async fn delete_leaves_a_tombstone(store: RedisStore) {
    let ns = ns();
    let key = ns.key("order-1").unwrap();
    let req = AcquireRequest::new(key.clone(), "w").with_max_attempts(1);
    let first = acquired(&store, &req).await;
    store
        .complete(&first, Bytes::from_static(b"ok"), HOUR)
        .await
        .unwrap();
    assert!(store.delete(&key).await.unwrap());

    let (tombstone, pttl) = raw(&store, &key).await;
    let mut expected = vec![128 + 7];
    expected.extend_from_slice(&first.token.get().to_be_bytes());
    assert_eq!(tombstone, expected, "the tombstone head, then the token");
    let week = 7 * 24 * 3600 * 1000;
    assert!(pttl > week - 60_000 && pttl <= week, "{pttl}");

    assert!(store.get(&key).await.unwrap().is_none());
    assert!(
        !store.delete(&key).await.unwrap(),
        "a tombstone is no record"
    );
    assert_eq!(
        raw(&store, &key).await.0,
        tombstone,
        "deleting it again keeps it"
    );
    for r in [
        store
            .complete(&first, Bytes::from_static(b"ok"), HOUR)
            .await,
        store.fail(&first, "x", FailureKind::Retryable, HOUR).await,
        store.release(&first).await,
        store.extend(&first, HOUR).await.map(drop),
    ] {
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
    }
    assert!(store.get(&key).await.unwrap().is_none());

    // A fresh record: attempt 1 (max_attempts 1 is no obstacle), a higher token, no expiry.
    let second = match store.acquire(&req).await {
        Ok(AcquireOutcome::Acquired { lease, takeover }) => {
            assert!(!takeover);
            lease
        }
        other => panic!("expected a fresh acquisition, got {other:?}"),
    };
    assert_eq!(second.attempt, 1);
    assert!(second.token > first.token, "{second:?} after {first:?}");
    let (value, pttl) = raw(&store, &key).await;
    assert_eq!(pttl, -1);
    assert_eq!(value[0] & 7, 0, "in progress: {value:?}");
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::InProgress);
    assert_eq!(record.attempts, 1);
    assert_eq!(record.token, second.token);

    // Deleting a record in progress leaves its token too.
    assert!(store.delete(&key).await.unwrap());
    let third = acquired(&store, &req).await;
    assert!(third.token > second.token);
    assert_eq!(third.attempt, 1);
}

mod standalone {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replayed_transitions_succeed() {
        let Some(store) = common::standalone().await else {
            return;
        };
        super::replayed_transitions_succeed(store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn delete_leaves_a_tombstone() {
        let Some(store) = common::standalone().await else {
            return;
        };
        super::delete_leaves_a_tombstone(store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lifecycle() {
        let Some(store) = common::standalone().await else {
            return;
        };
        super::lifecycle(store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_input_sends_nothing() {
        let Some(store) = common::standalone().await else {
            return;
        };
        super::bad_input_sends_nothing(store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hostile_keys() {
        let Some(store) = common::standalone().await else {
            return;
        };
        super::hostile_keys(store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn names_itself() {
        let Some(store) = common::standalone().await else {
            return;
        };
        super::names_itself(store, "redis").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unreachable_is_unavailable_quickly() {
        super::unreachable_is_unavailable_quickly(common::unreachable(), "redis").await;
    }

    /// A URL naming another kind of server (here one that answers like an HTTP server) is a
    /// `Backend` error that says so, not the driver's bare "Incompatible type - Parse error".
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_that_is_not_redis_is_named_as_such() {
        super::a_server_that_is_not_redis_is_named_as_such(|addr| async move {
            RedisStore::connect(&format!("redis://{addr}")).await
        })
        .await;
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

/// A server at `addr` that answers every request like an HTTP server; `connect` opens the
/// store there. Whichever call first reads a reply meets it: a `Backend` error naming the
/// protocol, not an outage (retrying cannot help).
async fn a_server_that_is_not_redis_is_named_as_such<F, Fut>(connect: F)
where
    F: FnOnce(std::net::SocketAddr) -> Fut,
    Fut: std::future::Future<Output = idem_core::Result<RedisStore>>,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = socket.read(&mut buf).await;
                let _ = socket
                    .write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                    .await;
            });
        }
    });
    let r = match connect(addr).await {
        Ok(store) => store.get(&ns().key("k").unwrap()).await.map(drop),
        Err(e) => Err(e),
    };
    match r {
        Err(e @ Error::Backend { .. }) => {
            let text = e.to_string();
            assert!(text.contains("not the Redis protocol"), "{text}");
        }
        other => panic!("expected Backend, got {other:?}"),
    }
}

mod cluster {
    use super::*;
    use common::slots::{Migration, masters};

    /// As on one server: a node list naming another kind of server is a `Backend` error.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_that_is_not_redis_is_named_as_such() {
        super::a_server_that_is_not_redis_is_named_as_such(|addr| async move {
            RedisStore::connect_cluster([format!("redis://{addr}")]).await
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replayed_transitions_succeed() {
        let Some(store) = common::cluster().await else {
            return;
        };
        super::replayed_transitions_succeed(store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn delete_leaves_a_tombstone() {
        let Some(store) = common::cluster().await else {
            return;
        };
        super::delete_leaves_a_tombstone(store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lifecycle() {
        let Some(store) = common::cluster().await else {
            return;
        };
        super::lifecycle(store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bad_input_sends_nothing() {
        let Some(store) = common::cluster().await else {
            return;
        };
        super::bad_input_sends_nothing(store).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hostile_keys() {
        let Some(store) = common::cluster().await else {
            return;
        };
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

    /// A standalone connection to a cluster node would see one node's slots only (a listing
    /// would silently miss the others' records): connecting refuses it as a wrong address.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_standalone_connection_to_a_cluster_node_is_refused() {
        if common::cluster().await.is_none() {
            return;
        }
        for node in common::cluster_nodes() {
            match RedisStore::connect(&node).await {
                Err(idem_core::Error::InvalidInput { field, reason }) => {
                    assert_eq!(field, "url");
                    assert!(reason.contains("cluster_enabled:1"), "{reason}");
                    assert!(reason.contains("connect_cluster"), "{reason}");
                }
                other => panic!("{node}: expected a refused url, got {other:?}"),
            }
        }
    }

    /// The other way round: a cluster connection to a single server (cluster support disabled)
    /// is a wrong address too, saying how to connect.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cluster_connection_to_a_single_server_is_refused() {
        if common::standalone().await.is_none() {
            return;
        }
        match RedisStore::connect_cluster([common::url()]).await {
            Err(idem_core::Error::InvalidInput { field, reason }) => {
                assert_eq!(field, "url");
                assert!(reason.contains("cluster support disabled"), "{reason}");
                assert!(reason.contains("RedisStore::connect "), "{reason}");
            }
            other => panic!("expected a refused url, got {other:?}"),
        }
    }

    /// A wrong password is the same answer as on one server: a backend error (no outage to
    /// wait out), not `Unavailable`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wrong_password_is_a_backend_error() {
        if common::cluster().await.is_none() {
            return;
        }
        let nodes: Vec<String> = common::cluster_nodes()
            .iter()
            .map(|n| n.replacen("redis://", "redis://:wrong-password@", 1))
            .collect();
        let r = RedisStore::connect_cluster(&nodes).await;
        assert!(
            matches!(r, Err(idem_core::Error::Backend { .. })),
            "{:?}",
            r.err()
        );
        let single = common::cluster_nodes()[0].replacen("redis://", "redis://:wrong-password@", 1);
        let r = RedisStore::connect(&single).await;
        assert!(
            matches!(r, Err(idem_core::Error::Backend { .. })),
            "{:?}",
            r.err()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn names_itself() {
        let Some(store) = common::cluster().await else {
            return;
        };
        super::names_itself(store, "redis-cluster").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unreachable_is_unavailable_quickly() {
        super::unreachable_is_unavailable_quickly(common::unreachable_cluster(), "redis-cluster")
            .await;
    }

    /// The driver retries nothing (a re-sent script may run twice); the store follows ASK and
    /// MOVED itself, so a slot being migrated or already moved is still served.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redirections_are_followed() {
        let Some(store) = common::cluster().await else {
            return;
        };
        let ns = ns();
        let key = ns.key("moving").unwrap();
        let storage_key = store.storage_key(&key);
        let req = AcquireRequest::new(key.clone(), "w");
        assert!(store.get(&key).await.unwrap().is_none());

        let mut masters = masters().await;
        let moving = Migration::of(&mut masters, &storage_key).await;
        let neighbour = moving.add_neighbour(&mut masters, &storage_key).await;

        // ASK: the slot is migrating and the key is not on its owner.
        moving.begin(&mut masters).await;
        let asked = store.acquire(&req).await;
        let asked_get = store.get(&key).await;

        // MOVED: the migration finishes; the store's slot map is stale.
        moving.finish(&mut masters).await;
        let moved_get = store.get(&key).await;
        let moved_release = match &asked {
            Ok(AcquireOutcome::Acquired { lease, .. }) => Some(store.release(lease).await),
            _ => None,
        };

        // Put everything back before asserting.
        moving.undo(&mut masters, &storage_key).await;
        let neighbour_back: Option<String> = redis::cmd("GET")
            .arg(&neighbour)
            .query_async(&mut masters[moving.from].1)
            .await
            .unwrap();

        assert_eq!(
            neighbour_back.as_deref(),
            Some("kept"),
            "moved there and back"
        );
        assert!(
            matches!(asked, Ok(AcquireOutcome::Acquired { .. })),
            "{asked:?}"
        );
        let record = asked_get
            .unwrap()
            .expect("the record on the importing node");
        assert_eq!(record.state, RecordState::InProgress);
        let record = moved_get.unwrap().expect("the record on the new owner");
        assert_eq!(record.state, RecordState::InProgress);
        moved_release.unwrap().unwrap();
    }
}
