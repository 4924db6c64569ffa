//! Tests on a redis-server this test process starts on a free port, so that Redis' own counters
//! see only this test's traffic: round trips counted per operation, the stored layout, memory,
//! and an outage followed by reconnection.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

use common::PrivateRedis;
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Error, FailureKind, FencingToken, Fingerprint,
    IdempotencyStore, Lease, LostLease, Namespace, RecordState,
};
use idem_redis::{RedisConfig, RedisStore};
use integer_encoding::VarInt;
use redis::aio::MultiplexedConnection;

const HOUR: Duration = Duration::from_secs(3600);

async fn admin(server: &PrivateRedis) -> MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("admin connection to the private server")
}

async fn commandstats(admin: &mut MultiplexedConnection) -> HashMap<String, u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(admin)
        .await
        .unwrap();
    info.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("cmdstat_")?;
            let (name, stats) = rest.split_once(':')?;
            let calls = stats
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// MONITOR on the private server (over a plain socket): every command it executes, scripts'
/// inner calls marked `lua`, each with the client address that sent it.
struct Monitor {
    socket: TcpStream,
    lines: mpsc::Receiver<String>,
}

impl Monitor {
    fn start(port: u16) -> Self {
        let mut socket = TcpStream::connect(("127.0.0.1", port)).expect("monitor connection");
        socket.write_all(b"MONITOR\r\n").unwrap();
        let reader = BufReader::new(socket.try_clone().unwrap());
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            // Each event is a RESP simple string: `+1700000000.123456 [0 127.0.0.1:5000] "CMD" ...`
            for line in reader.lines().map_while(Result::ok) {
                if tx.send(line.trim_start_matches('+').to_owned()).is_err() {
                    break;
                }
            }
        });
        // MONITOR is in force once the server answered +OK.
        let ok = lines.recv_timeout(Duration::from_secs(10));
        assert_eq!(ok.as_deref(), Ok("OK"), "MONITOR refused");
        Self { socket, lines }
    }

    /// Lines up to (and including) the one that contains `mark`.
    fn until(&self, mark: &str) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut out = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("MONITOR never showed {mark}; saw {out:#?}"));
            let done = line.contains(mark);
            out.push(line);
            if done {
                return out;
            }
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }
}

/// `1700000000.123456 [0 127.0.0.1:5000] "EVALSHA" ...` -> ("127.0.0.1:5000", "EVALSHA")
fn source_and_command(line: &str) -> Option<(&str, &str)> {
    let start = line.find('[')?;
    let end = line[start..].find(']')? + start;
    let source = line[start + 1..end].split_once(' ')?.1;
    let command = line[end + 1..].trim().split(' ').next()?.trim_matches('"');
    Some((source, command))
}

struct Counter {
    admin: MultiplexedConnection,
    monitor: Monitor,
    store: RedisStore,
    n: u32,
}

/// What one operation cost, as Redis saw it.
#[derive(Debug)]
struct Cost {
    /// Commands the store's connection sent (MONITOR, everything but the admin's and Lua's).
    sent: Vec<String>,
    /// What `RedisStore::requests_sent` counted meanwhile.
    requests: u64,
    /// `cmdstat_evalsha` calls added.
    evalsha: u64,
    /// Changes of every other command's call count (scripts' inner calls included), less the
    /// admin's own INFO.
    others: HashMap<String, u64>,
}

