//! Hostile values at record keys, through the real server: every script meets them.
//!
//! Values someone else wrote under the prefix (another application, a hand edit, a cut-off
//! copy) are generated with proptest: real records of every state with bytes cut off, changed,
//! inserted or appended (huge varints, a bad state byte, wrong lengths), random bytes behind a
//! record head, and keys of another type (list, hash, set, sorted set, stream). For each value
//! every operation runs: `get`, `extend`, `complete`, `fail`, `release`, `complete_with`, the
//! four batch calls, `acquire` and `delete`. When the scripts find the value corrupt, every
//! operation must answer a typed `CorruptRecord` and leave the key exactly as it was (`DUMP`,
//! which covers the type and the bytes, and `PTTL` compared before and after). A value that
//! still decodes (a mutation can land on a valid record) must get ordinary answers: never an
//! untyped error.
//!
//! The scripts do not check that the owner and the error text are UTF-8 (Lua has no cheap way
//! to); the Rust side does where it returns them (`get`, a busy key's owner, a stored error), and
//! answers `CorruptRecord` there. Such a value counts as decodable here.
//!
//! Runs on the standalone server and on the cluster (`IDEM_REDIS_URL`,
//! `IDEM_REDIS_CLUSTER_NODES`); `IDEM_HOSTILE_CASES` sets the number of values (default 256).

mod common;

use std::time::{Duration, SystemTime};

use common::Admin;
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Completion, Error, Failure, FailureKind, FencingToken,
    Fingerprint, IdempotencyKey, IdempotencyStore, Lease, Namespace, TransactionalStore,
};
use idem_redis::{RedisStore, RedisWrites};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

const HOUR: Duration = Duration::from_secs(3600);

/// How a value is planted.
#[derive(Clone)]
enum Planted {
    /// A string value with these bytes.
    Bytes(Vec<u8>),
    /// A key of another type.
    List,
    Hash,
    Set,
    SortedSet,
    Stream,
}

impl std::fmt::Debug for Planted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Bytes(b) => write!(f, "{:?}", Bytes::copy_from_slice(b)),
            Self::List => f.write_str("a list"),
            Self::Hash => f.write_str("a hash"),
            Self::Set => f.write_str("a set"),
            Self::SortedSet => f.write_str("a sorted set"),
            Self::Stream => f.write_str("a stream"),
        }
    }
}

/// A change to a real record's bytes.
#[derive(Clone, Debug)]
enum Change {
    /// Cut the value to this many bytes (modulo its length).
    Truncate(usize),
    /// Set the byte at (position modulo length) to this.
    Set(usize, u8),
    /// Insert these bytes at (position modulo length + 1).
    Insert(usize, Vec<u8>),
    /// Append a varint-looking run of continuation bytes (a huge length).
    HugeVarint(usize),
    /// Set the head byte's state bits to this (0-7).
    State(u8),
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        any::<usize>().prop_map(Change::Truncate),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Change::Set(i, b)),
        (
            any::<usize>(),
            proptest::collection::vec(any::<u8>(), 1..12)
        )
            .prop_map(|(i, b)| Change::Insert(i, b)),
        (1..20usize).prop_map(Change::HugeVarint),
        (0..8u8).prop_map(Change::State),
    ]
}

fn apply(mut v: Vec<u8>, changes: &[Change]) -> Vec<u8> {
    for c in changes {
        let len = v.len().max(1);
        match c {
            Change::Truncate(n) => v.truncate(n % len),
            Change::Set(i, b) => {
                if !v.is_empty() {
                    let i = i % v.len();
                    v[i] = *b;
                }
            }
            Change::Insert(i, bytes) => {
                let at = (i % len + 1).min(v.len());
                v.splice(at..at, bytes.iter().copied());
            }
            Change::HugeVarint(n) => v.extend(std::iter::repeat_n(0xff, *n)),
            Change::State(s) => {
                if let Some(head) = v.first_mut() {
                    *head = (*head & !7) | s;
                }
            }
        }
    }
    v
}

/// The hostile values, from the real records in `bases`.
fn planted(bases: Vec<Vec<u8>>) -> impl Strategy<Value = Planted> {
    let base = proptest::sample::select(bases);
    prop_oneof![
        6 => (base, proptest::collection::vec(change(), 1..4))
            .prop_map(|(b, changes)| Planted::Bytes(apply(b, &changes))),
        2 => (128u8..192, proptest::collection::vec(any::<u8>(), 0..64))
            .prop_map(|(head, rest)| Planted::Bytes([&[head][..], &rest].concat())),
        1 => proptest::collection::vec(any::<u8>(), 0..32).prop_map(Planted::Bytes),
        1 => prop_oneof![
            Just(Planted::List),
            Just(Planted::Hash),
            Just(Planted::Set),
            Just(Planted::SortedSet),
            Just(Planted::Stream),
        ],
    ]
}

