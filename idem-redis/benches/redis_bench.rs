//! Throughput of `RedisStore` against the raw scripts, and memory per record.
//!
//! ```text
//! CARGO_TARGET_DIR=/work/target-redis cargo bench -p idem-redis --bench redis_bench
//! ```
//!
//! Starts a private `redis-server` on a free loopback port (so nothing else skews the figures),
//! then for 1 and 64 concurrent tasks:
//!
//! 1. measures acquire + complete messages per second through `RedisStore` (a fresh key per
//!    message, with a fingerprint, an empty result);
//! 2. runs `redis-benchmark` with as many connections on the same two scripts by SHA, with the
//!    same arguments: `acquire` on fresh random keys, and `complete` on records prepared in
//!    progress with a known token (so the fence passes and the full write happens); the raw
//!    messages per second are `1 / (1/acquire_rps + 1/complete_rps)`;
//!
//! prints both and their ratio (plus the same loop straight through the driver, and a pipelined
//! raw run at 64 connections), then `MEMORY USAGE` of completed records with an empty result:
//! with and without a fingerprint, with the bench owner, the executor's default owner and a
//! Kubernetes-style pod name, and with a UUID id. Prints figures only; asserts nothing.
//!
//! Environment: `IDEM_BENCH_SECONDS` (default 3) per store measurement.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_core::{AcquireOutcome, AcquireRequest, Bytes, Fingerprint, IdempotencyStore, Namespace};
use idem_redis::{RedisStore, lua_scripts};
use integer_encoding::VarInt;
use redis::aio::MultiplexedConnection;

const RETENTION: Duration = Duration::from_secs(3600);
const LEASE_MS: u64 = 30_000;
const OWNER: &str = "bench-1";
/// The raw baseline passes this 32-byte stand-in for a fingerprint on the command line (a real
/// digest may hold bytes a command line cannot); the scripts treat both alike.
const RAW_FP: &str = "0123456789abcdef0123456789abcdef";

struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server() -> Server {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let child = Command::new("redis-server")
        .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
        .args(["--save", "", "--appendonly", "no", "--dir", "/tmp"])
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server on PATH (scripts/services.sh redis installs it)");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    Server { child, port }
}

