//! Test helpers: whether NATS and Redis answer (every test starts with [`nats_and_redis`]),
//! unique names, streams, publishing, reading a stream back, consumer state, private servers.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_conformance::servers;
use idem_core::DynStore;
use idem_executor::{Executor, ExecutorConfig, JsonCodec};
use idem_nats::async_nats::jetstream::{self, stream};
use idem_nats::async_nats::{self, HeaderMap};
use idem_redis::{RedisConfig, RedisStore};

pub const NATS_VAR: &str = "IDEM_NATS_URL";
pub const REDIS_VAR: &str = "IDEM_REDIS_URL";
const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";
const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
/// The suite named in the "skipped" line.
const SUITE: &str = "nats";

/// Whether NATS answers at `IDEM_NATS_URL` and Redis at `IDEM_REDIS_URL`. When one does not:
/// outside CI, one "skipped" line for the suite and `false`; with `CI=true`, a panic naming the
/// variable.
pub fn nats_and_redis() -> bool {
    servers::endpoint(SUITE, NATS_VAR, DEFAULT_NATS_URL).is_some()
        && servers::endpoint(SUITE, REDIS_VAR, DEFAULT_REDIS_URL).is_some()
}

/// Whether `nats-server` can be started (for the private-server test).
pub fn nats_program() -> bool {
    servers::program(SUITE, "nats-server", "scripts/services.sh nats installs it")
}

pub fn nats_url() -> String {
    std::env::var(NATS_VAR).unwrap_or_else(|_| DEFAULT_NATS_URL.to_owned())
}

pub fn redis_url() -> String {
    std::env::var(REDIS_VAR).unwrap_or_else(|_| DEFAULT_REDIS_URL.to_owned())
}

/// A name no other run uses (letters, digits and `_`: valid in stream names and subjects).
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("IDEM_TEST_LOG")
                .unwrap_or_else(|_| "warn,async_nats=error".into()),
        )
        .with_test_writer()
        .try_init();
}

pub async fn connect(url: &str) -> async_nats::Client {
    async_nats::connect(url).await.unwrap_or_else(|e| {
        panic!("no NATS at {url} ({e}); set {NATS_VAR} or start it with scripts/services.sh nats")
    })
}