/// Real records of every state, as the store writes them.
async fn real_records(store: &RedisStore, admin: &mut Admin) -> Vec<Vec<u8>> {
    let ns = Namespace::new(format!("hostile-{}", uuid::Uuid::new_v4().simple())).unwrap();
    let mut out = Vec::new();
    for (i, finish) in ["in_progress", "released", "completed", "failed", "terminal"]
        .into_iter()
        .enumerate()
    {
        let key = ns.key(format!("base-{i}")).unwrap();
        let req = AcquireRequest::new(key.clone(), "owner-with-a-long-name")
            .with_fingerprint((i % 2 == 0).then(|| Fingerprint::of([i as u8])));
        let AcquireOutcome::Acquired { lease, .. } = store.acquire(&req).await.unwrap() else {
            panic!("a fresh key is acquired");
        };
        match finish {
            "released" => store.release(&lease).await.unwrap(),
            "completed" => store
                .complete(&lease, Bytes::from_static(b"result \x00\xff"), HOUR)
                .await
                .unwrap(),
            "failed" => store
                .fail(&lease, "boom", FailureKind::Retryable, HOUR)
                .await
                .unwrap(),
            "terminal" => store
                .fail(&lease, "é", FailureKind::Terminal, HOUR)
                .await
                .unwrap(),
            _ => {}
        }
        let storage = store.storage_key(&key);
        let value: Vec<u8> = admin.query(redis::cmd("GET").arg(&storage)).await;
        out.push(value);
    }
    out
}

async fn plant(admin: &mut Admin, key: &[u8], value: &Planted) {
    let cmd = match value {
        Planted::Bytes(b) => redis::cmd("SET").arg(key).arg(b).clone(),
        Planted::List => redis::cmd("RPUSH").arg(key).arg("x").clone(),
        Planted::Hash => redis::cmd("HSET").arg(key).arg("t").arg("12345").clone(),
        Planted::Set => redis::cmd("SADD").arg(key).arg("x").clone(),
        Planted::SortedSet => redis::cmd("ZADD").arg(key).arg(1).arg("x").clone(),
        Planted::Stream => redis::cmd("XADD")
            .arg(key)
            .arg("*")
            .arg("f")
            .arg("v")
            .clone(),
    };
    let _: redis::Value = admin.query(&cmd).await;
}

/// `DUMP` (type and contents) and `PTTL` of `key`.
async fn snapshot(admin: &mut Admin, key: &[u8]) -> (Option<Vec<u8>>, i64) {
    let dump: Option<Vec<u8>> = admin.query(redis::cmd("DUMP").arg(key)).await;
    let pttl: i64 = admin.query(redis::cmd("PTTL").arg(key)).await;
    (dump, pttl)
}

/// Every operation on `key`; the fenced ones with a lease holding `token`.
async fn every_operation(
    store: &RedisStore,
    key: &IdempotencyKey,
    token: u64,
) -> Vec<(&'static str, idem_core::Result<()>)> {
    let lease = Lease {
        key: key.clone(),
        owner: "w".into(),
        token: FencingToken::new(token),
        attempt: 1,
        expires_at: SystemTime::now() + HOUR,
    };
    let req = AcquireRequest::new(key.clone(), "w");
    let flat = |r: idem_core::Result<Vec<idem_core::Result<()>>>| {
        r.and_then(|mut v| v.pop().expect("one result per item"))
    };
    vec![
        ("get", store.get(key).await.map(drop)),
        ("extend", store.extend(&lease, HOUR).await.map(drop)),
        (
            "complete",
            store.complete(&lease, Bytes::from_static(b"r"), HOUR).await,
        ),
        (
            "fail",
            store.fail(&lease, "e", FailureKind::Retryable, HOUR).await,
        ),
        ("release", store.release(&lease).await),
        (
            "complete_with",
            store
                .complete_with(&lease, Bytes::from_static(b"r"), HOUR, RedisWrites::new())
                .await,
        ),
        (
            "complete_many",
            flat(
                store
                    .complete_many(&[Completion::new(lease.clone(), "r")], HOUR)
                    .await,
            ),
        ),
        (
            "fail_many",
            flat(
                store
                    .fail_many(
                        &[Failure::new(lease.clone(), "e", FailureKind::Terminal)],
                        HOUR,
                    )
                    .await,
            ),
        ),
        (
            "release_many",
            flat(store.release_many(std::slice::from_ref(&lease)).await),
        ),
        (
            "acquire_many",
            store
                .acquire_many(std::slice::from_ref(&req))
                .await
                .and_then(|mut v| v.pop().expect("one result").map(drop)),
        ),
        ("acquire", store.acquire(&req).await.map(drop)),
        ("delete", store.delete(key).await.map(drop)),
    ]
}