/// acquire + complete through the store, `tasks` at a time, for `seconds`.
async fn store_rate(store: &RedisStore, tasks: usize, seconds: f64) -> f64 {
    let ns = Namespace::new(format!("b{tasks}")).unwrap();
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let mut handles = Vec::new();
    for task in 0..tasks {
        let (store, ns, done) = (store.clone(), ns.clone(), done.clone());
        handles.push(tokio::spawn(async move {
            let fp = Fingerprint::of(format!("payload {task}"));
            let mut i = 0u64;
            while Instant::now() < deadline {
                let key = ns.key(format!("{task}-{i:012}")).unwrap();
                let req = AcquireRequest::new(key, OWNER)
                    .with_fingerprint(fp)
                    .with_lease_ttl(Duration::from_millis(LEASE_MS));
                let lease = match store.acquire(&req).await.expect("acquire") {
                    AcquireOutcome::Acquired { lease, .. } => lease,
                    other => panic!("fresh key not acquired: {other:?}"),
                };
                store
                    .complete(&lease, Bytes::new(), RETENTION)
                    .await
                    .expect("complete");
                done.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

/// acquire + complete by the same scripts straight through the driver (a `ConnectionManager`,
/// no store code: no validation, timeout or reply decoding), to tell the store's own cost from
/// the driver's.
async fn driver_rate(url: &str, tasks: usize, seconds: f64) -> f64 {
    let conn = redis::Client::open(url)
        .unwrap()
        .get_connection_manager()
        .await
        .unwrap();
    let [acquire, _, complete, ..] = lua_scripts();
    let acquire = Arc::new(redis::Script::new(&acquire.source));
    let complete = Arc::new(redis::Script::new(&complete.source));
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let mut handles = Vec::new();
    for task in 0..tasks {
        let (mut conn, done) = (conn.clone(), done.clone());
        let (acquire, complete) = (acquire.clone(), complete.clone());
        let fp = *Fingerprint::of(format!("payload {task}")).as_bytes();
        handles.push(tokio::spawn(async move {
            let mut i = 0u64;
            while Instant::now() < deadline {
                let key = format!("idem:d{tasks}:{task}-{i:012}");
                let reply: Vec<i64> = acquire
                    .key(&key)
                    .arg(OWNER)
                    .arg(LEASE_MS)
                    .arg(5)
                    .arg(&fp[..])
                    .invoke_async(&mut conn)
                    .await
                    .expect("acquire");
                let _: Vec<i64> = complete
                    .key(&key)
                    .arg(reply[1])
                    .arg("")
                    .arg(3_600_000)
                    .invoke_async(&mut conn)
                    .await
                    .expect("complete");
                done.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

/// Requests per second of one `redis-benchmark` run (`pipeline` requests in flight per
/// connection).
fn redis_benchmark(
    port: u16,
    clients: usize,
    pipeline: usize,
    requests: u64,
    keyspace: u64,
    args: &[&str],
) -> f64 {
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-c", &clients.to_string(), "-n", &requests.to_string()])
        .args(["-P", &pipeline.to_string()])
        .args(["-r", &keyspace.to_string(), "--csv"])
        .args(args)
        .output()
        .expect("redis-benchmark on PATH (Debian package redis-tools)");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .nth(1)
        .unwrap_or_else(|| panic!("redis-benchmark printed {text:?} {:?}", out.stderr));
    line.split(',')
        .nth(1)
        .and_then(|f| f.trim_matches('"').parse().ok())
        .unwrap_or_else(|| panic!("cannot read the rate from {line:?}"))
}

/// The value `acquire` writes for a record in progress with token 1 (so `base` is 0), attempt
/// 1, a 30 s lease, [`RAW_FP`] and [`OWNER`], following the layout in the crate docs.
fn prepared_record() -> Vec<u8> {
    let mut v = vec![128 + 8 + 32];
    v.extend_from_slice(&1u64.to_be_bytes());
    v.extend_from_slice(&1u64.encode_var_vec()); // attempts
    v.extend_from_slice(&0i64.encode_var_vec()); // updated_at - base
    v.extend_from_slice(&i64::try_from(LEASE_MS).unwrap().encode_var_vec()); // lease end - base
    v.extend_from_slice(RAW_FP.as_bytes());
    v.extend_from_slice(&OWNER.len().encode_var_vec());
    v.extend_from_slice(OWNER.as_bytes());
    v
}

/// Prepares `count` in-progress records `{prefix}{12-digit i}` with token 1, the way acquire
/// writes them, for the raw `complete` runs.
async fn prepare(admin: &mut MultiplexedConnection, prefix: &str, count: u64) {
    let script = redis::Script::new(
        r"
        for i = tonumber(ARGV[2]), tonumber(ARGV[3]) do
          redis.call('SET', ARGV[1] .. string.format('%012d', i), ARGV[4])
        end
        return 1",
    );
    let record = prepared_record();
    let chunk = 50_000;
    let mut from = 0;
    while from < count {
        let to = (from + chunk).min(count) - 1;
        let _: i64 = script
            .arg(prefix)
            .arg(from)
            .arg(to)
            .arg(&record)
            .invoke_async(admin)
            .await
            .unwrap();
        from = to + 1;
    }
    // The baseline is only fair if the prepared records pass the fence: complete one of them.
    let [_, _, complete, ..] = lua_scripts();
    let reply: Vec<i64> = redis::cmd("EVALSHA")
        .arg(complete.sha1())
        .arg(1)
        .arg(format!("{prefix}{:012}", count - 1))
        .arg(1)
        .arg("")
        .arg(3_600_000)
        .query_async(admin)
        .await
        .expect("complete on a prepared record");
    assert_eq!(reply, [1], "a prepared record must accept the raw complete");
}

fn main() {
    let seconds: f64 = std::env::var("IDEM_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run(seconds));
}

async fn run(seconds: f64) {
    let server = start_server();
    let url = format!("redis://127.0.0.1:{}", server.port);
    let store = RedisStore::connect(&url).await.expect("connect");
    let mut admin = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection_with_config(
            &redis::AsyncConnectionConfig::new().set_response_timeout(None),
        )
        .await
        .unwrap();
    let version: String = redis::cmd("INFO")
        .arg("server")
        .query_async::<String>(&mut admin)
        .await
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:").map(str::to_owned))
        .unwrap_or_default();
    println!(
        "redis_bench: private redis-server {version} on port {}, {} CPUs, {seconds} s per store run",
        server.port,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    // Warm up: load the scripts and the connection.
    store_rate(&store, 4, 0.3).await;
    let [acquire, _, complete, ..] = lua_scripts();
    let (acquire_sha, complete_sha) = (acquire.sha1().to_owned(), complete.sha1().to_owned());

    println!();
    println!(
        "{:>6}  {:>12}  {:>12}  {:>14}  {:>14}  {:>10}  {:>6}",
        "tasks",
        "store msg/s",
        "driver msg/s",
        "raw acquire/s",
        "raw complete/s",
        "raw msg/s",
        "ratio"
    );
    let mut ceiling = None;
    for tasks in [1usize, 64] {
        let store_msgs = store_rate(&store, tasks, seconds).await;
        let driver_msgs = driver_rate(&url, tasks, seconds).await;
        // Size the raw runs to take about as long as the store run.
        let requests = ((store_msgs * 2.0 * seconds) as u64).clamp(10_000, 400_000);
        let raw = |pipeline: usize, prepared: String| {
            let (acquire_sha, complete_sha) = (acquire_sha.clone(), complete_sha.clone());
            let port = server.port;
            move || {
                let acquire_key = format!("idem:ra{tasks}-{pipeline}:__rand_int__");
                let lease = LEASE_MS.to_string();
                let acquire = redis_benchmark(
                    port,
                    tasks,
                    pipeline,
                    requests,
                    1_000_000_000_000,
                    &[
                        "EVALSHA",
                        &acquire_sha,
                        "1",
                        &acquire_key,
                        OWNER,
                        &lease,
                        "5",
                        RAW_FP,
                    ],
                );
                let complete_key = format!("{prepared}__rand_int__");
                let complete = redis_benchmark(
                    port,
                    tasks,
                    pipeline,
                    requests,
                    requests * 4,
                    &[
                        "EVALSHA",
                        &complete_sha,
                        "1",
                        &complete_key,
                        "1",
                        "",
                        "3600000",
                    ],
                );
                (acquire, complete, 1.0 / (1.0 / acquire + 1.0 / complete))
            }
        };
        let prefix = format!("idem:rc{tasks}:");
        prepare(&mut admin, &prefix, requests * 4).await;
        let (raw_acquire, raw_complete, raw_msgs) = raw(1, prefix)();
        println!(
            "{tasks:>6}  {store_msgs:>12.0}  {driver_msgs:>12.0}  {raw_acquire:>14.0}  {raw_complete:>14.0}  {raw_msgs:>10.0}  {:>6.2}",
            store_msgs / raw_msgs
        );
        if tasks == 64 {
            // The server's own ceiling: the same scripts with 16 requests in flight per connection.
            let prefix = format!("idem:rcp{tasks}:");
            prepare(&mut admin, &prefix, requests * 4).await;
            ceiling = Some((store_msgs, raw(16, prefix)()));
        }
        let _: () = redis::cmd("FLUSHALL")
            .arg("ASYNC")
            .query_async(&mut admin)
            .await
            .unwrap();
    }
    if let Some((store_msgs, (acquire, complete, msgs))) = ceiling {
        println!(
            "raw pipelined, 64 connections x 16 in flight: acquire {acquire:.0}/s, complete \
             {complete:.0}/s, {msgs:.0} msg/s; store at 64 tasks / this = {:.2}",
            store_msgs / msgs
        );
    }
    println!(
        "(raw complete runs pick keys at random among 4x as many prepared records: about 88% \
         find their record in progress and write it, the rest fail the fence. The store can beat \
         the raw run: its one multiplexed connection pipelines the tasks' requests, where each of \
         redis-benchmark's connections waits for its reply.)"
    );

    println!();
    memory(&store, &mut admin).await;
    drop(server);
}

/// `MEMORY USAGE` of completed records with an empty result, for a few key, owner and
/// fingerprint choices; the first row is the one the target speaks of.
async fn memory(store: &RedisStore, admin: &mut MultiplexedConnection) {
    // What the executor picks when no owner is configured: idem-<host>-<pid>-<n>.
    let executor_owner = match std::env::var("HOSTNAME").unwrap_or_default() {
        host if host.is_empty() => format!("idem-{}-1", std::process::id()),
        host => format!("idem-{host}-{}-1", std::process::id()),
    };
    let pod = "payments-consumer-7d9f8b6c5d-x2x9z-1";
    let uuid = "0b6f6bd8-4a8e-4f5e-9d51-3c2f4a7b8e19";
    let ns = Namespace::new("bench").unwrap();
    println!(
        "MEMORY USAGE of one completed record, empty result (target: at most 150 bytes for the \
         first row):"
    );
    println!(
        "{:<48}  {:<40}  {:>11}  {:>11}  {:>12}  {:>8}",
        "storage key", "owner", "fingerprint", "value bytes", "MEMORY USAGE", "encoding"
    );
    let rows = [
        ("k0000001", OWNER, true),
        ("k0000002", OWNER, false),
        ("k0000003", executor_owner.as_str(), true),
        ("k0000004", pod, true),
        (uuid, OWNER, true),
    ];
    for (id, owner, with_fp) in rows {
        let key = ns.key(id).unwrap();
        let fingerprint = with_fp.then(|| Fingerprint::of("payload"));
        let req = AcquireRequest::new(key.clone(), owner).with_fingerprint(fingerprint);
        let AcquireOutcome::Acquired { lease, .. } = store.acquire(&req).await.unwrap() else {
            panic!("not acquired");
        };
        store
            .complete(&lease, Bytes::new(), RETENTION)
            .await
            .unwrap();
        let storage_key = store.storage_key(&key);
        let query = |cmd: &str, sub: Option<&str>| {
            let mut c = redis::cmd(cmd);
            if let Some(sub) = sub {
                c.arg(sub);
            }
            c.arg(&storage_key);
            c
        };
        let bytes: u64 = query("MEMORY", Some("USAGE"))
            .query_async(admin)
            .await
            .unwrap();
        let len: u64 = query("STRLEN", None).query_async(admin).await.unwrap();
        let encoding: String = query("OBJECT", Some("ENCODING"))
            .query_async(admin)
            .await
            .unwrap();
        println!(
            "{:<48}  {:<40}  {:>11}  {len:>11}  {bytes:>12}  {encoding:>8}",
            String::from_utf8_lossy(&storage_key),
            format!("{owner} ({} B)", owner.len()),
            if with_fp { "yes" } else { "no" },
        );
    }
}
