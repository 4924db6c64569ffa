//! The batch scripts' fast paths (`lua/acquire_fast.lua`, `lua/complete_fast.lua`) write
//! exactly what the single-key bodies write, and decline, writing nothing, whatever they do not
//! take for certain.
//!
//! A harness script is built from the store's own batch script (everything before its loop: the
//! prelude, the body as `one`, the fast path as `fast`) and runs, with the keys declared (one
//! server) and without (a cluster primary's call of many slots), in ONE call and so at one
//! instant of the server clock, key `a` of each pair as a batch runs it (the fast path, then
//! the body if it declined) and key `b` through the body alone, the two keys holding the same
//! value beforehand. Both replies, both values and both expiries must be equal, and where the
//! fast path declined it must have left `a` as it was. The values: records the
//! store wrote in every shape a record takes (owners of 1 to 128 bytes, with and without a
//! fingerprint, leases of 1 ms to a day, attempts past 127, taken over, retried, released,
//! completed, failed, deleted), then each in-progress one altered byte by byte, cut short at
//! every length, lengthened, and written with needless varint bytes.

mod common;

use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    AcquireOutcome, AcquireRequest, FailureKind, Fingerprint, IdempotencyStore, Lease, Namespace,
};
use idem_redis::{RedisStore, lua_batch_scripts};
use redis::Value;

/// The first line of `lua/batch.lua`: the harness replaces the loop from there on.
const LOOP: &str = "-- The loop of every batch script";

/// ARGV[1]: how many arguments an item has; ARGV[2]: how many pairs (a, b) of keys, the two
/// holding the same value; then the pairs' key names; then each item's arguments, in the single
/// script's order. KEYS: the same names (declared keys, as on one server), or none (as a
/// cluster primary's call of many slots). Key `a` goes as in a batch (the fast path, then the
/// body if it declined), key `b` to the body alone. Replies per pair: 1 if the fast path
/// answered (0 if it declined), the reply on `a`, the reply on `b`, each key's value (its
/// bytes, or an array of its type when it is no string) and `PEXPIRETIME` after the deferred
/// writes, and, when the fast path declined, `a`'s value as it left it and whether it noted a
/// write (an empty array when it answered).
const HARNESS: &str = r#"
prefetch()
local per, pairs = tonumber(ARGV[1]), tonumber(ARGV[2])
local names = {}
for i = 1, 2 * pairs do
  names[i] = ARGV[2 + i]
end
local function caught(e)
  if type(e) == 'table' and e.err ~= nil then
    return {-1, e.err}
  end
  return {-1, tostring(e)}
end
local function value(k)
  local t = redis.call('TYPE', k).ok
  if t == 'string' then
    return redis.call('GET', k)
  end
  return {t}
end
local took, a_out, b_out, declined = {}, {}, {}, {}
for i = 1, pairs do
  local args = {}
  for j = 1, per do
    args[j] = ARGV[2 + 2 * pairs + (i - 1) * per + j]
  end
  key = names[2 * i - 1]
  local ok, reply = pcall(fast, args)
  took[i] = 1
  declined[i] = {}
  if ok and reply == nil then
    took[i] = 0
    declined[i] = {value(key), written[key] ~= nil and 1 or 0}
    ok, reply = pcall(one, args)
  end
  a_out[i] = ok and reply or caught(reply)
  key = names[2 * i]
  ok, reply = pcall(one, args)
  b_out[i] = ok and reply or caught(reply)
end
flush()
local out = {}
for i = 1, pairs do
  local a, b = names[2 * i - 1], names[2 * i]
  local ra, rb = a_out[i], b_out[i]
  if failed_writes[a] then
    ra = {-1, failed_writes[a]}
  end
  if failed_writes[b] then
    rb = {-1, failed_writes[b]}
  end
  out[i] = {took[i], ra, rb, value(a), value(b), redis.call('PEXPIRETIME', a),
    redis.call('PEXPIRETIME', b), declined[i]}
end
return out
"#;

/// The harness of the acquire batch's all-fresh shortcut (`all_fresh` in
/// `lua/acquire_fast.lua`), after the batch script's head as [`harness`] takes it. KEYS: the
/// shortcut's keys (`ARGV[1]` of them), then as many for the fast path alone (`ARGV[2]`: 0 or
/// the same number); `ARGV[3..5]`: the owner, lease and attempts every item shares; then each
/// shortcut item's fingerprint, which the fast-path item of the same index shares. In ONE call,
/// so at one instant: the shortcut over its keys, then each other key through `fast` as a batch
/// item, then the deferred writes. Replies the shortcut's reply (false when it declined), the
/// fast path's replies, then every key's value as `TYPE` and, for a string, its bytes.
const ALL_FRESH_HARNESS: &str = r#"
local n, m = tonumber(ARGV[1]), tonumber(ARGV[2])
local shortcut_keys = {}
for i = 1, n do
  shortcut_keys[i] = KEYS[i]
