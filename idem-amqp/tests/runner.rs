//! The runner on the real broker: acks, replays, delayed retries, dead letters, poison messages,
//! slow handlers, graceful drain. Needs RabbitMQ (`IDEM_AMQP_URL`) and Redis (`IDEM_REDIS_URL`);
//! start both with `scripts/services.sh rabbitmq redis`.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use common::*;
use idem_amqp::{AmqpMessage, AmqpRunner, QueueType, RunnerOptions};
use idem_executor::{ExecutorConfig, HandlerContext, HandlerError, Message};
use tokio_util::sync::CancellationToken;

fn options() -> RunnerOptions {
    RunnerOptions::default()
        .with_prefetch(8)
        .with_retry_delays(Duration::from_millis(50), Duration::from_secs(2))
        .with_drain_timeout(Duration::from_secs(10))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_replay_conflicts_and_poison_dead_letter() {
    if !amqp_and_redis() {
        return;
    }
    init_tracing();
    for queue_type in [QueueType::Classic, QueueType::Quorum] {
        poison_and_conflicts(queue_type).await;
    }
}

async fn poison_and_conflicts(queue_type: QueueType) {
    let url = amqp_url();
    let topology = topology("runner", queue_type);
    declare(&url, &topology).await;
    let mut msgs = vec![Msg::keyed("poison", r#"{"n":-1}"#)];
    for i in 0..40 {
        msgs.push(Msg::keyed(&format!("k{i}"), format!(r#"{{"n":{i}}}"#)));
    }
    for i in 0..10 {
        msgs.push(Msg::keyed(&format!("k{i}"), format!(r#"{{"n":{i}}}"#)));
    }
    msgs.push(Msg::keyed("k3", r#"{"n":"another payload"}"#));
    publish(&url, &topology.queue, &msgs).await;

    let store = shared(redis_store(&format!("{}:", unique("idem-amqp-runner"))).await);
    let runs = Arc::new(std::sync::Mutex::new(BTreeMap::<String, u32>::new()));
    let seen = Arc::clone(&runs);
    let handler = move |msg: AmqpMessage, ctx: HandlerContext| {
        let seen = Arc::clone(&seen);
        async move {
            let key = ctx.key().unwrap().id().to_owned();
            *seen.lock().unwrap().entry(key.clone()).or_default() += 1;
            if key == "poison" {
                return Err(HandlerError::retryable(format!(
                    "cannot handle {}",
                    String::from_utf8_lossy(msg.payload())
                )));
            }
            Ok(format!("done {key}"))
        }
    };
    let config = ExecutorConfig::new("amqp-runner")
        .with_max_attempts(3)
        .with_retry_delay(Duration::from_millis(100));
    let runner = AmqpRunner::builder(&url, topology.clone(), executor(store, config), handler)
        .options(options())
        .build()
        .expect("runner");
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));

    let done = wait_for(Duration::from_secs(30), || {
        let stats = Arc::clone(&stats);
        async move { stats.executed() == 40 && stats.dead_lettered() == 2 }
    })
    .await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("drained in time")
        .unwrap()
        .expect("run");
    assert!(done, "{stats:?}");
    assert_eq!(stats.replayed(), 10, "{stats:?}");
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.get("poison"), Some(&3), "three attempts");
    assert!(runs.iter().all(|(k, n)| k == "poison" || *n == 1), "{runs:?}");
    assert_eq!(stats.retries(), 2, "two delayed retries of the poison message");

    let dead = drain_queue(&url, &topology.dead_letter_queue).await;
    let mut reasons: Vec<(String, String, String)> = dead
        .iter()
        .map(|r| {
            (
                r.header(idem_amqp::HEADER_KEY).unwrap(),
                r.header(idem_amqp::HEADER_REASON).unwrap(),
                r.header(idem_amqp::HEADER_ATTEMPTS).unwrap(),
            )
        })
        .collect();
    reasons.sort();
    assert_eq!(
        reasons,
        [
            ("k3".into(), "conflict".into(), "0".into()),
            ("poison".into(), "exhausted".into(), "3".into())
        ],
        "{queue_type:?}"
    );
    let poison = dead.iter().find(|r| r.body.contains("-1")).unwrap();
    assert!(
        poison.header(idem_amqp::HEADER_ERROR).unwrap().contains("cannot handle"),
        "{poison:?}"
    );
    assert_eq!(
        poison.header("idempotency-key").as_deref(),
        Some("poison"),
        "original headers kept"
    );
    assert_eq!(queue_state(&url, &topology.queue).await, (0, 0), "nothing left");
    assert_eq!(queue_state(&url, &topology.retry_queue).await.0, 0);
    cleanup(&url, &topology).await;
}
