//! Test helpers: endpoints from the environment, random prefixes, private servers.
//!
//! Every test that needs a server starts with one call here (`standalone`, `cluster`,
//! `PrivateRedis::start`, `programs`): when the server or program is missing it returns `None`
//! and the test returns early, after one "skipped" line per suite, or, with `CI` set, panics (see
//! `idem_conformance::servers`).
#![allow(dead_code, unreachable_pub)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub mod slots;

use idem_conformance::servers;
use idem_redis::{RedisConfig, RedisStore};

pub const URL_VAR: &str = "IDEM_REDIS_URL";
pub const CLUSTER_VAR: &str = "IDEM_REDIS_CLUSTER_NODES";
const DEFAULT_URL: &str = "redis://127.0.0.1:6379";
const DEFAULT_CLUSTER: &str =
    "redis://127.0.0.1:7001,redis://127.0.0.1:7002,redis://127.0.0.1:7003";

/// The standalone server's URL (the server is known to answer once `standalone` returned a
/// store).
pub fn url() -> String {
    std::env::var(URL_VAR).unwrap_or_else(|_| DEFAULT_URL.to_owned())
}

/// The cluster's nodes (known to answer once `cluster` returned a store).
pub fn cluster_nodes() -> Vec<String> {
    std::env::var(CLUSTER_VAR)
        .unwrap_or_else(|_| DEFAULT_CLUSTER.to_owned())
        .split(',')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

/// A prefix no other run uses, so runs sharing a server never collide.
pub fn random_prefix() -> String {
    format!("idem-test-{}:", uuid::Uuid::new_v4().simple())
}

pub fn config() -> RedisConfig {
    RedisConfig::default().with_prefix(random_prefix())
}

/// The logical database of the standalone server that C26 (listing) runs in. A listing SCANs
/// every key of its database, and database 0 of a shared server holds whatever other tests,
/// benches and earlier runs left there (with their retention): with a million such keys one
/// listing outlasts the 600 ms age gap C26 relies on. Database 15 holds only C26's records.
pub const LISTING_DB: i64 = 15;

/// The standalone store for C26: same server as [`standalone`], database [`LISTING_DB`].
pub async fn standalone_listing() -> Option<RedisStore> {
    use redis::IntoConnectionInfo;

    let url = servers::endpoint("redis", URL_VAR, DEFAULT_URL)?;
    let info = url
        .as_str()
        .into_connection_info()
        .expect("IDEM_REDIS_URL is a Redis URL");
    let settings = info.redis_settings().clone().set_db(LISTING_DB);
    let client = redis::Client::open(info.set_redis_settings(settings)).expect("Redis client");
    let manager = redis::aio::ConnectionManager::new(client)
        .await
        .unwrap_or_else(|e| panic!("Redis at {url}, database {LISTING_DB}: {e}"));
    Some(RedisStore::from_connection_manager(manager, config()))
}

/// The standalone store under test, with a fresh prefix; `None` (the test skips) when nothing
/// answers at `IDEM_REDIS_URL` outside CI.
pub async fn standalone() -> Option<RedisStore> {
    let url = servers::endpoint("redis", URL_VAR, DEFAULT_URL)?;
    let store = RedisStore::connect_with(&url, config())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "Redis at {url} answers but the store cannot use it ({e}); set {URL_VAR} or \
                 start one with scripts/services.sh redis"
            )
        });
    Some(store)
}

/// The cluster store under test, with a fresh prefix; `None` (the test skips) when nothing
/// answers at `IDEM_REDIS_CLUSTER_NODES` outside CI.
pub async fn cluster() -> Option<RedisStore> {
    servers::endpoint("redis-cluster", CLUSTER_VAR, DEFAULT_CLUSTER)?;
    let nodes = cluster_nodes();
    let store = RedisStore::connect_cluster_with(&nodes, config())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "the Redis Cluster at {nodes:?} answers but the store cannot use it ({e}); set \
                 {CLUSTER_VAR} or start one with scripts/services.sh redis-cluster"
            )
        });
    Some(store)
}

/// Whether the programs a private-server suite runs are installed (each test of such a suite
/// starts with this, or with `PrivateRedis::start`); `false` (the test skips) outside CI.
pub fn programs(suite: &str, programs: &[&str]) -> bool {
    programs.iter().all(|program| {
        let hint = match *program {
            "redis-server" => "scripts/services.sh redis installs it",
            "openssl" => "the Debian package openssl has it",
            _ => "install it",
        };
        servers::program(suite, program, hint)
    })
}

/// A store pointed at 127.0.0.1:1, where nothing listens.
pub async fn unreachable() -> idem_core::Result<RedisStore> {
    RedisStore::connect("redis://127.0.0.1:1").await
}

pub async fn unreachable_cluster() -> idem_core::Result<RedisStore> {
    RedisStore::connect_cluster(["redis://127.0.0.1:1"]).await
}

/// A free loopback port for a cluster node: at most 45,535, with its cluster bus port (10,000
/// above) free too (a node refuses a port whose bus port would pass 65,535; free ports the
/// system hands out may be that high).
pub fn cluster_port() -> u16 {
    loop {
        let port = 20_000 + (uuid::Uuid::new_v4().as_u128() % 25_536) as u16;
        let free = |p: u16| TcpListener::bind(("127.0.0.1", p)).is_ok();
        if free(port) && free(port + 10_000) {
            return port;
        }
    }
}

