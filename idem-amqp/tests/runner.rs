//! The runner on the real broker: acks, replays, delayed retries, dead letters, poison messages,
//! slow handlers, graceful drain. Needs RabbitMQ (`IDEM_AMQP_URL`) and Redis (`IDEM_REDIS_URL`);
//! start both with `scripts/services.sh rabbitmq redis`.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use idem_core::{IdempotencyStore, Namespace, RecordState};

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

/// Runs `runner` until `done` holds on its stats (at most 30 s), then stops it and waits for
/// its drain; whether `done` held.
async fn run_until<H, T>(
    runner: AmqpRunner<H, T>,
    done: impl Fn(&idem_amqp::RunnerStats) -> bool + Copy,
) -> bool
where
    H: idem_amqp::Handler<AmqpMessage, T>,
    T: serde::Serialize + serde::de::DeserializeOwned + Send + 'static,
{
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));
    let held = wait_for(Duration::from_secs(30), || {
        let stats = Arc::clone(&stats);
        async move { done(&stats) }
    })
    .await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("drained in time")
        .unwrap()
        .expect("run");
    held
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
    // Every delivery settled before the stop (a duplicate still in hand would be given back).
    let done = run_until(runner, |s| {
        s.executed() == 40 && s.dead_lettered() == 2 && s.replayed() == 10
    })
    .await;
    assert!(done, "{stats:?}");
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.get("poison"), Some(&3), "three attempts");
    assert!(
        runs.iter().all(|(k, n)| k == "poison" || *n == 1),
        "{runs:?}"
    );
    assert!(
        stats.retries() >= 2,
        "two delayed retries of the poison message: {stats:?}"
    );

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
        poison
            .header(idem_amqp::HEADER_ERROR)
            .unwrap()
            .contains("cannot handle"),
        "{poison:?}"
    );
    assert_eq!(
        poison.header("idempotency-key").as_deref(),
        Some("poison"),
        "original headers kept"
    );
    assert_eq!(
        queue_state(&url, &topology.queue).await,
        (0, 0),
        "nothing left"
    );
    assert_eq!(queue_state(&url, &topology.retry_queue).await.0, 0);
    cleanup(&url, &topology).await;
}

/// A handler that runs three times its lease TTL (heartbeats keep the lease) is not run again:
/// a copy of its message delivered meanwhile to a second runner meets the live lease, waits in
/// the retry queue and is replayed once the first finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handler_holding_its_lease_is_not_run_twice() {
    if !amqp_and_redis() {
        return;
    }
    init_tracing();
    let url = amqp_url();
    let topology = topology("slow", QueueType::Classic);
    declare(&url, &topology).await;
    let prefix = format!("{}:", unique("idem-amqp-slow"));
    let store = shared(redis_store(&prefix).await);
    let runs = Arc::new(AtomicU32::new(0));
    let lease = Duration::from_secs(1);
    // Heartbeats every 100 ms: a stall shorter than about 800 ms (a loaded machine) keeps the
    // lease.
    let config = ExecutorConfig::new("slow")
        .with_lease_ttl(lease)
        .with_heartbeat_interval(Duration::from_millis(100));
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    let mut all_stats = Vec::new();
    for _ in 0..2 {
        let runs = Arc::clone(&runs);
        let handler = move |_msg: AmqpMessage, ctx: HandlerContext| {
            let runs = Arc::clone(&runs);
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(lease * 3).await;
                assert!(!ctx.is_cancelled(), "the lease was kept all along");
                Ok::<_, HandlerError>(ctx.token().unwrap().get())
            }
        };
        let runner = AmqpRunner::builder(
            &url,
            topology.clone(),
            executor(store.clone(), config.clone()),
            handler,
        )
        .options(options().with_prefetch(1))
        .build()
        .unwrap();
        all_stats.push(runner.stats());
        tasks.push(tokio::spawn(runner.run(stop.clone().cancelled_owned())));
    }
    // Both consumers are registered before the two copies are published.
    let consumers = wait_for(Duration::from_secs(10), || {
        let (url, queue) = (url.clone(), topology.queue.clone());
        async move { queue_state(&url, &queue).await.1 == 2 }
    })
    .await;
    assert!(consumers);
    let started = Instant::now();
    publish(
        &url,
        &topology.queue,
        &[Msg::keyed("slow", "{}"), Msg::keyed("slow", "{}")],
    )
    .await;
    let settled = wait_for(Duration::from_secs(20), || {
        let all_stats = all_stats.clone();
        async move {
            all_stats.iter().map(|s| s.executed()).sum::<u64>() == 1
                && all_stats.iter().map(|s| s.replayed()).sum::<u64>() == 1
        }
    })
    .await;
    let elapsed = started.elapsed();
    stop.cancel();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(20), task)
            .await
            .expect("drained")
            .unwrap()
            .expect("run");
    }
    assert!(settled, "{all_stats:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
    assert!(
        elapsed >= lease * 3,
        "the copy was replayed after the handler ended"
    );
    assert!(
        all_stats.iter().map(|s| s.retries()).sum::<u64>() >= 1,
        "the copy waited in the retry queue: {all_stats:?}"
    );
    let key = Namespace::new("slow").unwrap().key("slow").unwrap();
    let record = store.get(&key).await.unwrap().unwrap();
    assert!(
        matches!(record.state, RecordState::Completed { .. }),
        "{record:?}"
    );
    assert_eq!(record.attempts, 1, "no takeover: {record:?}");
    assert_eq!(queue_state(&url, &topology.queue).await, (0, 0));
    assert!(
        drain_queue(&url, &topology.dead_letter_queue)
            .await
            .is_empty()
    );
    cleanup(&url, &topology).await;
}

