//! Test helpers: whether the broker and Redis answer (every test starts with [`kafka_and_redis`]
//! or [`kafka_only`]), random topic and group names, topic creation, producing, reading a topic
//! back, committed offsets.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::collections::BTreeMap;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_conformance::servers;
use idem_core::DynStore;
use idem_executor::{Executor, ExecutorConfig, JsonCodec};

use idem_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use idem_kafka::rdkafka::error::{KafkaError, RDKafkaErrorCode};
use idem_kafka::rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use idem_kafka::rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use idem_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use idem_redis::{RedisConfig, RedisStore};

pub const BROKERS_VAR: &str = "IDEM_KAFKA_BROKERS";
pub const TANSU_VAR: &str = "IDEM_TANSU_BIN";
pub const REDIS_VAR: &str = "IDEM_REDIS_URL";
const DEFAULT_BROKERS: &str = "127.0.0.1:9092";
const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
/// The suite named in the "skipped" line.
const SUITE: &str = "kafka";

/// Whether a broker answers at `IDEM_KAFKA_BROKERS` and Redis at `IDEM_REDIS_URL`. When one does
/// not: outside CI, one "skipped" line for the suite and `false` (the test returns at once); with
/// `CI=true`, a panic naming the variable.
pub fn kafka_and_redis() -> bool {
    kafka_only() && servers::endpoint(SUITE, REDIS_VAR, DEFAULT_REDIS_URL).is_some()
}

/// Whether a broker answers at `IDEM_KAFKA_BROKERS`, for the tests that need no Redis; skips or
/// fails as [`kafka_and_redis`].
pub fn kafka_only() -> bool {
    servers::endpoint(SUITE, BROKERS_VAR, DEFAULT_BROKERS).is_some()
}

/// The broker list under test (default `127.0.0.1:9092`).
pub fn brokers() -> String {
    std::env::var(BROKERS_VAR).unwrap_or_else(|_| DEFAULT_BROKERS.to_owned())
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
                .unwrap_or_else(|_| "warn,librdkafka=error".into()),
        )
        .with_test_writer()
        .try_init();
}

/// Fails when the broker does not answer the metadata request (the test already checked that
/// something listens there), naming the variable and the services script.
fn require_broker() {
    let brokers = brokers();
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .expect("consumer");
    if let Err(e) = consumer.fetch_metadata(None, Duration::from_secs(10)) {
        panic!(
            "no Kafka broker answers at {brokers} ({e}); set {BROKERS_VAR} or start one with \
             scripts/services.sh kafka"
        );
    }
}

/// The tansu binary: `IDEM_TANSU_BIN`, else the path `scripts/services/kafka.sh` wrote to
/// `$IDEM_RUN_DIR/kafka.bin`, else `${IDEM_CACHE_DIR:-$HOME/.cache/idem}/kafka/bin/tansu`.
pub fn tansu_bin() -> Option<PathBuf> {
    if let Ok(bin) = std::env::var(TANSU_VAR) {
        return Some(PathBuf::from(bin));
    }
    let run_dir = std::env::var("IDEM_RUN_DIR").unwrap_or_else(|_| "/tmp/idem-services".into());
    if let Ok(path) = std::fs::read_to_string(format!("{run_dir}/kafka.bin")) {
        let path = PathBuf::from(path.trim());
        if path.exists() {
            return Some(path);
        }
    }
    let cache = std::env::var("IDEM_CACHE_DIR")
        .unwrap_or_else(|_| format!("{}/.cache/idem", std::env::var("HOME").unwrap_or_default()));
    let path = PathBuf::from(format!("{cache}/kafka/bin/tansu"));
    path.exists().then_some(path)
}

/// Creates a topic with `partitions` partitions and waits until its metadata shows them.
///
/// With tansu it runs `tansu topic create NAME --partitions N --broker tcp://BROKER` (the
/// binary from [`tansu_bin`]); against another broker it uses the Kafka admin API.
pub async fn create_topic(name: &str, partitions: i32) {
    require_broker();
    let brokers = brokers();
    let first = brokers.split(',').next().unwrap().trim().to_owned();
    match tansu_bin() {
        Some(bin) => {
            let out = Command::new(&bin)
                .args(["topic", "create", name, "--partitions"])
                .arg(partitions.to_string())
                .arg("--broker")
                .arg(format!("tcp://{first}"))
                .output()
                .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()));
            assert!(
                out.status.success(),
                "tansu topic create {name}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        None => {
            use idem_kafka::rdkafka::admin::{
                AdminClient, AdminOptions, NewTopic, TopicReplication,
            };
            let admin: AdminClient<_> = ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .create()
                .expect("admin client");
            let r = admin
                .create_topics(
                    &[NewTopic::new(name, partitions, TopicReplication::Fixed(1))],
                    &AdminOptions::new(),
                )
                .await
                .expect("create_topics");
            for r in r {
                r.unwrap_or_else(|(t, e)| panic!("creating {t}: {e}"));
            }
        }
    }
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .expect("consumer");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let shown = consumer
            .fetch_metadata(Some(name), Duration::from_secs(5))
            .is_ok_and(|md| {
                md.topics()
                    .iter()
                    .any(|t| t.name() == name && t.partitions().len() == partitions as usize)
            });
        if shown {
            return;
        }
        assert!(Instant::now() < deadline, "topic {name} did not show up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub fn producer() -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("linger.ms", "5")
        .create()
        .expect("producer")
}

