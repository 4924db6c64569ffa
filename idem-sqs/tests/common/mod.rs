//! Test helpers: whether LocalStack (and Redis) answer (every test starts with [`localstack`] or
//! [`localstack_and_redis`]), an SQS client on it, queues with names no other run uses, sending
//! in batches, reading a queue out, the queue's counts.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_conformance::servers;
use idem_core::DynStore;
use idem_redis::{RedisConfig, RedisStore};
use idem_sqs::aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use idem_sqs::aws_sdk_sqs::types::{
    MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
    SendMessageBatchRequestEntry,
};
use idem_sqs::aws_sdk_sqs::{self, Client};

pub const ENDPOINT_VAR: &str = "IDEM_LOCALSTACK_ENDPOINT";
pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:4566";
pub const REDIS_VAR: &str = "IDEM_REDIS_URL";
const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
/// The suite named in the "skipped" line.
const SUITE: &str = "sqs (LocalStack)";

/// Whether LocalStack answers at `IDEM_LOCALSTACK_ENDPOINT`. When it does not: outside CI, one
/// "skipped" line for the suite and `false` (the test returns at once); with `CI=true`, a panic
/// naming the variable.
pub fn localstack() -> bool {
    servers::endpoint(SUITE, ENDPOINT_VAR, DEFAULT_ENDPOINT).is_some()
}

/// [`localstack`], and Redis at `IDEM_REDIS_URL`.
pub fn localstack_and_redis() -> bool {
    localstack() && servers::endpoint(SUITE, REDIS_VAR, DEFAULT_REDIS_URL).is_some()
}

pub fn endpoint() -> String {
    std::env::var(ENDPOINT_VAR).unwrap_or_else(|_| DEFAULT_ENDPOINT.to_owned())
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
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// An SQS client on LocalStack (any credentials do).
pub fn client() -> Client {
    client_at(&endpoint())
}

/// An SQS client on `endpoint` (LocalStack, or a [`HangingProxy`] in front of it).
pub fn client_at(endpoint: &str) -> Client {
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .endpoint_url(endpoint)
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new(
            "idemtest",
            "idemtest",
            None,
            None,
            "idem-tests",
        ))
        .build();
    Client::from_conf(config)
}

/// Creates a queue named `prefix-<random>` (`.fifo` for a FIFO queue, without content-based
/// deduplication) and returns its URL.
pub async fn queue(client: &Client, prefix: &str, fifo: bool) -> String {
    let mut name = unique(prefix);
    let mut create = client.create_queue();
    if fifo {
        name.push_str(".fifo");
        create = create
            .attributes(QueueAttributeName::FifoQueue, "true")
            .attributes(QueueAttributeName::ContentBasedDeduplication, "false");
    }
    create
        .queue_name(&name)
        .send()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "creating the queue {name} on {} failed: {}. Is it LocalStack with SQS? Start it \
                 with scripts/services.sh localstack",
                endpoint(),
                aws_sdk_sqs::Error::from(e)
            )
        })
        .queue_url
        .expect("a queue url")
}

/// A message to send.
#[derive(Clone, Debug)]
pub struct Out {
    pub body: String,
    pub attributes: Vec<(String, String)>,
    /// FIFO only.
    pub group: Option<String>,
}

impl Out {
    pub fn new(body: impl Into<String>) -> Self {
        Self {
            body: body.into(),
            attributes: Vec::new(),
            group: None,
        }
    }

    /// With the attribute `idempotency-key`.
    pub fn keyed(key: &str, body: impl Into<String>) -> Self {
        Self::new(body).attr("idempotency-key", key)
    }

    pub fn attr(mut self, name: &str, value: &str) -> Self {
        self.attributes.push((name.to_owned(), value.to_owned()));
        self
    }

    pub fn group(mut self, group: &str) -> Self {
        self.group = Some(group.to_owned());
        self
    }
}

pub fn string(value: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .unwrap()
}