/// Shutdown drains: the handlers in process finish and are acknowledged, nothing else starts,
/// and what was not processed is back in the queue, with no key left in progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_in_flight_deliveries_and_gives_the_rest_back() {
    if !amqp_and_redis() {
        return;
    }
    init_tracing();
    let url = amqp_url();
    let topology = topology("drain", QueueType::Classic);
    declare(&url, &topology).await;
    let msgs: Vec<Msg> = (0..20)
        .map(|i| Msg::keyed(&format!("d{i}"), format!(r#"{{"n":{i}}}"#)))
        .collect();
    publish(&url, &topology.queue, &msgs).await;
    let prefix = format!("{}:", unique("idem-amqp-drain"));
    let store = shared(redis_store(&prefix).await);
    let started_runs = Arc::new(AtomicU32::new(0));
    let counter = Arc::clone(&started_runs);
    let handler = move |_msg: AmqpMessage, ctx: HandlerContext| {
        let counter = Arc::clone(&counter);
        async move {
            counter.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(400)).await;
            Ok::<_, HandlerError>(ctx.attempt())
        }
    };
    let runner = AmqpRunner::builder(
        &url,
        topology.clone(),
        executor(store.clone(), ExecutorConfig::new("drain")),
        handler,
    )
    .options(options().with_prefetch(4))
    .build()
    .unwrap();
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));
    let running = wait_for(Duration::from_secs(10), || {
        let n = Arc::clone(&started_runs);
        async move { n.load(Ordering::SeqCst) >= 4 }
    })
    .await;
    assert!(running);
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(15), task)
        .await
        .expect("drained in time")
        .unwrap()
        .expect("run");
    let ran = started_runs.load(Ordering::SeqCst) as u64;
    assert!((4..20).contains(&ran), "{ran} handlers ran");
    assert_eq!(
        stats.executed(),
        ran,
        "every started handler finished: {stats:?}"
    );
    assert_eq!(stats.abandoned(), 0, "{stats:?}");
    assert_eq!(
        queue_state(&url, &topology.queue).await,
        (20 - ran as u32, 0),
        "the rest is back in the queue"
    );
    let ns = Namespace::new("drain").unwrap();
    for i in 0..20 {
        let record = store.get(&ns.key(format!("d{i}")).unwrap()).await.unwrap();
        assert!(
            record
                .as_ref()
                .is_none_or(|r| matches!(r.state, RecordState::Completed { .. })),
            "d{i}: {record:?}"
        );
    }
    cleanup(&url, &topology).await;
}

/// A broker that accepts the TCP connection and never answers the handshake: the first
/// connection fails with `TimedOut` after `connect_timeout`, the runner does not hang. Needs no
/// RabbitMQ (the "broker" is a listener of this test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_never_answers_times_out() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    // Accepts, then holds the sockets open without a byte.
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let store = shared(idem_core::MemoryStore::new());
    let handler = |_msg: AmqpMessage, _ctx: HandlerContext| async { Ok::<_, HandlerError>(1u8) };
    let runner = AmqpRunner::builder(
        format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
        topology("silent", QueueType::Classic),
        executor(store, ExecutorConfig::new("amqp-silent")),
        handler,
    )
    .options(options().with_connect_timeout(Duration::from_millis(300)))
    .build()
    .expect("runner");
    let started = Instant::now();
    let ran = tokio::time::timeout(Duration::from_secs(20), runner.run(std::future::pending()))
        .await
        .expect("the runner gave up instead of hanging");
    assert!(
        matches!(
            ran,
            Err(idem_amqp::RunnerError::TimedOut {
                after,
                ..
            }) if after == Duration::from_millis(300)
        ),
        "{ran:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    silent.abort();
}