end
local args = {ARGV[3], ARGV[4], ARGV[5]}
local reply = all_fresh(shortcut_keys, args, {4}, 6)
prefetch()
local fast_replies = {}
for i = 1, m do
  args[4] = ARGV[5 + i]
  key = KEYS[n + i]
  fast_replies[i] = fast(args) or false
end
flush()
local values = {}
for i = 1, n + m do
  local t = redis.call('TYPE', KEYS[i]).ok
  values[i] = {t, t == 'string' and redis.call('GET', KEYS[i]) or false}
end
return {reply or false, fast_replies, values}
"#;

/// The harness over the batch script named `name`.
fn harness(name: &str) -> String {
    format!("{}{HARNESS}", head(name))
}

/// The batch script named `name` up to its loop: the prelude, the body as `one`, the fast path.
fn head(name: &str) -> String {
    let script = lua_batch_scripts()
        .into_iter()
        .find(|s| s.name == name)
        .expect("batch script");
    let at = script
        .source
        .find(LOOP)
        .expect("the batch loop's first line");
    let head = &script.source[..at];
    assert!(
        head.contains("local function fast(args)"),
        "{name} has a fast path"
    );
    head.to_owned()
}

/// What a pair holds before the call.
#[derive(Clone, Debug)]
enum Before {
    Nothing,
    Bytes(Vec<u8>),
    /// A key of another type (a list).
    List,
    /// The keys of the item before, as that item left them (the same key twice in a batch).
    Previous,
}

/// One item of a harness call: what its pair holds, its arguments, and whether the fast path
/// must take it (`Some(true)`), must decline it (`Some(false)`), or may do either (`None`).
struct Case {
    before: Before,
    args: Vec<Vec<u8>>,
    fast: Option<bool>,
    what: String,
}

struct Outcome {
    fast_taken: usize,
    declined: usize,
}

/// Runs `cases` through the harness of the batch script `name`, with the keys declared or not,
/// and checks each pair.
async fn check(
    admin: &mut common::Admin,
    prefix: &str,
    name: &str,
    declared: bool,
    cases: &[Case],
) -> Outcome {
    let script = harness(name);
    let mut out = Outcome {
        fast_taken: 0,
        declined: 0,
    };
    let per = cases[0].args.len();
    for (chunk_no, chunk) in cases.chunks(200).enumerate() {
        let mut keys: Vec<String> = Vec::new();
        for (i, case) in chunk.iter().enumerate() {
            for side in ["a", "b"] {
                keys.push(if matches!(case.before, Before::Previous) {
                    assert!(i > 0, "{}: no item before it in its call", case.what);
                    keys[keys.len() - 2].clone()
                } else {
                    format!("{prefix}{name}:{declared}:{chunk_no}:{i}:{side}")
                });
            }
        }
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(&script);
        if declared {
            cmd.arg(keys.len()).arg(&keys);
        } else {
            cmd.arg(0);
        }
        cmd.arg(per).arg(chunk.len()).arg(&keys);
        let mut mset = redis::cmd("MSET");
        let mut lists = Vec::new();
        for (case, pair) in chunk.iter().zip(keys.chunks(2)) {
            for k in pair {
                match &case.before {
                    Before::Nothing | Before::Previous => {}
                    Before::Bytes(v) => {
                        mset.arg(k).arg(v.as_slice());
                    }
                    Before::List => {
                        lists.push(k);
                    }
                }
            }
        }
        if mset.args_iter().count() > 1 {
            admin.query::<()>(&mset).await;
        }
        for k in lists {
            admin.query::<()>(redis::cmd("RPUSH").arg(k).arg("x")).await;
        }
        for case in chunk {
            assert_eq!(case.args.len(), per);
            for a in &case.args {
                cmd.arg(a.as_slice());
            }
        }
        let replies: Vec<Vec<Value>> = admin.query(&cmd).await;
        // The pairs hold in-progress records, which have no expiry: remove them.
        let mut del = redis::cmd("DEL");
        del.arg(&keys);
        admin.query::<()>(&del).await;
        for (case, reply) in chunk.iter().zip(replies) {
            let [took, ra, rb, a, b, exp_a, exp_b, declined] =
                <[Value; 8]>::try_from(reply).unwrap();
            let took = took == Value::Int(1);
            if let Some(expected) = case.fast {
                assert_eq!(
                    took,
                    expected,
                    "{}: the fast path {} (reply {ra:?}, body {rb:?})",
                    case.what,
                    if took { "took it" } else { "declined" }
                );
            }
            if let Value::Int(_) = ra {
                assert!(took, "{}: the body answered a compact reply", case.what);
            }
            let ra = full_reply(name, &case.args, ra);
            assert_eq!(ra, rb, "{}: replies differ", case.what);
            assert_eq!(a, b, "{}: stored values differ", case.what);
            assert_eq!(exp_a, exp_b, "{}: expiries differ", case.what);
            if took {
                out.fast_taken += 1;
                continue;
            }
            out.declined += 1;
            if matches!(case.before, Before::Previous) {
                continue;
            }
            let Value::Array(declined) = declined else {
                panic!("{}: no declined entry: {declined:?}", case.what)
            };
            let [left, noted] = <[Value; 2]>::try_from(declined).unwrap();
            let type_is = |t: &[u8]| matches!(&left, Value::Array(v) if v[..] == [Value::BulkString(t.to_vec())]);
            let unchanged = match (&case.before, &left) {
                (Before::Nothing, _) => type_is(b"none"),
                (Before::List, _) => type_is(b"list"),
                (Before::Bytes(v), Value::BulkString(now)) => v == now,
                _ => false,
            };
            assert!(unchanged, "{}: declined but wrote {left:?}", case.what);
            assert_eq!(
                noted,
                Value::Int(0),
                "{}: declined but noted a write",
                case.what
            );
        }
    }
    out
}

