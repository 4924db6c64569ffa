//! Throughput of the transactional completion against the plain one, in the same run.
//!
//! ```text
//! cargo bench -p idem-redis --bench transactional_bench
//! ```
//!
//! Starts a private `redis-server` on a free loopback port (no persistence, so the figures are
//! the store's and the server's, not the disk's), then with 64 concurrent tasks sharing one
//! `RedisStore` measures messages per second (a fresh key per message, an empty result):
//!
//! - plain: `acquire` + `complete`;
//! - transactional: `acquire` + `complete_with` carrying 2 writes under the record's hash tag
//!   (`SET {..}:receipt <16 bytes> PX 1h` and `INCRBY {..}:count 1`);
//!
//! alternating the two (plain, transactional, plain, transactional) so that drift hits both,
//! and prints each round, the means and their ratio. Prints figures only; asserts nothing.
//!
//! Environment: `IDEM_BENCH_SECONDS` (default 3) per measurement, `IDEM_BENCH_TASKS` (default 64).

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, IdempotencyStore, Namespace, TransactionalStore,
};
use idem_redis::{RedisStore, RedisWrites};

const RETENTION: Duration = Duration::from_secs(3600);

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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Plain,
    Transactional,
}

/// acquire + complete (or complete_with), `tasks` at a time, for `seconds`: messages per second.
async fn rate(store: &RedisStore, path: Path, round: usize, tasks: usize, seconds: f64) -> f64 {
    let ns = Namespace::new(format!("b-{path:?}-{round}")).unwrap();
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let mut handles = Vec::new();
    for task in 0..tasks {
        let (store, ns, done) = (store.clone(), ns.clone(), done.clone());
        handles.push(tokio::spawn(async move {
            let mut i = 0u64;
            while Instant::now() < deadline {
                let key = ns.key(format!("{task}-{i:012}")).unwrap();
                let req = AcquireRequest::new(key.clone(), "bench-1");
                let lease = match store.acquire(&req).await.expect("acquire") {
                    AcquireOutcome::Acquired { lease, .. } => lease,
                    other => panic!("fresh key not acquired: {other:?}"),
                };
                match path {
                    Path::Plain => store.complete(&lease, Bytes::new(), RETENTION).await,
                    Path::Transactional => {
                        let writes = RedisWrites::new()
                            .set_expiring(
                                store.effect_key(&key, ":receipt").unwrap(),
                                "receipt-00000001",
                                RETENTION,
                            )
                            .incr_by(store.effect_key(&key, ":count").unwrap(), 1);
                        store
                            .complete_with(&lease, Bytes::new(), RETENTION, writes)
                            .await
                    }
                }
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

fn main() {
    let env = |name: &str, default: f64| {
        std::env::var(name)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(default)
    };
    let seconds = env("IDEM_BENCH_SECONDS", 3.0);
    let tasks = env("IDEM_BENCH_TASKS", 64.0) as usize;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run(seconds, tasks));
}

async fn run(seconds: f64, tasks: usize) {
    let server = start_server();
    let url = format!("redis://127.0.0.1:{}", server.port);
    let store = RedisStore::connect(&url).await.expect("connect");
    println!(
        "transactional_bench: private redis-server on port {}, {} CPUs, {tasks} tasks, {seconds} s \
         per measurement",
        server.port,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    // Warm up: connection, scripts, allocator.
    rate(&store, Path::Plain, 0, 4, 0.3).await;
    rate(&store, Path::Transactional, 0, 4, 0.3).await;

    let (mut plain, mut tx) = (Vec::new(), Vec::new());
    println!(
        "{:>6}  {:>15}  {:>21}",
        "round", "plain msg/s", "transactional msg/s"
    );
    for round in 1..=2 {
        let p = rate(&store, Path::Plain, round, tasks, seconds).await;
        let t = rate(&store, Path::Transactional, round, tasks, seconds).await;
        println!("{round:>6}  {p:>15.0}  {t:>21.0}");
        plain.push(p);
        tx.push(t);
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (p, t) = (mean(&plain), mean(&tx));
    println!(
        "mean    plain {p:.0} msg/s (acquire + complete), transactional {t:.0} msg/s (acquire + \
         complete_with, 2 writes): ratio transactional / plain = {:.2}",
        t / p
    );
    drop(server);
}