/// Store requests for 200 waiting deliveries, prefetch 64, groups of at most `max_batch`.
async fn requests_for_200(max_batch: usize) -> u64 {
    let url = amqp_url();
    let topology = topology("groups", QueueType::Classic);
    declare(&url, &topology).await;
    let msgs: Vec<Msg> = (0..200)
        .map(|i| Msg::keyed(&format!("k{i}"), format!(r#"{{"n":{i}}}"#)))
        .collect();
    publish(&url, &topology.queue, &msgs).await;
    let store = redis_store(&format!("{}:", unique("idem-amqp-groups"))).await;
    let handler = |_msg: AmqpMessage, _ctx: HandlerContext| async { Ok::<_, HandlerError>(1u8) };
    let runner = AmqpRunner::builder(
        &url,
        topology.clone(),
        executor(shared(store.clone()), ExecutorConfig::new("amqp-groups")),
        handler,
    )
    .options(options().with_prefetch(64).with_max_batch(max_batch))
    .build()
    .expect("runner");
    let stats = runner.stats();
    let done = run_until(runner, |s| s.executed() == 200).await;
    assert!(done, "{stats:?}");
    assert_eq!(
        queue_state(&url, &topology.queue).await,
        (0, 0),
        "nothing left, nothing unacknowledged"
    );
    cleanup(&url, &topology).await;
    store.requests_sent()
}

/// A store outage holds new deliveries back: while the last outcomes were store errors, the
/// runner waits the reconnect delay of the failures in a row after each group, so a 2-second
/// outage costs a few retry copies instead of one per delivery per retry delay (50 ms here: a
/// hundred or more), and every message executes once the store is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_holds_new_deliveries_back_while_it_lasts() {
    use idem_conformance::faults::FaultyStore;
    if !amqp_and_redis() {
        return;
    }
    init_tracing();
    let url = amqp_url();
    let topology = topology("outagepause", QueueType::Classic);
    declare(&url, &topology).await;
    let msgs: Vec<Msg> = (0..5).map(|i| Msg::keyed(&format!("k{i}"), "{}")).collect();
    publish(&url, &topology.queue, &msgs).await;
    let store = Arc::new(FaultyStore::new(idem_core::MemoryStore::new()));
    store.set_outage(true);
    let handler = |_msg: AmqpMessage, _ctx: HandlerContext| async { Ok::<_, HandlerError>(1u8) };
    let runner = AmqpRunner::builder(
        &url,
        topology.clone(),
        executor(
            Arc::clone(&store) as idem_core::DynStore,
            ExecutorConfig::new("amqp-outagepause"),
        ),
        handler,
    )
    .options(
        options()
            .with_retry_delays(Duration::from_millis(50), Duration::from_millis(100))
            .with_reconnect_delays(Duration::from_millis(300), Duration::from_secs(3)),
    )
    .build()
    .expect("runner");
    let stats = runner.stats();
    let healer = Arc::clone(&store);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(2)).await;
        healer.set_outage(false);
    });
    let done = run_until(runner, |s| s.executed() == 5).await;
    assert!(done, "{stats:?}");
    assert!(stats.store_pauses() >= 1, "{stats:?}");
    assert!(
        stats.retries() <= 20,
        "{} retry copies for 5 messages in a 2 s outage: {stats:?}",
        stats.retries()
    );
    assert_eq!(queue_state(&url, &topology.queue).await, (0, 0));
    cleanup(&url, &topology).await;
}

/// Deliveries at hand together run as groups: their keys acquired and their results recorded
/// in batched store calls, where `max_batch` 1 sends an acquire and a completion for each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_deliveries_run_in_groups() {
    if !amqp_and_redis() {
        return;
    }
    init_tracing();
    let one_by_one = requests_for_200(1).await;
    assert_eq!(one_by_one, 400, "an acquire and a completion per delivery");
    let grouped = requests_for_200(64).await;
    assert!(
        grouped <= 200,
        "200 deliveries in groups: {grouped} store requests, fewer than one per delivery"
    );
    println!("store requests for 200 deliveries: {one_by_one} one by one, {grouped} in groups");
}

