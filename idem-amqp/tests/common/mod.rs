//! Test helpers: whether RabbitMQ and Redis answer (every test starts with [`amqp_and_redis`]),
//! unique names, publishing, reading a queue back, queue depths, cleanup, private RabbitMQ
//! nodes.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_amqp::lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use idem_amqp::lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use idem_amqp::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use idem_amqp::{QueueTopology, QueueType, RunnerStats};
use idem_conformance::servers;
use idem_core::DynStore;
use idem_executor::{Executor, ExecutorConfig, JsonCodec};
use idem_redis::{RedisConfig, RedisStore};

pub const AMQP_VAR: &str = "IDEM_AMQP_URL";
pub const REDIS_VAR: &str = "IDEM_REDIS_URL";
const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
/// The suite named in the "skipped" line.
const SUITE: &str = "amqp";

/// Whether RabbitMQ answers at `IDEM_AMQP_URL` and Redis at `IDEM_REDIS_URL`. When one does
/// not: outside CI, one "skipped" line for the suite and `false` (the test returns at once);
/// with `CI=true`, a panic naming the variable.
pub fn amqp_and_redis() -> bool {
    servers::endpoint(SUITE, AMQP_VAR, DEFAULT_AMQP_URL).is_some()
        && servers::endpoint(SUITE, REDIS_VAR, DEFAULT_REDIS_URL).is_some()
}

/// Whether `rabbitmq-server` can be started (for the private-node test); skips or fails as
/// [`amqp_and_redis`].
pub fn rabbitmq_program() -> bool {
    servers::program(
        SUITE,
        "rabbitmq-server",
        "scripts/services.sh rabbitmq installs it",
    )
}

pub fn amqp_url() -> String {
    std::env::var(AMQP_VAR).unwrap_or_else(|_| DEFAULT_AMQP_URL.to_owned())
}

pub fn redis_url() -> String {
    std::env::var(REDIS_VAR).unwrap_or_else(|_| DEFAULT_REDIS_URL.to_owned())
}

/// A name no other run uses.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("IDEM_TEST_LOG")
                .unwrap_or_else(|_| "warn,lapin=error".into()),
        )
        .with_test_writer()
        .try_init();
}

pub async fn connect(url: &str) -> Connection {
    let attempt = Connection::connect(url, ConnectionProperties::default());
    match tokio::time::timeout(Duration::from_secs(30), attempt).await {
        Ok(Ok(connection)) => connection,
        Ok(Err(e)) => panic!(
            "no RabbitMQ at {url} ({e}); set {AMQP_VAR} or start it with scripts/services.sh rabbitmq"
        ),
        Err(_) => panic!("RabbitMQ at {url} did not finish the handshake within 30 s"),
    }
}

/// A topology under a fresh queue name.
pub fn topology(prefix: &str, queue_type: QueueType) -> QueueTopology {
    QueueTopology::new(unique(prefix)).with_queue_type(queue_type)
}

/// Declares the topology the way the runner does, so messages can be published before a
/// runner starts.
pub async fn declare(url: &str, topology: &QueueTopology) {
    let conn = connect(url).await;
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("x-queue-type"),
        AMQPValue::LongString(LongString::from(topology.queue_type.as_str())),
    );
    ch.queue_declare(
        topology.queue.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        args,
    )
    .await
    .expect("declare the work queue");
    let _ = conn.close(200, "bye".into()).await;
}

/// Deletes the queues and the exchange of `topology`.
pub async fn cleanup(url: &str, topology: &QueueTopology) {
    let conn = connect(url).await;
    let ch = conn.create_channel().await.unwrap();
    for q in [
        &topology.queue,
        &topology.retry_queue,
        &topology.dead_letter_queue,
    ] {
        let _ = ch
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = ch
        .exchange_delete(
            topology.dead_letter_exchange.as_str().into(),
            ExchangeDeleteOptions::default(),
        )
        .await;
    let _ = conn.close(200, "bye".into()).await;
}

/// One message to publish.
#[derive(Clone, Debug)]
pub struct Msg {
    pub key: Option<String>,
    pub body: String,
    /// Headers besides the key.
    pub headers: Vec<(String, AMQPValue)>,
}

impl Msg {
    pub fn keyed(key: &str, body: impl Into<String>) -> Self {
        Self {
            key: Some(key.to_owned()),
            body: body.into(),
            headers: Vec::new(),
        }
    }
}

/// Publishes persistent messages to `queue` (default exchange) with publisher confirms.
pub async fn publish(url: &str, queue: &str, msgs: &[Msg]) {
    let conn = connect(url).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirms = Vec::with_capacity(msgs.len());
    for m in msgs {
        let mut props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into());
        let mut headers = FieldTable::default();
        if let Some(k) = &m.key {
            headers.insert(
                ShortString::from("idempotency-key"),
                AMQPValue::LongString(LongString::from(k.as_str())),
            );
        }
        for (name, value) in &m.headers {
            headers.insert(ShortString::from(name.as_str()), value.clone());
        }
        if !headers.inner().is_empty() {
            props = props.with_headers(headers);
        }
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                m.body.as_bytes(),
                props,
            )
            .await
            .expect("publish");
        confirms.push(confirm);
        if confirms.len() >= 500 {
            for c in confirms.drain(..) {
                let c = c.await.expect("confirm");
                assert!(
                    c.is_ack() && c.take_message().is_none(),
                    "routed and confirmed"
                );
            }
        }
    }
    for c in confirms {
        let c = c.await.expect("confirm");
        assert!(
            c.is_ack() && c.take_message().is_none(),
            "routed and confirmed"
        );
    }
    let _ = conn.close(200, "bye".into()).await;
}