/// The body's reply that a fast path's compact reply stands for (lua/batch.lua): an acquire's
/// token alone for `{0, token, 1, floor(token / 1000) + lease, 0}` (the lease the item sent), a
/// completion's 1 for `{1}`. Any other reply as it is.
fn full_reply(name: &str, args: &[Vec<u8>], reply: Value) -> Value {
    let Value::Int(n) = reply else {
        return reply;
    };
    match name {
        "acquire_many" => {
            let lease: f64 = std::str::from_utf8(&args[1]).unwrap().parse().unwrap();
            let lease = lease as i64;
            Value::Array(vec![
                Value::Int(0),
                Value::Int(n),
                Value::Int(1),
                Value::Int(n / 1000 + lease),
                Value::Int(0),
            ])
        }
        "complete_many" => {
            assert_eq!(n, 1, "a completion's compact reply");
            Value::Array(vec![Value::Int(1)])
        }
        other => panic!("{other} has no compact reply"),
    }
}

fn fp(seed: u8) -> Fingerprint {
    Fingerprint::of([seed; 7])
}

/// A record the store wrote, with the token a completion would present (the holder's for one in
/// progress, the last holder's for the others).
struct Shape {
    what: String,
    value: Vec<u8>,
    token: String,
    in_progress: bool,
}

impl Shape {
    /// The record at `lease`'s key as it is now.
    async fn of(
        admin: &mut common::Admin,
        store: &RedisStore,
        lease: &Lease,
        what: impl Into<String>,
        in_progress: bool,
    ) -> Self {
        let value = admin
            .query::<Option<Vec<u8>>>(redis::cmd("GET").arg(store.storage_key(&lease.key)))
            .await
            .expect("the record");
        Self {
            what: what.into(),
            value,
            token: lease.token.to_string(),
            in_progress,
        }
    }
}