/// Keys far over the key limit are dead-lettered as `invalid_key` with the key header cut to
/// `MAX_HEADER_TEXT` bytes, and the connection stays up. Whole, the copy beside the original
/// header made the dead letter's header frame larger than the broker's frame size: the broker
/// closed the connection, and the runner reconnected and failed again, forever. A key header
/// that alone nearly fills a frame (128,000 bytes) leaves no room for the dead letter's own
/// headers: that dead letter goes without the original headers and names them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_keys_are_dead_lettered_with_their_headers_cut_or_dropped() {
    if !amqp_and_redis() {
        return;
    }
    init_tracing();
    let url = amqp_url();
    let topology = topology("runner-long-key", QueueType::Classic);
    declare(&url, &topology).await;
    let (long, longest) = ("k".repeat(100_000), "j".repeat(128_000));
    publish(
        &url,
        &topology.queue,
        &[
            Msg::keyed(&long, "{}"),
            Msg::keyed(&longest, "{}"),
            Msg::keyed("fine", "{}"),
        ],
    )
    .await;

    let store = shared(redis_store(&format!("{}:", unique("idem-amqp-long-key"))).await);
    let handler = |_msg: AmqpMessage, _ctx: HandlerContext| async { Ok("done".to_owned()) };
    let runner = AmqpRunner::builder(
        &url,
        topology.clone(),
        executor(store, ExecutorConfig::new("amqp-long-key")),
        handler,
    )
    .options(options())
    .build()
    .expect("runner");
    let stats = runner.stats();
    let done = run_until(runner, |s| s.executed() == 1 && s.dead_lettered() == 2).await;
    assert!(done, "{stats:?}");
    assert_eq!(stats.reconnects(), 0, "{stats:?}");

    let dead = drain_queue(&url, &topology.dead_letter_queue).await;
    assert_eq!(dead.len(), 2, "two dead letters");
    for d in &dead {
        assert_eq!(
            d.header(idem_amqp::HEADER_REASON).as_deref(),
            Some("invalid_key")
        );
        let key = d.header(idem_amqp::HEADER_KEY).unwrap();
        assert!(
            key.len() <= idem_executor::broker::MAX_HEADER_TEXT && key.ends_with('…'),
            "the key header is cut: {} bytes",
            key.len()
        );
    }
    let kept = dead
        .iter()
        .find(|d| d.header(idem_amqp::HEADER_KEY).unwrap().starts_with('k'));
    assert_eq!(
        kept.unwrap().header("idempotency-key").map(|k| k.len()),
        Some(long.len()),
        "the original header is kept whole where it fits"
    );
    assert_eq!(kept.unwrap().header(idem_amqp::HEADER_DROPPED), None);
    let dropped = dead
        .iter()
        .find(|d| d.header(idem_amqp::HEADER_KEY).unwrap().starts_with('j'));
    assert_eq!(dropped.unwrap().header("idempotency-key"), None);
    assert_eq!(
        dropped
            .unwrap()
            .header(idem_amqp::HEADER_DROPPED)
            .as_deref(),
        Some("idempotency-key")
    );
    assert_eq!(queue_state(&url, &topology.queue).await, (0, 0));
    cleanup(&url, &topology).await;
}

/// A message carrying `CC` (RabbitMQ's sender-selected distribution) is retried and
/// dead-lettered without copies to the queue it names: the runner's republished copies drop
/// `CC` and `BCC`. Before, every retry and dead letter sent one more copy there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_the_runner_publishes_are_not_routed_by_cc() {
    use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
    use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString};
    if !amqp_and_redis() {
        return;
    }
    init_tracing();
    let url = amqp_url();
    let topology = topology("runner-cc", QueueType::Classic);
    declare(&url, &topology).await;
    let audit = unique("audit");
    let conn = connect(&url).await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        audit.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let cc = AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString(
        LongString::from(audit.as_str()),
    )]));
    let mut msgs = vec![
        Msg::keyed("flaky", r#"{"n":1}"#),
        Msg::keyed("bad", r#"{"n":2}"#),
    ];
    for m in &mut msgs {
        m.headers.push(("CC".into(), cc.clone()));
    }
    publish(&url, &topology.queue, &msgs).await;
    assert_eq!(
        queue_state(&url, &audit).await.0,
        2,
        "the originals' copies"
    );

    let store = shared(redis_store(&format!("{}:", unique("idem-amqp-cc"))).await);
    let runs = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&runs);
    let handler = move |_msg: AmqpMessage, ctx: HandlerContext| {
        let seen = Arc::clone(&seen);
        async move {
            seen.fetch_add(1, Ordering::SeqCst);
            match ctx.key().unwrap().id() {
                "bad" => Err(HandlerError::terminal("malformed amount")),
                _ if ctx.attempt() == 1 => Err(HandlerError::retryable("try again")),
                _ => Ok(()),
            }
        }
    };
    let config = ExecutorConfig::new("amqp-cc")
        .with_max_attempts(3)
        .with_retry_delay(Duration::from_millis(50));
    let runner = AmqpRunner::builder(&url, topology.clone(), executor(store, config), handler)
        .options(options())
        .build()
        .expect("runner");
    let stats = runner.stats();
    let done = run_until(runner, |s| s.executed() == 1 && s.dead_lettered() == 1).await;
    assert!(done, "{stats:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 3, "flaky twice, bad once");
    assert_eq!(
        queue_state(&url, &audit).await.0,
        2,
        "no copy of a retry or a dead letter went to the queue named by CC"
    );
    let dead = drain_queue(&url, &topology.dead_letter_queue).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].header("CC"), None);
    ch.queue_delete(audit.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let _ = conn.close(200, "bye".into()).await;
    cleanup(&url, &topology).await;
}