/// The ready messages of `queue` (passive declare), `None` when it does not exist.
pub async fn depth(ch: &Channel, queue: &str) -> Option<u32> {
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        },
        FieldTable::default(),
    )
    .await
    .ok()
    .map(|q| q.message_count())
}

/// Ready messages and consumers of `queue` on a fresh connection.
pub async fn queue_state(url: &str, queue: &str) -> (u32, u32) {
    let conn = connect(url).await;
    let ch = conn.create_channel().await.unwrap();
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("queue exists");
    let _ = conn.close(200, "bye".into()).await;
    (q.message_count(), q.consumer_count())
}

/// Whether the retry queue and then the work queue hold no ready message. `message_count`
/// counts ready messages only; read in this order, a copy moving from the retry queue to the
/// work queue is seen in the work queue or, once delivered, in a consumer's [`held`] count.
pub async fn queues_empty(url: &str, topology: &QueueTopology) -> bool {
    queue_state(url, &topology.retry_queue).await.0 == 0
        && queue_state(url, &topology.queue).await.0 == 0
}

/// The deliveries a runner has received and not settled yet (resolved, given back, or left to
/// the broker). The settled ones are read first: a delivery is received before it is settled.
pub fn held(stats: &RunnerStats) -> u64 {
    let settled = stats.resolved() + stats.requeued() + stats.abandoned();
    stats.received().saturating_sub(settled)
}

/// Waits (at most `timeout`) until `quiet` holds three times in a row, 50 ms apart: a delivery
/// the broker pushed to a consumer that had not read it yet at the first look is seen at a later
/// one (even through a consumer's report made up to 20 ms before), so that a graceful stop then
/// has nothing to give back.
pub async fn wait_quiet<F, Fut>(timeout: Duration, mut quiet: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    let mut in_a_row = 0;
    while in_a_row < 3 {
        if Instant::now() >= deadline {
            return false;
        }
        in_a_row = if quiet().await { in_a_row + 1 } else { 0 };
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    true
}

/// A message read back from a queue.
#[derive(Clone, Debug)]
pub struct Read {
    pub body: String,
    pub headers: FieldTable,
}

impl Read {
    pub fn header(&self, name: &str) -> Option<String> {
        match self.headers.inner().get(name)? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
            other => Some(format!("{other:?}")),
        }
    }
}

