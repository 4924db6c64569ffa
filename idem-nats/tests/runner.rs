//! The runner on the real server: acks, replays, delayed naks, dead letters, poison messages,
//! max_deliver, slow handlers holding their ack deadline, graceful drain. Needs NATS with
//! JetStream (`IDEM_NATS_URL`) and Redis (`IDEM_REDIS_URL`); start both with
//! `scripts/services.sh nats redis`.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use common::*;
use idem_core::{AcquireRequest, IdempotencyStore, Namespace, RecordState};
use idem_executor::{ExecutorConfig, HandlerContext, HandlerError, Message};
use idem_nats::{NatsMessage, NatsRunner, RunnerOptions};
use tokio_util::sync::CancellationToken;

fn options() -> RunnerOptions {
    RunnerOptions::default()
        .with_max_in_flight(8)
        .with_retry_delays(Duration::from_millis(50), Duration::from_secs(1))
        .with_drain_timeout(Duration::from_secs(10))
}

async fn run_until<F>(
    runner_task: tokio::task::JoinHandle<Result<(), idem_nats::RunnerError>>,
    stop: CancellationToken,
    timeout: Duration,
    done: F,
) -> bool
where
    F: FnMut() -> futures::future::BoxFuture<'static, bool>,
{
    let reached = wait_for(timeout, done).await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), runner_task)
        .await
        .expect("drained in time")
        .unwrap()
        .expect("run");
    reached
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_replay_conflicts_and_poison_dead_letter() {
    if !nats_and_redis() {
        return;
    }
    init_tracing();
    let client = connect(&nats_url()).await;
    let js = idem_nats::async_nats::jetstream::new(client.clone());
    let name = unique("runner");
    create_streams(&js, &name).await;
    let mut msgs = vec![Msg::keyed("poison", r#"{"n":-1}"#)];
    for i in 0..40 {
        msgs.push(Msg::keyed(&format!("k{i}"), format!(r#"{{"n":{i}}}"#)));
    }
    for i in 0..10 {
        msgs.push(Msg::keyed(&format!("k{i}"), format!(r#"{{"n":{i}}}"#)));
    }
    msgs.push(Msg::keyed("k3", r#"{"n":"another payload"}"#));
    publish(&js, &name, &msgs).await;

    let store = shared(redis_store(&format!("{}:", unique("idem-nats-runner"))).await);
    let runs = Arc::new(std::sync::Mutex::new(BTreeMap::<String, u32>::new()));
    let seen = Arc::clone(&runs);
    let handler = move |msg: NatsMessage, ctx: HandlerContext| {
        let seen = Arc::clone(&seen);
        async move {
            let key = ctx.key().unwrap().id().to_owned();
            *seen.lock().unwrap().entry(key.clone()).or_default() += 1;
            if key == "poison" {
                return Err(HandlerError::retryable(format!(
                    "cannot handle {}\nsecond line",
                    String::from_utf8_lossy(Message::payload(&msg))
                )));
            }
            Ok(format!("done {key}"))
        }
    };
    let config = ExecutorConfig::new("nats-runner")
        .with_max_attempts(3)
        .with_retry_delay(Duration::from_millis(100));
    let runner = NatsRunner::builder(client, &name, "workers", executor(store, config), handler)
        .options(options())
        .build()
        .expect("runner");
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));
    let watched = Arc::clone(&stats);
    let done = run_until(task, stop, Duration::from_secs(30), move || {
        let s = Arc::clone(&watched);
        Box::pin(async move { s.executed() == 40 && s.dead_lettered() == 2 && s.replayed() == 10 })
    })
    .await;
    assert!(done, "{stats:?}");
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.get("poison"), Some(&3), "three attempts");
    assert!(
        runs.iter().all(|(k, n)| k == "poison" || *n == 1),
        "{runs:?}"
    );
    assert!(stats.naks() >= 2, "{stats:?}");

    let dead = read_stream(&js, &format!("{name}_dlq")).await;
    let mut reasons: Vec<(String, String, String)> = dead
        .iter()
        .map(|r| {
            (
                r.header(idem_nats::HEADER_KEY).unwrap(),
                r.header(idem_nats::HEADER_REASON).unwrap(),
                r.header(idem_nats::HEADER_ATTEMPTS).unwrap(),
            )
        })
        .collect();
    reasons.sort();
    assert_eq!(
        reasons,
        [
            ("k3".into(), "conflict".into(), "0".into()),
            ("poison".into(), "exhausted".into(), "3".into())
        ]
    );
    let poison = dead.iter().find(|r| r.body.contains("-1")).unwrap();
    assert_eq!(poison.subject, format!("dlq.{name}.orders"));
    let error = idem_nats::unescape(&poison.header(idem_nats::HEADER_ERROR).unwrap());
    assert!(
        error.contains("cannot handle") && error.ends_with("\nsecond line"),
        "{error:?}"
    );
    assert_eq!(poison.header("idempotency-key").as_deref(), Some("poison"));
    assert_eq!(
        consumer_state(&js, &name, "workers").await,
        (0, 0),
        "nothing pending, nothing unacknowledged"
    );
    delete_streams(&js, &name).await;
}

/// A handler that runs well past the consumer's ack deadline is not redelivered while it holds
/// its lease: the runner sends a progress ack at every heartbeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handler_past_the_ack_deadline_is_not_redelivered() {
    if !nats_and_redis() {
        return;
    }
    init_tracing();
    let client = connect(&nats_url()).await;
    let js = idem_nats::async_nats::jetstream::new(client.clone());
    let name = unique("slow");
    create_streams(&js, &name).await;
    let store = shared(redis_store(&format!("{}:", unique("idem-nats-slow"))).await);
    let ack_wait = Duration::from_secs(2);
    let config = ExecutorConfig::new("slow")
        .with_lease_ttl(Duration::from_millis(1500))
        .with_heartbeat_interval(Duration::from_millis(500));
    let runs = Arc::new(AtomicU32::new(0));
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    let mut all_stats = Vec::new();
    for _ in 0..2 {
        let runs = Arc::clone(&runs);
        let handler = move |msg: NatsMessage, ctx: HandlerContext| {
            let runs = Arc::clone(&runs);
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                assert_eq!(msg.delivered(), 1);
                tokio::time::sleep(ack_wait * 3).await;
                assert!(!ctx.is_cancelled());
                Ok::<_, HandlerError>(())
            }
        };
        let runner = NatsRunner::builder(
            client.clone(),
            &name,
            "workers",
            executor(store.clone(), config.clone()),
            handler,
        )
        .options(options().with_ack_wait(ack_wait))
        .build()
        .unwrap();
        all_stats.push(runner.stats());
        tasks.push(tokio::spawn(runner.run(stop.clone().cancelled_owned())));
    }
    let started = Instant::now();
    publish(&js, &name, &[Msg::keyed("slow", "{}")]).await;
    let watched = all_stats.clone();
    let done = wait_for(Duration::from_secs(20), || {
        let s = watched.clone();
        async move { s.iter().map(|s| s.executed()).sum::<u64>() == 1 }
    })
    .await;
    let elapsed = started.elapsed();
    // Long enough for a redelivery to show up, had there been one.
    tokio::time::sleep(ack_wait).await;
    stop.cancel();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(20), t)
            .await
            .expect("drained")
            .unwrap()
            .expect("run");
    }
    assert!(done, "{all_stats:?}");
    assert!(elapsed >= ack_wait * 3);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        all_stats.iter().map(|s| s.received()).sum::<u64>(),
        1,
        "delivered once: {all_stats:?}"
    );
    assert!(
        all_stats.iter().map(|s| s.progress()).sum::<u64>() >= 8,
        "a progress ack per heartbeat: {all_stats:?}"
    );
    assert_eq!(consumer_state(&js, &name, "workers").await, (0, 0));
    delete_streams(&js, &name).await;
}

/// A message whose key stays held elsewhere is nak'ed until its last allowed delivery, then
/// dead-lettered (reason `exhausted`) rather than dropped by the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_allowed_delivery_is_dead_lettered_not_dropped() {
    if !nats_and_redis() {
        return;
    }
    init_tracing();
    let client = connect(&nats_url()).await;
    let js = idem_nats::async_nats::jetstream::new(client.clone());
    let name = unique("maxdeliver");
    create_streams(&js, &name).await;
    let store = redis_store(&format!("{}:", unique("idem-nats-maxdeliver"))).await;
    // Another worker holds the key for a minute.
    let key = Namespace::new("maxdeliver").unwrap().key("held").unwrap();
    let held = store
        .acquire(
            &AcquireRequest::new(key.clone(), "someone-else")
                .with_lease_ttl(Duration::from_secs(60)),
        )
        .await
        .unwrap();
    assert!(
        matches!(held, idem_core::AcquireOutcome::Acquired { .. }),
        "{held:?}"
    );
    publish(
        &js,
        &name,
        &[Msg::keyed("held", "{}"), Msg::keyed("free", "{}")],
    )
    .await;
    let config = ExecutorConfig::new("maxdeliver")
        .with_max_attempts(3)
        .with_fingerprint(idem_executor::FingerprintPolicy::Off);
    let handler = |_msg: NatsMessage, _ctx: HandlerContext| async { Ok::<_, HandlerError>(()) };
    let runner = NatsRunner::builder(
        client,
        &name,
        "workers",
        executor(shared(store), config),
        handler,
    )
    .options(
        options()
            .with_max_deliver(Some(4))
            .with_retry_delays(Duration::from_millis(50), Duration::from_millis(100)),
    )
    .build()
    .unwrap();
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));
    let watched = Arc::clone(&stats);
    let done = run_until(task, stop, Duration::from_secs(20), move || {
        let s = Arc::clone(&watched);
        Box::pin(async move { s.executed() == 1 && s.dead_lettered() == 1 })
    })
    .await;
    assert!(done, "{stats:?}");
    assert_eq!(
        stats.naks(),
        3,
        "three naks, then the fourth delivery is dead-lettered"
    );
    let dead = read_stream(&js, &format!("{name}_dlq")).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].header(idem_nats::HEADER_REASON).as_deref(),
        Some("exhausted")
    );
    assert_eq!(
        dead[0].header(idem_nats::HEADER_DELIVERED).as_deref(),
        Some("4")
    );
    assert!(
        dead[0]
            .header(idem_nats::HEADER_ERROR)
            .unwrap()
            .contains("max_deliver"),
        "{dead:?}"
    );
    assert_eq!(consumer_state(&js, &name, "workers").await, (0, 0));
    delete_streams(&js, &name).await;
}