/// The dead-letter exchange and queue deleted while the runner runs are declared again when a
/// dead letter is refused for them: the dead letter lands. Before, the runner held the message,
/// trying every second, until it reconnected for another reason. A deleted retry queue is
/// declared again when a retry copy is returned as unroutable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_exchange_deleted_while_running_is_declared_again() {
    use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
    if !amqp_and_redis() {
        return;
    }
    init_tracing();
    let url = amqp_url();
    let topology = topology("runner-redeclare", QueueType::Classic);
    declare(&url, &topology).await;
    let store = shared(redis_store(&format!("{}:", unique("idem-amqp-redeclare"))).await);
    let handler = |_msg: AmqpMessage, ctx: HandlerContext| async move {
        match ctx.key().unwrap().id() {
            "bad" => Err(HandlerError::terminal("malformed amount")),
            "flaky" if ctx.attempt() == 1 => Err(HandlerError::retryable("try again")),
            _ => Ok(()),
        }
    };
    let config = ExecutorConfig::new("amqp-redeclare").with_retry_delay(Duration::from_millis(50));
    let runner = AmqpRunner::builder(&url, topology.clone(), executor(store, config), handler)
        .options(options())
        .build()
        .expect("runner");
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));
    publish(&url, &topology.queue, &[Msg::keyed("fine", "{}")]).await;
    let watched = Arc::clone(&stats);
    assert!(
        wait_for(Duration::from_secs(30), || {
            let s = Arc::clone(&watched);
            async move { s.executed() == 1 }
        })
        .await,
        "{stats:?}"
    );

    let conn = connect(&url).await;
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_delete(
        topology.dead_letter_exchange.as_str().into(),
        ExchangeDeleteOptions::default(),
    )
    .await
    .unwrap();
    ch.queue_delete(
        topology.dead_letter_queue.as_str().into(),
        QueueDeleteOptions::default(),
    )
    .await
    .unwrap();
    let _ = conn.close(200, "bye".into()).await;
    publish(&url, &topology.queue, &[Msg::keyed("bad", "{}")]).await;
    let watched = Arc::clone(&stats);
    let landed = wait_for(Duration::from_secs(20), || {
        let s = Arc::clone(&watched);
        async move { s.dead_lettered() == 1 }
    })
    .await;

    let conn = connect(&url).await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_delete(
        topology.retry_queue.as_str().into(),
        QueueDeleteOptions::default(),
    )
    .await
    .unwrap();
    let _ = conn.close(200, "bye".into()).await;
    publish(&url, &topology.queue, &[Msg::keyed("flaky", "{}")]).await;
    let watched = Arc::clone(&stats);
    let retried = wait_for(Duration::from_secs(20), || {
        let s = Arc::clone(&watched);
        async move { s.executed() == 2 }
    })
    .await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("drained in time")
        .unwrap()
        .expect("run");
    assert!(landed && retried, "{stats:?}");
    assert_eq!(stats.reconnects(), 0, "{stats:?}");
    let conn = connect(&url).await;
    let ch = conn.create_channel().await.unwrap();
    assert!(
        depth(&ch, &topology.retry_queue).await.is_some(),
        "the retry queue was declared again"
    );
    let _ = conn.close(200, "bye".into()).await;
    let dead = drain_queue(&url, &topology.dead_letter_queue).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].header(idem_amqp::HEADER_REASON).as_deref(),
        Some("failed")
    );
    cleanup(&url, &topology).await;
}

/// The queues named in a message's `x-death` header (RabbitMQ's dead-letter history).
fn death_queues(headers: &lapin::types::FieldTable) -> Vec<String> {
    use lapin::types::AMQPValue;
    let Some(AMQPValue::FieldArray(deaths)) = headers.inner().get("x-death") else {
        return Vec::new();
    };
    deaths
        .as_slice()
        .iter()
        .filter_map(|death| match death {
            AMQPValue::FieldTable(death) => match death.inner().get("queue") {
                Some(AMQPValue::LongString(q)) => {
                    Some(String::from_utf8_lossy(q.as_bytes()).into_owned())
                }
                _ => None,
            },
            _ => None,
        })
        .collect()
}

