//! A payments consumer on Kafka, made effectively-once by idem with Redis as the store.
//!
//! It creates its topic `idem-example-payments` (3 partitions) and the dead-letter topic
//! `idem-example-payments.dlq` (1 partition) if they do not exist yet, produces a few payment
//! records (one of them twice, one key reused with another amount), then consumes them with
//! [`KafkaRunner`] until every record is resolved: each payment is charged once, the duplicate is
//! replayed from the store, and the reused key goes to `idem-example-payments.dlq` with its reason
//! in the headers.
//!
//! ```text
//! scripts/services.sh kafka redis
//! cargo run -p idem --features kafka,redis --example kafka_consumer
//! ```
//!
//! Endpoints: `IDEM_KAFKA_BROKERS` (default `127.0.0.1:9092`), `IDEM_REDIS_URL` (default
//! `redis://127.0.0.1:6379`). Set `RUST_LOG=info` to see the runner's events.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem::kafka::rdkafka::ClientConfig;
use idem::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem::kafka::rdkafka::client::DefaultClientContext;
use idem::kafka::rdkafka::message::{Header, OwnedHeaders};
use idem::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem::kafka::rdkafka::types::RDKafkaErrorCode;
use idem::kafka::{DeadLetterTopic, KafkaMessage, KafkaRunner, RunnerOptions};
use idem::redis::RedisStore;
use idem::{Executor, ExecutorConfig, HandlerContext, HandlerError};
use serde::{Deserialize, Serialize};

const TOPIC: &str = "idem-example-payments";
/// Partitions of the source topic: at most this many records are processed at once.
const PARTITIONS: i32 = 3;
/// Partitions of the dead-letter topic: it only gets the records that need a person.
const DLQ_PARTITIONS: i32 = 1;

/// What the handler returns: stored once, replayed to every duplicate.
#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    payment: String,
    charged_cents: i64,
    fencing_token: u64,
}

#[derive(Debug, Deserialize)]
struct Payment {
    amount_cents: i64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,librdkafka=error".into()),
        )
        .init();
    let brokers = std::env::var("IDEM_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let redis_url =
        std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());

    // 0. The topics: the source topic and its dead-letter topic (`payments` -> `payments.dlq`, the
    //    runner's default). Created here if missing; "already exists" is fine.
    let dead_letter = DeadLetterTopic::default();
    let dlq = dead_letter.for_source(TOPIC);
    create_topics(&brokers, &[(TOPIC, PARTITIONS), (&dlq, DLQ_PARTITIONS)]).await?;

    // 1. Some payments; the key travels in the `idempotency-key` header (the default key source).
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()?;
    let run = uuid::Uuid::new_v4().simple().to_string();
    let payments = [
        ("pay-1", 1_000),
        ("pay-2", 2_500),
        ("pay-1", 1_000), // a redelivery: same key, same payload
        ("pay-3", 700),
        ("pay-2", 9_999), // the key reused for another payment: a conflict
    ];
    for (id, cents) in payments {
        let key = format!("{run}-{id}");
        let value = format!("{{\"amount_cents\":{cents}}}");
        let headers = OwnedHeaders::new().insert(Header {
            key: "idempotency-key",
            value: Some(&key),
        });
        producer
            .send(
                FutureRecord::to(TOPIC)
                    .key(&key)
                    .payload(&value)
                    .headers(headers),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)?;
    }

    // 2. The executor over a shared store, and the consumer configuration.
    let store = RedisStore::connect(&redis_url).await?;
    let executor = Executor::new(
        Arc::new(store),
        ExecutorConfig::new("example-payments").with_lease_ttl(Duration::from_secs(10)),
    )?;
    let mut consumer = ClientConfig::new();
    consumer
        .set("bootstrap.servers", &brokers)
        .set("group.id", format!("idem-example-{run}"))
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000");

    // 3. The business handler: runs once per key; fence downstream writes with the token.
    let handler = |msg: KafkaMessage, ctx: HandlerContext| async move {
        let payment: Payment =
            serde_json::from_slice(msg.payload()).map_err(HandlerError::terminal)?;
        let id = ctx.key().map(|k| k.id().to_owned()).unwrap_or_default();
        println!(
            "charging {} cents for {id} (partition {}, offset {}, attempt {})",
            payment.amount_cents,
            msg.partition(),
            msg.offset(),
            ctx.attempt()
        );
        Ok::<_, HandlerError>(Receipt {
            payment: id,
            charged_cents: payment.amount_cents,
            fencing_token: ctx.token().map_or(0, |t| t.get()),
        })
    };

    // 4. The runner: commits only resolved records, pauses on busy keys, dead-letters conflicts.
    let runner = KafkaRunner::builder(consumer, executor, handler)
        .topic(TOPIC)
        .options(
            RunnerOptions::default()
                .with_commit_interval(Duration::from_millis(500))
                .with_dead_letter_topic(dead_letter),
        )
        .build()?;
    let stats = runner.stats();
    let ours = payments.len() as u64;
    let watch = Arc::clone(&stats);
    let started = Instant::now();
    // Stop on Ctrl-C or SIGTERM (what systemd and Kubernetes send), or once our records are
    // resolved (the topic may hold earlier runs' records, which are resolved too: replayed, or
    // dead-lettered as conflicts of nothing).
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let shutdown = async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = terminate.recv() => {}
            () = async {
                while watch.resolved() < ours && started.elapsed() < Duration::from_secs(60) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                // let the earlier runs' records, if any, go through too
                tokio::time::sleep(Duration::from_secs(1)).await;
            } => {}
        }
    };
    runner.run(shutdown).await?;
    println!(
        "resolved {} records: {} executed, {} replayed, {} dead-lettered to {dlq}",
        stats.resolved(),
        stats.executed(),
        stats.replayed(),
        stats.dead_lettered()
    );
    Ok(())
}

/// Creates each `(topic, partitions)` that does not exist yet, with the broker's default
/// replication factor (`TopicReplication::Fixed(-1)`: 1 on a one-broker development cluster,
/// `default.replication.factor` on a real one). A topic that already exists is left as it is.
async fn create_topics(
    brokers: &str,
    topics: &[(&str, i32)],
) -> Result<(), Box<dyn std::error::Error>> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|&(name, partitions)| NewTopic::new(name, partitions, TopicReplication::Fixed(-1)))
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    for result in admin.create_topics(&new, &options).await? {
        match result {
            Ok(topic) => println!("created topic {topic}"),
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => return Err(format!("creating topic {topic}: {code}").into()),
        }
    }
    Ok(())
}
