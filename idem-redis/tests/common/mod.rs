//! Test helpers: endpoints from the environment, random prefixes, private servers.
#![allow(dead_code, unreachable_pub)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem_redis::{RedisConfig, RedisStore};

pub const URL_VAR: &str = "IDEM_REDIS_URL";
pub const CLUSTER_VAR: &str = "IDEM_REDIS_CLUSTER_NODES";

pub fn url() -> String {
    std::env::var(URL_VAR).unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

pub fn cluster_nodes() -> Vec<String> {
    std::env::var(CLUSTER_VAR)
        .unwrap_or_else(|_| {
            "redis://127.0.0.1:7001,redis://127.0.0.1:7002,redis://127.0.0.1:7003".to_owned()
        })
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

/// The standalone store under test; fails (never skips) when the server is missing.
pub async fn standalone() -> RedisStore {
    let url = url();
    RedisStore::connect_with(&url, config())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "no Redis at {url} ({e}); set {URL_VAR} or start one with scripts/services.sh redis"
            )
        })
}

/// The cluster store under test; fails (never skips) when the cluster is missing.
pub async fn cluster() -> RedisStore {
    let nodes = cluster_nodes();
    RedisStore::connect_cluster_with(&nodes, config())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "no Redis Cluster at {nodes:?} ({e}); set {CLUSTER_VAR} or start one with \
                 scripts/services.sh redis-cluster"
            )
        })
}

/// A store pointed at 127.0.0.1:1, where nothing listens.
pub async fn unreachable() -> idem_core::Result<RedisStore> {
    RedisStore::connect("redis://127.0.0.1:1").await
}

pub async fn unreachable_cluster() -> idem_core::Result<RedisStore> {
    RedisStore::connect_cluster(["redis://127.0.0.1:1"]).await
}

/// A redis-server this test process owns, on a free loopback port, killed on drop.
pub struct PrivateRedis {
    child: Child,
    pub port: u16,
    dir: PathBuf,
}

impl PrivateRedis {
    pub fn start() -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        Self::start_on(port)
    }

    pub fn start_on(port: u16) -> Self {
        let dir = std::env::temp_dir().join(format!("idem-redis-test-{port}"));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run redis-server ({e}); install it with scripts/services.sh redis")
            });
        let server = Self { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "private redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    /// Kills the server now (the test's outage).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