/// One record to produce.
#[derive(Clone, Debug)]
pub struct Rec {
    pub partition: i32,
    pub key: Option<String>,
    pub value: String,
    pub headers: Vec<(String, String)>,
}

impl Rec {
    /// A record carrying `key` as its `idempotency-key` header and as its record key.
    pub fn keyed(partition: i32, key: &str, value: impl Into<String>) -> Self {
        Self {
            partition,
            key: Some(key.to_owned()),
            value: value.into(),
            headers: vec![("idempotency-key".into(), key.to_owned())],
        }
    }
}

/// Produces the records in order (all sends are pipelined, order per partition is kept) and
/// returns each one's (partition, offset). When the producer's queue is full, waits for the
/// oldest send in flight before enqueuing more.
pub async fn produce(topic: &str, records: &[Rec]) -> Vec<(i32, i64)> {
    let producer = producer();
    let mut futures = std::collections::VecDeque::new();
    let mut out = Vec::with_capacity(records.len());
    for rec in records {
        let mut headers = OwnedHeaders::new();
        for (k, v) in &rec.headers {
            headers = headers.insert(Header {
                key: k,
                value: Some(v),
            });
        }
        let mut record: FutureRecord<'_, str, str> = FutureRecord::to(topic)
            .partition(rec.partition)
            .payload(rec.value.as_str())
            .headers(headers);
        if let Some(k) = &rec.key {
            record = record.key(k);
        }
        loop {
            match producer.send_result(record) {
                Ok(future) => {
                    futures.push_back(future);
                    break;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    let oldest = futures.pop_front().expect("a full queue holds a send");
                    out.push(delivered(oldest).await);
                }
                Err((e, _)) => panic!("enqueue: {e}"),
            }
        }
    }
    for f in futures {
        out.push(delivered(f).await);
    }
    out
}

/// The (partition, offset) a send was delivered at.
async fn delivered(send: DeliveryFuture) -> (i32, i64) {
    let delivery = send.await.expect("delivery").expect("delivered");
    (delivery.partition, delivery.offset)
}

/// The end offset of each partition written by `produce` (last offset + 1).
pub fn ends(deliveries: &[(i32, i64)]) -> BTreeMap<i32, i64> {
    let mut ends = BTreeMap::new();
    for &(p, o) in deliveries {
        let e = ends.entry(p).or_insert(0);
        *e = (*e).max(o + 1);
    }
    ends
}

/// A consumer (no group commits) assigned every partition of `topic` from its beginning, and
/// the partitions' ids.
fn reader(topic: &str) -> (BaseConsumer, Vec<i32>) {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("enable.partition.eof", "false")
        .set("group.id", unique("reader"))
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let md = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    let partitions: Vec<i32> = md
        .topics()
        .iter()
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    let mut tpl = TopicPartitionList::new();
    for &p in &partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).expect("assign");
    (consumer, partitions)
}

/// One poll of `consumer`, its record (an error is printed and skipped).
fn poll_one(consumer: &BaseConsumer, topic: &str) -> Option<OwnedMessage> {
    let polled = tokio::task::block_in_place(|| {
        consumer
            .poll(Duration::from_millis(100))
            .map(|r| r.map(|m| m.detach()))
    });
    match polled {
        Some(Ok(m)) => Some(m),
        Some(Err(e)) => {
            eprintln!("reading {topic}: {e}");
            None
        }
        None => None,
    }
}

/// Reads `topic` from the beginning of every partition (no group) until `want` records were
/// read or `timeout` passed.
pub async fn read_topic(topic: &str, want: usize, timeout: Duration) -> Vec<OwnedMessage> {
    let (consumer, _) = reader(topic);
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    while out.len() < want && Instant::now() < deadline {
        out.extend(poll_one(&consumer, topic));
    }
    out
}

/// Every record of `topic`: read from the beginning of each partition up to the high
/// watermark it had when the read began (a test calls it once the writers have stopped), for at
/// most `timeout`. Panics when the end is not reached in time, rather than return a part.
pub async fn read_topic_to_end(topic: &str, timeout: Duration) -> Vec<OwnedMessage> {
    let (consumer, partitions) = reader(topic);
    // Per partition holding records, the offset the read must reach.
    let mut ends: BTreeMap<i32, i64> = BTreeMap::new();
    for p in partitions {
        let (low, high) = consumer
            .fetch_watermarks(topic, p, Duration::from_secs(10))
            .expect("watermarks");
        if high > low {
            ends.insert(p, high);
        }
    }
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    while !ends.is_empty() {
        assert!(
            Instant::now() < deadline,
            "read_topic_to_end {topic}: not at the end within {timeout:?}, left {ends:?}"
        );
        out.extend(poll_one(&consumer, topic));
        // The consumer's position, not the last record's offset: it also moves past control
        // records (transaction markers), which are never handed out.
        let position = consumer.position().expect("position");
        ends.retain(|partition, end| {
            !matches!(
                position.find_partition(topic, *partition).map(|p| p.offset()),
                Some(Offset::Offset(at)) if at >= *end
            )
        });
    }
    out
}