async fn check(
    store: &RedisStore,
    admin: &mut Admin,
    ns: &Namespace,
    n: u64,
    value: &Planted,
) -> Result<(), TestCaseError> {
    let key = ns.key(format!("v{n}")).unwrap();
    let storage = store.storage_key(&key);
    plant(admin, &storage, value).await;
    let before = snapshot(admin, &storage).await;
    let token = match value {
        Planted::Bytes(b) if b.len() >= 9 => u64::from_be_bytes(b[1..9].try_into().unwrap()),
        _ => 12345,
    };
    let answers = every_operation(store, &key, token).await;
    // Every script decodes the record first (`load` in common.lua), whatever the token: when
    // `extend` finds the value corrupt, every script does.
    let corrupt = matches!(
        answers.iter().find(|(op, _)| *op == "extend"),
        Some((_, Err(Error::CorruptRecord { .. })))
    );
    if corrupt {
        for (op, answer) in &answers {
            prop_assert!(
                matches!(answer, Err(Error::CorruptRecord { .. })),
                "{op} on {value:?}: expected CorruptRecord, got {answer:?}"
            );
        }
        let after = snapshot(admin, &storage).await;
        prop_assert_eq!(&after, &before, "the value {:?} was changed", value);
    } else {
        for (op, answer) in &answers {
            prop_assert!(
                matches!(
                    answer,
                    Ok(()) | Err(Error::LeaseLost { .. } | Error::CorruptRecord { .. })
                ),
                "{op} on the decodable value {value:?}: {answer:?}"
            );
        }
    }
    Ok(())
}

fn run(store: Option<RedisStore>, rt: &tokio::runtime::Runtime) {
    let Some(store) = store else {
        return;
    };
    let mut admin = rt.block_on(Admin::of(&store));
    let bases = rt.block_on(real_records(&store, &mut admin));
    let ns = Namespace::new(format!("hostile-{}", uuid::Uuid::new_v4().simple())).unwrap();
    let cases = std::env::var("IDEM_HOSTILE_CASES")
        .ok()
        .map_or(256, |v| v.parse().expect("IDEM_HOSTILE_CASES is a number"));
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let n = std::cell::Cell::new(0u64);
    let admin = std::cell::RefCell::new(admin);
    let result = runner.run(&planted(bases), |value| {
        n.set(n.get() + 1);
        rt.block_on(check(&store, &mut admin.borrow_mut(), &ns, n.get(), &value))
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn hostile_values_are_corrupt_and_left_alone_standalone() {
    let rt = runtime();
    let store = rt.block_on(common::standalone());
    run(store, &rt);
}

#[test]
fn hostile_values_are_corrupt_and_left_alone_cluster() {
    let rt = runtime();
    let store = rt.block_on(common::cluster());
    run(store, &rt);
}

/// Found by the test above: a record or tombstone whose token is 2^53 or more (which Lua's
/// numbers cannot hold exactly, so the next token would not rise) was decoded by the scripts: a
/// completed one was replayed, a released one could be acquired again with a token no higher than
/// the last. Every script now answers `CorruptRecord` and leaves it alone.
#[test]
fn a_token_of_2_pow_53_or_more_is_corrupt() {
    let rt = runtime();
    let Some(store) = rt.block_on(common::standalone()) else {
        return;
    };
    rt.block_on(async {
        let mut admin = Admin::of(&store).await;
        let ns = Namespace::new(format!("hostile-{}", uuid::Uuid::new_v4().simple())).unwrap();
        let mut n = 0;
        for token in [1u64 << 53, 1 << 63, u64::MAX] {
            let token = token.to_be_bytes();
            for value in [
                // completed, attempts 1, updated +0, owner "w", result "r"
                [&[128 + 2][..], &token, b"\x01\x00\x01wr"].concat(),
                // released
                [&[128 + 1][..], &token, b"\x01\x00\x01w"].concat(),
                // a tombstone
                [&[128 + 7][..], &token].concat(),
            ] {
                n += 1;
                let planted = Planted::Bytes(value);
                let key = ns.key(format!("v{n}")).unwrap();
                let storage = store.storage_key(&key);
                plant(&mut admin, &storage, &planted).await;
                let before = snapshot(&mut admin, &storage).await;
                for (op, answer) in every_operation(&store, &key, 1).await {
                    assert!(
                        matches!(&answer, Err(Error::CorruptRecord { reason, .. }) if reason.contains("2^53")),
                        "{op} on {planted:?}: {answer:?}"
                    );
                }
                assert_eq!(snapshot(&mut admin, &storage).await, before, "{planted:?}");
            }
        }
    });
}