/// A message the work queue dead-lettered once (here: expired by a queue TTL into a parking
/// queue) and that was then moved back into the work queue carries an `x-death` entry naming
/// the work queue. Its retry copy goes without RabbitMQ's dead-letter headers, so when it expires
/// from the retry queue the broker moves it back to the work queue: the handler runs a second
/// time and the key ends completed. Before, the copy kept `x-death`; the broker saw the work
/// queue in it, took the move back for a dead-letter cycle and dropped the copy ("Dead-letter
/// queues cycle detected"), the original being acknowledged already: the message was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_message_with_a_death_history_naming_the_work_queue_comes_back() {
    if !amqp_and_redis() {
        return;
    }
    init_tracing();
    for queue_type in [QueueType::Classic, QueueType::Quorum] {
        retried_with_death_history(queue_type).await;
    }
}

async fn retried_with_death_history(queue_type: QueueType) {
    use lapin::options::{
        BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
        QueueDeleteOptions,
    };
    use lapin::types::{AMQPValue, FieldTable, LongString};
    let url = amqp_url();
    let topology = topology("runner-x-death", queue_type);
    let parking = unique("parking");
    let conn = connect(&url).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    ch.queue_declare(
        parking.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    // For a moment, a queue of the work queue's name that expires what it holds into the
    // parking queue: the broker writes an `x-death` entry naming the work queue.
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), AMQPValue::LongInt(1));
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString(LongString::from("")),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(LongString::from(parking.as_str())),
    );
    ch.queue_declare(
        topology.queue.as_str().into(),
        QueueDeclareOptions::default(),
        args,
    )
    .await
    .unwrap();
    let mut headers = FieldTable::default();
    headers.insert(
        "idempotency-key".into(),
        AMQPValue::LongString(LongString::from("moved-back")),
    );
    let props = lapin::BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(headers);
    ch.basic_publish(
        "".into(),
        topology.queue.as_str().into(),
        BasicPublishOptions::default(),
        b"{}",
        props,
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let parked = wait_for(Duration::from_secs(10), || {
        let (url, parking) = (url.clone(), parking.clone());
        async move { queue_state(&url, &parking).await.0 == 1 }
    })
    .await;
    assert!(parked, "the message expired into the parking queue");
    let parked = ch
        .basic_get(parking.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("the parked message")
        .delivery;
    let history = death_queues(parked.properties.headers().as_ref().unwrap());
    assert_eq!(
        history,
        std::slice::from_ref(&topology.queue),
        "the broker's history names the work queue"
    );
    ch.queue_delete(
        topology.queue.as_str().into(),
        QueueDeleteOptions::default(),
    )
    .await
    .unwrap();
    // The operator moves it back into the (real) work queue, headers and all.
    declare(&url, &topology).await;
    let confirm = ch
        .basic_publish(
            "".into(),
            topology.queue.as_str().into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            &parked.data,
            parked.properties.clone(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack() && confirm.take_message().is_none());

    let prefix = format!("{}:", unique("idem-amqp-x-death"));
    let store = shared(redis_store(&prefix).await);
    let runs = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&runs);
    let handler = move |_msg: AmqpMessage, ctx: HandlerContext| {
        let seen = Arc::clone(&seen);
        async move {
            seen.fetch_add(1, Ordering::SeqCst);
            if ctx.attempt() == 1 {
                return Err(HandlerError::retryable("not yet"));
            }
            Ok::<_, HandlerError>(ctx.attempt())
        }
    };
    let config = ExecutorConfig::new("x-death").with_retry_delay(Duration::from_millis(50));
    let runner = AmqpRunner::builder(
        &url,
        topology.clone(),
        executor(store.clone(), config),
        handler,
    )
    .options(options())
    .build()
    .expect("runner");
    let stats = runner.stats();
    let done = run_until(runner, |s| s.executed() == 1).await;
    let key = Namespace::new("x-death")
        .unwrap()
        .key("moved-back")
        .unwrap();
    let record = store.get(&key).await.unwrap();
    let work = queue_state(&url, &topology.queue).await;
    let retry = queue_state(&url, &topology.retry_queue).await;
    let dead = drain_queue(&url, &topology.dead_letter_queue).await;
    ch.queue_delete(parking.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let _ = conn.close(200, "bye".into()).await;
    cleanup(&url, &topology).await;
    let runs = runs.load(Ordering::SeqCst);
    assert!(
        done,
        "{queue_type:?}: the retry never came back ({runs} runs, queues {work:?} {retry:?}): {stats:?}"
    );
    assert_eq!(runs, 2, "{queue_type:?}");
    assert_eq!(stats.retries(), 1, "{stats:?}");
    assert!(
        matches!(
            record.as_ref().map(|r| &r.state),
            Some(RecordState::Completed { .. })
        ),
        "{record:?}"
    );
    assert_eq!(work, (0, 0), "nothing left in the work queue");
    assert_eq!(retry.0, 0);
    assert!(dead.is_empty(), "{dead:?}");
}

/// `url` with a `frame_max` of 4,096 bytes, the smallest AMQP allows.
fn with_small_frames(url: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}frame_max=4096")
}

/// On a connection with the smallest frame size (4,096 bytes), a dead letter with a 5,000-byte
/// error does not fit in a frame with the original headers, nor without them (the error header
/// alone is cut to 4,096 bytes): it goes in the compact form, its error and key headers cut to
/// `COMPACT_TEXT` bytes and the original headers named, and the original is acknowledged.
/// Before, the form without the original headers was refused as too large and then tried again
/// every second, forever: the delivery was held and nothing was dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_too_large_without_the_original_headers_goes_compact() {
    use idem_executor::broker::COMPACT_TEXT;
    if !amqp_and_redis() {
        return;
    }
    init_tracing();
    let url = with_small_frames(&amqp_url());
    let topology = topology("runner-compact", QueueType::Classic);
    declare(&url, &topology).await;
    let key = "k".repeat(400);
    publish(&url, &topology.queue, &[Msg::keyed(&key, "{}")]).await;
    let store = shared(redis_store(&format!("{}:", unique("idem-amqp-compact"))).await);
    let runs = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&runs);
    let handler = move |_msg: AmqpMessage, _ctx: HandlerContext| {
        let seen = Arc::clone(&seen);
        async move {
            seen.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(HandlerError::terminal("e".repeat(5_000)))
        }
    };
    let runner = AmqpRunner::builder(
        &url,
        topology.clone(),
        executor(store, ExecutorConfig::new("amqp-compact")),
        handler,
    )
    .options(options())
    .build()
    .expect("runner");
    let stats = runner.stats();
    let done = run_until(runner, |s| s.dead_lettered() == 1).await;
    let work = queue_state(&url, &topology.queue).await;
    let dead = drain_queue(&url, &topology.dead_letter_queue).await;
    cleanup(&url, &topology).await;
    assert!(done, "{stats:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(stats.reconnects(), 0, "{stats:?}");
    assert_eq!(work, (0, 0), "the original is acknowledged");
    assert_eq!(dead.len(), 1);
    let dead = &dead[0];
    assert_eq!(
        dead.header(idem_amqp::HEADER_REASON).as_deref(),
        Some("failed")
    );
    let error = dead.header(idem_amqp::HEADER_ERROR).unwrap();
    assert!(
        error.len() <= COMPACT_TEXT && error.starts_with("eee") && error.ends_with('…'),
        "the error is cut to {COMPACT_TEXT} bytes: {} bytes",
        error.len()
    );
    let cut = dead.header(idem_amqp::HEADER_KEY).unwrap();
    assert!(
        cut.len() <= COMPACT_TEXT && cut.starts_with("kkk") && cut.ends_with('…'),
        "the key is cut to {COMPACT_TEXT} bytes: {} bytes",
        cut.len()
    );
    assert_eq!(dead.header("idempotency-key"), None);
    assert_eq!(
        dead.header(idem_amqp::HEADER_DROPPED).as_deref(),
        Some("idempotency-key")
    );
    assert_eq!(
        dead.header(idem_amqp::HEADER_SOURCE_QUEUE).as_deref(),
        Some(topology.queue.as_str())
    );
}