/// The offsets committed by `group` on partitions `0..partitions` of `topic` (`-1` for none).
pub fn committed(group: &str, topic: &str, partitions: i32) -> BTreeMap<i32, i64> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("group.id", group)
        .create()
        .expect("consumer");
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let got = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("committed offsets");
    got.elements()
        .iter()
        .map(|e| {
            let o = match e.offset() {
                Offset::Offset(o) => o,
                _ => -1,
            };
            (e.partition(), o)
        })
        .collect()
}

/// The consumer configuration the tests use: fast group joins on tansu (which takes half the
/// session timeout to form a group), earliest reset.
pub fn consumer_config(group: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers())
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "2000")
        .set("heartbeat.interval.ms", "500")
        .set("enable.partition.eof", "false");
    // e.g. `cooperative-sticky`, to run the suite under the incremental rebalance protocol.
    if let Ok(strategy) = std::env::var("IDEM_KAFKA_ASSIGNMENT_STRATEGY") {
        c.set("partition.assignment.strategy", strategy);
    }
    c
}

/// A Redis store under a fresh prefix (the test checked that Redis answers).
pub async fn redis_store(prefix: &str) -> RedisStore {
    redis_store_with(RedisConfig::default().with_prefix(prefix)).await
}

/// A Redis store with `config` (the test checked that Redis answers).
pub async fn redis_store_with(config: RedisConfig) -> RedisStore {
    let url = redis_url();
    RedisStore::connect_with(&url, config)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "no Redis at {url} ({e}); set {REDIS_VAR} or start one with scripts/services.sh redis"
            )
        })
}

pub async fn redis_conn() -> redis::aio::ConnectionManager {
    let url = redis_url();
    let client = redis::Client::open(url.as_str()).expect("redis url");
    redis::aio::ConnectionManager::new(client)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "no Redis at {url} ({e}); set {REDIS_VAR} or start one with scripts/services.sh redis"
            )
        })
}

pub fn executor(store: DynStore, config: ExecutorConfig) -> Executor<JsonCodec> {
    Executor::new(store, config).expect("executor config")
}

pub fn shared(store: impl idem_core::IdempotencyStore) -> DynStore {
    Arc::new(store)
}

/// The value of header `name`, as text. Headers whose names rdkafka cannot read (not UTF-8: it
/// panics on them) are skipped.
pub fn header(m: &OwnedMessage, name: &str) -> Option<String> {
    let headers = m.headers()?;
    (0..headers.count())
        .find_map(|i| {
            let h = catch_unwind(AssertUnwindSafe(|| headers.try_get(i))).ok()??;
            (h.key == name).then_some(h.value).flatten()
        })
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// Headers holding first a header whose name is not UTF-8, as any producer may send, then
/// `idempotency-key: key` when `key` is given. rdkafka's safe API takes names as `&str`, so the
/// first one is added through librdkafka itself.
pub fn headers_with_a_name_that_is_not_utf8(key: Option<&str>) -> OwnedHeaders {
    headers_with_names_that_are_not_utf8(1, key)
}

/// Headers holding first `n` headers whose names (`\xff\xfe`) are not UTF-8, then
/// `idempotency-key: key` when `key` is given (see [`headers_with_a_name_that_is_not_utf8`]).
#[allow(unsafe_code)]
pub fn headers_with_names_that_are_not_utf8(n: usize, key: Option<&str>) -> OwnedHeaders {
    use idem_kafka::rdkafka::bindings::{rd_kafka_header_add, rd_kafka_resp_err_t};
    let headers = OwnedHeaders::new_with_capacity(n + 1);
    let (name, value) = (b"\xff\xfe", b"v");
    for _ in 0..n {
        // SAFETY: `as_borrowed` is rdkafka's view of this `rd_kafka_headers_t`, at its address
        // (rdkafka casts it back to the native pointer the same way); librdkafka copies the
        // name and the value, whose lengths are given.
        let err = unsafe {
            rd_kafka_header_add(
                std::ptr::from_ref(headers.as_borrowed()).cast_mut().cast(),
                name.as_ptr().cast(),
                name.len().try_into().unwrap(),
                value.as_ptr().cast(),
                value.len().try_into().unwrap(),
            )
        };
        assert_eq!(err, rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR);
    }
    match key {
        Some(key) => headers.insert(Header {
            key: "idempotency-key",
            value: Some(key),
        }),
        None => headers,
    }
}

/// `n` headers `h0: v`, `h1: v`, ... (names UTF-8), then `idempotency-key: key`.
pub fn many_headers(n: usize, key: &str) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new_with_capacity(n + 1);
    for i in 0..n {
        headers = headers.insert(Header {
            key: &format!("h{i}"),
            value: Some("v"),
        });
    }
    headers.insert(Header {
        key: "idempotency-key",
        value: Some(key),
    })
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
