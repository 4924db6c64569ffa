//! Running the `idem` binary, and the stores the tests write through the library.
//!
//! Every test that needs a server starts with [`fixture`]: when nothing answers at the
//! server's address it returns `None` and the test returns early, after one "skipped" line per
//! suite, or, with `CI` set, panics (see `idem_conformance::servers`).
#![allow(dead_code, unreachable_pub)]

use std::time::{Duration, SystemTime};

use assert_cmd::Command;
use idem_conformance::servers;
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, FailureKind, FencingToken, IdempotencyKey,
    IdempotencyStore, Lease, Namespace,
};
use idem_dynamo::{DynamoConfig, DynamoStore};
use idem_postgres::{PostgresConfig, PostgresStore};
use idem_redis::RedisStore;
use idem_sqlite::SqliteStore;
use serde_json::Value;

/// The longest any one `idem` run may take in these tests: a hang fails the test.
pub const RUN_LIMIT: Duration = Duration::from_secs(60);

/// A retention long enough for any test.
pub const DAY: Duration = Duration::from_secs(86_400);

/// The `idem` binary with a clean environment: no store or timeout from the caller's, and
/// dummy AWS credentials and region, with the instance metadata service off (so the AWS SDK
/// never looks beyond loopback), for DynamoDB Local.
pub fn idem() -> Command {
    let mut cmd = Command::new(assert_cmd::cargo::cargo_bin!("idem"));
    cmd.env_remove("IDEM_STORE")
        .env_remove("IDEM_TIMEOUT")
        .env("AWS_ACCESS_KEY_ID", "idemtest")
        .env("AWS_SECRET_ACCESS_KEY", "idemtest")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env("AWS_CONFIG_FILE", "/nonexistent/idem-test")
        .env("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/idem-test")
        .timeout(RUN_LIMIT);
    cmd
}

/// The one error line of a failed run (`idem: error: ...`); fails when there is more or less.
pub fn one_line_error(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "expected one error line, got: {text}");
    assert!(lines[0].starts_with("idem: error: "), "{text}");
    assert!(!text.contains("panicked"), "{text}");
    lines[0].to_owned()
}

/// Standard output as JSON lines.
pub fn json_lines(stdout: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// A namespace no other test or run uses.
pub fn fresh_namespace() -> Namespace {
    Namespace::new(format!("cli-{}", uuid::Uuid::new_v4().simple())).unwrap()
}

/// The stores the CLI is tested on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Redis,
    Cluster,
    Postgres,
    Dynamo,
    Sqlite,
}

/// The schema the PostgreSQL tests use (migrated by the first test; migrations are safe to run
/// concurrently and again).
const PG_SCHEMA: &str = "idem_cli_test";
/// The DynamoDB table the tests use (created when missing).
const DYNAMO_TABLE: &str = "idem-cli-test";

/// A store reached two ways: through the library (`store`) and by the CLI (`url`).
pub struct Fixture {
    pub backend: Backend,
    pub store: Box<dyn IdempotencyStore>,
    pub url: String,
    _dir: Option<tempfile::TempDir>,
}

