//! The broker killed (SIGKILL) and restarted mid-run: the runner reconnects and every key still
//! gets exactly one effect; a memory alarm blocking publications does not stop the runner's
//! acknowledgements. Each test runs a PRIVATE RabbitMQ node on its own ports and data directory
//! (`rabbitmq-server` must be installed: `scripts/services.sh rabbitmq`), never the shared one.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
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
    // The second half of the keys waits for the kill: it comes mid-run however slowly the test
    // gets to it.
    let (killed_tx, killed) = tokio::sync::watch::channel(false);
    let handler = move |msg: AmqpMessage, ctx: HandlerContext| {
        let mut conn = conn.clone();
        let ledger = effects.clone();
        let mut killed = killed.clone();
        async move {
            let key = ctx.key().unwrap().id().to_owned();
            if key[1..].parse::<usize>().expect("k<n>") >= KEYS / 2 {
                let _ = killed.wait_for(|k| *k).await;
            }
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
    killed_tx.send(true).unwrap();
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
    // Nothing left to do: no copy waits in the retry queue, none in the work queue, none
    // unsettled in the runner's hands (a graceful stop would give it back).
    let emptied = wait_quiet(Duration::from_secs(30), || {
        let (url, topology, stats) = (url.clone(), topology.clone(), Arc::clone(&stats));
        async move { queues_empty(&url, &topology).await && held(&stats) == 0 }
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

/// A memory alarm on the broker blocks every connection that publishes, and the broker then
/// reads nothing more from it. The runner's retries and dead letters go out on a connection of
/// their own, so a retry publication during the alarm (which cannot complete: it times out and
/// the delivery is given back with `basic.nack`) leaves the consuming connection acknowledging:
/// every message is done while the alarm is on. Before, the retry publication went out on the
/// consuming connection, the broker blocked it, and no acknowledgement got through any more: the
/// prefetch filled and nothing was consumed until the alarm cleared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_alarm_blocking_publications_does_not_stop_acknowledgements() {
    if !amqp_and_redis() || !rabbitmq_program() {
        return;
    }
    init_tracing();
    const MESSAGES: usize = 40;
    let node = PrivateNode::start().await;
    let url = node.url();
    let topology = topology("alarm", QueueType::Classic);
    declare(&url, &topology).await;
    let msgs: Vec<Msg> = (0..MESSAGES)
        .map(|i| Msg::keyed(&format!("k{i}"), "{}"))
        .collect();
    publish(&url, &topology.queue, &msgs).await;
    // Every publication is blocked from now on.
    node.ctl(&["set_vm_memory_high_watermark", "0.0000001"]);

    let store = shared(redis_store(&format!("{}:", unique("idem-amqp-alarm"))).await);
    let tried = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let handler = move |_msg: AmqpMessage, ctx: HandlerContext| {
        let tried = std::sync::Arc::clone(&tried);
        async move {
            // The first message's first attempt fails: its retry is a publication.
            if ctx.key().unwrap().id() == "k0"
                && !tried.swap(true, std::sync::atomic::Ordering::SeqCst)
            {
                return Err(HandlerError::retryable("not yet"));
            }
            Ok::<_, HandlerError>(())
        }
    };
    let config = ExecutorConfig::new("alarm").with_retry_delay(Duration::from_millis(100));
    let runner = AmqpRunner::builder(&url, topology.clone(), executor(store, config), handler)
        .options(
            RunnerOptions::default()
                .with_prefetch(4)
                .with_max_batch(2)
                .with_publish_timeout(Duration::from_secs(2))
                .with_retry_delays(Duration::from_millis(50), Duration::from_secs(1)),
        )
        .build()
        .unwrap();
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));
    let watched = std::sync::Arc::clone(&stats);
    let done = wait_for(Duration::from_secs(60), || {
        let s = std::sync::Arc::clone(&watched);
        async move { s.executed() == MESSAGES as u64 }
    })
    .await;
    assert!(done, "every message done during the alarm: {stats:?}");
    assert_eq!(
        queue_state(&url, &topology.queue).await.0,
        0,
        "and nothing left in the queue: {stats:?}"
    );
    // Stopped with the alarm still on: the retry copy that timed out stays unsent (cleared, the
    // alarm would let it land late, as a timed-out publication may), and the node goes with the
    // test.
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("drained in time")
        .unwrap()
        .expect("run");
    assert!(
        stats.requeued() >= 1,
        "the retry publication could not complete: the delivery was given back: {stats:?}"
    );
    assert_eq!(
        queue_state(&url, &topology.queue).await,
        (0, 0),
        "nothing left unacknowledged"
    );
}

/// A connection lost while a handler runs, then a shutdown: [`AmqpRunner::run`] returns only
/// once that handler has finished and its result is recorded (it gets half the orphan timeout
/// to finish, as the lost deliveries do), whether the stop comes after the runner reconnected
/// (the connections closed by the broker) or while it is still trying to (the broker killed).
/// Before, the tasks of a lost connection were left to themselves: `run` returned at once
/// (4 ms after the stop in the review), with the handler mid-effect and its key in progress; a
/// service exiting then killed the handler, and the key's next owner ran the effect again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_the_handlers_of_a_lost_connection() {
    if !amqp_and_redis() || !rabbitmq_program() {
        return;
    }
    init_tracing();
    let mut node = PrivateNode::start().await;
    // The broker closes the connections; the runner reconnects, then is stopped.
    stop_after_a_lost_connection(&mut node, false).await;
    // The broker dies; the runner is stopped while it tries to reconnect.
    stop_after_a_lost_connection(&mut node, true).await;
}

