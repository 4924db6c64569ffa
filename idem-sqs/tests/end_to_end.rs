//! End to end on LocalStack's SQS, on a standard queue and on a FIFO queue: 3,000 messages (20%
//! duplicates sent as separate messages, a few keys reused with another payload, a few poison
//! keys whose handler always fails), two consumer processes sharing a Redis store, one killed
//! with SIGKILL mid-run and started again. The business effect is a Redis hash written by the
//! handler and fenced by the lease's token.
//!
//! Needs LocalStack (`IDEM_LOCALSTACK_ENDPOINT`) and Redis (`IDEM_REDIS_URL`); start both with
//! `scripts/services.sh localstack redis`. Without them each test returns after one "skipped"
//! line; with `CI=true` it fails.
//!
//! The consumer processes are this test binary itself, run again with `IDEM_SQS_E2E_CHILD=1` and
//! the test name `child_consumer_process` (which does nothing in a normal run). A child stops
//! gracefully (drain, pending deletes) when its standard input closes.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use idem_core::{IdempotencyStore, Namespace, RecordState};
use idem_executor::{Executor, ExecutorConfig, HandlerContext, HandlerError};
use idem_sqs::{
    ATTR_ATTEMPTS, ATTR_ERROR, ATTR_KEY, ATTR_REASON, RunnerOptions, SqsMessage, SqsRunner,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use redis::AsyncCommands;

const CHILD_VAR: &str = "IDEM_SQS_E2E_CHILD";
const TOTAL: usize = 3000;
const DUPLICATES: usize = 600;
const CONFLICTS: usize = 12;
const UNIQUE: usize = TOTAL - DUPLICATES - CONFLICTS;
/// Originals whose number is 7 modulo this are poison: their handler always fails.
const POISON_EVERY: usize = 300;
const MAX_ATTEMPTS: u32 = 3;
const NAMESPACE: &str = "e2e";
/// FIFO message groups (keys are spread over them; a key's copies share its group).
const GROUPS: usize = 40;

/// Accepts an effect only from a token at least as high as the one that wrote the key before:
/// a worker that lost its lease cannot overwrite its successor's effect.
const LEDGER_WRITE: &str = r"
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  local t = tonumber(string.match(cur, '^(%d+)|'))
  if t > tonumber(ARGV[2]) then
    redis.call('HINCRBY', KEYS[2], 'stale', 1)
    return 0
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. '|' .. ARGV[3])
return 1
";

struct Names {
    queue: String,
    dlq: String,
    prefix: String,
}

impl Names {
    fn ledger(&self) -> String {
        format!("{}ledger", self.prefix)
    }
    fn runs(&self) -> String {
        format!("{}runs", self.prefix)
    }
    fn counters(&self) -> String {
        format!("{}counters", self.prefix)
    }
    fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} missing"));
        Self {
            queue: var("IDEM_E2E_QUEUE"),
            dlq: var("IDEM_E2E_DLQ"),
            prefix: var("IDEM_E2E_PREFIX"),
        }
    }
}

/// The consumer process (only when run as a child by the tests below).
#[test]
fn child_consumer_process() {
    if std::env::var(CHILD_VAR).is_err() {
        return;
    }
    init_tracing();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(child_main());
}

async fn child_main() {
    let names = Names::from_env();
    let owner = std::env::var("IDEM_E2E_OWNER").unwrap();
    let store = shared(redis_store(&format!("{}idem:", names.prefix)).await);
    let conn = redis_conn().await;
    let script = Arc::new(redis::Script::new(LEDGER_WRITE));
    let (ledger, runs, counters) = (names.ledger(), names.runs(), names.counters());
    let handler = move |msg: SqsMessage, ctx: HandlerContext| {
        let mut conn = conn.clone();
        let script = Arc::clone(&script);
        let (ledger, runs, counters) = (ledger.clone(), runs.clone(), counters.clone());
        async move {
            let key = ctx.key().expect("deduplicated").id().to_owned();
            let token = ctx.token().expect("leased").get();
            let _: i64 = conn.hincr(&runs, format!("{key}|{token}"), 1).await?;
            tokio::time::sleep(Duration::from_millis(2)).await;
            if msg.body().contains("\"poison\":true") {
                return Err(HandlerError::retryable(format!(
                    "poison payload, attempt {}",
                    ctx.attempt()
                )));
            }
            let _: i64 = script
                .key(&ledger)
                .key(&counters)
                .arg(&key)
                .arg(token)
                .arg(msg.body())
                .invoke_async(&mut conn)
                .await?;
            Ok::<_, HandlerError>(token)
        }
    };
    let config = ExecutorConfig::new(NAMESPACE)
        .with_owner(owner.clone())
        .with_lease_ttl(Duration::from_secs(3))
        .with_heartbeat_interval(Duration::from_secs(1))
        .with_max_attempts(MAX_ATTEMPTS)
        .with_retry_delay(Duration::from_secs(1));
    let runner = SqsRunner::builder(
        client(),
        &names.queue,
        Executor::new(store, config).expect("executor"),
        handler,
    )
    .dead_letter_queue(&names.dlq)
    .options(
        RunnerOptions::default()
            .with_max_in_flight(16)
            .with_wait_time(Duration::from_secs(1))
            .with_visibility_timeout(Duration::from_secs(5))
            .with_drain_timeout(Duration::from_secs(10)),
    )
    .build()
    .expect("runner");
    let stats = runner.stats();
    runner
        .run(async {
            use tokio::io::AsyncReadExt;
            let mut stdin = tokio::io::stdin();
            let mut buf = [0u8; 64];
            while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
        })
        .await
        .expect("runner run");
    eprintln!("child {owner} stopped: {stats:?}");
}

