//! `complete_with` on a standalone server and on a cluster, beyond C25: one `EVALSHA` per call,
//! every command of the set applied as documented, bad input refused before sending, failing
//! conditions and writes that could fail half-way refused with nothing written, the record
//! still in progress and completable afterwards, zombies writing nothing.

mod common;

use std::time::Duration;

use common::Admin;
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Error, IdempotencyKey, IdempotencyStore, Lease,
    LostLease, Namespace, RecordState, StateKind, TransactionalStore,
};
use idem_redis::{MAX_WRITES, RedisConfig, RedisStore, RedisWrites};

const HOUR: Duration = Duration::from_secs(3600);

fn key(id: &str) -> IdempotencyKey {
    Namespace::new(format!("tx-{}", uuid::Uuid::new_v4().simple()))
        .unwrap()
        .key(id)
        .unwrap()
}

async fn acquired(store: &RedisStore, key: &IdempotencyKey, ttl: Duration) -> Lease {
    let req = AcquireRequest::new(key.clone(), "w1").with_lease_ttl(ttl);
    match store.acquire(&req).await {
        Ok(AcquireOutcome::Acquired { lease, .. }) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

async fn state(store: &RedisStore, key: &IdempotencyKey) -> RecordState {
    store.get(key).await.unwrap().expect("the record").state
}

/// Asserts that `lease` still holds its record in progress and can complete it with writes.
async fn still_completable(store: &RedisStore, admin: &mut Admin, lease: &Lease) {
    assert_eq!(state(store, &lease.key).await, RecordState::InProgress);
    let done = store.effect_key(&lease.key, ":done").unwrap();
    store
        .complete_with(
            lease,
            Bytes::from_static(b"ok"),
            HOUR,
            RedisWrites::new().set(done.as_str(), "yes"),
        )
        .await
        .expect("the lease still completes after a refusal");
    assert_eq!(admin.get(&done).await.as_deref(), Some(&b"yes"[..]));
    assert_eq!(
        state(store, &lease.key).await,
        RecordState::Completed {
            result: Bytes::from_static(b"ok")
        }
    );
}

/// One `EVALSHA` per transactional completion, whatever its outcome; nothing sent for bad
/// input.
async fn one_request_per_completion(store: RedisStore) {
    let k = key("count");
    let lease = acquired(&store, &k, HOUR).await;
    let a = store.effect_key(&k, ":a").unwrap();
    let writes = RedisWrites::new()
        .set(a.as_str(), "1")
        .incr_by(store.effect_key(&k, ":n").unwrap(), 2)
        .rpush(store.effect_key(&k, ":l").unwrap(), "x");

    let sent = |before: u64| store.requests_sent() - before;
    let before = store.requests_sent();
    let r = store
        .complete_with(
            &lease,
            Bytes::new(),
            HOUR,
            RedisWrites::new().require_eq(a.as_str(), "0"),
        )
        .await;
    assert!(
        matches!(r, Err(Error::EffectRefused { index: 0, .. })),
        "{r:?}"
    );
    assert_eq!(sent(before), 1, "a refused completion is one request");

    let before = store.requests_sent();
    let too_many = (0..=MAX_WRITES).fold(RedisWrites::new(), |w, i| {
        w.del(store.effect_key(&k, &format!(":{i}")).unwrap())
    });
    let r = store
        .complete_with(&lease, Bytes::new(), HOUR, too_many)
        .await;
    assert!(
        matches!(
            r,
            Err(Error::InvalidInput {
                field: "writes",
                ..
            })
        ),
        "{r:?}"
    );
    assert_eq!(sent(before), 0, "bad input sends nothing");

    let before = store.requests_sent();
    store
        .complete_with(&lease, Bytes::new(), HOUR, writes.clone())
        .await
        .unwrap();
    assert_eq!(sent(before), 1, "a transactional completion is one EVALSHA");

    let before = store.requests_sent();
    store
        .complete_with(&lease, Bytes::new(), HOUR, writes)
        .await
        .unwrap();
    assert_eq!(sent(before), 1, "a replayed completion is one EVALSHA");
}

/// Every command of the set, applied in order, as its Redis command would.
async fn every_command_applies(store: RedisStore) {
    let k = key("all");
    let lease = acquired(&store, &k, HOUR).await;
    let at = |suffix: &str| store.effect_key(&k, suffix).unwrap();
    let mut admin = Admin::of(&store).await;
    // State before: a counter, a hash, a key to delete, a key to expire.
    admin
        .query::<()>(redis::cmd("SET").arg(at(":n")).arg("40"))
        .await;
    admin
        .query::<()>(
            redis::cmd("HSET")
                .arg(at(":h"))
                .arg("hits")
                .arg("-3")
                .arg("old")
                .arg("x"),
        )
        .await;
    admin
        .query::<()>(redis::cmd("SET").arg(at(":gone")).arg("x"))
        .await;
    admin
        .query::<()>(redis::cmd("SET").arg(at(":ttl")).arg("x"))
        .await;
    admin
        .query::<()>(redis::cmd("SET").arg(at(":cond")).arg("v1"))
        .await;

    let writes = RedisWrites::new()
        .require_eq(at(":cond"), "v1")
        .require_absent(at(":nothing"))
        .set(at(":s"), "plain")
        .set_expiring(at(":se"), "expiring", Duration::from_secs(100))
        .set_if_absent(at(":snx"), "first")
        .set_if_absent_expiring(at(":snxe"), "first", Duration::from_secs(200))
        .incr_by(at(":n"), 5)
        .decr_by(at(":n"), 3)
        .set(at(":m"), "7")
        .incr_by(at(":m"), 1)
        .del(at(":gone"))
        .expire(at(":ttl"), Duration::from_secs(300))
        .hset(at(":h"), "name", "alice")
        .hdel(at(":h"), "old")
        .hincr_by(at(":h"), "hits", 4)
        .hincr_by(at(":h"), "new", 2)
        .lpush(at(":l"), "b")
        .lpush(at(":l"), "a")
        .rpush(at(":l"), "c")
        .sadd(at(":set"), "x")
        .sadd(at(":set"), "y")
        .srem(at(":set"), "x")
        .zadd(at(":z"), 1.5, "m")
        .zincr_by(at(":z"), 2.25, "m")
        .zadd(at(":z"), f64::INFINITY, "top")
        .zadd(at(":z"), 0.0, "gone")
        .zrem(at(":z"), "gone")
        .xadd(at(":x"), [("kind", "charged"), ("cents", "1250")])
        .xadd(at(":x"), [("kind", &b"\xffbinary\0"[..])]);
    store
        .complete_with(&lease, Bytes::from_static(b"done"), HOUR, writes)
        .await
        .unwrap();

    assert_eq!(admin.get(&at(":s")).await.as_deref(), Some(&b"plain"[..]));
    assert_eq!(
        admin.get(&at(":se")).await.as_deref(),
        Some(&b"expiring"[..])
    );
    let se = admin.pttl(&at(":se")).await;
    assert!((99_000..=100_000).contains(&se), "{se}");
    assert_eq!(admin.pttl(&at(":s")).await, -1);
    assert_eq!(admin.get(&at(":snx")).await.as_deref(), Some(&b"first"[..]));
    let snxe = admin.pttl(&at(":snxe")).await;
    assert!((199_000..=200_000).contains(&snxe), "{snxe}");
    assert_eq!(admin.get(&at(":n")).await.as_deref(), Some(&b"42"[..]));
    assert_eq!(admin.get(&at(":m")).await.as_deref(), Some(&b"8"[..]));
    assert!(!admin.exists(&at(":gone")).await);
    let ttl = admin.pttl(&at(":ttl")).await;
    assert!((299_000..=300_000).contains(&ttl), "{ttl}");
    let mut hash: Vec<(String, String)> = admin.query(redis::cmd("HGETALL").arg(at(":h"))).await;
    hash.sort();
    assert_eq!(
        hash,
        [("hits", "1"), ("name", "alice"), ("new", "2")].map(|(f, v)| (f.into(), v.into()))
    );
    let list: Vec<String> = admin
        .query(redis::cmd("LRANGE").arg(at(":l")).arg(0).arg(-1))
        .await;
    assert_eq!(list, ["a", "b", "c"]);
    let set: Vec<String> = admin.query(redis::cmd("SMEMBERS").arg(at(":set"))).await;
    assert_eq!(set, ["y"]);
    let z: Vec<(String, String)> = admin
        .query(
            redis::cmd("ZRANGE")
                .arg(at(":z"))
                .arg(0)
                .arg(-1)
                .arg("WITHSCORES"),
        )
        .await;
    assert_eq!(
        z,
        [("m", "3.75"), ("top", "inf")].map(|(m, s)| (m.into(), s.into()))
    );
    let entries: Vec<(String, Vec<Vec<u8>>)> = admin
        .query(redis::cmd("XRANGE").arg(at(":x")).arg("-").arg("+"))
        .await;
    let fields: Vec<_> = entries.into_iter().map(|(_, f)| f).collect();
    assert_eq!(
        fields,
        [
            vec![
                b"kind".to_vec(),
                b"charged".to_vec(),
                b"cents".to_vec(),
                b"1250".to_vec()
            ],
            vec![b"kind".to_vec(), b"\xffbinary\0".to_vec()],
        ]
    );
    assert_eq!(
        state(&store, &k).await,
        RecordState::Completed {
            result: Bytes::from_static(b"done")
        }
    );
}

/// Writes refused before sending: too many, a key outside the record's slot (cluster), the
/// record's own key, an expiry out of range. Nothing written, the record in progress.
async fn bad_input_writes_nothing(store: RedisStore) {
    let k = key("bad");
    let lease = acquired(&store, &k, HOUR).await;
    let mut admin = Admin::of(&store).await;
    let first = store.effect_key(&k, ":first").unwrap();
    let before = store.requests_sent();

    let too_many = (0..MAX_WRITES).fold(RedisWrites::new().set(first.as_str(), "x"), |w, i| {
        w.set(store.effect_key(&k, &format!(":{i}")).unwrap(), "x")
    });
    assert_eq!(too_many.len(), MAX_WRITES + 1);
    let mut cases = vec![
        ("too many writes", too_many),
        (
            "the record's own key",
            RedisWrites::new()
                .set(first.as_str(), "x")
                .set(store.storage_key(&k), "overwritten"),
        ),
        (
            "an expiry of 0",
            RedisWrites::new()
                .set(first.as_str(), "x")
                .expire(first.as_str(), Duration::ZERO),
        ),
    ];
    // A key that hashes elsewhere: on a cluster it is refused, on one server it is fine.
    let elsewhere = format!("elsewhere-{}", uuid::Uuid::new_v4().simple());
    let outside = RedisWrites::new()
        .set(first.as_str(), "x")
        .set(elsewhere.as_str(), "x");
    if store.is_cluster() {
        cases.push(("a key outside the record's slot", outside.clone()));
    }
    for (what, writes) in cases {
        let r = store
            .complete_with(&lease, Bytes::new(), HOUR, writes)
            .await;
        assert!(
            matches!(
                &r,
                Err(Error::InvalidInput {
                    field: "writes",
                    ..
                })
            ),
            "{what}: {r:?}"
        );
    }
    assert_eq!(store.requests_sent(), before, "bad input sends nothing");
    assert!(!admin.exists(&first).await, "nothing written");
    assert!(!admin.exists(&elsewhere).await, "nothing written");
    if store.is_cluster() {
        still_completable(&store, &mut admin, &lease).await;
    } else {
        // Standalone has no slot limit.
        assert_eq!(state(&store, &k).await, RecordState::InProgress);
        store
            .complete_with(&lease, Bytes::new(), HOUR, outside)
            .await
            .unwrap();
        assert!(admin.exists(&elsewhere).await);
        let _: i64 = admin.query(redis::cmd("DEL").arg(&elsewhere)).await;
    }
}

/// A failed condition, or a write that would fail in the middle of the script (WRONGTYPE, a
/// counter that is not an integer or would overflow, a NaN score), refuses the whole
/// completion with its index before anything is written.
async fn refusals_write_nothing(store: RedisStore) {
    let k = key("refused");
    let lease = acquired(&store, &k, HOUR).await;
    let at = |suffix: &str| store.effect_key(&k, suffix).unwrap();
    let mut admin = Admin::of(&store).await;
    admin
        .query::<()>(redis::cmd("SET").arg(at(":text")).arg("abc"))
        .await;
    admin
        .query::<()>(redis::cmd("SET").arg(at(":max")).arg(i64::MAX))
        .await;
    admin
        .query::<()>(redis::cmd("SET").arg(at(":min")).arg(i64::MIN))
        .await;
    admin
        .query::<()>(redis::cmd("SET").arg(at(":zero")).arg("007"))
        .await;
    admin
        .query::<()>(redis::cmd("RPUSH").arg(at(":list")).arg("a"))
        .await;
    admin
        .query::<()>(redis::cmd("HSET").arg(at(":hash")).arg("f").arg("1.5"))
        .await;
    admin
        .query::<()>(redis::cmd("ZADD").arg(at(":z")).arg("inf").arg("m"))
        .await;
    admin
        .query::<()>(redis::cmd("SET").arg(at(":cond")).arg("v1"))
        .await;
    // Streams whose last ID is the largest there is, and the one before it.
    let max_id = format!("{0}-{0}", u64::MAX);
    let one_left = format!("{}-{}", u64::MAX, u64::MAX - 1);
    for (suffix, id) in [(":spent", &max_id), (":one-left", &one_left)] {
        admin
            .query::<String>(redis::cmd("XADD").arg(at(suffix)).arg(id).arg("f").arg("v"))
            .await;
    }

    let first = at(":first");
    // Each list starts with writes that would apply (and must not), then the one refused.
    let lead = || {
        RedisWrites::new()
            .set(first.as_str(), "written")
            .incr_by(at(":counter"), 1)
            .rpush(at(":log"), "entry")
    };
    let cases: Vec<(&str, RedisWrites, &str)> = vec![
        (
            "require_eq, other value",
            lead().require_eq(at(":cond"), "v2"),
            "another value",
        ),
        (
            "require_eq, absent",
            lead().require_eq(at(":none"), "v1"),
            "does not exist",
        ),
        (
            "require_eq, a list",
            lead().require_eq(at(":list"), "a"),
            "holds a list",
        ),
        (
            "require_absent",
            lead().require_absent(at(":cond")),
            "exists",
        ),
        (
            "set_if_absent",
            lead().set_if_absent(at(":cond"), "x"),
            "exists",
        ),
        (
            "hset on a list",
            lead().hset(at(":list"), "f", "v"),
            "WRONGTYPE",
        ),
        (
            "rpush on a string",
            lead().rpush(at(":text"), "v"),
            "WRONGTYPE",
        ),
        ("sadd on a hash", lead().sadd(at(":hash"), "m"), "WRONGTYPE"),
        (
            "zadd on a list",
            lead().zadd(at(":list"), 1.0, "m"),
            "WRONGTYPE",
        ),
        (
            "xadd on a string",
            lead().xadd(at(":text"), [("f", "v")]),
            "WRONGTYPE",
        ),
        (
            "incr_by on a list",
            lead().incr_by(at(":list"), 1),
            "WRONGTYPE",
        ),
        (
            "incr_by on text",
            lead().incr_by(at(":text"), 1),
            "not an integer",
        ),
        (
            "incr_by on 007",
            lead().incr_by(at(":zero"), 1),
            "not an integer",
        ),
        (
            "incr_by overflow",
            lead().incr_by(at(":max"), 1),
            "overflow",
        ),
        (
            "decr_by overflow",
            lead().decr_by(at(":min"), 1),
            "overflow",
        ),
        (
            "incr_by overflow after a set",
            lead()
                .set(at(":fresh"), i64::MAX.to_string())
                .incr_by(at(":fresh"), 1),
            "overflow",
        ),
        (
            "incr_by on a key an earlier write made a list",
            lead().rpush(at(":fresh"), "x").incr_by(at(":fresh"), 1),
            "WRONGTYPE",
        ),
        (
            "hincr_by on 1.5",
            lead().hincr_by(at(":hash"), "f", 1),
            "not an integer",
        ),
        (
            "hincr_by overflow",
            lead()
                .hincr_by(at(":h2"), "f", i64::MAX)
                .hincr_by(at(":h2"), "f", 1),
            "overflow",
        ),
        (
            "zincr_by to NaN",
            lead().zincr_by(at(":z"), f64::NEG_INFINITY, "m"),
            "NaN",
        ),
        (
            "xadd on a stream whose IDs are exhausted",
            lead().xadd(at(":spent"), [("f", "v2")]),
            "exhausted",
        ),
        (
            "a second xadd on a stream with one ID left",
            lead()
                .xadd(at(":one-left"), [("f", "v2")])
                .xadd(at(":one-left"), [("f", "v3")]),
            "exhausted",
        ),
    ];
    for (what, writes, reason_has) in cases {
        let before = store.requests_sent();
        let last = writes.len() - 1;
        let r = store
            .complete_with(&lease, Bytes::from_static(b"x"), HOUR, writes)
            .await;
        match &r {
            Err(Error::EffectRefused {
                index: i, reason, ..
            }) => {
                assert_eq!(*i, last, "{what}: the refused write's index");
                assert!(reason.contains(reason_has), "{what}: {reason:?}");
            }
            other => panic!("{what}: expected EffectRefused, got {other:?}"),
        }
        assert_eq!(store.requests_sent() - before, 1, "{what}");
        for (key, holds) in [(&first, None), (&at(":counter"), None)] {
            assert_eq!(
                admin.get(key).await,
                holds,
                "{what}: nothing written at {key}"
            );
        }
        for key in [at(":log"), at(":fresh"), at(":h2")] {
            assert!(
                !admin.exists(&key).await,
                "{what}: nothing written at {key}"
            );
        }
        assert_eq!(admin.get(&at(":text")).await.as_deref(), Some(&b"abc"[..]));
    }
    let max: String = admin.query(redis::cmd("GET").arg(at(":max"))).await;
    assert_eq!(max, i64::MAX.to_string());
    for suffix in [":spent", ":one-left"] {
        let len: u64 = admin.query(redis::cmd("XLEN").arg(at(suffix))).await;
        assert_eq!(len, 1, "nothing added to {suffix}");
    }
    still_completable(&store, &mut admin, &lease).await;
}

/// Counters at the edges of 64 bits apply exactly (the script checks them with exact
/// arithmetic, not with Lua's doubles).
async fn counters_at_the_edges_apply(store: RedisStore) {
    let k = key("edges");
    let lease = acquired(&store, &k, HOUR).await;
    let at = |suffix: &str| store.effect_key(&k, suffix).unwrap();
    let mut admin = Admin::of(&store).await;
    admin
        .query::<()>(redis::cmd("SET").arg(at(":a")).arg(i64::MAX - 1))
        .await;
    admin
        .query::<()>(redis::cmd("SET").arg(at(":b")).arg(i64::MIN + 5))
        .await;
    // A stream with one entry ID left takes exactly one more entry.
    admin
        .query::<String>(
            redis::cmd("XADD")
                .arg(at(":s"))
                .arg(format!("{}-{}", u64::MAX, u64::MAX - 1))
                .arg("f")
                .arg("v"),
        )
        .await;
    let writes = RedisWrites::new()
        .xadd(at(":s"), [("f", "last")])
        .incr_by(at(":a"), 1)
        .decr_by(at(":b"), 5)
        .incr_by(at(":c"), 9_007_199_254_740_993) // 2^53 + 1: not a double
        .incr_by(at(":c"), -1)
        .hincr_by(at(":h"), "f", i64::MIN)
        .hincr_by(at(":h"), "f", i64::MAX);
    store
        .complete_with(&lease, Bytes::new(), HOUR, writes)
        .await
        .unwrap();
    assert_eq!(
        admin.get(&at(":a")).await,
        Some(i64::MAX.to_string().into_bytes())
    );
    assert_eq!(
        admin.get(&at(":b")).await,
        Some(i64::MIN.to_string().into_bytes())
    );
    assert_eq!(
        admin.get(&at(":c")).await,
        Some(b"9007199254740992".to_vec())
    );
    let f: String = admin.query(redis::cmd("HGET").arg(at(":h")).arg("f")).await;
    assert_eq!(f, "-1");
    let len: u64 = admin.query(redis::cmd("XLEN").arg(at(":s"))).await;
    assert_eq!(len, 2, "the last ID was taken");
}

/// A worker whose lease was taken over writes nothing; a finished lease neither.
async fn zombies_write_nothing(store: RedisStore) {
    let k = key("zombie");
    let mut admin = Admin::of(&store).await;
    let effect = store.effect_key(&k, ":effect").unwrap();
    let zombie = acquired(&store, &k, Duration::from_millis(50)).await;
    tokio::time::sleep(Duration::from_millis(80)).await;
    let holder = acquired(&store, &k, HOUR).await;
    let writes = || {
        RedisWrites::new()
            .set(effect.as_str(), "zombie")
            .incr_by(format!("{effect}:n"), 1)
    };
    let r = store
        .complete_with(&zombie, Bytes::from_static(b"z"), HOUR, writes())
        .await;
    assert!(
        matches!(&r, Err(Error::LeaseLost { why: LostLease::Superseded { current }, .. }) if *current == holder.token),
        "{r:?}"
    );
    assert!(!admin.exists(&effect).await && !admin.exists(&format!("{effect}:n")).await);

    store
        .complete(&holder, Bytes::from_static(b"h"), HOUR)
        .await
        .unwrap();
    // The holder's own lease, finished another way (other bytes): refused, nothing written.
    let r = store
        .complete_with(&holder, Bytes::from_static(b"other"), HOUR, writes())
        .await;
    assert!(
        matches!(
            &r,
            Err(Error::LeaseLost {
                why: LostLease::NotInProgress {
                    state: StateKind::Completed
                },
                ..
            })
        ),
        "{r:?}"
    );
    // A replay of what `complete` stored answers Ok and writes nothing.
    store
        .complete_with(&holder, Bytes::from_static(b"h"), HOUR, writes())
        .await
        .unwrap();
    assert!(!admin.exists(&effect).await && !admin.exists(&format!("{effect}:n")).await);
    // Deleted: gone.
    store.delete(&k).await.unwrap();
    let r = store
        .complete_with(&holder, Bytes::from_static(b"h"), HOUR, writes())
        .await;
    assert!(
        matches!(
            &r,
            Err(Error::LeaseLost {
                why: LostLease::Gone,
                ..
            })
        ),
        "{r:?}"
    );
    assert!(!admin.exists(&effect).await);
}

/// Ids sharing a hash tag share data across messages, also on a cluster: two messages of
/// `{alice}` add to one balance.
async fn shared_tags_share_data(store: RedisStore) {
    let ns = Namespace::new(format!("tx-{}", uuid::Uuid::new_v4().simple())).unwrap();
    let user = format!("u{}", uuid::Uuid::new_v4().simple());
    let mut admin = Admin::of(&store).await;
    let mut balance = None;
    for (msg, cents) in [("m1", 100), ("m2", 250)] {
        let k = ns.key(format!("{{{user}}}:{msg}")).unwrap();
        assert_eq!(store.hash_tag(&k).unwrap(), format!("{{{user}}}"));
        let key = store.effect_key(&k, ":balance").unwrap();
        assert_eq!(key, format!("{{{user}}}:balance"));
        let lease = acquired(&store, &k, HOUR).await;
        store
            .complete_with(
                &lease,
                Bytes::new(),
                HOUR,
                RedisWrites::new().incr_by(key.as_str(), cents),
            )
            .await
            .unwrap();
        balance = Some(key);
    }
    let balance = balance.unwrap();
    assert_eq!(admin.get(&balance).await.as_deref(), Some(&b"350"[..]));
    // An id whose storage key has no tag and holds `}`: no tag can name its slot.
    let r = store.effect_key(&ns.key("a}b").unwrap(), ":x");
    assert!(
        matches!(r, Err(Error::InvalidInput { field: "key", .. })),
        "{r:?}"
    );
}

/// A Redis user of the standalone server, removed (`ACL DELUSER`) when dropped, so also when the
/// test fails.
struct AclUser {
    name: String,
    password: String,
}

impl AclUser {
    /// Creates the user with `rules` (after `on` and its password).
    async fn create(admin: &mut Admin, rules: &[&str]) -> Self {
        let user = Self {
            name: format!("idem-test-{}", uuid::Uuid::new_v4().simple()),
            password: uuid::Uuid::new_v4().simple().to_string(),
        };
        let password = format!(">{}", user.password);
        user.set(admin, &["on", &password]).await;
        user.set(admin, rules).await;
        user
    }

    /// `ACL SETUSER name rules...`.
    async fn set(&self, admin: &mut Admin, rules: &[&str]) {
        admin
            .query::<()>(redis::cmd("ACL").arg("SETUSER").arg(&self.name).arg(rules))
            .await;
    }

    /// `url` (the tests' server) logging in as this user.
    fn url(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").expect("a redis:// URL");
        // Any user the URL names is replaced.
        let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
        format!("{scheme}://{}:{}@{host}", self.name, self.password)
    }
}

impl Drop for AclUser {
    fn drop(&mut self) {
        // Drop cannot await: a blocking connection of its own.
        let deleted = redis::Client::open(common::url())
            .and_then(|client| client.get_connection_with_timeout(Duration::from_secs(5)))
            .and_then(|mut c| {
                redis::cmd("ACL")
                    .arg("DELUSER")
                    .arg(&self.name)
                    .query::<i64>(&mut c)
            });
        if let Err(e) = deleted {
            eprintln!("the ACL user {} is left on the server: {e}", self.name);
        }
    }
}

/// `XLEN key` (0 when there is no key).
async fn xlen(admin: &mut Admin, key: &str) -> u64 {
    admin.query(redis::cmd("XLEN").arg(key)).await
}

/// Redis checks ACLs command by command and does not roll a script back: a user denied `XADD`
/// had `incr_by + xadd` apply the `INCRBY`, then fail, the record left in progress, and every
/// redelivery applied the `INCRBY` again. The script checks every write's command first: the
/// call is a `Backend` error naming the command, nothing is written, and once the ACL allows it
/// the same lease completes, applying every write once.
#[tokio::test]
async fn a_write_the_acl_denies_writes_nothing() {
    let Some(store) = common::standalone().await else {
        return;
    };
    let mut admin = Admin::of(&store).await;
    let user = AclUser::create(&mut admin, &["~*", "&*", "+@all", "-xadd"]).await;
    // The same prefix as `store`: the same records.
    let denied = RedisStore::connect_with(&user.url(&common::url()), store.config().clone())
        .await
        .expect("a store logged in as the restricted user");

    let k = key("acl");
    let lease = acquired(&denied, &k, HOUR).await;
    let balance = denied.effect_key(&k, ":balance").unwrap();
    let events = denied.effect_key(&k, ":events").unwrap();
    let writes = RedisWrites::new()
        .incr_by(balance.as_str(), 1250)
        .xadd(events.as_str(), [("kind", "charged")]);

    // The delivery, then a redelivery: each refused, neither writing anything.
    for attempt in 1..=2 {
        let r = denied
            .complete_with(&lease, Bytes::from_static(b"r"), HOUR, writes.clone())
            .await;
        let applied = admin.get(&balance).await;
        assert_eq!(applied, None, "attempt {attempt}: INCRBY applied ({r:?})");
        assert_eq!(xlen(&mut admin, &events).await, 0, "attempt {attempt}");
        assert_eq!(state(&store, &k).await, RecordState::InProgress);
        let shown = match &r {
            Err(e @ Error::Backend { .. }) => format!("{e} / {e:?}"),
            other => panic!("attempt {attempt}: expected Backend, got {other:?}"),
        };
        assert!(
            shown.contains("may not run XADD on the key of write 2")
                && shown.contains("nothing was written"),
            "attempt {attempt}: {shown}"
        );
    }

    // The completion's own SET of the record is checked too.
    user.set(&mut admin, &["+xadd", "-set"]).await;
    let r = denied
        .complete_with(&lease, Bytes::from_static(b"r"), HOUR, writes.clone())
        .await;
    assert!(
        matches!(&r, Err(Error::Backend { .. }))
            && format!("{r:?}").contains("may not run SET on the record's key"),
        "{r:?}"
    );
    assert!(!admin.exists(&balance).await, "INCRBY applied");
    assert_eq!(xlen(&mut admin, &events).await, 0);
    assert_eq!(state(&store, &k).await, RecordState::InProgress);

    // The ACL mended: the same lease completes, every write applied once.
    user.set(&mut admin, &["+set"]).await;
    denied
        .complete_with(&lease, Bytes::from_static(b"r"), HOUR, writes)
        .await
        .expect("the lease completes once the ACL allows its writes");
    assert_eq!(admin.get(&balance).await.as_deref(), Some(&b"1250"[..]));
    assert_eq!(xlen(&mut admin, &events).await, 1);
    assert_eq!(
        state(&store, &k).await,
        RecordState::Completed {
            result: Bytes::from_static(b"r")
        }
    );
}

/// Under a prefix holding a hash tag (`{idem}:`) every record has that tag, whatever its id, so
/// `effect_key` would give every record the same key, under the prefix (refused at completion):
/// it refuses. Tags in the ids work as before under a plain prefix.
#[tokio::test]
async fn effect_keys_are_refused_under_a_prefix_holding_a_hash_tag() {
    let Some(store) = common::standalone().await else {
        return;
    };
    let unique = uuid::Uuid::new_v4().simple().to_string();
    async fn connect(prefix: String) -> RedisStore {
        let config = RedisConfig::default().with_prefix(prefix);
        RedisStore::connect_with(&common::url(), config)
            .await
            .unwrap()
    }
    let tagged = connect(format!("{{idem-test-{unique}}}:")).await;
    for id in ["order-42", "{alice}:msg-1"] {
        let k = key(id);
        // The slot's tag is the prefix's, whatever the id.
        assert_eq!(
            tagged.hash_tag(&k).unwrap(),
            format!("{{idem-test-{unique}}}")
        );
        let r = tagged.effect_key(&k, ":receipt");
        match &r {
            Err(Error::InvalidInput {
                field: "key",
                reason,
            }) => assert!(
                reason.contains(&format!("{{idem-test-{unique}}}"))
                    && reason.contains("prefix")
                    && reason.contains("shared by every record"),
                "{id}: {reason}"
            ),
            other => panic!("{id}: expected InvalidInput on key, got {other:?}"),
        }
    }

    // A prefix opening a tag that the id closes: the key would still lie under the prefix.
    let open = connect(format!("{{idem-test-{unique}:")).await;
    let r = open.effect_key(&key("{alice}:msg-1"), ":receipt");
    assert!(
        matches!(&r, Err(Error::InvalidInput { field: "key", reason }) if reason.contains("under the store's prefix")),
        "{r:?}"
    );

    // A plain prefix: the id's tag, or the whole storage key.
    let k = key("{alice}:msg-1");
    assert_eq!(store.effect_key(&k, ":receipt").unwrap(), "{alice}:receipt");
    let k = key("order-42");
    let storage_key = String::from_utf8(store.storage_key(&k)).unwrap();
    assert_eq!(
        store.effect_key(&k, ":receipt").unwrap(),
        format!("{{{storage_key}}}:receipt")
    );
}

macro_rules! suite {
    ($module:ident, $connect:path) => {
        mod $module {
            use super::*;

            async fn store() -> Option<RedisStore> {
                $connect().await
            }

            #[tokio::test]
            async fn one_request_per_completion() {
                let Some(store) = store().await else { return };
                super::one_request_per_completion(store).await;
            }

            #[tokio::test]
            async fn every_command_applies() {
                let Some(store) = store().await else { return };
                super::every_command_applies(store).await;
            }

            #[tokio::test]
            async fn bad_input_writes_nothing() {
                let Some(store) = store().await else { return };
                super::bad_input_writes_nothing(store).await;
            }

            #[tokio::test]
            async fn refusals_write_nothing() {
                let Some(store) = store().await else { return };
                super::refusals_write_nothing(store).await;
            }

            #[tokio::test]
            async fn counters_at_the_edges_apply() {
                let Some(store) = store().await else { return };
                super::counters_at_the_edges_apply(store).await;
            }

            #[tokio::test]
            async fn zombies_write_nothing() {
                let Some(store) = store().await else { return };
                super::zombies_write_nothing(store).await;
            }

            #[tokio::test]
            async fn shared_tags_share_data() {
                let Some(store) = store().await else { return };
                super::shared_tags_share_data(store).await;
            }
        }
    };
}

suite!(standalone, common::standalone);
suite!(cluster, common::cluster);