/// A work stream `<name>` on `<name>.>` and its dead-letter stream `<name>_dlq` on
/// `dlq.<name>.>`, both on file storage.
pub async fn create_streams(js: &jetstream::Context, name: &str) {
    for (stream, subject) in [
        (name.to_owned(), format!("{name}.>")),
        (format!("{name}_dlq"), format!("dlq.{name}.>")),
    ] {
        js.create_stream(stream::Config {
            name: stream,
            subjects: vec![subject],
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .expect("create stream");
    }
}

/// What a runner test starts from: the client, its JetStream context and a fresh name
/// (`<prefix>_<unique>`) whose streams are created; `None` (the test skips) when NATS or Redis
/// does not answer, outside CI.
pub async fn streams_for(prefix: &str) -> Option<(async_nats::Client, jetstream::Context, String)> {
    if !nats_and_redis() {
        return None;
    }
    init_tracing();
    let client = connect(&nats_url()).await;
    let js = jetstream::new(client.clone());
    let name = unique(prefix);
    create_streams(&js, &name).await;
    Some((client, js, name))
}

pub async fn delete_streams(js: &jetstream::Context, name: &str) {
    let _ = js.delete_stream(name).await;
    let _ = js.delete_stream(format!("{name}_dlq")).await;
}

/// One message to publish.
#[derive(Clone, Debug)]
pub struct Msg {
    pub key: String,
    pub body: String,
    /// Headers besides the key.
    pub headers: Vec<(String, String)>,
}

impl Msg {
    pub fn keyed(key: &str, body: impl Into<String>) -> Self {
        Self {
            key: key.to_owned(),
            body: body.into(),
            headers: Vec::new(),
        }
    }
}

/// Publishes to `<stream>.orders` with the key header, waiting for every stream ack.
pub async fn publish(js: &jetstream::Context, stream: &str, msgs: &[Msg]) {
    let mut acks = Vec::with_capacity(msgs.len());
    for m in msgs {
        let mut headers = HeaderMap::new();
        headers.insert("idempotency-key", m.key.as_str());
        for (name, value) in &m.headers {
            headers.insert(name.as_str(), value.as_str());
        }
        acks.push(
            js.publish_with_headers(format!("{stream}.orders"), headers, m.body.clone().into())
                .await
                .expect("publish"),
        );
        if acks.len() >= 500 {
            for a in acks.drain(..) {
                a.await.expect("stream ack");
            }
        }
    }
    for a in acks {
        a.await.expect("stream ack");
    }
}

/// A message read back from a stream.
#[derive(Clone, Debug)]
pub struct Read {
    pub subject: String,
    pub body: String,
    pub headers: HeaderMap,
}

impl Read {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers.get(name).map(|v| v.as_str().to_owned())
    }
}

/// Every message of `stream`.
pub async fn read_stream(js: &jetstream::Context, stream: &str) -> Vec<Read> {
    let mut s = js.get_stream(stream).await.expect("stream");
    let last = s.info().await.expect("info").state.last_sequence;
    let mut out = Vec::new();
    for seq in 1..=last {
        if let Ok(m) = s.get_raw_message(seq).await {
            out.push(Read {
                subject: m.subject.to_string(),
                body: String::from_utf8_lossy(&m.payload).into_owned(),
                headers: m.headers,
            });
        }
    }
    out
}

/// The consumer's (pending, ack pending, redelivered) counts.
pub async fn consumer_state(js: &jetstream::Context, stream: &str, consumer: &str) -> (u64, usize) {
    let s = js.get_stream(stream).await.expect("stream");
    let mut c: jetstream::consumer::PullConsumer =
        s.get_consumer(consumer).await.expect("consumer");
    let info = c.info().await.expect("consumer info");
    (info.num_pending, info.num_ack_pending)
}

/// A Redis store under a fresh prefix (the test checked that Redis answers).
pub async fn redis_store(prefix: &str) -> RedisStore {
    let url = redis_url();
    RedisStore::connect_with(&url, RedisConfig::default().with_prefix(prefix))
        .await
        .unwrap_or_else(|e| {
            panic!("no Redis at {url} ({e}); set {REDIS_VAR} or start one with scripts/services.sh redis")
        })
}

pub async fn redis_conn() -> redis::aio::ConnectionManager {
    let url = redis_url();
    let client = redis::Client::open(url.as_str()).expect("redis url");
    redis::aio::ConnectionManager::new(client)
        .await
        .unwrap_or_else(|e| {
            panic!("no Redis at {url} ({e}); set {REDIS_VAR} or start one with scripts/services.sh redis")
        })
}

pub fn executor(store: DynStore, config: ExecutorConfig) -> Executor<JsonCodec> {
    Executor::new(store, config).expect("executor config")
}

pub fn shared(store: impl idem_core::IdempotencyStore) -> DynStore {
    Arc::new(store)
}

/// Polls `cond` every 50 ms until it holds or `timeout` passes; returns whether it held.
pub async fn wait_for<F, Fut>(timeout: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if cond().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A free TCP port on loopback (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A private `nats-server -js` on its own port and store directory, killed (SIGKILL, by its
/// own pid) on drop; its directory is removed.
pub struct PrivateServer {
    pub port: u16,
    dir: std::path::PathBuf,
    child: Option<std::process::Child>,
}

impl PrivateServer {
    pub async fn start() -> Self {
        let dir = std::env::temp_dir().join(unique("idem_nats_server"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut server = Self {
            port: free_port(),
            dir,
            child: None,
        };
        server.spawn().await;
        server
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    async fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.log"))
            .unwrap();
        let child = std::process::Command::new("nats-server")
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.dir.join("store"))
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        let addr = format!("127.0.0.1:{}", self.port);
        let up = wait_for(Duration::from_secs(20), || {
            let addr = addr.clone();
            async move { tokio::net::TcpStream::connect(addr).await.is_ok() }
        })
        .await;
        assert!(up, "the private nats-server did not start on {addr}");
    }

    /// SIGKILL (`Child::kill`, the server's own pid) and wait.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and store.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