/// Sends `messages` in order, ten per `SendMessageBatch`; on a FIFO queue every message gets a
/// deduplication id of its own (so duplicates are delivered: SQS's deduplication is not ours).
pub async fn send(client: &Client, url: &str, messages: &[Out]) {
    for chunk in messages.chunks(10) {
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let mut e = SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(&m.body);
                for (k, v) in &m.attributes {
                    e = e.message_attributes(k, string(v));
                }
                if let Some(g) = &m.group {
                    e = e
                        .message_group_id(g)
                        .message_deduplication_id(uuid::Uuid::new_v4().simple().to_string());
                }
                e.build().unwrap()
            })
            .collect();
        let out = client
            .send_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .unwrap_or_else(|e| panic!("SendMessageBatch: {}", aws_sdk_sqs::Error::from(e)));
        assert!(out.failed().is_empty(), "{:?}", out.failed());
    }
}

/// A received message's body and string attributes.
#[derive(Clone, Debug)]
pub struct In {
    pub body: String,
    pub attributes: HashMap<String, String>,
    pub group: Option<String>,
}

/// Receives (and deletes) everything `url` holds, until a receive of `quiet` finds nothing.
pub async fn read_out(client: &Client, url: &str, quiet: Duration) -> Vec<In> {
    let mut out = Vec::new();
    loop {
        let got = client
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .wait_time_seconds(quiet.as_secs().max(1) as i32)
            .message_attribute_names("All")
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .send()
            .await
            .unwrap_or_else(|e| panic!("ReceiveMessage: {}", aws_sdk_sqs::Error::from(e)));
        let messages = got.messages.unwrap_or_default();
        if messages.is_empty() {
            return out;
        }
        for m in messages {
            client
                .delete_message()
                .queue_url(url)
                .receipt_handle(m.receipt_handle().unwrap())
                .send()
                .await
                .unwrap();
            out.push(In {
                body: m.body().unwrap_or_default().to_owned(),
                attributes: m
                    .message_attributes()
                    .map(|a| {
                        a.iter()
                            .filter_map(|(k, v)| Some((k.clone(), v.string_value()?.to_owned())))
                            .collect()
                    })
                    .unwrap_or_default(),
                group: m
                    .attributes()
                    .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
                    .cloned(),
            });
        }
    }
}

/// The queue's (visible, in flight) message counts.
pub async fn counts(client: &Client, url: &str) -> (u64, u64) {
    let out = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GetQueueAttributes: {}", aws_sdk_sqs::Error::from(e)));
    let attrs = out.attributes().cloned().unwrap_or_default();
    let n = |name| {
        attrs
            .get(&name)
            .and_then(|v: &String| v.parse().ok())
            .unwrap_or(0)
    };
    (
        n(QueueAttributeName::ApproximateNumberOfMessages),
        n(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
    )
}

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

/// A TCP proxy in front of LocalStack that can stop answering: once [`hang`](Self::hang)ed it
/// holds the connections it carries and every new one, forwarding nothing, as a server or a
/// network that stopped answering would. Answering again, it closes the connections it held
/// (a client's pool then opens new ones) and forwards as before.
pub struct HangingProxy {
    url: String,
    hung: Arc<tokio::sync::watch::Sender<bool>>,
    accept: tokio::task::JoinHandle<()>,
}

impl HangingProxy {
    /// A proxy to `upstream` (`http://host:port`) on a free loopback port.
    pub async fn start(upstream: &str) -> Self {
        let upstream = upstream
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port");
        let url = format!("http://{}", listener.local_addr().unwrap());
        let hung = Arc::new(tokio::sync::watch::Sender::new(false));
        let carried = Arc::clone(&hung);
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let mut hung = carried.subscribe();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    // Held while hung, closed once it answers again.
                    if *hung.borrow_and_update() {
                        let _ = hung.wait_for(|h| !*h).await;
                        return;
                    }
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    // (The watch's guard is not held past the select: the setter would wait on it.)
                    let held = tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => false,
                        now = hung.wait_for(|h| *h) => now.is_ok(),
                    };
                    if held {
                        let _ = hung.wait_for(|h| !*h).await;
                    }
                });
            }
        });
        Self { url, hung, accept }
    }

    /// The proxy's endpoint, for [`client_at`].
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Stops answering (`true`) or answers again (`false`).
    pub fn hang(&self, hung: bool) {
        self.hung.send_replace(hung);
    }
}

impl Drop for HangingProxy {
    fn drop(&mut self) {
        self.hang(false);
        self.accept.abort();
    }
}