fn spawn_child(names: &Names, owner: &str) -> Child {
    let log = std::env::temp_dir().join(format!(
        "idem-sqs-e2e-{owner}-{}.log",
        names.prefix.trim_end_matches(':')
    ));
    let log = std::fs::File::create(&log).expect("child log");
    Command::new(std::env::current_exe().unwrap())
        .args([
            "child_consumer_process",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_VAR, "1")
        .env("IDEM_E2E_QUEUE", &names.queue)
        .env("IDEM_E2E_DLQ", &names.dlq)
        .env("IDEM_E2E_PREFIX", &names.prefix)
        .env("IDEM_E2E_OWNER", owner)
        .env(ENDPOINT_VAR, endpoint())
        .env(REDIS_VAR, redis_url())
        .stdin(Stdio::piped())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("spawn child consumer")
}

/// Closes the child's stdin (graceful stop) and waits for it.
fn stop_child(mut child: Child, name: &str) {
    drop(child.stdin.take());
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "consumer {name} exited with {status}");
            return;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("consumer {name} did not stop within 40 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Kills every child still running when the test fails.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[derive(Clone, Debug)]
struct Planned {
    key: String,
    group: String,
    payload: String,
    kind: Kind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Original,
    Duplicate,
    Conflict,
}

impl Planned {
    fn out(&self, fifo: bool) -> Out {
        let out = Out::keyed(&self.key, self.payload.clone());
        if fifo { out.group(&self.group) } else { out }
    }
}

/// 3,000 messages: every duplicate and conflict comes after its original.
fn plan(seed: u64) -> Vec<Planned> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut kinds: Vec<Kind> = std::iter::repeat_n(Kind::Original, UNIQUE - 1)
        .chain(std::iter::repeat_n(Kind::Duplicate, DUPLICATES))
        .chain(std::iter::repeat_n(Kind::Conflict, CONFLICTS))
        .collect();
    kinds.shuffle(&mut rng);
    kinds.insert(0, Kind::Original);
    let mut originals: Vec<Planned> = Vec::new();
    let mut conflicted = BTreeSet::new();
    let mut out = Vec::with_capacity(TOTAL);
    for kind in kinds {
        let rec = match kind {
            Kind::Original => {
                let n = originals.len();
                let poison = n % POISON_EVERY == 7;
                let rec = Planned {
                    key: format!("order-{n}"),
                    group: format!("g{}", n % GROUPS),
                    payload: format!(
                        "{{\"order\":{n},\"amount\":{},\"poison\":{poison}}}",
                        100 + n
                    ),
                    kind,
                };
                originals.push(rec.clone());
                rec
            }
            Kind::Duplicate => {
                let orig = &originals[rng.random_range(0..originals.len())];
                Planned {
                    kind,
                    ..orig.clone()
                }
            }
            Kind::Conflict => {
                let orig = loop {
                    let o = &originals[rng.random_range(0..originals.len())];
                    if !o.payload.contains("\"poison\":true") && conflicted.insert(o.key.clone()) {
                        break o;
                    }
                };
                Planned {
                    payload: orig.payload.replace("\"amount\":", "\"amount\":-"),
                    kind,
                    ..orig.clone()
                }
            }
        };
        out.push(rec);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_queue_two_processes_one_killed_give_exactly_one_effect_per_key() {
    end_to_end(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_queue_two_processes_one_killed_give_exactly_one_effect_per_key() {
    end_to_end(true).await;
}

async fn end_to_end(fifo: bool) {
    if !localstack_and_redis() {
        return;
    }
    init_tracing();
    let what = if fifo { "fifo" } else { "standard" };
    let sqs = client();
    let names = Names {
        queue: queue(&sqs, &format!("idem-e2e-{what}"), fifo).await,
        dlq: queue(&sqs, &format!("idem-e2e-{what}-dlq"), fifo).await,
        prefix: format!("{}:", unique(&format!("idem-sqs-e2e-{what}"))),
    };
    let seed = rand::rng().random();
    let planned = plan(seed);
    let originals: HashMap<&str, &str> = planned
        .iter()
        .filter(|p| p.kind == Kind::Original)
        .map(|p| (p.key.as_str(), p.payload.as_str()))
        .collect();
    let poison: BTreeSet<&str> = originals
        .iter()
        .filter(|(_, payload)| payload.contains("\"poison\":true"))
        .map(|(key, _)| *key)
        .collect();
    let conflicts: BTreeMap<&str, &str> = planned
        .iter()
        .filter(|p| p.kind == Kind::Conflict)
        .map(|p| (p.key.as_str(), p.payload.as_str()))
        .collect();
    let effects = UNIQUE - poison.len();
    assert_eq!((originals.len(), conflicts.len()), (UNIQUE, CONFLICTS));
    assert!(!poison.is_empty());

    // Originals and duplicates first; the conflicting copies once their originals are done, so
    // that on a standard queue (no order) the original is the one that ran.
    let started = Instant::now();
    let first: Vec<Out> = planned
        .iter()
        .filter(|p| p.kind != Kind::Conflict)
        .map(|p| p.out(fifo))
        .collect();
    send(&sqs, &names.queue, &first).await;
    let sent_in = started.elapsed();

    let mut conn = redis_conn().await;
    let ledger_len = |mut conn: redis::aio::ConnectionManager, key: String| async move {
        conn.hlen::<_, usize>(key).await.unwrap()
    };
    let started = Instant::now();
    let mut children = Children(vec![spawn_child(&names, "a"), spawn_child(&names, "b")]);
    // Kill A with SIGKILL once a fifth of the keys have their effect, then start it again.
    let reached = wait_for(Duration::from_secs(120), || {
        let (conn, key) = (conn.clone(), names.ledger());
        async move { ledger_len(conn, key).await >= UNIQUE / 5 }
    })
    .await;
    assert!(reached, "consumers made no progress");
    children.0[0].kill().expect("SIGKILL consumer a");
    children.0[0].wait().unwrap();
    let at_kill = ledger_len(conn.clone(), names.ledger()).await;
    let killed_at = started.elapsed();
    assert!(
        at_kill < effects,
        "the kill happened mid-run ({at_kill} of {effects} effects)"
    );
    children.0.push(spawn_child(&names, "a2"));

    let all = wait_for(Duration::from_secs(120), || {
        let (conn, key) = (conn.clone(), names.ledger());
        async move { ledger_len(conn, key).await >= effects }
    })
    .await;
    assert!(
        all,
        "effects: {} of {effects}",
        ledger_len(conn.clone(), names.ledger()).await
    );
    let effects_in = started.elapsed();
    let second: Vec<Out> = planned
        .iter()
        .filter(|p| p.kind == Kind::Conflict)
        .map(|p| p.out(fifo))
        .collect();
    send(&sqs, &names.queue, &second).await;
    // The queue empty: every message deleted (acknowledged or dead-lettered); a message waiting
    // for a retry counts as in flight.
    let emptied = wait_for(Duration::from_secs(90), || {
        let (sqs, url) = (sqs.clone(), names.queue.clone());
        async move { counts(&sqs, &url).await == (0, 0) }
    })
    .await;
    assert!(
        emptied,
        "the queue still holds {:?}",
        counts(&sqs, &names.queue).await
    );
    let emptied_in = started.elapsed();

    // Graceful stop of both survivors.
    let a2 = children.0.pop().unwrap();
    let b = children.0.pop().unwrap();
    tokio::task::spawn_blocking(move || {
        stop_child(b, "b");
        stop_child(a2, "a2");
    })
    .await
    .unwrap();
    assert_eq!(
        counts(&sqs, &names.queue).await,
        (0, 0),
        "the queue is empty"
    );

    // Exactly one effect per key, written by the acquisition the store completed.
    let store = redis_store(&format!("{}idem:", names.prefix)).await;
    let ns = Namespace::new(NAMESPACE).unwrap();
    let ledger: HashMap<String, String> = conn.hgetall(names.ledger()).await.unwrap();
    assert_eq!(
        ledger.len(),
        effects,
        "one ledger entry per key, every key but the poison ones"
    );
    for (key, entry) in &ledger {
        let (token, payload) = entry.split_once('|').unwrap();
        assert_eq!(
            Some(&payload),
            originals.get(key.as_str()),
            "{key}: the effect is the original payload's (never a conflicting one)"
        );
        let record = store.get(&ns.key(key).unwrap()).await.unwrap().expect(key);
        assert!(
            matches!(record.state, RecordState::Completed { .. }),
            "{key}: {record:?}"
        );
        assert_eq!(
            token,
            record.token.get().to_string(),
            "{key}: the effect was written by the acquisition the store completed"
        );
    }
    for key in &poison {
        let record = store.get(&ns.key(key).unwrap()).await.unwrap().expect(key);
        assert_eq!(record.attempts, MAX_ATTEMPTS, "{key}: {record:?}");
    }
    // No acquisition ran the handler twice; duplicates and redeliveries were replayed.
    let runs: HashMap<String, u64> = conn.hgetall(names.runs()).await.unwrap();
    let mut per_key: HashMap<&str, u64> = HashMap::new();
    for (run, count) in &runs {
        assert_eq!(*count, 1, "acquisition {run} ran the handler {count} times");
        *per_key.entry(run.split_once('|').unwrap().0).or_default() += 1;
    }
    assert_eq!(per_key.len(), UNIQUE, "every key ran");
    let rerun_keys = per_key
        .iter()
        .filter(|(k, n)| **n > 1 && !poison.contains(**k))
        .count();
    let total_runs: u64 = per_key.values().sum();
    // Re-runs happen only for the keys in process when A died: at most its 16 in flight.
    assert!(rerun_keys <= 16, "{rerun_keys} keys ran more than once");
    let stale: Option<u64> = conn.hget(names.counters(), "stale").await.unwrap();

    // The dead-letter queue: the conflicting copies and the poison messages, with reasons.
    let dlq = read_out(&sqs, &names.dlq, Duration::from_secs(1)).await;
    let mut conflicted = BTreeSet::new();
    let mut exhausted = BTreeSet::new();
    for m in &dlq {
        let key = m.attributes[ATTR_KEY].as_str();
        assert_eq!(
            m.attributes.get("idempotency-key").map(String::as_str),
            Some(key),
            "original attributes kept: {m:?}"
        );
        match m.attributes[ATTR_REASON].as_str() {
            "conflict" => {
                assert_eq!(m.attributes[ATTR_ATTEMPTS], "0");
                assert!(m.attributes[ATTR_ERROR].contains("conflict"), "{m:?}");
                assert_eq!(
                    Some(&m.body.as_str()),
                    conflicts.get(key),
                    "the conflicting body kept"
                );
                conflicted.insert(key);
            }
            "exhausted" => {
                assert_eq!(m.attributes[ATTR_ATTEMPTS], MAX_ATTEMPTS.to_string());
                assert!(
                    m.attributes[ATTR_ERROR].starts_with("poison payload"),
                    "{m:?}"
                );
                assert_eq!(Some(&m.body.as_str()), originals.get(key));
                exhausted.insert(key);
            }
            other => panic!("unexpected dead-letter reason {other}: {m:?}"),
        }
        if fifo {
            let n: usize = key.trim_start_matches("order-").parse().unwrap();
            let group = format!("g{}", n % GROUPS);
            assert_eq!(m.group.as_deref(), Some(group.as_str()), "the group kept");
        }
    }
    assert_eq!(
        conflicted,
        conflicts.keys().copied().collect(),
        "exactly the conflicting messages are dead-lettered as conflicts"
    );
    assert_eq!(
        exhausted, poison,
        "every poison key is dead-lettered as exhausted"
    );

    eprintln!(
        "end-to-end {what} (seed {seed}): {TOTAL} messages ({UNIQUE} keys of which {} poison, \
         {DUPLICATES} duplicates, {CONFLICTS} conflicts) sent in {sent_in:?}; consumer a \
         SIGKILLed at {killed_at:?} with {at_kill} effects done; all effects at {effects_in:?}, \
         queue empty at {emptied_in:?}; handler runs {total_runs} ({rerun_keys} keys ran more \
         than once, poison keys aside), stale effect writes refused {}, dead-letter messages {}",
        poison.len(),
        stale.unwrap_or(0),
        dlq.len(),
    );
}
