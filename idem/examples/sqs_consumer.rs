//! A payments consumer on SQS, made effectively-once by idem with Redis as the store.
//!
//! It creates the queues `idem-example-payments` and `idem-example-payments-dlq` if they do not
//! exist yet (`CreateQueue` with no attributes is idempotent), sends a few payments (one of them
//! twice, one key reused with another amount, one without a key), then consumes them with
//! [`SqsRunner`] until the queue is empty: each payment is charged once, the duplicate is
//! replayed from the store, and the reused key and the message without a key go to the
//! dead-letter queue with their reasons as message attributes, which the example prints.
//!
//! ```text
//! scripts/services.sh localstack redis
//! cargo run -p idem --features sqs,redis --example sqs_consumer
//! ```
//!
//! Endpoints: `IDEM_LOCALSTACK_ENDPOINT` (default `http://127.0.0.1:4566`; against AWS, build the
//! client from `aws-config` instead), `IDEM_REDIS_URL` (default `redis://127.0.0.1:6379`). Set
//! `RUST_LOG=info` to see the runner's events.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem::redis::RedisStore;
use idem::sqs::aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use idem::sqs::aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
use idem::sqs::aws_sdk_sqs::{self, Client};
use idem::sqs::{ATTR_ERROR, ATTR_KEY, ATTR_REASON, RunnerOptions, SqsMessage, SqsRunner};
use idem::{Executor, ExecutorConfig, HandlerContext, HandlerError, KeySource};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

const QUEUE: &str = "idem-example-payments";
const DLQ: &str = "idem-example-payments-dlq";

/// What the handler returns: stored once, replayed to every duplicate.
#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    charged: i64,
    token: u64,
}

fn text(value: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .expect("the data type is set")
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let endpoint = std::env::var("IDEM_LOCALSTACK_ENDPOINT")
        .unwrap_or_else(|_| "http://127.0.0.1:4566".into());
    let redis = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let sqs = Client::from_conf(
        aws_sdk_sqs::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .endpoint_url(&endpoint)
            .region(Region::new("us-east-1"))
            .credentials_provider(Credentials::new(
                "example", "example", None, None, "example",
            ))
            .build(),
    );
    let queue = sqs
        .create_queue()
        .queue_name(QUEUE)
        .send()
        .await?
        .queue_url
        .unwrap_or_default();
    let dlq = sqs
        .create_queue()
        .queue_name(DLQ)
        .send()
        .await?
        .queue_url
        .unwrap_or_default();

    // A run of its own: keys that earlier runs did not use.
    let run = std::process::id();
    let payments = [
        (
            Some(format!("pay-{run}-1")),
            r#"{"account":"alice","amount":10}"#,
        ),
        (
            Some(format!("pay-{run}-2")),
            r#"{"account":"bob","amount":25}"#,
        ),
        (
            Some(format!("pay-{run}-1")),
            r#"{"account":"alice","amount":10}"#,
        ), // a duplicate
        (
            Some(format!("pay-{run}-2")),
            r#"{"account":"bob","amount":99}"#,
        ), // key reused
        (None, r#"{"account":"carol","amount":5}"#), // no key
    ];
    for (key, body) in &payments {
        let mut send = sqs.send_message().queue_url(&queue).message_body(*body);
        if let Some(key) = key {
            send = send.message_attributes("idempotency-key", text(key));
        }
        send.send().await?;
        // One after the other, so that the reused key meets its original completed.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    let store = RedisStore::connect(&redis).await?;
    let config = ExecutorConfig::new("payments")
        // The attribute `idempotency-key` (the default, spelled out).
        .with_key_source(KeySource::header("idempotency-key"));
    let executor = Executor::new(Arc::new(store), config)?;
    let handler = |msg: SqsMessage, ctx: HandlerContext| async move {
        #[derive(Deserialize)]
        struct Payment {
            account: String,
            amount: i64,
        }
        let payment: Payment = serde_json::from_str(msg.body()).map_err(HandlerError::terminal)?;
        // The charge itself goes here, fenced downstream with ctx.token().
        let token = ctx.token().map_or(0, |t| t.get());
        println!(
            "charging {} {} (key {}, attempt {})",
            payment.account,
            payment.amount,
            ctx.key().map_or("-", |k| k.id()),
            ctx.attempt()
        );
        Ok::<_, HandlerError>(Receipt {
            charged: payment.amount,
            token,
        })
    };
    let runner = SqsRunner::builder(sqs.clone(), &queue, executor, handler)
        .dead_letter_queue(&dlq)
        .options(RunnerOptions::default().with_wait_time(Duration::from_secs(1)))
        .build()?;
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let shutdown = stop.clone();
    let running = tokio::spawn(runner.run(async move { shutdown.cancelled().await }));

    let deadline = Instant::now() + Duration::from_secs(30);
    while stats.deleted() < payments.len() as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    running.await??;
    println!(
        "executed {}, replayed {}, dead-lettered {}, deleted {}",
        stats.executed(),
        stats.replayed(),
        stats.dead_lettered(),
        stats.deleted()
    );

    // The dead letters of this run, with their reasons.
    let out = sqs
        .receive_message()
        .queue_url(&dlq)
        .max_number_of_messages(10)
        .wait_time_seconds(1)
        .message_attribute_names("All")
        .send()
        .await?;
    for m in out.messages() {
        let attr = |name: &str| {
            m.message_attributes()
                .and_then(|a| a.get(name))
                .and_then(|v| v.string_value())
                .unwrap_or("-")
                .to_owned()
        };
        println!(
            "dead letter: reason {}, key {}, error {:?}, body {}",
            attr(ATTR_REASON),
            attr(ATTR_KEY),
            attr(ATTR_ERROR),
            m.body().unwrap_or_default()
        );
        if let Some(receipt) = m.receipt_handle() {
            sqs.delete_message()
                .queue_url(&dlq)
                .receipt_handle(receipt)
                .send()
                .await?;
        }
    }
    let left = sqs
        .get_queue_attributes()
        .queue_url(&queue)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .send()
        .await?;
    println!("left in {QUEUE}: {:?}", left.attributes());
    Ok(())
}