/// Acquires `req`, which must be free.
async fn acquired(store: &RedisStore, req: &AcquireRequest) -> Lease {
    match store.acquire(req).await.unwrap() {
        AcquireOutcome::Acquired { lease, .. } => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Records in every shape the store writes.
async fn shapes(store: &RedisStore, admin: &mut common::Admin) -> Vec<Shape> {
    let ns = Namespace::new("fast").unwrap();
    let mut out = Vec::new();
    let mut n = 0;
    let mut key = || {
        n += 1;
        ns.key(format!("k{n}")).unwrap()
    };
    let owners = [
        "w".to_owned(),
        "x".repeat(127),
        "y".repeat(128),
        "wörker ✓".to_owned(),
    ];
    let leases = [
        Duration::from_millis(1),
        Duration::from_millis(63),
        Duration::from_millis(64),
        Duration::from_secs(30),
        Duration::from_secs(24 * 3600),
    ];
    for owner in &owners {
        for ttl in leases {
            for with_fp in [false, true] {
                let mut req = AcquireRequest::new(key(), owner.as_str()).with_lease_ttl(ttl);
                if with_fp {
                    req = req.with_fingerprint(fp(1));
                }
                let lease = acquired(store, &req).await;
                let what = format!(
                    "first attempt, owner {} bytes, lease {ttl:?}, fingerprint {with_fp}",
                    owner.len()
                );
                out.push(Shape::of(admin, store, &lease, what, true).await);
            }
        }
    }
    // Taken over once the 1 ms lease ran out (attempt 2, a creation time before the token's).
    let req = AcquireRequest::new(key(), "a")
        .with_lease_ttl(Duration::from_millis(1))
        .with_fingerprint(fp(2));
    acquired(store, &req).await;
    let lease = loop {
        match store.acquire(&req).await.unwrap() {
            AcquireOutcome::Acquired { lease, .. } => break lease,
            AcquireOutcome::InProgress { .. } => tokio::task::yield_now().await,
            other => panic!("expected a takeover, got {other:?}"),
        }
    };
    assert_eq!(lease.attempt, 2);
    out.push(Shape::of(admin, store, &lease, "taken over", true).await);
    // Retried 130 times: attempts past one varint byte.
    let req = AcquireRequest::new(key(), "r").with_max_attempts(200);
    let mut lease = acquired(store, &req).await;
    for _ in 0..130 {
        let retention = Duration::from_secs(60);
        let failed = store.fail(&lease, "again", FailureKind::Retryable, retention);
        failed.await.unwrap();
        lease = acquired(store, &req).await;
    }
    assert_eq!(lease.attempt, 131);
    out.push(Shape::of(admin, store, &lease, "attempt 131", true).await);
    // Released, then acquired again.
    let req = AcquireRequest::new(key(), "r");
    let first = acquired(store, &req).await;
    store.release(&first).await.unwrap();
    out.push(Shape::of(admin, store, &first, "released", false).await);
    let lease = acquired(store, &req).await;
    out.push(Shape::of(admin, store, &lease, "acquired after a release", true).await);
    // Finished records and a tombstone: never the fast path.
    let lease = acquired(store, &AcquireRequest::new(key(), "c")).await;
    let done = Bytes::from_static(b"done");
    store
        .complete(&lease, done, Duration::from_secs(60))
        .await
        .unwrap();
    out.push(Shape::of(admin, store, &lease, "completed", false).await);
    for kind in [FailureKind::Retryable, FailureKind::Terminal] {
        let lease = acquired(store, &AcquireRequest::new(key(), "f")).await;
        let failed = store.fail(&lease, "no", kind, Duration::from_secs(60));
        failed.await.unwrap();
        out.push(Shape::of(admin, store, &lease, format!("failed {kind:?}"), false).await);
    }
    let lease = acquired(store, &AcquireRequest::new(key(), "d")).await;
    assert!(store.delete(&lease.key).await.unwrap());
    out.push(Shape::of(admin, store, &lease, "tombstone", false).await);
    out
}

/// The token text a record's bytes 2 to 9 hold.
fn token_of(v: &[u8]) -> Option<String> {
    let bytes: [u8; 8] = v.get(1..9)?.try_into().ok()?;
    Some(u64::from_be_bytes(bytes).to_string())
}

fn complete_args(token: &str, result: &[u8]) -> Vec<Vec<u8>> {
    vec![
        token.as_bytes().to_vec(),
        result.to_vec(),
        b"60000".to_vec(),
    ]
}

#[tokio::test]
async fn fast_paths_write_exactly_what_the_single_key_bodies_write() {
    let Some(store) = common::standalone().await else {
        return;
    };
    let mut admin = common::Admin::of(&store).await;
    let prefix = common::random_prefix();
    let records = shapes(&store, &mut admin).await;

    // Completions: each record with its own token (and others), then each in-progress record
    // altered.
    let mut cases = Vec::new();
    for Shape {
        what,
        value: v,
        token,
        in_progress,
    } in &records
    {
        cases.push(Case {
            before: Before::Bytes(v.clone()),
            args: complete_args(token, b"ok"),
            fast: Some(*in_progress),
            what: format!("{what}, its token"),
        });
        let t: u64 = token.parse().unwrap();
        for other in [
            format!("{}", t + 1),
            format!("{}", t - 1),
            format!("0{t}"),
            format!("{t} "),
            String::new(),
            "x".into(),
        ] {
            cases.push(Case {
                before: Before::Bytes(v.clone()),
                args: complete_args(&other, b"ok"),
                fast: Some(false),
                what: format!("{what}, token {other:?}"),
            });
        }
        if !*in_progress {
            continue;
        }
        // Results: empty, bytes that look like a record, large.
        for result in [&b""[..], &v[..], &[0xA2; 5000][..]] {
            cases.push(Case {
                before: Before::Bytes(v.clone()),
                args: complete_args(token, result),
                fast: Some(true),
                what: format!("{what}, a result of {} bytes", result.len()),
            });
        }
        for at in 0..v.len() {
            let orig = v[at];
            for b in [
                0x00,
                0x01,
                0x7f,
                0x80,
                0xff,
                orig ^ 0x01,
                orig ^ 0x80,
                orig ^ 0x10,
            ] {
                let mut m = v.clone();
                m[at] = b;
                let tok = token_of(&m).unwrap();
                cases.push(Case {
                    before: Before::Bytes(m),
                    args: complete_args(&tok, b"ok"),
                    fast: None,
                    what: format!("{what}, byte {at} set to {b:#04x}"),
                });
            }
        }
        for len in 0..v.len() {
            let m = v[..len].to_vec();
            let tok = token_of(&m).unwrap_or_else(|| token.clone());
            cases.push(Case {
                before: Before::Bytes(m),
                args: complete_args(&tok, b"ok"),
                fast: Some(false),
                what: format!("{what}, cut to {len} bytes"),
            });
        }
        for extra in [&b"\0"[..], b"x", b"\x80"] {
            let mut m = v.clone();
            m.extend_from_slice(extra);
            cases.push(Case {
                before: Before::Bytes(m),
                args: complete_args(token, b"ok"),
                fast: Some(false),
                what: format!("{what}, {extra:?} appended"),
            });
        }
        // Needless varint bytes (0x80 then 0x00 in place of 0x00 and the like) at the attempts
        // (byte 9) and the updated time (byte 10 for one-byte attempts), and a creation time of
        // zero written out (flag 16 with a 0 after the updated time).
        for at in [9, 10] {
            if v[at] < 0x80 {
                let mut m = v.clone();
                m[at] |= 0x80;
                m.insert(at + 1, 0);
                cases.push(Case {
                    before: Before::Bytes(m),
                    args: complete_args(token, b"ok"),
                    fast: Some(false),
                    what: format!("{what}, varint at {at} with a needless byte"),
                });
            }
        }
        if v[0] & 16 == 0 && v[9] < 0x80 && v[10] < 0x80 {
            let mut m = v.clone();
            m[0] |= 16;
            m.insert(11, 0);
            cases.push(Case {
                before: Before::Bytes(m),
                args: complete_args(token, b"ok"),
                fast: Some(false),
                what: format!("{what}, a creation time of zero written out"),
            });
        }
    }
    // Retentions changing from item to item (the fast path makes the expiry's text again only
    // when the retention differs from the item before), a retention that is no number (left to
    // the body, which fails it), and the same key completed again at once (a replay, which the
    // fast path leaves to the body).
    for (i, shape) in records.iter().filter(|r| r.in_progress).take(8).enumerate() {
        for retention in ["x", "1", "86400000", "60000"] {
            cases.push(Case {
                before: Before::Bytes(shape.value.clone()),
                args: vec![
                    shape.token.clone().into_bytes(),
                    b"ok".to_vec(),
                    retention.into(),
                ],
                fast: Some(retention != "x"),
                what: format!("{}, retention {retention} ({i})", shape.what),
            });
        }
        cases.push(Case {
            before: Before::Previous,
            args: vec![
                shape.token.clone().into_bytes(),
                b"ok".to_vec(),
                b"60000".to_vec(),
            ],
            fast: Some(false),
            what: format!("{}, completed twice", shape.what),
        });
    }
    cases.push(Case {
        before: Before::List,
        args: complete_args("1", b"ok"),
        fast: Some(false),
        what: "a list".into(),
    });
    cases.push(Case {
        before: Before::Nothing,
        args: complete_args("1", b"ok"),
        fast: Some(false),
        what: "no key".into(),
    });
    for declared in [true, false] {
        let complete = check(&mut admin, &prefix, "complete_many", declared, &cases).await;
        println!(
            "completions, keys declared {declared}: {} cases, the fast path took {} and declined {}",
            cases.len(),
            complete.fast_taken,
            complete.declined
        );
        // Many single-byte changes leave a record the fast path must decline, many others one it
        // may take (a byte of the owner, the fingerprint, the lease): both counts are far from
        // zero.
        assert!(
            complete.fast_taken > 1_000,
            "fast path took {}",
            complete.fast_taken
        );
        assert!(
            complete.declined > 1_000,
            "fast path declined {}",
            complete.declined
        );
    }

    // Records of two acquire batches, each batch's sharing everything but their fingerprints (a
    // fast path compares each record with the one it took before with the same token, outside
    // the fingerprint), interleaved: with and without fingerprints, owners of two lengths, each
    // followed by near misses (the owner's last byte changed, a byte appended, the fingerprint
    // flag dropped).
    let ns = Namespace::new("fast").unwrap();
    let mut batches = Vec::new();
    for batch in 0..2 {
        let mut reqs = Vec::new();
        for (i, owner) in ["w", "w", "worker-7", "worker-7", "w"].iter().enumerate() {
            for n in 0..6u8 {
                let key = ns.key(format!("batch-{batch}-{i}-{n}")).unwrap();
                let mut req = AcquireRequest::new(key, *owner);
                if i % 2 == 0 {
                    req = req.with_fingerprint(fp(n));
                }
                reqs.push(req);
            }
        }
        batches.push(store.acquire_many(&reqs).await.unwrap());
    }
    let [first, second] = <[_; 2]>::try_from(batches).unwrap();
    let interleaved = first.into_iter().zip(second).flat_map(|(a, b)| [a, b]);
    let mut cases = Vec::new();
    for outcome in interleaved {
        let AcquireOutcome::Acquired { lease, .. } = outcome.unwrap() else {
            panic!("a fresh key")
        };
        let shape = Shape::of(&mut admin, &store, &lease, "", true).await;
        let (v, token) = (shape.value, shape.token);
        let what = format!(
            "one acquire batch, owner {}, key {}",
            lease.owner,
            lease.key.id()
        );
        cases.push(Case {
            before: Before::Bytes(v.clone()),
            args: complete_args(&token, b"ok"),
            fast: Some(true),
            what: what.clone(),
        });
        let mut owner_changed = v.clone();
        *owner_changed.last_mut().unwrap() ^= 0x01;
        let mut appended = v.clone();
        appended.push(b'x');
        let mut no_fp_flag = v.clone();
        no_fp_flag[0] &= !8;
        for (m, change) in [
            (owner_changed, "the owner's last byte changed"),
            (appended, "a byte appended"),
            (no_fp_flag, "no fingerprint flag"),
        ] {
            cases.push(Case {
                before: Before::Bytes(m),
                args: complete_args(&token, b"ok"),
                fast: None,
                what: format!("{what}, {change}"),
            });
        }
    }
    for declared in [true, false] {
        let batch = check(&mut admin, &prefix, "complete_many", declared, &cases).await;
        assert!(
            batch.fast_taken >= 30,
            "fast path took {}",
            batch.fast_taken
        );
    }

    // Completions missing their retention, or their result too: left to the body.
    let first = records.iter().find(|r| r.in_progress).unwrap();
    for per in [1, 2] {
        let args = complete_args(&first.token, b"ok")[..per].to_vec();
        let cases = [Case {
            before: Before::Bytes(first.value.clone()),
            args,
            fast: Some(false),
            what: format!("a completion with {per} of its 3 arguments"),
        }];
        for declared in [true, false] {
            check(&mut admin, &prefix, "complete_many", declared, &cases).await;
        }
    }

    // Acquires: absent keys with every argument shape, owners changing from item to item (the
    // fast path builds what items share again when the owner or lease differs from the item
    // before), leases that are not whole milliseconds, out of range or not numbers (left to the
    // body), the same key twice, and
    // keys holding a record or another type, which it declines or (another type, read as absent
    // with declared keys) writes with SET NX like the body.
    let mut cases = Vec::new();
    let fps: [Vec<u8>; 2] = [Vec::new(), vec![0xAB; 32]];
    for (i, owner) in ["w", "v", "w", &"x".repeat(128), "wörker ✓"]
        .iter()
        .enumerate()
    {
        for lease in ["1", "63", "64", "30000", "86400000"] {
            for f in &fps {
                cases.push(Case {
                    before: Before::Nothing,
                    args: vec![
                        owner.as_bytes().to_vec(),
                        lease.as_bytes().to_vec(),
                        b"5".to_vec(),
                        f.clone(),
                    ],
                    fast: Some(true),
                    what: format!(
                        "absent, owner {i}, lease {lease}, fingerprint {}",
                        !f.is_empty()
                    ),
                });
            }
        }
    }
    for Shape { what, value: v, .. } in &records {
        cases.push(Case {
            before: Before::Bytes(v.clone()),
            args: vec![
                b"w".to_vec(),
                b"30000".to_vec(),
                b"5".to_vec(),
                vec![0xAB; 32],
            ],
            fast: Some(false),
            what: format!("acquire over: {what}"),
        });
    }
    for lease in [
        "1.9999999",
        "0.9999999",
        "9007199000000000",
        "-5",
        "x",
        "1.0",
    ] {
        let args = vec![b"w".to_vec(), lease.into(), b"5".to_vec(), Vec::new()];
        cases.push(Case {
            before: Before::Nothing,
            args: args.clone(),
            // The compact reply stands for whole milliseconds, counted exactly.
            fast: Some(lease == "1.0"),
            what: format!("absent, lease {lease}"),
        });
        cases.push(Case {
            before: Before::Previous,
            args,
            fast: Some(false),
            what: format!("absent, lease {lease}, the same key again"),
        });
    }
    cases.push(Case {
        before: Before::List,
        args: vec![b"w".to_vec(), b"30000".to_vec(), b"5".to_vec(), Vec::new()],
        fast: Some(true),
        what: "acquire over a list".into(),
    });
    for declared in [true, false] {
        // Without declared keys a key of another type is refused at the fast path's read, and
        // the body reads it again and answers as always.
        cases.last_mut().unwrap().fast = Some(declared);
        let acquire = check(&mut admin, &prefix, "acquire_many", declared, &cases).await;
        println!(
            "acquires, keys declared {declared}: {} cases, the fast path took {} and declined {}",
            cases.len(),
            acquire.fast_taken,
            acquire.declined
        );
        assert!(acquire.fast_taken >= 50);
    }
    // An acquire with no fingerprint argument at all: the body takes it as none, and so does the
    // fast path.
    let cases = [Case {
        before: Before::Nothing,
        args: vec![b"w".to_vec(), b"30000".to_vec(), b"5".to_vec()],
        fast: Some(true),
        what: "an acquire with 3 of its 4 arguments".into(),
    }];
    for declared in [true, false] {
        check(&mut admin, &prefix, "acquire_many", declared, &cases).await;
    }
    let dropped = store
        .drop_namespace(&Namespace::new("fast").unwrap())
        .await
        .unwrap();
    assert!(dropped >= 40, "removed the test's {dropped} records");
}

/// What [`ALL_FRESH_HARNESS`] answered: the shortcut's reply, the fast path's replies, and each
/// key's type and bytes.
struct Fresh {
    shortcut: Value,
    fast: Vec<Value>,
    values: Vec<(String, Option<Vec<u8>>)>,
}

/// Runs the shortcut harness over `keys` (the fast path over as many others when `compare`),
/// with the shared `owner`, `lease` and attempts 5, and a fingerprint per key.
async fn all_fresh(
    admin: &mut common::Admin,
    prefix: &str,
    keys: &[String],
    compare: bool,
    owner: &[u8],
    lease: &str,
    fingerprints: &[Vec<u8>],
) -> Fresh {
    let harness = head("acquire_many") + ALL_FRESH_HARNESS;
    let others: Vec<String> = if compare {
        (0..keys.len())
            .map(|i| format!("{prefix}fast:{i}"))
            .collect()
    } else {
        Vec::new()
    };
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(&harness)
        .arg(keys.len() + others.len())
        .arg(keys)
        .arg(&others)
        .arg(keys.len())
        .arg(others.len())
        .arg(owner)
        .arg(lease)
        .arg(5);
    for f in fingerprints {
        cmd.arg(f.as_slice());
    }
    let reply: Vec<Value> = admin.query(&cmd).await;
    let [shortcut, fast, values] = <[Value; 3]>::try_from(reply).unwrap();
    let Value::Array(fast) = fast else {
        panic!("{fast:?}")
    };
    let Value::Array(values) = values else {
        panic!("{values:?}")
    };
    let values = values
        .into_iter()
        .map(|v| {
            let Value::Array(v) = v else { panic!("{v:?}") };
            let [t, bytes] = <[Value; 2]>::try_from(v).unwrap();
            let t = redis::from_redis_value::<String>(t).unwrap();
            let bytes = match bytes {
                Value::BulkString(b) => Some(b),
                _ => None,
            };
            (t, bytes)
        })
        .collect();
    let mut del = redis::cmd("DEL");
    del.arg(keys).arg(&others);
    admin.query::<()>(&del).await;
    Fresh {
        shortcut,
        fast,
        values,
    }
}

/// The acquire batch's shortcut for a call whose keys are all distinct and absent
/// (`all_fresh`, one `MSETNX`) writes exactly what the fast path writes for each of them, with
/// the same token as its one reply; and declines, writing nothing, when a key exists (of any
/// type), a key comes twice, an argument is one the fast path declines, or there are more than
/// 500 keys.
#[tokio::test]
async fn the_all_fresh_shortcut_writes_what_the_fast_path_writes() {
    let Some(store) = common::standalone().await else {
        return;
    };
    let mut admin = common::Admin::of(&store).await;
    let prefix = common::random_prefix();
    let keys = |n: usize, tag: &str| -> Vec<String> {
        (0..n).map(|i| format!("{prefix}{tag}:{i}")).collect()
    };
    let fps = |n: usize| -> Vec<Vec<u8>> {
        (0..n)
            .map(|i| {
                if i % 3 == 0 {
                    Vec::new()
                } else {
                    vec![i as u8; 32]
                }
            })
            .collect()
    };
    // Taken: owners of 1, 127, 128 and more bytes (the owner's length is a varint), leases
    // from 1 ms to a day and the largest the fast path takes, 1 to 500 keys.
    let long_owner = "o".repeat(128);
    let mut taken = 0;
    for (owner, lease, n) in [
        ("w", "30000", 1),
        ("w", "1", 3),
        (&"x".repeat(127)[..], "86400000", 7),
        (&long_owner[..], "64", 20),
        ("wörker ✓", "1099511627775", 5),
        ("w", "30000", 500),
    ] {
        let tag = format!("take-{n}-{lease}");
        let ks = keys(n, &tag);
        let out = all_fresh(
            &mut admin,
            &prefix,
            &ks,
            true,
            owner.as_bytes(),
            lease,
            &fps(n),
        )
        .await;
        let Value::Int(token) = out.shortcut else {
            panic!("{tag}: the shortcut declined: {:?}", out.shortcut)
        };
        assert!(token > 0);
        for (i, f) in out.fast.iter().enumerate() {
            assert_eq!(
                *f,
                Value::Int(token),
                "{tag}: item {i}: the fast path's token"
            );
        }
        for i in 0..n {
            let (a, b) = (&out.values[i], &out.values[n + i]);
            assert_eq!(a.0, "string", "{tag}: item {i} written");
            assert_eq!(
                a, b,
                "{tag}: item {i}: the shortcut and the fast path wrote differently"
            );
        }
        taken += 1;
    }
    assert_eq!(taken, 6);

    // Declined, nothing written: the values before the call are there after it.
    let ks = keys(4, "exists");
    admin
        .query::<()>(redis::cmd("SET").arg(&ks[2]).arg("a record"))
        .await;
    let out = all_fresh(&mut admin, &prefix, &ks, false, b"w", "30000", &fps(4)).await;
    assert_eq!(out.shortcut, Value::Nil, "a key holds a string");
    let types: Vec<&str> = out.values.iter().map(|(t, _)| t.as_str()).collect();
    assert_eq!(types, ["none", "none", "string", "none"]);
    assert_eq!(out.values[2].1.as_deref(), Some(&b"a record"[..]));

    let ks = keys(3, "list");
    admin
        .query::<()>(redis::cmd("RPUSH").arg(&ks[0]).arg("x"))
        .await;
    let out = all_fresh(&mut admin, &prefix, &ks, false, b"w", "30000", &fps(3)).await;
    assert_eq!(out.shortcut, Value::Nil, "a key holds a list");
    let types: Vec<&str> = out.values.iter().map(|(t, _)| t.as_str()).collect();
    assert_eq!(types, ["list", "none", "none"]);

    let mut ks = keys(3, "twice");
    ks.push(ks[1].clone());
    let out = all_fresh(&mut admin, &prefix, &ks, false, b"w", "30000", &fps(4)).await;
    assert_eq!(out.shortcut, Value::Nil, "a key twice");
    assert!(
        out.values.iter().all(|(t, _)| t == "none"),
        "{:?}",
        out.values
    );

    for lease in ["1.5", "-1", "x", "1099511627776"] {
        let ks = keys(3, &format!("lease-{lease}"));
        let out = all_fresh(&mut admin, &prefix, &ks, false, b"w", lease, &fps(3)).await;
        assert_eq!(out.shortcut, Value::Nil, "lease {lease}");
        assert!(out.values.iter().all(|(t, _)| t == "none"), "lease {lease}");
    }

    let ks = keys(501, "many");
    let out = all_fresh(&mut admin, &prefix, &ks, false, b"w", "30000", &fps(501)).await;
    assert_eq!(out.shortcut, Value::Nil, "501 keys");
    assert!(out.values.iter().all(|(t, _)| t == "none"));
}
