//! Store-level throughput of batches against single calls, on Redis, Redis Cluster and
//! PostgreSQL, in one run.
//!
//! ```text
//! cargo bench -p idem --features redis,postgres --bench batch_bench
//! ```
//!
//! For each store, 64 concurrent tasks (`IDEM_BENCH_TASKS`) process fresh keys (a fingerprint, a 2-byte result):
//!
//! - unbatched: each task loops `acquire` then `complete`, one message at a time;
//! - batched: each task loops `acquire_many` of 100 keys then `complete_many` of the 100 leases.
//!
//! and prints messages per second of each and their ratio. On the standalone server it also runs
//! a raw baseline with no store, in the same run: 64 tasks each looping one pipeline of 100
//! `SET key 1 NX PX 30000`, then one pipeline of 100 `SET key done EX 600` (the cheapest
//! dedupe there is, with none of the store's guarantees: no fencing, no tokens, no replayed
//! results); then the same claims finished with the least a fenced completion does, by one
//! script call per 100 keys whose only work is `GET`, compare with the claim's token, `SET`
//! (what any script-based fence costs the server at the least, before the store's record
//! format, state machine and replies), and, where the server has it (Redis 8.4, Valkey 8.1),
//! by a pipeline of `SET key done IFEQ token`, a fenced completion as one native command;
//! and for each standalone row the server's CPU time per message (`INFO cpu`, user +
//! system, before and after), which tells the server's work per message apart from the
//! client's and the network's. On the cluster it runs the batched
//! loop twice: with ids spread over the slots (one script call per slot, so about one per key,
//! sent concurrently) and with the ids of each batch under one hash tag (one call per batch).
//! Prints figures only; asserts nothing.
//!
//! Servers: `IDEM_REDIS_URL` (default `redis://127.0.0.1:6379`), `IDEM_REDIS_CLUSTER_NODES`
//! (default the three nodes `127.0.0.1:7001-7003`), `IDEM_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`; the bench migrates a schema of its own and drops
//! it at the end). A store that cannot be reached is reported and skipped.
//! `IDEM_BENCH_SECONDS` (default 3): the length of each measurement. `IDEM_BENCH_ROUNDS`
//! (default 3): each round runs every mode once, in turn, and the summary lines give the median
//! of the rounds' ratios (the disk behind PostgreSQL, for one, varies a lot from one second to
//! the next on a shared machine). `IDEM_BENCH_STORES`
//! (default all): a comma-separated choice of `redis`, `redis-cluster`, `postgres`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem::postgres::{PostgresConfig, PostgresStore};
use idem::redis::{RedisConfig, RedisStore};
use idem::{
    AcquireOutcome, AcquireRequest, Bytes, Completion, DynStore, Fingerprint, IdempotencyStore,
    Namespace,
};
use redis::aio::MultiplexedConnection;