/// Shutdown drains: the handlers in process finish and are acknowledged, nothing else starts,
/// and what was not processed is still pending for the consumer, with no key left in progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_in_flight_messages() {
    if !nats_and_redis() {
        return;
    }
    init_tracing();
    let client = connect(&nats_url()).await;
    let js = idem_nats::async_nats::jetstream::new(client.clone());
    let name = unique("drain");
    create_streams(&js, &name).await;
    let msgs: Vec<Msg> = (0..20)
        .map(|i| Msg::keyed(&format!("d{i}"), format!(r#"{{"n":{i}}}"#)))
        .collect();
    publish(&js, &name, &msgs).await;
    let store = shared(redis_store(&format!("{}:", unique("idem-nats-drain"))).await);
    let started = Arc::new(AtomicU32::new(0));
    let counter = Arc::clone(&started);
    let handler = move |_msg: NatsMessage, ctx: HandlerContext| {
        let counter = Arc::clone(&counter);
        async move {
            counter.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(400)).await;
            Ok::<_, HandlerError>(ctx.attempt())
        }
    };
    let runner = NatsRunner::builder(
        client,
        &name,
        "workers",
        executor(store.clone(), ExecutorConfig::new("drain")),
        handler,
    )
    .options(options().with_max_in_flight(4))
    .build()
    .unwrap();
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));
    let counter = Arc::clone(&started);
    let done = run_until(task, stop, Duration::from_secs(10), move || {
        let n = Arc::clone(&counter);
        Box::pin(async move { n.load(Ordering::SeqCst) >= 4 })
    })
    .await;
    assert!(done);
    let ran = u64::from(started.load(Ordering::SeqCst));
    assert!((4..20).contains(&ran), "{ran}");
    assert_eq!(
        stats.executed(),
        ran,
        "every started handler finished: {stats:?}"
    );
    let (pending, ack_pending) = consumer_state(&js, &name, "workers").await;
    assert_eq!(
        (pending, ack_pending),
        (20 - ran, 0),
        "the rest is pending again (buffered ones were nak'ed): {stats:?}"
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
    delete_streams(&js, &name).await;
}