/// Reads (and acknowledges) every message of `queue`.
pub async fn drain_queue(url: &str, queue: &str) -> Vec<Read> {
    let conn = connect(url).await;
    let ch = conn.create_channel().await.unwrap();
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get")
    {
        let d = m.delivery;
        out.push(Read {
            body: String::from_utf8_lossy(&d.data).into_owned(),
            headers: d.properties.headers().clone().unwrap_or_default(),
        });
    }
    let _ = conn.close(200, "bye".into()).await;
    out
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

/// A private RabbitMQ node on its own ports, node name, data and log directories and Erlang
/// cookie (its own `HOME`), started from `rabbitmq-server` in its own process group so that a
/// SIGKILL takes the whole node down. Stopped (killed) on drop; its directory is removed.
pub struct PrivateNode {
    pub port: u16,
    dir: std::path::PathBuf,
    env: Vec<(String, String)>,
    child: Option<std::process::Child>,
}

impl PrivateNode {
    /// Starts a node and waits until it accepts AMQP connections.
    pub async fn start() -> Self {
        let port = free_port();
        let dist = free_port();
        let dir = std::env::temp_dir().join(unique("idem-amqp-node"));
        for sub in ["mnesia", "log", "home"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        std::fs::write(
            dir.join("rabbitmq.conf"),
            format!("listeners.tcp.local = 127.0.0.1:{port}\nloopback_users = none\n"),
        )
        .unwrap();
        std::fs::write(dir.join("enabled_plugins"), "[].\n").unwrap();
        std::fs::write(dir.join("rabbitmq-env.conf"), "").unwrap();
        let path = |p: &str| dir.join(p).display().to_string();
        let node = format!(
            "idem-{}@localhost",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let env = vec![
            ("HOME".into(), path("home")),
            ("RABBITMQ_NODENAME".into(), node),
            ("RABBITMQ_NODE_IP_ADDRESS".into(), "127.0.0.1".into()),
            ("RABBITMQ_NODE_PORT".into(), port.to_string()),
            ("RABBITMQ_DIST_PORT".into(), dist.to_string()),
            ("RABBITMQ_MNESIA_BASE".into(), path("mnesia")),
            ("RABBITMQ_LOG_BASE".into(), path("log")),
            ("RABBITMQ_CONFIG_FILE".into(), path("rabbitmq.conf")),
            (
                "RABBITMQ_ADVANCED_CONFIG_FILE".into(),
                path("advanced.config"),
            ),
            (
                "RABBITMQ_ENABLED_PLUGINS_FILE".into(),
                path("enabled_plugins"),
            ),
            ("RABBITMQ_CONF_ENV_FILE".into(), path("rabbitmq-env.conf")),
            ("RABBITMQ_PID_FILE".into(), path("node.pid")),
            ("ERL_EPMD_ADDRESS".into(), "127.0.0.1".into()),
            (
                "ERL_FLAGS".into(),
                "-kernel inet_dist_use_interface {127,0,0,1}".into(),
            ),
        ];
        let mut node = Self {
            port,
            dir,
            env,
            child: None,
        };
        node.spawn().await;
        node
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    async fn spawn(&mut self) {
        use std::os::unix::process::CommandExt;
        let server = ["/usr/lib/rabbitmq/bin/rabbitmq-server", "rabbitmq-server"]
            .into_iter()
            .find(|p| !p.starts_with('/') || std::path::Path::new(p).exists())
            .unwrap();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.out"))
            .unwrap();
        let child = Command::new(server)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .current_dir(&self.dir)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("start rabbitmq-server");
        self.child = Some(child);
        let url = self.url();
        let up = wait_for(Duration::from_secs(60), || {
            let url = url.clone();
            async move {
                // Bounded: an attempt that meets the node mid-boot may never be answered.
                let attempt = Connection::connect(&url, ConnectionProperties::default());
                matches!(
                    tokio::time::timeout(Duration::from_secs(5), attempt).await,
                    Ok(Ok(_))
                )
            }
        })
        .await;
        assert!(
            up,
            "the private RabbitMQ node did not start on port {} (see {})",
            self.port,
            self.dir.join("server.out").display()
        );
    }

    /// SIGKILLs every process of the node's process group (by their own, positive pids: never
    /// a negative pid, which some `kill` builds take for -1, every process) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pids = group_members(child.id());
            if !pids.is_empty() {
                let _ = Command::new("kill")
                    .arg("-9")
                    .args(pids.iter().map(u32::to_string))
                    .status();
            }
            let _ = child.wait();
        }
    }

    /// Runs `rabbitmqctl` with `args` against the node (its own name and Erlang cookie) and
    /// panics unless it succeeds.
    pub fn ctl(&self, args: &[&str]) {
        let ctl = ["/usr/lib/rabbitmq/bin/rabbitmqctl", "rabbitmqctl"]
            .into_iter()
            .find(|p| !p.starts_with('/') || std::path::Path::new(p).exists())
            .unwrap();
        let out = Command::new(ctl)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .args(args)
            .output()
            .expect("run rabbitmqctl");
        assert!(
            out.status.success(),
            "rabbitmqctl {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts the node again on the same ports and data.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().await;
    }
}

use std::process::Command;

/// The pids (all above 1) of the processes in the process group `pgid`, from `/proc`.
fn group_members(pgid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid pgrp ...`; comm may hold spaces and parentheses.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let group = rest
            .split_whitespace()
            .nth(2)
            .and_then(|g| g.parse::<u32>().ok());
        if group == Some(pgid) && pid > 1 {
            out.push(pid);
        }
    }
    out
}

impl Drop for PrivateNode {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