impl Counter {
    async fn measure<T>(&mut self, op: impl Future<Output = T>) -> (T, Cost) {
        self.n += 1;
        let (start, end) = (
            format!("mark-start-{}", self.n),
            format!("mark-end-{}", self.n),
        );
        let _: String = redis::cmd("ECHO")
            .arg(&start)
            .query_async(&mut self.admin)
            .await
            .unwrap();
        let before = commandstats(&mut self.admin).await;
        let requests_before = self.store.requests_sent();
        let out = op.await;
        let requests = self.store.requests_sent() - requests_before;
        let after = commandstats(&mut self.admin).await;
        let _: String = redis::cmd("ECHO")
            .arg(&end)
            .query_async(&mut self.admin)
            .await
            .unwrap();

        let seen = self.monitor.until(&end);
        let begin = seen
            .iter()
            .position(|l| l.contains(&start))
            .expect("start mark seen");
        let admin_addr = source_and_command(&seen[begin]).unwrap().0.to_owned();
        let sent = seen[begin..]
            .iter()
            .filter_map(|l| source_and_command(l))
            .filter(|(source, _)| *source != "lua" && *source != admin_addr)
            .map(|(_, command)| command.to_ascii_uppercase())
            .collect::<Vec<_>>();
        assert_eq!(
            usize::try_from(requests).unwrap(),
            sent.len(),
            "requests_sent counts what the server received from the store: {sent:?}"
        );
        let mut others: HashMap<String, u64> = after
            .iter()
            .map(|(name, calls)| (name.clone(), calls - before.get(name).copied().unwrap_or(0)))
            .filter(|(name, delta)| *delta > 0 && name != "evalsha")
            .collect();
        // The first INFO is counted by the second one.
        match others.get_mut("info") {
            Some(1) => {
                others.remove("info");
            }
            other => panic!("unexpected INFO count {other:?}"),
        }
        let evalsha = after.get("evalsha").copied().unwrap_or(0)
            - before.get("evalsha").copied().unwrap_or(0);
        (
            out,
            Cost {
                sent,
                requests,
                evalsha,
                others,
            },
        )
    }
}

/// Commands the scripts call inside Redis (never sent by the client).
const INNER: &[&str] = &["time", "get", "set", "del", "pexpiretime"];

fn assert_one_script_call(what: &str, cost: &Cost) {
    println!("{what}: sent {:?}, inner {:?}", cost.sent, cost.others);
    assert_eq!(cost.sent, vec!["EVALSHA".to_owned()], "{what}: {cost:?}");
    assert_eq!(cost.requests, 1, "{what}: {cost:?}");
    assert_eq!(cost.evalsha, 1, "{what}: {cost:?}");
    for name in cost.others.keys() {
        assert!(
            INNER.contains(&name.as_str()),
            "{what}: unexpected command {name}: {cost:?}"
        );
    }
}