/// Runs 200 waiting messages with `max_batch` and returns the store requests sent for them.
async fn requests_for_200(max_batch: usize) -> u64 {
    let client = connect(&nats_url()).await;
    let js = idem_nats::async_nats::jetstream::new(client.clone());
    let name = unique("groups");
    create_streams(&js, &name).await;
    let msgs: Vec<Msg> = (0..200)
        .map(|i| Msg::keyed(&format!("k{i}"), format!(r#"{{"n":{i}}}"#)))
        .collect();
    publish(&js, &name, &msgs).await;
    let store = redis_store(&format!("{}:", unique("idem-nats-groups"))).await;
    let handler = |_msg: NatsMessage, _ctx: HandlerContext| async { Ok::<_, HandlerError>(1u8) };
    let exec = executor(shared(store.clone()), ExecutorConfig::new("nats-groups"));
    let runner = NatsRunner::builder(client, &name, "workers", exec, handler)
        .options(options().with_max_in_flight(64).with_max_batch(max_batch))
        .build()
        .expect("runner");
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));
    let watched = Arc::clone(&stats);
    let done = run_until(task, stop, Duration::from_secs(30), move || {
        let s = Arc::clone(&watched);
        Box::pin(async move { s.executed() == 200 })
    })
    .await;
    assert!(done, "{stats:?}");
    assert_eq!(
        consumer_state(&js, &name, "workers").await,
        (0, 0),
        "nothing pending, nothing unacknowledged"
    );
    delete_streams(&js, &name).await;
    store.requests_sent()
}

/// Messages the stream already holds are pulled without waiting and run as groups: their keys
/// acquired and their results recorded in a few batched store calls, where `max_batch` 1 sends
/// an acquire and a completion for each message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_messages_run_in_groups() {
    if !nats_and_redis() {
        return;
    }
    init_tracing();
    let one_by_one = requests_for_200(1).await;
    assert_eq!(one_by_one, 400, "an acquire and a completion per message");
    let grouped = requests_for_200(64).await;
    assert!(
        grouped <= 40,
        "200 messages in groups of 64 at most: {grouped} store requests"
    );
}