/// A dead-letter exchange that routes nowhere (no queue bound: `dead_letter_queue` empty, the
/// operator's binding missing) refuses every dead letter. The delivery is held at most a minute
/// (a delivery held past the broker's `consumer_timeout` costs the whole channel), then given
/// back with `basic.nack` and requeue; the redelivery is answered from the store (the handler
/// does not run again) and dead-lettered again, and lands once a queue is bound. Before, the
/// delivery was held, the dead letter tried every second, without a bound. Takes a minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_refused_for_a_minute_is_given_back_and_dead_lettered_again() {
    use lapin::options::{QueueBindOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;
    if !amqp_and_redis() {
        return;
    }
    init_tracing();
    let url = amqp_url();
    let topology = topology("runner-dlx-unbound", QueueType::Classic).with_dead_letter_queue("");
    declare(&url, &topology).await;
    publish(&url, &topology.queue, &[Msg::keyed("bad", "{}")]).await;
    let store = shared(redis_store(&format!("{}:", unique("idem-amqp-unbound"))).await);
    let runs = Arc::new(AtomicU32::new(0));
    let seen = Arc::clone(&runs);
    let handler = move |_msg: AmqpMessage, _ctx: HandlerContext| {
        let seen = Arc::clone(&seen);
        async move {
            seen.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(HandlerError::terminal("malformed amount"))
        }
    };
    let runner = AmqpRunner::builder(
        &url,
        topology.clone(),
        executor(store, ExecutorConfig::new("amqp-unbound")),
        handler,
    )
    .options(options())
    .build()
    .expect("runner");
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));
    let watched = Arc::clone(&stats);
    let started = Instant::now();
    let requeued = wait_for(Duration::from_secs(90), || {
        let s = Arc::clone(&watched);
        async move { s.requeued() >= 1 }
    })
    .await;
    let held = started.elapsed();
    // The operator binds a queue.
    let parked = unique("dlq");
    let conn = connect(&url).await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        parked.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        parked.as_str().into(),
        topology.dead_letter_exchange.as_str().into(),
        topology.dead_letter_routing_key.as_str().into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let watched = Arc::clone(&stats);
    let landed = wait_for(Duration::from_secs(20), || {
        let s = Arc::clone(&watched);
        async move { s.dead_lettered() == 1 }
    })
    .await;
    stop.cancel();
    let ran = tokio::time::timeout(Duration::from_secs(20), task).await;
    let work = queue_state(&url, &topology.queue).await;
    let dead = drain_queue(&url, &parked).await;
    let _ = conn.close(200, "bye".into()).await;
    cleanup(&url, &topology.clone().with_dead_letter_queue(parked)).await;
    ran.expect("drained in time").unwrap().expect("run");
    assert!(
        requeued,
        "the delivery was given back within 90 s: {stats:?}"
    );
    assert!(
        held >= Duration::from_secs(55),
        "held about a minute first: {held:?}"
    );
    assert!(landed, "{stats:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
    assert_eq!(work, (0, 0));
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].header(idem_amqp::HEADER_REASON).as_deref(),
        Some("failed")
    );
}