/// A private node in cluster mode ([`cluster_port`]), without persistence, its node file in its
/// own data directory, with `extra` arguments; not yet part of any cluster.
pub fn start_cluster_node(extra: &[&str]) -> PrivateRedis {
    let mut args = vec![
        "--appendonly",
        "no",
        "--cluster-enabled",
        "yes",
        // Relative to the node's own (fresh, temporary) data directory.
        "--cluster-config-file",
        "nodes.conf",
    ];
    args.extend_from_slice(extra);
    PrivateRedis::start_on_with(cluster_port(), &args)
}

/// A redis-server this test process owns, on a free loopback port, killed on drop.
pub struct PrivateRedis {
    child: Child,
    pub port: u16,
    dir: PathBuf,
    /// Persistence arguments, kept for `restart`.
    persistence: Vec<String>,
}

impl PrivateRedis {
    /// A server on a free port, without persistence; `None` (the test skips) when
    /// `redis-server` is not installed, outside CI.
    pub fn start() -> Option<Self> {
        Self::start_with(&["--appendonly", "no"])
    }

    /// A server on a free port with `persistence` (for instance `--appendonly yes`), in a fresh
    /// data directory that survives `kill` and `restart`; `None` as for `start`.
    pub fn start_with(persistence: &[&str]) -> Option<Self> {
        if !programs("redis (private servers)", &["redis-server"]) {
            return None;
        }
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        Some(Self::spawn(port, persistence))
    }

    /// A server on `port` (a test that restarts its own server; `start` checked the program).
    pub fn start_on(port: u16) -> Self {
        Self::spawn(port, &["--appendonly", "no"])
    }

    /// A server on `port` with `args` (`programs` checked the program).
    pub fn start_on_with(port: u16, args: &[&str]) -> Self {
        Self::spawn(port, args)
    }

    fn spawn(port: u16, persistence: &[&str]) -> Self {
        let dir = std::env::temp_dir().join(format!("idem-redis-test-{port}"));
        // A directory left by an earlier run on this port may hold its data.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let persistence: Vec<String> = persistence.iter().map(|s| (*s).to_owned()).collect();
        let child = run_server(port, &dir, &persistence);
        Self {
            child,
            port,
            dir,
            persistence,
        }
    }

    /// Kills the server now (`SIGKILL`: the test's outage).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the server again on the same port and data directory (after `stop`); returns
    /// once it accepts connections (it may still be loading its data).
    pub fn restart(&mut self) {
        self.stop();
        self.child = run_server(self.port, &self.dir, &self.persistence);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Stops the process where it stands (`SIGSTOP`): it keeps its connections open and answers
    /// nobody, as a node cut off by the network would, until [`resume`](Self::resume).
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Lets a [`pause`](Self::pause)d process run again (`SIGCONT`).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, which: &str) {
        let status = Command::new("kill")
            .args([which, &self.child.id().to_string()])
            .status()
            .expect("kill(1)");
        assert!(status.success(), "kill {which} failed");
    }
}

fn run_server(port: u16, dir: &std::path::Path, persistence: &[String]) -> Child {
    let child = Command::new("redis-server")
        .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
        .args(["--save", ""])
        .args(persistence)
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot run redis-server ({e}); install it with scripts/services.sh redis")
        });
    // Wait until it accepts connections (polling: the process gives no other signal).
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "private redis-server did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A plain connection to the server(s) behind `store` (routed by key on a cluster), to read and
/// write data behind the store's back.
pub enum Admin {
    Single(redis::aio::MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Admin {
    /// Connects to the same standalone server or cluster as `store` (one the tests' `standalone`
    /// or `cluster` returned, so it is known to answer).
    pub async fn of(store: &RedisStore) -> Self {
        if store.is_cluster() {
            Self::Cluster(
                redis::cluster::ClusterClient::new(cluster_nodes())
                    .unwrap()
                    .get_async_connection()
                    .await
                    .expect("admin connection to the cluster"),
            )
        } else {
            Self::Single(
                redis::Client::open(url())
                    .unwrap()
                    .get_multiplexed_async_connection()
                    .await
                    .expect("admin connection to the server"),
            )
        }
    }

    /// Runs `cmd`, panicking on an error.
    pub async fn query<T: redis::FromRedisValue>(&mut self, cmd: &redis::Cmd) -> T {
        match self {
            Self::Single(c) => cmd.query_async(c).await,
            Self::Cluster(c) => cmd.query_async(c).await,
        }
        .unwrap_or_else(|e| panic!("admin command failed: {e}"))
    }

    /// `EXISTS key` (0 or 1).
    pub async fn exists(&mut self, key: &str) -> bool {
        self.query::<i64>(redis::cmd("EXISTS").arg(key)).await == 1
    }

    /// `GET key`.
    pub async fn get(&mut self, key: &str) -> Option<Vec<u8>> {
        self.query(redis::cmd("GET").arg(key)).await
    }

    /// `PTTL key` in ms (-1 no expiry, -2 no key).
    pub async fn pttl(&mut self, key: &str) -> i64 {
        self.query(redis::cmd("PTTL").arg(key)).await
    }
}