async fn stop_after_a_lost_connection(node: &mut PrivateNode, kill: bool) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use idem_core::{IdempotencyStore, Namespace, RecordState};

    let url = node.url();
    let topology = topology("orphan", QueueType::Classic);
    declare(&url, &topology).await;
    publish(&url, &topology.queue, &[Msg::keyed("slow", "{}")]).await;
    let store = shared(redis_store(&format!("{}:", unique("idem-amqp-orphan"))).await);
    let (started, finished) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    // The handler runs until the test lets it finish, a second after the stop: however long
    // the connection's loss takes to bring about, the stop comes while it runs.
    let release = Arc::new(tokio::sync::Notify::new());
    let (start, finish, hold) = (
        Arc::clone(&started),
        Arc::clone(&finished),
        Arc::clone(&release),
    );
    let handler = move |_msg: AmqpMessage, _ctx: HandlerContext| {
        let (start, finish, hold) = (Arc::clone(&start), Arc::clone(&finish), Arc::clone(&hold));
        async move {
            start.store(true, Ordering::SeqCst);
            hold.notified().await;
            finish.store(true, Ordering::SeqCst);
            Ok::<_, HandlerError>("charged".to_owned())
        }
    };
    let runner = AmqpRunner::builder(
        &url,
        topology.clone(),
        executor(store.clone(), ExecutorConfig::new("orphan")),
        handler,
    )
    .options(
        RunnerOptions::default()
            // The lost connection's handler gets half of it to finish: it is released a
            // second after the stop, however long the loss took to bring about.
            .with_orphan_timeout(Duration::from_secs(60))
            .with_retry_delays(Duration::from_millis(50), Duration::from_millis(500))
            .with_reconnect_delays(Duration::from_millis(100), Duration::from_millis(500)),
    )
    .build()
    .unwrap();
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));
    let running = wait_for(Duration::from_secs(20), || {
        let started = Arc::clone(&started);
        async move { started.load(Ordering::SeqCst) }
    })
    .await;
    assert!(running, "the handler started: {stats:?}");
    if kill {
        node.kill();
    } else {
        node.ctl(&["close_all_connections", "idem-amqp test: connection lost"]);
    }
    let watched = std::sync::Arc::clone(&stats);
    let lost = wait_for(Duration::from_secs(10), || {
        let s = std::sync::Arc::clone(&watched);
        async move { s.reconnects() >= 1 }
    })
    .await;
    assert!(lost, "the runner saw the connection lost: {stats:?}");
    if !kill {
        // Consuming again on a new connection.
        let (url, queue) = (url.clone(), topology.queue.clone());
        let consuming = wait_for(Duration::from_secs(10), || {
            let (url, queue) = (url.clone(), queue.clone());
            async move { queue_state(&url, &queue).await.1 == 1 }
        })
        .await;
        assert!(consuming, "reconnected: {stats:?}");
    }
    let stopping = Instant::now();
    stop.cancel();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        release.notify_one();
    });
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("stopped in time")
        .unwrap()
        .expect("run");
    let took = stopping.elapsed();
    let record = store
        .get(&Namespace::new("orphan").unwrap().key("slow").unwrap())
        .await
        .unwrap();
    assert!(
        finished.load(Ordering::SeqCst),
        "run returned {took:?} after the stop, before the handler of the lost connection finished (kill: {kill})"
    );
    assert!(
        matches!(
            record.as_ref().map(|r| &r.state),
            Some(RecordState::Completed { .. })
        ),
        "its completion is recorded when run returns (kill: {kill}): {record:?}"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
}

trait Then: std::future::Future + Sized {
    fn then<U>(self, f: impl FnOnce(Self::Output) -> U) -> impl std::future::Future<Output = U> {
        async move { f(self.await) }
    }
}

impl<F: std::future::Future> Then for F {}