/// A slow handler holds only its own delivery and prefetch slot: each delivery of a group is
/// settled as soon as its outcome is recorded, so the others of its group are acked at once and
/// the broker sends the next deliveries into their slots. Before, every delivery of a group was
/// settled when its slowest handler returned, and the others of its group waited for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handler_holds_back_no_other_delivery_of_its_group() {
    if !amqp_and_redis() {
        return;
    }
    init_tracing();
    let url = amqp_url();
    let topology = topology("slow-one", QueueType::Classic);
    declare(&url, &topology).await;
    // The first deliveries arrive together and form one group; the slow one is among them.
    let msgs: Vec<Msg> = (0..16)
        .map(|i| Msg::keyed(&format!("k{i}"), if i == 3 { "slow" } else { "fast" }))
        .collect();
    publish(&url, &topology.queue, &msgs).await;
    // The slow handler runs until the others are done (or the wait for them gives up).
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let g = Arc::clone(&gate);
    let handler = move |msg: AmqpMessage, _ctx: HandlerContext| {
        let gate = Arc::clone(&g);
        async move {
            if msg.payload() == b"slow" {
                gate.acquire().await.expect("gate open").forget();
            }
            Ok::<_, HandlerError>(())
        }
    };
    let runner = AmqpRunner::builder(
        &url,
        topology.clone(),
        executor(
            shared(idem_core::MemoryStore::new()),
            ExecutorConfig::new("amqp-slow-one"),
        ),
        handler,
    )
    .options(options().with_prefetch(8))
    .build()
    .expect("runner");
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));
    let s = Arc::clone(&stats);
    let others = wait_for(Duration::from_secs(30), || {
        let s = Arc::clone(&s);
        async move { s.executed() >= 15 }
    })
    .await;
    gate.add_permits(1);
    let s = Arc::clone(&stats);
    let all = wait_for(Duration::from_secs(20), || {
        let s = Arc::clone(&s);
        async move { s.executed() == 16 }
    })
    .await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("drained in time")
        .unwrap()
        .expect("run");
    assert!(
        others,
        "the 15 others ran while the slow one did: {stats:?}"
    );
    assert!(all, "{stats:?}");
    assert_eq!(queue_state(&url, &topology.queue).await, (0, 0));
    cleanup(&url, &topology).await;
}
