//! The broker killed (SIGKILL) and restarted mid-run: the runner reconnects and every key still
//! gets exactly one effect. Runs a PRIVATE RabbitMQ node on its own ports and data directory
//! (`rabbitmq-server` must be installed: `scripts/services.sh rabbitmq`), never the shared one.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use idem_amqp::{AmqpMessage, AmqpRunner, QueueType, RunnerOptions};
use idem_executor::{ExecutorConfig, HandlerContext, HandlerError, Message};
use redis::AsyncCommands;
use tokio_util::sync::CancellationToken;

const KEYS: usize = 400;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runner_recovers_from_a_broker_restart() {
    if !amqp_and_redis() || !rabbitmq_program() {
        return;
    }
    init_tracing();
    let started = Instant::now();
    let mut node = PrivateNode::start().await;
    let started_in = started.elapsed();
    let url = node.url();
    let topology = topology("restart", QueueType::Quorum);
    declare(&url, &topology).await;
    let msgs: Vec<Msg> = (0..KEYS)
        .map(|i| Msg::keyed(&format!("k{i}"), format!(r#"{{"n":{i}}}"#)))
        .collect();
    publish(&url, &topology.queue, &msgs).await;

    let prefix = format!("{}:", unique("idem-amqp-restart"));
    let store = shared(redis_store(&format!("{prefix}idem:")).await);
    let ledger = format!("{prefix}ledger");
    let conn = redis_conn().await;
    let effects = ledger.clone();
    let handler = move |msg: AmqpMessage, ctx: HandlerContext| {
        let mut conn = conn.clone();
        let ledger = effects.clone();
        async move {
            let key = ctx.key().unwrap().id().to_owned();
            tokio::time::sleep(Duration::from_millis(10)).await;
            let _: i64 = conn.hincr(&ledger, &key, 1).await?;
            Ok::<_, HandlerError>(msg.payload().len())
        }
    };
    let config = ExecutorConfig::new("restart")
        .with_lease_ttl(Duration::from_secs(3))
        .with_heartbeat_interval(Duration::from_secs(1))
        .with_retry_delay(Duration::from_millis(100));
    let runner = AmqpRunner::builder(&url, topology.clone(), executor(store, config), handler)
        .options(
            RunnerOptions::default()
                .with_prefetch(8)
                .with_retry_delays(Duration::from_millis(50), Duration::from_secs(1))
                .with_reconnect_delays(Duration::from_millis(100), Duration::from_millis(500)),
        )
        .build()
        .unwrap();
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));

    let mut redis = redis_conn().await;
    let count = |mut redis: redis::aio::ConnectionManager, ledger: String| async move {
        redis.hlen::<_, usize>(ledger).await.unwrap()
    };
    let progressed = wait_for(Duration::from_secs(30), || {
        count(redis.clone(), ledger.clone()).then(|n| n >= KEYS / 4)
    })
    .await;
    assert!(progressed, "no progress before the restart: {stats:?}");
    let restart = Instant::now();
    eprintln!("killing the node");
    node.kill();
    eprintln!("killed");
    let at_kill = count(redis.clone(), ledger.clone()).await;
    node.restart().await;
    eprintln!("restarted");
    let restarted_in = restart.elapsed();
    assert!(
        at_kill < KEYS,
        "the broker died mid-run ({at_kill} of {KEYS})"
    );

    let all = wait_for(Duration::from_secs(60), || {
        count(redis.clone(), ledger.clone()).then(|n| n >= KEYS)
    })
    .await;
    let url2 = url.clone();
    let queue = topology.queue.clone();
    let emptied = wait_for(Duration::from_secs(30), || {
        let (url, queue) = (url2.clone(), queue.clone());
        async move { queue_state(&url, &queue).await.0 == 0 }
    })
    .await;
    let recovered_in = restart.elapsed();
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("drained in time")
        .unwrap()
        .expect("run");
    assert!(all && emptied, "{stats:?}");
    assert!(stats.reconnects() >= 1, "{stats:?}");
    assert_eq!(
        queue_state(&url, &topology.queue).await,
        (0, 0),
        "nothing left unacknowledged"
    );
    let ledger: HashMap<String, u64> = redis.hgetall(&ledger).await.unwrap();
    assert_eq!(ledger.len(), KEYS);
    let twice: Vec<_> = ledger.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        twice.is_empty(),
        "exactly one effect per key; more for {twice:?}"
    );
    eprintln!(
        "broker restart: node up in {started_in:?}; killed with {at_kill}/{KEYS} effects, back in \
         {restarted_in:?}, all effects and the queue empty {recovered_in:?} after the kill; {stats:?}"
    );
}

trait Then: std::future::Future + Sized {
    fn then<U>(self, f: impl FnOnce(Self::Output) -> U) -> impl std::future::Future<Output = U> {
        async move { f(self.await) }
    }
}

impl<F: std::future::Future> Then for F {}
