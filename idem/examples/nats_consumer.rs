//! Consumes payments from NATS JetStream with a Redis idempotency store: a duplicate is
//! replayed, a key reused with another payload is dead-lettered with its reason.
//!
//! Needs NATS with JetStream and Redis (`scripts/services.sh nats redis`):
//!
//! ```text
//! cargo run -p idem --features nats,redis --example nats_consumer
//! ```
//!
//! `IDEM_NATS_URL` and `IDEM_REDIS_URL` override the default addresses.

use std::sync::Arc;
use std::time::Duration;

use idem::nats::async_nats::{self, HeaderMap, jetstream};
use idem::nats::{NatsMessage, NatsRunner, RunnerOptions};
use idem::redis::{RedisConfig, RedisStore};
use idem::{Executor, ExecutorConfig, HandlerContext, HandlerError};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,async_nats=warn".into()),
        )
        .init();
    let url = std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let redis_url =
        std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let run = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let stream = format!("PAYMENTS_{run}");
    let subject = format!("payments{run}.created");

    // The streams: the payments, and one capturing their dead letters (`dlq.` + the subject).
    let client = async_nats::connect(&url).await?;
    let js = jetstream::new(client.clone());
    js.create_stream(jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![format!("payments{run}.>")],
        ..Default::default()
    })
    .await?;
    js.create_stream(jetstream::stream::Config {
        name: format!("{stream}_DLQ"),
        subjects: vec![format!("dlq.payments{run}.>")],
        ..Default::default()
    })
    .await?;
    for (key, body) in [
        ("tx-1", r#"{"amount": 10}"#),
        ("tx-1", r#"{"amount": 10}"#),
        ("tx-1", r#"{"amount": 99}"#),
        ("tx-2", r#"{"amount": 5}"#),
    ] {
        let mut headers = HeaderMap::new();
        headers.insert("idempotency-key", key);
        js.publish_with_headers(subject.clone(), headers, body.into())
            .await?
            .await?;
    }

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
    let handler = |msg: NatsMessage, ctx: HandlerContext| async move {
        let payment: serde_json::Value =
            serde_json::from_slice(msg.payload()).map_err(HandlerError::terminal)?;
        tracing::info!(%payment, token = ?ctx.token(), "charging");
        Ok::<_, HandlerError>(format!("charged {}", payment["amount"]))
    };
    let runner = NatsRunner::builder(client, &stream, "payments-workers", executor, handler)
        .options(RunnerOptions::default().with_max_in_flight(8))
        .build()?;
    let stats = runner.stats();
    let stop = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(runner.run(stop.clone().cancelled_owned()));
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
    let dlq = js.get_stream(format!("{stream}_DLQ")).await?;
    let dead = dlq.get_raw_message(1).await?;
    println!(
        "dead letter: {} ({})",
        String::from_utf8_lossy(&dead.payload),
        dead.headers
            .get(idem::nats::HEADER_REASON)
            .map_or("?", |v| v.as_str())
    );
    js.delete_stream(&stream).await?;
    js.delete_stream(format!("{stream}_DLQ")).await?;
    Ok(())
}