/// Concurrent tasks (`IDEM_BENCH_TASKS`, default 64).
fn tasks() -> usize {
    std::env::var("IDEM_BENCH_TASKS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64)
}
const BATCH: usize = 100;
const RETENTION: Duration = Duration::from_secs(600);

fn seconds() -> Duration {
    let s = std::env::var("IDEM_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    Duration::from_secs_f64(s)
}

fn request(ns: &Namespace, id: String, owner: &str) -> AcquireRequest {
    AcquireRequest::new(ns.key(id).expect("a valid id"), owner)
        .with_fingerprint(Fingerprint::of("payload"))
}

/// How ids are made for one batch of task `task`, batch number `n`.
#[derive(Clone, Copy)]
enum Ids {
    /// `t{task}-{n}-{i}`: spread over the cluster's slots.
    Spread,
    /// `{t{task}-{n}}:{i}`: one hash tag per batch.
    Tagged,
}

impl Ids {
    fn id(self, task: usize, n: u64, i: usize) -> String {
        match self {
            Self::Spread => format!("t{task}-{n}-{i}"),
            Self::Tagged => format!("{{t{task}-{n}}}:{i}"),
        }
    }
}

/// [`tasks`] tasks, each looping single acquires and completions.
async fn unbatched(store: &DynStore, ns: &Namespace) -> Measured {
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + seconds();
    let start = Instant::now();
    let tasks: Vec<_> = (0..tasks())
        .map(|task| {
            let (store, ns, done) = (store.clone(), ns.clone(), done.clone());
            tokio::spawn(async move {
                let owner = format!("bench-{task}");
                let mut n = 0u64;
                while Instant::now() < until {
                    n += 1;
                    let req = request(&ns, format!("u{task}-{n}"), &owner);
                    match store.acquire(&req).await.expect("acquire") {
                        AcquireOutcome::Acquired { lease, .. } => {
                            store
                                .complete(&lease, Bytes::from_static(b"ok"), RETENTION)
                                .await
                                .expect("complete");
                        }
                        other => panic!("a fresh key must be acquired, got {other:?}"),
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    Measured::of(&done, start)
}

/// [`tasks`] tasks, each looping `acquire_many` and `complete_many` of
/// `BATCH` keys.
async fn batched(store: &DynStore, ns: &Namespace, ids: Ids) -> Measured {
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + seconds();
    let start = Instant::now();
    let tasks: Vec<_> = (0..tasks())
        .map(|task| {
            let (store, ns, done) = (store.clone(), ns.clone(), done.clone());
            tokio::spawn(async move {
                let owner = format!("bench-{task}");
                let mut n = 0u64;
                while Instant::now() < until {
                    n += 1;
                    let reqs: Vec<_> = (0..BATCH)
                        .map(|i| request(&ns, ids.id(task, n, i), &owner))
                        .collect();
                    let outcomes = store.acquire_many(&reqs).await.expect("acquire_many");
                    let completions: Vec<_> = outcomes
                        .into_iter()
                        .map(|o| match o {
                            Ok(AcquireOutcome::Acquired { lease, .. }) => {
                                Completion::new(lease, Bytes::from_static(b"ok"))
                            }
                            other => panic!("a fresh key must be acquired, got {other:?}"),
                        })
                        .collect();
                    let results = store
                        .complete_many(&completions, RETENTION)
                        .await
                        .expect("complete_many");
                    for r in results {
                        r.expect("complete");
                    }
                    done.fetch_add(BATCH as u64, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    Measured::of(&done, start)
}

/// How a raw baseline finishes the keys it claimed.
#[derive(Clone, Copy)]
enum Finish {
    /// A pipeline of `SET key done EX 600`: no fence at all.
    Plain,
    /// One script call per batch whose only work per key is the least a fenced completion
    /// does: `GET`, compare with the claim's token, `SET key done EX 600`. The least any
    /// script-based fenced completion costs the server (the store's adds the record's format,
    /// the state machine and per-key replies).
    Script,
    /// A pipeline of `SET key done IFEQ token EX 600` (Redis 8.4, Valkey 8.1): a fenced
    /// completion as one native command.
    IfEq,
}

/// The script of [`Finish::Script`].
const FENCED_FINISH: &str = r"
local n = 0
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    redis.call('SET', KEYS[i], ARGV[2], 'EX', ARGV[3])
    n = n + 1
  end
end
return n
";

/// Whether the server takes `SET ... IFEQ` (an older server answers a syntax error).
async fn has_set_ifeq(conn: &MultiplexedConnection, prefix: &str) -> bool {
    let mut conn = conn.clone();
    let probe = format!("{prefix}ifeq-probe");
    let answer: redis::RedisResult<Option<String>> = redis::cmd("SET")
        .arg(&probe)
        .arg("1")
        .arg("IFEQ")
        .arg("0")
        .query_async(&mut conn)
        .await;
    let _: redis::RedisResult<()> = redis::cmd("UNLINK")
        .arg(&probe)
        .query_async(&mut conn)
        .await;
    answer.is_ok()
}

/// A raw baseline on the standalone server, with no store: [`tasks`] tasks, each looping one
/// pipeline of `BATCH` `SET key token NX PX 30000` (the token its task and batch) and then
/// finishing the keys it got as `finish` says; and the server's CPU time per message (µs) it
/// cost. Deletes its keys at the end (not counted).
async fn pipelined(
    conn: &MultiplexedConnection,
    prefix: &str,
    finish: Finish,
) -> (Measured, Option<f64>) {
    let mut cpu_conn = conn.clone();
    let cpu_before = server_cpu(&mut cpu_conn).await;
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + seconds();
    let start = Instant::now();
    let raw = Arc::new(format!("{prefix}raw:"));
    let key = move |task: usize, n: u64, i: usize| format!("{raw}t{task}-{n}-{i}");
    let script = Arc::new(redis::Script::new(FENCED_FINISH));
    let tasks: Vec<_> = (0..tasks())
        .map(|task| {
            let (mut conn, done, key) = (conn.clone(), done.clone(), key.clone());
            let script = script.clone();
            tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < until {
                    n += 1;
                    let token = format!("{task}-{n}");
                    let mut claim = redis::pipe();
                    for i in 0..BATCH {
                        claim
                            .cmd("SET")
                            .arg(key(task, n, i))
                            .arg(&token)
                            .arg("NX")
                            .arg("PX")
                            .arg(30_000);
                    }
                    let claimed: Vec<Option<String>> =
                        claim.query_async(&mut conn).await.expect("SET NX");
                    assert!(
                        claimed.iter().all(Option::is_some),
                        "a fresh key must be claimed"
                    );
                    let finished = match finish {
                        Finish::Plain | Finish::IfEq => {
                            let mut pipe = redis::pipe();
                            for i in 0..BATCH {
                                let set = pipe.cmd("SET").arg(key(task, n, i)).arg("done");
                                if let Finish::IfEq = finish {
                                    set.arg("IFEQ").arg(&token);
                                }
                                set.arg("EX").arg(RETENTION.as_secs());
                            }
                            let replies: Vec<Option<String>> =
                                pipe.query_async(&mut conn).await.expect("SET");
                            replies.iter().flatten().count()
                        }
                        Finish::Script => {
                            let mut call = script.prepare_invoke();
                            for i in 0..BATCH {
                                call.key(key(task, n, i));
                            }
                            call.arg(&token).arg("done").arg(RETENTION.as_secs());
                            call.invoke_async(&mut conn).await.expect("script")
                        }
                    };
                    assert_eq!(finished, BATCH, "every claimed key must be finished");
                    done.fetch_add(BATCH as u64, Ordering::Relaxed);
                }
                n
            })
        })
        .collect();
    let mut batches = Vec::new();
    for t in tasks {
        batches.push(t.await.expect("task"));
    }
    let measured = Measured::of(&done, start);
    let cpu = per_message(cpu_before, server_cpu(&mut cpu_conn).await, &measured);
    let mut conn = conn.clone();
    for (task, n) in batches.into_iter().enumerate() {
        for n in 1..=n {
            let keys: Vec<String> = (0..BATCH).map(|i| key(task, n, i)).collect();
            let _: Result<(), _> = redis::cmd("UNLINK").arg(keys).query_async(&mut conn).await;
        }
    }
    (measured, cpu)
}

/// What one measurement did: messages, and how long it took.
struct Measured {
    messages: u64,
    elapsed: Duration,
}

impl Measured {
    fn of(done: &AtomicU64, start: Instant) -> Self {
        Self {
            messages: done.load(Ordering::Relaxed),
            elapsed: start.elapsed(),
        }
    }

    fn rate(&self) -> f64 {
        self.messages as f64 / self.elapsed.as_secs_f64()
    }
}

/// The standalone server's CPU time so far, in seconds (`INFO cpu`: `used_cpu_sys` +
/// `used_cpu_user`); `None` when it cannot be read.
async fn server_cpu(conn: &mut MultiplexedConnection) -> Option<f64> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(conn).await.ok()?;
    let field = |name: &str| -> Option<f64> {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))?
            .trim()
            .parse()
            .ok()
    };
    Some(field("used_cpu_sys")? + field("used_cpu_user")?)
}

/// Runs `work`, and with `cpu` the server's CPU time per message (µs) it cost.
async fn with_cpu(
    cpu: Option<&MultiplexedConnection>,
    work: impl Future<Output = Measured>,
) -> (Measured, Option<f64>) {
    let mut conn = cpu.cloned();
    let before = match conn.as_mut() {
        Some(c) => server_cpu(c).await,
        None => None,
    };
    let measured = work.await;
    let after = match conn.as_mut() {
        Some(c) => server_cpu(c).await,
        None => None,
    };
    let cpu = per_message(before, after, &measured);
    (measured, cpu)
}

/// The server's CPU time per message (µs) between two readings.
fn per_message(before: Option<f64>, after: Option<f64>, measured: &Measured) -> Option<f64> {
    match (before, after) {
        (Some(b), Some(a)) if measured.messages > 0 => {
            Some((a - b) * 1e6 / measured.messages as f64)
        }
        _ => None,
    }
}

fn row(
    store: &str,
    round: usize,
    mode: &str,
    (measured, cpu): &(Measured, Option<f64>),
    base: f64,
) {
    let rate = measured.rate();
    let cpu = cpu.map_or_else(|| "-".to_owned(), |us| format!("{us:.1}"));
    println!(
        "| {store:<14} | {round:>5} | {mode:<52} | {rate:>12.0} | {:>6.1}x | {cpu:>10} |",
        rate / base
    );
}

/// Rounds per store (`IDEM_BENCH_ROUNDS`, default 3): each runs every mode once, one after the
/// other, so that a slow spell of the machine (a disk's flush, another process) weighs on
/// every mode alike, and the summary takes the median of the rounds' ratios.
fn rounds() -> usize {
    std::env::var("IDEM_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(3)
}

/// The median of `ratios` (not empty), and all of them as text.
fn median(mut ratios: Vec<f64>) -> (f64, String) {
    let all = ratios
        .iter()
        .map(|r| format!("{r:.2}x"))
        .collect::<Vec<_>>()
        .join(", ");
    ratios.sort_by(f64::total_cmp);
    (ratios[ratios.len() / 2], all)
}

/// Measures `store` over [`rounds`] rounds (with `cpu`, a connection to its server, also the
/// server's CPU time per message and the raw pipelined baseline), prints a row per mode and
/// round and the median ratios; returns the namespaces it wrote in (one per round: every key
/// of a round is fresh).
async fn measure(
    name: &str,
    store: DynStore,
    tagged_too: bool,
    cpu: Option<(&MultiplexedConnection, &str)>,
) -> Vec<Namespace> {
    let conn = cpu.map(|(c, _)| c);
    let (mut namespaces, mut batched_ratios, mut raw_ratios) = (Vec::new(), Vec::new(), Vec::new());
    let (mut fenced_ratios, mut ifeq_ratios) = (Vec::new(), Vec::new());
    let ifeq = match cpu {
        Some((conn, prefix)) => has_set_ifeq(conn, prefix).await,
        None => false,
    };
    if cpu.is_some() && !ifeq {
        println!(
            "{name}: no `SET ... IFEQ` on this server (Redis 8.4, Valkey 8.1): that row is left out"
        );
    }
    for round in 1..=rounds() {
        let ns = Namespace::new(format!("bench-{:08x}", rand_u32())).expect("namespace");
        namespaces.push(ns.clone());
        let single = with_cpu(conn, unbatched(&store, &ns)).await;
        let base = single.0.rate();
        row(
            name,
            round,
            "unbatched: acquire + complete, 64 tasks",
            &single,
            base,
        );
        let spread = with_cpu(conn, batched(&store, &ns, Ids::Spread)).await;
        row(
            name,
            round,
            "batches of 100: acquire_many + complete_many",
            &spread,
            base,
        );
        batched_ratios.push(spread.0.rate() / base);
        if tagged_too {
            let tagged = with_cpu(conn, batched(&store, &ns, Ids::Tagged)).await;
            row(
                name,
                round,
                "batches of 100, one hash tag per batch",
                &tagged,
                base,
            );
        }
        if let Some((conn, prefix)) = cpu {
            let raw = pipelined(conn, prefix, Finish::Plain).await;
            row(
                name,
                round,
                "raw, no store: pipelines of 100 SET NX, then SET",
                &raw,
                base,
            );
            raw_ratios.push(spread.0.rate() / raw.0.rate());
            let fenced = pipelined(conn, prefix, Finish::Script).await;
            row(
                name,
                round,
                "raw fenced: SET NX, then a script GET/compare/SET",
                &fenced,
                base,
            );
            fenced_ratios.push(fenced.0.rate() / raw.0.rate());
            if ifeq {
                let fenced = pipelined(conn, prefix, Finish::IfEq).await;
                row(
                    name,
                    round,
                    "raw fenced: SET NX, then SET IFEQ",
                    &fenced,
                    base,
                );
                ifeq_ratios.push(fenced.0.rate() / raw.0.rate());
            }
        }
    }
    let (m, all) = median(batched_ratios);
    println!("{name}: batches / unbatched, median of the rounds: {m:.2}x ({all})");
    if !raw_ratios.is_empty() {
        let (m, all) = median(raw_ratios);
        println!("{name}: batches / raw pipelines, median of the rounds: {m:.2}x ({all})");
        let (m, all) = median(fenced_ratios);
        println!(
            "{name}: raw fenced by a script / raw pipelines, median of the rounds: {m:.2}x ({all})"
        );
    }
    if !ifeq_ratios.is_empty() {
        let (m, all) = median(ifeq_ratios);
        println!(
            "{name}: raw fenced by SET IFEQ / raw pipelines, median of the rounds: {m:.2}x ({all})"
        );
    }
    namespaces
}

/// Removes what the bench wrote in a Redis store (a listing on the same server, such as the
/// conformance suite's, would otherwise scan it until it expires).
async fn clean(name: &str, store: &RedisStore, namespaces: &[Namespace]) {
    for ns in namespaces {
        match store.drop_namespace(ns).await {
            Ok(n) => println!("{name}: removed the bench's {n} records of {ns}"),
            Err(e) => println!(
                "{name}: could not remove the bench's records of {ns} ({e}); they expire after {}s",
                RETENTION.as_secs()
            ),
        }
    }
}

fn rand_u32() -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    t.subsec_nanos() ^ (t.as_secs() as u32).rotate_left(13) ^ std::process::id()
}

fn env_or(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        println!(
            "store-level messages/s, {} tasks, fresh keys, {:?} per measurement, {} rounds",
            tasks(),
            seconds(),
            rounds()
        );
        println!(
            "| {:<14} | {:>5} | {:<52} | {:>12} | {:>7} | {:>10} |",
            "store", "round", "mode", "messages/s", "vs 1x1", "server µs/msg"
        );
        println!(
            "|{:-<16}|{:-<7}|{:-<54}|{:-<14}|{:-<9}|{:-<12}|",
            "", "", "", "", "", ""
        );

        let only = std::env::var("IDEM_BENCH_STORES").ok();
        let wanted = |name: &str| {
            only.as_deref()
                .is_none_or(|o| o.split(',').any(|s| s.trim() == name))
        };
        let prefix = format!("idem-bench-{:08x}:", rand_u32());
        let url = env_or("IDEM_REDIS_URL", "redis://127.0.0.1:6379");
        if wanted("redis") {
            match RedisStore::connect_with(&url, RedisConfig::default().with_prefix(&prefix)).await
            {
                Ok(store) => {
                    let conn = match redis::Client::open(url.as_str()) {
                        Ok(client) => client.get_multiplexed_async_connection().await.ok(),
                        Err(_) => None,
                    };
                    let cpu = conn.as_ref().map(|c| (c, prefix.as_str()));
                    let namespaces = measure("redis", Arc::new(store.clone()), false, cpu).await;
                    clean("redis", &store, &namespaces).await;
                }
                Err(e) => println!("| redis          | skipped: {e}"),
            }
        }
        let nodes: Vec<String> = env_or(
            "IDEM_REDIS_CLUSTER_NODES",
            "redis://127.0.0.1:7001,redis://127.0.0.1:7002,redis://127.0.0.1:7003",
        )
        .split(',')
        .map(str::to_owned)
        .collect();
        if wanted("redis-cluster") {
            let config = RedisConfig::default().with_prefix(&prefix);
            match RedisStore::connect_cluster_with(&nodes, config).await {
                Ok(store) => {
                    let namespaces =
                        measure("redis-cluster", Arc::new(store.clone()), true, None).await;
                    clean("redis-cluster", &store, &namespaces).await;
                }
                Err(e) => println!("| redis-cluster  | skipped: {e}"),
            }
        }
        let pg_url = env_or(
            "IDEM_POSTGRES_URL",
            "postgres://postgres@127.0.0.1:5432/test",
        );
        let schema = format!("idem_bench_{:08x}", rand_u32());
        if wanted("postgres") {
            match postgres(&pg_url, &schema).await {
                Ok(store) => {
                    let _ = measure("postgres", Arc::new(store.clone()), false, None).await;
                    drop_schema(&store, &schema).await;
                }
                Err(e) => println!("| postgres       | skipped: {e}"),
            }
        }
    });
}

async fn postgres(url: &str, schema: &str) -> idem_core::Result<PostgresStore> {
    let config = PostgresConfig::new(url)?.with_schema(schema);
    let store = PostgresStore::connect(config).await?;
    store.migrate().await?;
    Ok(store)
}

async fn drop_schema(store: &PostgresStore, schema: &str) {
    match store.pool().get().await {
        Ok(client) => {
            if let Err(e) = client
                .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
                .await
            {
                println!("could not drop the bench schema {schema}: {e}");
            }
        }
        Err(e) => println!("could not drop the bench schema {schema}: {e}"),
    }
}