/// The store of `backend`; `None` (the test returns) when its server is not there, outside CI.
pub async fn fixture(backend: Backend) -> Option<Fixture> {
    let (store, url, dir): (Box<dyn IdempotencyStore>, String, _) = match backend {
        Backend::Redis => {
            let url = servers::endpoint("redis", "IDEM_REDIS_URL", "redis://127.0.0.1:6379")?;
            let store = RedisStore::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("Redis at {url} answers but cannot be used: {e}"));
            (Box::new(store), url, None)
        }
        Backend::Cluster => {
            let nodes = servers::endpoint(
                "redis-cluster",
                "IDEM_REDIS_CLUSTER_NODES",
                "redis://127.0.0.1:7001,redis://127.0.0.1:7002,redis://127.0.0.1:7003",
            )?;
            let nodes: Vec<&str> = nodes.split(',').map(str::trim).collect();
            let store = RedisStore::connect_cluster(&nodes)
                .await
                .unwrap_or_else(|e| panic!("the cluster at {nodes:?} cannot be used: {e}"));
            let hosts: Vec<&str> = nodes
                .iter()
                .map(|n| n.trim_start_matches("redis://"))
                .collect();
            (
                Box::new(store),
                format!("redis+cluster://{}", hosts.join(",")),
                None,
            )
        }
        Backend::Postgres => {
            let url = servers::endpoint(
                "postgres",
                "IDEM_POSTGRES_URL",
                "postgres://postgres@127.0.0.1:5432/test",
            )?;
            let config = PostgresConfig::new(&url).unwrap().with_schema(PG_SCHEMA);
            let store = PostgresStore::connect(config).await.unwrap();
            store
                .migrate()
                .await
                .unwrap_or_else(|e| panic!("PostgreSQL at {url} cannot be migrated: {e}"));
            let sep = if url.contains('?') { '&' } else { '?' };
            (
                Box::new(store),
                format!("{url}{sep}schema={PG_SCHEMA}"),
                None,
            )
        }
        Backend::Dynamo => {
            let endpoint =
                servers::endpoint("dynamo", "IDEM_DYNAMO_ENDPOINT", "http://127.0.0.1:8000")?;
            let config = DynamoConfig::new(DYNAMO_TABLE)
                .with_endpoint_url(endpoint.clone())
                .with_region("us-east-1")
                .with_static_credentials("idemtest", "idemtest");
            let store = DynamoStore::connect(config).await.unwrap();
            store
                .create_table_if_missing()
                .await
                .unwrap_or_else(|e| panic!("DynamoDB at {endpoint}: no table: {e}"));
            (
                Box::new(store),
                format!("dynamodb://{DYNAMO_TABLE}?endpoint={endpoint}&region=us-east-1"),
                None,
            )
        }
        Backend::Sqlite => {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("idem.db");
            let store = SqliteStore::open(&path).await.unwrap();
            (
                Box::new(store),
                format!("sqlite://{}", path.display()),
                Some(dir),
            )
        }
    };
    Some(Fixture {
        backend,
        store,
        url,
        _dir: dir,
    })
}

impl Fixture {
    /// `idem --store URL args...`.
    pub fn idem(&self, args: &[&str]) -> Command {
        let mut cmd = idem();
        cmd.arg("--store").arg(&self.url).args(args);
        cmd
    }

    /// Acquires `key` (a fresh one, or one that can be acquired again) with a lease of `ttl`.
    pub async fn acquire(&self, key: &IdempotencyKey, owner: &str, ttl: Duration) -> Lease {
        let req = AcquireRequest::new(key.clone(), owner).with_lease_ttl(ttl);
        match self.store.acquire(&req).await.unwrap() {
            AcquireOutcome::Acquired { lease, .. } => lease,
            other => panic!("{key}: {other:?}"),
        }
    }

    /// A completed record holding `result`; returns its token.
    pub async fn completed(&self, key: &IdempotencyKey, result: &[u8]) -> FencingToken {
        let lease = self.acquire(key, "worker-1", Duration::from_secs(30)).await;
        self.store
            .complete(&lease, Bytes::copy_from_slice(result), DAY)
            .await
            .unwrap();
        lease.token
    }

    /// A record failed with `error` of `kind`.
    pub async fn failed(&self, key: &IdempotencyKey, error: &str, kind: FailureKind) {
        let lease = self.acquire(key, "worker-2", Duration::from_secs(30)).await;
        self.store.fail(&lease, error, kind, DAY).await.unwrap();
    }

    /// A record in progress whose lease has already ended (its holder "crashed").
    pub async fn stuck(&self, key: &IdempotencyKey) -> Lease {
        let lease = self
            .acquire(key, "worker-crashed", Duration::from_millis(50))
            .await;
        // Wait for the lease's end itself, on the clock the CLI judges on.
        if let Ok(left) = lease.expires_at.duration_since(SystemTime::now()) {
            tokio::time::sleep(left + Duration::from_millis(20)).await;
        }
        lease
    }
}
