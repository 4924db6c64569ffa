//! Consumes payments from RabbitMQ with a Redis idempotency store: a duplicate is replayed, a key
//! reused with another payload is dead-lettered with its reason.
//!
//! Needs RabbitMQ and Redis (`scripts/services.sh rabbitmq redis`):
//!
//! ```text
//! cargo run -p idem --features amqp,redis --example amqp_consumer
//! ```
//!
//! `IDEM_AMQP_URL` and `IDEM_REDIS_URL` override the default addresses.

use std::sync::Arc;
use std::time::Duration;

use idem::amqp::lapin::options::{BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions};
use idem::amqp::lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use idem::amqp::lapin::{BasicProperties, Connection, ConnectionProperties};
use idem::amqp::{AmqpMessage, AmqpRunner, QueueTopology, RunnerOptions};
use idem::redis::{RedisConfig, RedisStore};
use idem::{Executor, ExecutorConfig, HandlerContext, HandlerError};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,lapin=warn".into()),
        )
        .init();
    let url = std::env::var("IDEM_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let redis_url =
        std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let run = uuid::Uuid::new_v4().simple().to_string();
    let topology = QueueTopology::new(format!("payments-{}", &run[..8]));

    let store = RedisStore::connect_with(
        &redis_url,
        RedisConfig::default().with_prefix(format!("example:{run}:")),
    )
    .await?;
    let executor = Executor::builder(Arc::new(store))
        .config(ExecutorConfig::new("payments"))
        .on_dead_letter(
            |dl| tracing::error!(key = %dl.key, error = %dl.last_error, "poison payment"),
        )
        .build()?;
    let handler = |msg: AmqpMessage, ctx: HandlerContext| async move {
        let payment: serde_json::Value =
            serde_json::from_slice(msg.body()).map_err(HandlerError::terminal)?;
        tracing::info!(%payment, token = ?ctx.token(), "charging");
        Ok::<_, HandlerError>(format!("charged {}", payment["amount"]))
    };
    let runner = AmqpRunner::builder(&url, topology.clone(), executor, handler)
        .options(RunnerOptions::default().with_prefetch(8))
        .build()?;
    let stats = runner.stats();
    let stop = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(runner.run(stop.clone().cancelled_owned()));

    // Publish once the runner declared the queues: a payment, its duplicate, and the same key
    // reused for another amount.
    let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (key, body) in [
        ("tx-1", r#"{"amount": 10}"#),
        ("tx-1", r#"{"amount": 10}"#),
        ("tx-1", r#"{"amount": 99}"#),
        ("tx-2", r#"{"amount": 5}"#),
    ] {
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("idempotency-key"),
            AMQPValue::LongString(LongString::from(key)),
        );
        channel
            .basic_publish(
                "".into(),
                topology.queue.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_headers(headers),
            )
            .await?
            .await?;
    }
    while stats.executed() + stats.replayed() + stats.dead_lettered() < 4 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    running.await??;
    println!(
        "executed {}, replayed {}, dead-lettered {}",
        stats.executed(),
        stats.replayed(),
        stats.dead_lettered()
    );
    while let Some(dead) = channel
        .basic_get(
            topology.dead_letter_queue.as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await?
    {
        let headers = dead
            .delivery
            .properties
            .headers()
            .clone()
            .unwrap_or_default();
        let reason = match headers.inner().get(idem::amqp::HEADER_REASON) {
            Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            _ => "?".to_owned(),
        };
        println!(
            "dead letter: {} ({reason})",
            String::from_utf8_lossy(&dead.delivery.data)
        );
    }
    for queue in [
        &topology.queue,
        &topology.retry_queue,
        &topology.dead_letter_queue,
    ] {
        channel
            .queue_delete(queue.as_str().into(), Default::default())
            .await?;
    }
    channel
        .exchange_delete(
            topology.dead_letter_exchange.as_str().into(),
            Default::default(),
        )
        .await?;
    conn.close(200, "bye".into()).await?;
    Ok(())
}