fn lease_of(outcome: idem_core::Result<AcquireOutcome>) -> Lease {
    match outcome {
        Ok(AcquireOutcome::Acquired { lease, .. }) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_transition_is_one_round_trip() {
    let Some(server) = PrivateRedis::start() else {
        return;
    };
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let mut counter = Counter {
        admin: admin(&server).await,
        monitor: Monitor::start(server.port),
        store: store.clone(),
        n: 0,
    };
    let ns = Namespace::new("rt").unwrap();
    let fp = Fingerprint::of("payload");
    let req = |id: &str| {
        AcquireRequest::new(ns.key(id).unwrap(), "w1")
            .with_fingerprint(fp)
            .with_lease_ttl(Duration::from_millis(300))
    };

    // `connect` loaded the scripts: even the first call of each is one EVALSHA.
    let (first, cost) = counter.measure(store.acquire(&req("first"))).await;
    assert_one_script_call("the first acquire on a fresh server", &cost);
    let first = lease_of(first);
    let (extended, cost) = counter.measure(store.extend(&first, HOUR)).await;
    assert_one_script_call("the first extend", &cost);
    let (released, cost) = counter.measure(store.release(&extended.unwrap())).await;
    assert_one_script_call("the first release", &cost);
    released.unwrap();

    let (fresh, cost) = counter.measure(store.acquire(&req("a"))).await;
    assert_one_script_call("acquire (fresh)", &cost);
    let lease = lease_of(fresh);

    let (busy, cost) = counter.measure(store.acquire(&req("a"))).await;
    assert_one_script_call("acquire (busy)", &cost);
    assert!(
        matches!(busy, Ok(AcquireOutcome::InProgress { .. })),
        "{busy:?}"
    );

    let other =
        AcquireRequest::new(ns.key("a").unwrap(), "w2").with_fingerprint(Fingerprint::of("x"));
    let (conflict, cost) = counter.measure(store.acquire(&other)).await;
    assert_one_script_call("acquire (conflict)", &cost);
    assert!(
        matches!(conflict, Ok(AcquireOutcome::Conflict)),
        "{conflict:?}"
    );

    let (extended, cost) = counter
        .measure(store.extend(&lease, Duration::from_millis(100)))
        .await;
    assert_one_script_call("extend", &cost);
    let lease = extended.unwrap();

    tokio::time::sleep(Duration::from_millis(150)).await;
    let (takeover, cost) = counter.measure(store.acquire(&req("a"))).await;
    assert_one_script_call("acquire (takeover)", &cost);
    assert!(
        matches!(
            &takeover,
            Ok(AcquireOutcome::Acquired { takeover: true, .. })
        ),
        "{takeover:?}"
    );
    let current = lease_of(takeover);

    let (zombie, cost) = counter
        .measure(store.complete(&lease, Bytes::from_static(b"late"), HOUR))
        .await;
    assert_one_script_call("complete (fenced off)", &cost);
    assert!(matches!(zombie, Err(Error::LeaseLost { .. })), "{zombie:?}");

    let (done, cost) = counter
        .measure(store.complete(&current, Bytes::from_static(b"result"), HOUR))
        .await;
    assert_one_script_call("complete", &cost);
    done.unwrap();

    let (dup, cost) = counter.measure(store.acquire(&req("a"))).await;
    assert_one_script_call("acquire (duplicate)", &cost);
    assert!(
        matches!(&dup, Ok(AcquireOutcome::Replayed { result }) if result.as_ref() == b"result"),
        "{dup:?}"
    );

    let b = lease_of(store.acquire(&req("b")).await);
    let (failed, cost) = counter
        .measure(store.fail(&b, "boom", FailureKind::Retryable, HOUR))
        .await;
    assert_one_script_call("fail", &cost);
    failed.unwrap();

    let (retry, cost) = counter.measure(store.acquire(&req("b"))).await;
    assert_one_script_call("acquire (retry after failure)", &cost);
    let b = lease_of(retry);

    let (released, cost) = counter.measure(store.release(&b)).await;
    assert_one_script_call("release", &cost);
    released.unwrap();

    let (record, cost) = counter.measure(store.get(&b.key)).await;
    assert_one_script_call("get", &cost);
    assert!(record.unwrap().is_some());

    let (deleted, cost) = counter.measure(store.delete(&b.key)).await;
    assert_one_script_call("delete", &cost);
    assert!(deleted.unwrap());

    // Replays and refusals are one call too.
    let c = lease_of(store.acquire(&req("c")).await);
    for kind in FailureKind::ALL {
        let c = lease_of(store.acquire(&req(&format!("c-{kind}"))).await);
        store.fail(&c, "boom", kind, HOUR).await.unwrap();
        let (replayed, cost) = counter.measure(store.fail(&c, "boom", kind, HOUR)).await;
        assert_one_script_call("fail (replayed)", &cost);
        replayed.unwrap();
        let (refused, cost) = counter.measure(store.fail(&c, "bang", kind, HOUR)).await;
        assert_one_script_call("fail (refused, not in progress)", &cost);
        assert!(
            matches!(
                refused,
                Err(Error::LeaseLost {
                    why: LostLease::NotInProgress { .. },
                    ..
                })
            ),
            "{refused:?}"
        );
    }
    store.complete(&c, Bytes::new(), HOUR).await.unwrap();
    let (replayed, cost) = counter
        .measure(store.complete(&c, Bytes::new(), HOUR))
        .await;
    assert_one_script_call("complete (replayed)", &cost);
    replayed.unwrap();

    // A server that lost its scripts (a restart, SCRIPT FLUSH): EVALSHA answers NOSCRIPT and the
    // script goes in full with EVAL, which caches it; the next call is one EVALSHA again.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut counter.admin)
        .await
        .unwrap();
    let (flushed, cost) = counter.measure(store.acquire(&req("d"))).await;
    println!("acquire after SCRIPT FLUSH: sent {:?}", cost.sent);
    assert_eq!(cost.sent, ["EVALSHA", "EVAL"], "{cost:?}");
    assert_eq!(cost.requests, 2, "{cost:?}");
    lease_of(flushed);
    let (busy, cost) = counter.measure(store.acquire(&req("d"))).await;
    assert_one_script_call("acquire (after the reload)", &cost);
    assert!(
        matches!(busy, Ok(AcquireOutcome::InProgress { .. })),
        "{busy:?}"
    );
}

/// A stored record, decoded here independently of the scripts, following the layout in the
/// crate docs.
#[derive(Debug, PartialEq)]
struct Packed {
    state: u8,
    token: u64,
    attempts: u64,
    updated: i64,
    created: Option<i64>,
    lease: Option<i64>,
    fingerprint: Option<Vec<u8>>,
    owner: String,
    payload: Vec<u8>,
}

fn unpack(v: &[u8]) -> Packed {
    let head = v[0];
    assert_eq!(head & 0b1100_0000, 0b1000_0000, "format 1: {head:#b}");
    let token = u64::from_be_bytes(v[1..9].try_into().unwrap());
    let mut rest = &v[9..];
    let mut unsigned = || {
        let (n, len) = u64::decode_var(rest).expect("varint");
        rest = &rest[len..];
        n
    };
    let attempts = unsigned();
    let zigzag = |n: u64| i64::decode_var(&n.encode_var_vec()).unwrap().0;
    let updated = zigzag(unsigned());
    let created = (head & 16 != 0).then(|| zigzag(unsigned()));
    let lease = (head & 32 != 0).then(|| zigzag(unsigned()));
    let fingerprint = (head & 8 != 0).then(|| {
        let (fp, tail) = rest.split_at(32);
        rest = tail;
        fp.to_vec()
    });
    let (len, n) = u64::decode_var(rest).expect("owner length");
    let (owner, payload) = rest[n..].split_at(usize::try_from(len).unwrap());
    Packed {
        state: head & 7,
        token,
        attempts,
        updated,
        created,
        lease,
        fingerprint,
        owner: String::from_utf8(owner.to_vec()).unwrap(),
        payload: payload.to_vec(),
    }
}

async fn raw_value(admin: &mut MultiplexedConnection, storage_key: &[u8]) -> (Vec<u8>, i64) {
    let value: Vec<u8> = redis::cmd("GET")
        .arg(storage_key)
        .query_async(admin)
        .await
        .unwrap();
    let pttl: i64 = redis::cmd("PTTL")
        .arg(storage_key)
        .query_async(admin)
        .await
        .unwrap();
    (value, pttl)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_layout_is_one_packed_string_with_key_expiry() {
    let Some(server) = PrivateRedis::start() else {
        return;
    };
    let store = RedisStore::connect_with(&server.url(), RedisConfig::default())
        .await
        .unwrap();
    let mut admin = admin(&server).await;
    let ns = Namespace::new("bench").unwrap();
    let key = ns.key("k0000001").unwrap();
    let storage_key = store.storage_key(&key);
    assert_eq!(storage_key, b"idem:bench:k0000001");
    let fp = Fingerprint::of("p");
    let lease_ttl = Duration::from_secs(30);

    let req = AcquireRequest::new(key.clone(), "w1")
        .with_fingerprint(fp)
        .with_lease_ttl(lease_ttl);
    let lease = lease_of(store.acquire(&req).await);
    let (value, pttl) = raw_value(&mut admin, &storage_key).await;
    let packed = unpack(&value);
    let base = i64::try_from(lease.token.get() / 1000).unwrap();
    assert_eq!(value[0], 128 + 8 + 32, "in progress, fingerprint, lease");
    assert_eq!(packed.state, 0);
    assert_eq!(packed.token, lease.token.get());
    assert_eq!(packed.attempts, 1);
    assert_eq!(packed.created, None, "created at the token's millisecond");
    assert_eq!(packed.updated, 0);
    let lease_end = i64::try_from(
        lease
            .expires_at
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap();
    assert_eq!(packed.lease, Some(lease_end - base));
    assert_eq!(packed.fingerprint.as_deref(), Some(&fp.as_bytes()[..]));
    assert_eq!(packed.owner, "w1");
    assert!(packed.payload.is_empty());
    assert_eq!(pttl, -1, "records in progress carry no expiry");

    tokio::time::sleep(Duration::from_millis(5)).await;
    store.complete(&lease, Bytes::new(), HOUR).await.unwrap();
    let (value, pttl) = raw_value(&mut admin, &storage_key).await;
    let packed = unpack(&value);
    assert_eq!(value[0], 128 + 2 + 8, "completed, fingerprint, no lease");
    assert_eq!(packed.state, 2);
    assert_eq!(packed.lease, None);
    assert!(packed.updated >= 5, "{packed:?}");
    assert!(
        pttl > 3_590_000 && pttl <= 3_600_000,
        "retention is the key's expiry: {pttl}"
    );
    // Head, token, attempts, updated (one or two bytes), fingerprint, owner length and owner.
    assert!(
        (1 + 8 + 1 + 1 + 32 + 1 + 2..=1 + 8 + 1 + 2 + 32 + 1 + 2).contains(&value.len()),
        "{} bytes",
        value.len()
    );
    let bytes: u64 = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(&storage_key)
        .query_async(&mut admin)
        .await
        .unwrap();
    println!(
        "MEMORY USAGE of a completed record with an empty result and a fingerprint: {bytes} B \
         ({} bytes of value)",
        value.len()
    );
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.token, lease.token);
    assert!(record.expires_at.is_some());

    // A result and an error are the tail of the value; a later attempt records when the key was
    // created, relative to its newer token.
    let key = ns.key("k0000002").unwrap();
    let storage_key = store.storage_key(&key);
    let req = AcquireRequest::new(key.clone(), "worker-two");
    let first = lease_of(store.acquire(&req).await);
    store
        .fail(&first, "timeout \u{1F4A5}", FailureKind::Retryable, HOUR)
        .await
        .unwrap();
    let (value, _) = raw_value(&mut admin, &storage_key).await;
    let packed = unpack(&value);
    assert_eq!((packed.state, packed.fingerprint), (3, None));
    assert_eq!(packed.payload, "timeout \u{1F4A5}".as_bytes());
    tokio::time::sleep(Duration::from_millis(3)).await;
    let second = lease_of(store.acquire(&req).await);
    store
        .complete(&second, Bytes::from_static(b"\x00{\"ok\":1}\xff"), HOUR)
        .await
        .unwrap();
    let (value, _) = raw_value(&mut admin, &storage_key).await;
    let packed = unpack(&value);
    assert_eq!((packed.state, packed.attempts), (2, 2));
    assert_eq!(packed.payload, b"\x00{\"ok\":1}\xff");
    assert_eq!(packed.owner, "worker-two");
    let created = packed.created.expect("created before the second token");
    assert!(created >= 3, "{packed:?}");
    let record = store.get(&key).await.unwrap().unwrap();
    let first_ms = first
        .token
        .get()
        .checked_div(1000)
        .map(|ms| std::time::UNIX_EPOCH + Duration::from_millis(ms))
        .unwrap();
    assert_eq!(record.created_at, first_ms);

    // delete leaves a tombstone: the head of a tombstone and the token, nothing else.
    assert!(store.delete(&key).await.unwrap());
    let (value, pttl) = raw_value(&mut admin, &storage_key).await;
    let mut tombstone = vec![128 + 7];
    tombstone.extend_from_slice(&second.token.get().to_be_bytes());
    assert_eq!(value, tombstone);
    assert!(pttl > 604_700_000, "{pttl}");

    // Each failure kind is its own state in the head byte (the table in the crate docs), with
    // the error text as the tail and the retention as the key's expiry; it reads back exactly.
    for (kind, state) in [
        (FailureKind::Retryable, 3),
        (FailureKind::Terminal, 4),
        (FailureKind::ResultNotStored, 5),
    ] {
        let key = ns.key(format!("failed-{kind}")).unwrap();
        let storage_key = store.storage_key(&key);
        let lease = lease_of(
            store
                .acquire(&AcquireRequest::new(key.clone(), "w").with_max_attempts(1))
                .await,
        );
        let error = format!("why: {kind} \u{e9}");
        store.fail(&lease, &error, kind, HOUR).await.unwrap();
        let (value, pttl) = raw_value(&mut admin, &storage_key).await;
        let packed = unpack(&value);
        assert_eq!(
            value[0] & !7,
            128,
            "no fingerprint, no created, no lease: {value:?}"
        );
        assert_eq!(packed.state, state, "{kind}: {packed:?}");
        assert_eq!(packed.token, lease.token.get());
        assert_eq!(packed.owner, "w");
        assert_eq!(packed.payload, error.as_bytes());
        assert!(pttl > 3_590_000 && pttl <= 3_600_000, "{pttl}");
        let record = store.get(&key).await.unwrap().unwrap();
        assert_eq!(
            record.state,
            RecordState::Failed {
                error: error.clone(),
                kind
            }
        );
        let again = store
            .acquire(&AcquireRequest::new(key, "w").with_max_attempts(1))
            .await;
        let expected = match kind {
            FailureKind::Retryable => AcquireOutcome::Exhausted {
                attempts: 1,
                last_error: Some(error),
            },
            _ => AcquireOutcome::Failed { error, kind },
        };
        assert_eq!(again.unwrap(), expected, "{kind}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_is_unavailable_then_the_store_reconnects() {
    let Some(mut server) = PrivateRedis::start() else {
        return;
    };
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let ns = Namespace::new("outage").unwrap();
    let lease = lease_of(
        store
            .acquire(&AcquireRequest::new(ns.key("a").unwrap(), "w"))
            .await,
    );

    let port = server.port;
    server.stop();
    let started = Instant::now();
    let r = store
        .acquire(&AcquireRequest::new(ns.key("b").unwrap(), "w"))
        .await;
    assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
    let r = store.complete(&lease, Bytes::new(), HOUR).await;
    assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );

    // The connection manager reconnected after each failed call, and gives up after
    // `RedisConfig::retries` attempts (50 to 500 ms apart; each refused at once). It then keeps
    // the failed attempt until the next call: nothing to await from outside, so wait well past
    // that.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // A new server on the same port (empty: no persistence), accepting connections: the very
    // first call succeeds (the connection manager answers it with the refusal of its last
    // reconnect, which the store retries), reloads its scripts on NOSCRIPT, and the old lease
    // is gone.
    let _server = PrivateRedis::start_on(port);
    let outcome = store
        .acquire(&AcquireRequest::new(ns.key("c").unwrap(), "w"))
        .await
        .expect("the first call once the server is back");
    assert!(
        matches!(outcome, AcquireOutcome::Acquired { .. }),
        "{outcome:?}"
    );
    let r = store.complete(&lease, Bytes::new(), HOUR).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_records_are_corrupt_and_left_alone() {
    let Some(server) = PrivateRedis::start() else {
        return;
    };
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let mut admin = admin(&server).await;
    let ns = Namespace::new("corrupt").unwrap();
    let set = async |admin: &mut MultiplexedConnection, id: &str, value: &[u8]| {
        let key = ns.key(id).unwrap();
        let _: () = redis::cmd("SET")
            .arg(store.storage_key(&key))
            .arg(value)
            .query_async(admin)
            .await
            .unwrap();
        key
    };

    // A tombstone (what `delete` leaves) is absent to every script; its token only raises the
    // next one.
    let mut tombstone = vec![128 + 7];
    tombstone.extend_from_slice(&12345u64.to_be_bytes());
    let key = set(&mut admin, "tombstone", &tombstone).await;
    assert!(store.get(&key).await.unwrap().is_none());
    assert!(!store.delete(&key).await.unwrap());
    let lease = lease_of(store.acquire(&AcquireRequest::new(key.clone(), "w")).await);
    assert_eq!(lease.attempt, 1);
    assert!(lease.token.get() > 12345);

    let token = 12345u64.to_be_bytes();
    let with_token = |head: u8, tail: &[u8]| [&[head][..], &token, tail].concat();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "bad-state",
            with_token(128 + 6, b"\x01\x00\x01w"),
            "unknown state 6",
        ),
        ("truncated", with_token(128 + 2, b""), "truncated"),
        (
            "overlong",
            with_token(128 + 2, &[0xff; 12]),
            "longer than 8 bytes",
        ),
        (
            "owner-cut",
            with_token(128 + 2, b"\x01\x00\x09w"),
            "truncated in the owner",
        ),
        (
            "fp-cut",
            with_token(128 + 2 + 8, b"\x01\x00abc"),
            "fingerprint",
        ),
        ("no-lease", with_token(128, b"\x01\x00\x01w"), "lease"),
        (
            "lease-done",
            with_token(128 + 2 + 32, b"\x01\x00\x02\x01w"),
            "lease",
        ),
        ("tomb-tail", with_token(128 + 7, b"x"), "tombstone"),
        (
            "reserved",
            with_token(128 + 64 + 2, b"\x01\x00\x01w"),
            "format",
        ),
        (
            "text",
            b"{\"some\": \"other application\"}".to_vec(),
            "format",
        ),
        ("short", vec![128 + 2, 1, 2], "format"),
        (
            "released-tail",
            with_token(128 + 1, b"\x01\x00\x01wgarbage"),
            "bytes after the owner",
        ),
    ];
    for (id, value, reason) in cases {
        let key = set(&mut admin, id, &value).await;
        for r in every_operation(&store, &key).await {
            match r {
                Err(Error::CorruptRecord { reason: why, .. }) => {
                    assert!(why.contains(reason), "{id}: {why:?} lacks {reason:?}");
                    assert!(!why.contains("script:"), "{id}: {why:?}");
                }
                other => panic!("{id}: expected CorruptRecord, got {other:?}"),
            }
        }
        let (stored, _) = raw_value(&mut admin, &store.storage_key(&key)).await;
        assert_eq!(stored, value, "{id}: a corrupt record is left as it was");
    }

    // Another type of value under the prefix (some other application's hash).
    let key = ns.key("a-hash").unwrap();
    let _: () = redis::cmd("HSET")
        .arg(store.storage_key(&key))
        .arg(&["t", "12345"])
        .query_async(&mut admin)
        .await
        .unwrap();
    for r in every_operation(&store, &key).await {
        assert!(
            matches!(&r, Err(Error::CorruptRecord { reason, .. }) if reason.contains("WRONGTYPE")),
            "{r:?}"
        );
    }
    let hash: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(store.storage_key(&key))
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(
        hash,
        HashMap::from([("t".to_owned(), "12345".to_owned())]),
        "left as it was"
    );
}

/// Runs all seven operations on `key` (the fenced ones with a lease holding token 12345).
async fn every_operation(
    store: &RedisStore,
    key: &idem_core::IdempotencyKey,
) -> [idem_core::Result<()>; 7] {
    let lease = Lease {
        key: key.clone(),
        owner: "w".into(),
        token: FencingToken::new(12345),
        attempt: 1,
        expires_at: SystemTime::now() + HOUR,
    };
    [
        store
            .acquire(&AcquireRequest::new(key.clone(), "w"))
            .await
            .map(drop),
        store.get(key).await.map(drop),
        store.delete(key).await.map(drop),
        store.extend(&lease, HOUR).await.map(drop),
        store.complete(&lease, Bytes::new(), HOUR).await,
        store.fail(&lease, "e", FailureKind::Retryable, HOUR).await,
        store.release(&lease).await,
    ]
}

/// A token above the server clock (left by a tombstone, after the clock stepped back) is the
/// `previous` of the next one, and the record's times, stored as negative offsets from it, read
/// back right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_above_the_clock_round_trip() {
    let Some(server) = PrivateRedis::start() else {
        return;
    };
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let mut admin = admin(&server).await;
    let key = Namespace::new("ahead").unwrap().key("k").unwrap();
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut admin).await.unwrap();
    // About 2.8 hours ahead of the server clock.
    let ahead = secs * 1_000_000 + micros + 10_000_000_000;
    let mut tombstone = vec![128 + 7];
    tombstone.extend_from_slice(&ahead.to_be_bytes());
    let _: () = redis::cmd("SET")
        .arg(store.storage_key(&key))
        .arg(&tombstone)
        .query_async(&mut admin)
        .await
        .unwrap();

    let started = SystemTime::now();
    let near = |t: SystemTime| {
        let d = t.duration_since(started).unwrap_or_else(|e| e.duration());
        d < Duration::from_secs(5)
    };
    let req = AcquireRequest::new(key.clone(), "w").with_fingerprint(Fingerprint::of("p"));
    let lease = lease_of(store.acquire(&req).await);
    assert_eq!(lease.token.get(), ahead + 1, "previous + 1 beats the clock");
    let record = store.get(&key).await.unwrap().unwrap();
    assert!(near(record.created_at), "{record:?}");
    assert!(near(record.updated_at), "{record:?}");
    let (value, _) = raw_value(&mut admin, &store.storage_key(&key)).await;
    let packed = unpack(&value);
    assert!(packed.updated < 0, "{packed:?}");
    assert!(
        packed.created.is_some(),
        "created is not the token's ms: {packed:?}"
    );

    let lease = store.extend(&lease, HOUR).await.unwrap();
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(record.lease_expires_at, Some(lease.expires_at));
    store
        .complete(&lease, Bytes::from_static(b"done"), HOUR)
        .await
        .unwrap();
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(
        record.state,
        RecordState::Completed {
            result: Bytes::from_static(b"done")
        }
    );
    assert_eq!(record.token, lease.token);
    assert!(near(record.created_at), "{record:?}");
    assert!(near(record.updated_at), "{record:?}");
    assert!(
        near(record.expires_at.expect("retention") - HOUR),
        "{record:?}"
    );
    let replay = store.acquire(&req).await;
    assert!(
        matches!(&replay, Ok(AcquireOutcome::Replayed { result }) if result == "done"),
        "{replay:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_server_is_unavailable_within_the_bound() {
    let Some(server) = PrivateRedis::start() else {
        return;
    };
    let config = RedisConfig::default()
        .with_response_timeout(Duration::from_millis(300))
        .with_operation_timeout(Duration::from_secs(1));
    let store = RedisStore::connect_with(&server.url(), config)
        .await
        .unwrap();
    let mut admin = admin(&server).await;
    let ns = Namespace::new("stall").unwrap();
    lease_of(
        store
            .acquire(&AcquireRequest::new(ns.key("warm").unwrap(), "w"))
            .await,
    );

    // The server accepts the request but answers nobody for 3 s.
    let _: () = redis::cmd("CLIENT")
        .arg(&["PAUSE", "3000", "ALL"])
        .query_async(&mut admin)
        .await
        .unwrap();
    let started = Instant::now();
    let r = store
        .acquire(&AcquireRequest::new(ns.key("a").unwrap(), "w"))
        .await;
    let took = started.elapsed();
    assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
    assert!(took < Duration::from_millis(1500), "{took:?}");

    // Once the pause ends, the store answers again.
    tokio::time::sleep(Duration::from_millis(3200)).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match store
            .acquire(&AcquireRequest::new(ns.key("b").unwrap(), "w"))
            .await
        {
            Ok(outcome) => {
                assert!(
                    matches!(outcome, AcquireOutcome::Acquired { .. }),
                    "{outcome:?}"
                );
                break;
            }
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("store did not recover: {e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_memory_is_unavailable() {
    let Some(server) = PrivateRedis::start() else {
        return;
    };
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let mut admin = admin(&server).await;
    let key = Namespace::new("oom").unwrap().key("k").unwrap();
    let config_set = |value: &'static str| {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("SET").arg("maxmemory").arg(value);
        cmd
    };

    // Over maxmemory (noeviction), Redis refuses a writing script before running it.
    let _: () = config_set("1").query_async(&mut admin).await.unwrap();
    let r = store.acquire(&AcquireRequest::new(key.clone(), "w")).await;
    let _: () = config_set("0").query_async(&mut admin).await.unwrap();
    assert!(
        matches!(&r, Err(Error::Unavailable { store: "redis", .. }) if r.as_ref().unwrap_err().is_retryable()),
        "{r:?}"
    );
    assert!(r.unwrap_err().to_string().contains("OOM"));

    // Nothing ran: the key is fresh, attempt 1.
    let lease = lease_of(store.acquire(&AcquireRequest::new(key, "w")).await);
    assert_eq!(lease.attempt, 1);
}
