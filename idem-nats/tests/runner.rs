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
use idem_nats::{DeadLetterSubject, NatsMessage, NatsRunner, RunnerOptions, RunnerStats};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

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
    let Some((client, js, name)) = streams_for("runner").await else {
        return;
    };
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

/// A message published with the server's own headers (`Nats-Expected-Stream` names the work
/// stream) is dead-lettered with them renamed: published as they were, the dead-letter stream
/// refused it every time ("expected stream does not match") and the runner held the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_headers_are_renamed_in_the_dead_letter() {
    let Some((client, js, name)) = streams_for("runner_server_headers").await else {
        return;
    };
    let mut msg = Msg::keyed("bad", "{}");
    msg.headers
        .push(("Nats-Expected-Stream".into(), name.clone()));
    msg.headers.push(("trace".into(), "t-1".into()));
    publish(&js, &name, &[msg, Msg::keyed("fine", "{}")]).await;

    let store = shared(redis_store(&format!("{}:", unique("idem-nats-server-headers"))).await);
    let handler = |_msg: NatsMessage, ctx: HandlerContext| async move {
        match ctx.key().unwrap().id() {
            "bad" => Err(HandlerError::terminal("malformed amount")),
            _ => Ok(()),
        }
    };
    let runner = NatsRunner::builder(
        client,
        &name,
        "workers",
        executor(store, ExecutorConfig::new("nats-server-headers")),
        handler,
    )
    .options(options())
    .build()
    .expect("runner");
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
    assert_eq!(stats.publish_failures(), 0, "{stats:?}");

    let dead = read_stream(&js, &format!("{name}_dlq")).await;
    assert_eq!(dead.len(), 1);
    let d = &dead[0];
    assert_eq!(
        d.header(idem_nats::HEADER_REASON).as_deref(),
        Some("failed")
    );
    assert_eq!(d.header("Nats-Expected-Stream"), None);
    assert_eq!(
        d.header(&format!(
            "{}Nats-Expected-Stream",
            idem_nats::HEADER_SOURCE_NATS_PREFIX
        )),
        Some(name.clone())
    );
    assert_eq!(d.header("trace").as_deref(), Some("t-1"));
    assert_eq!(consumer_state(&js, &name, "workers").await, (0, 0));
    delete_streams(&js, &name).await;
}

/// Runs a runner on durable consumer `consumer` whose handler refuses every message terminally
/// until one dead letter is published (20 s at most), checks that no publication failed on the
/// way, and returns the dead-letter stream's messages.
async fn dead_letter_the_one_message(
    client: async_nats::Client,
    js: &async_nats::jetstream::Context,
    name: &str,
    consumer: &str,
) -> Vec<Read> {
    dead_letter_the_one_message_with(client, js, name, consumer, "malformed amount").await
}

/// [`dead_letter_the_one_message`] with the handler's error text.
async fn dead_letter_the_one_message_with(
    client: async_nats::Client,
    js: &async_nats::jetstream::Context,
    name: &str,
    consumer: &str,
    error: &'static str,
) -> Vec<Read> {
    let store = shared(redis_store(&format!("{}:", unique("idem-nats-refused"))).await);
    let handler = move |_msg: NatsMessage, _ctx: HandlerContext| async move {
        Err::<(), _>(HandlerError::terminal(error))
    };
    let runner = NatsRunner::builder(
        client,
        name,
        consumer,
        executor(store, ExecutorConfig::new("nats-refused")),
        handler,
    )
    .options(options())
    .build()
    .expect("runner");
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));
    let watched = Arc::clone(&stats);
    let done = run_until(task, stop, Duration::from_secs(20), move || {
        let s = Arc::clone(&watched);
        Box::pin(async move { s.dead_lettered() == 1 })
    })
    .await;
    assert!(done, "{stats:?}");
    assert_eq!(stats.publish_failures(), 0, "{stats:?}");
    read_stream(js, &format!("{name}_dlq")).await
}

/// Two durable consumers of one stream (two services, each with its own records) that both
/// dead-letter the same message each have their dead letter stored, naming its consumer. With
/// the dead letter's `Nats-Msg-Id` made of the stream and the sequence alone, the server took
/// the second for a duplicate of the first and dropped it, and its runner terminated the message
/// as if it were published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_dead_lettering_one_message_each_store_theirs() {
    let Some((client, js, name)) = streams_for("runner_two_consumers_dead_letter").await else {
        return;
    };
    publish(&js, &name, &[Msg::keyed("order-1", "{}")]).await;
    let first = dead_letter_the_one_message(client.clone(), &js, &name, "billing").await;
    assert_eq!(first.len(), 1);
    let both = dead_letter_the_one_message(client, &js, &name, "shipping").await;
    let consumers: Vec<Option<String>> = both
        .iter()
        .map(|d| d.header(idem_nats::HEADER_SOURCE_CONSUMER))
        .collect();
    assert_eq!(
        consumers,
        [Some("billing".to_owned()), Some("shipping".to_owned())],
        "one dead letter per consumer"
    );
    assert_eq!(
        both[1].header("Nats-Msg-Id"),
        Some(idem_nats::dead_letter_id(&name, "shipping", 1))
    );
    assert_eq!(consumer_state(&js, &name, "billing").await, (0, 0));
    assert_eq!(consumer_state(&js, &name, "shipping").await, (0, 0));
    delete_streams(&js, &name).await;
}

/// A runner on `name`'s durable consumer "workers" whose handler does nothing, with `options`.
fn plain_runner(
    client: async_nats::Client,
    name: &str,
    store: idem_core::DynStore,
    options: RunnerOptions,
) -> NatsRunner<impl idem_nats::Handler<NatsMessage, ()> + use<>, ()> {
    let handler = |_msg: NatsMessage, _ctx: HandlerContext| async { Ok::<_, HandlerError>(()) };
    NatsRunner::builder(
        client,
        name,
        "workers",
        executor(store, ExecutorConfig::new("nats-consumer-gone")),
        handler,
    )
    .options(options)
    .build()
    .expect("runner")
}

/// An existing consumer whose limits the runner's pulls would exceed (the server refuses every
/// pull over `max_batch` or `max_expires`) is refused at the start with a typed error, naming
/// the option; before, the runner pulled in vain forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_refusing_the_runners_pulls_is_a_config_error() {
    let Some((client, js, name)) = streams_for("runner_pull_limits").await else {
        return;
    };
    let stream = js.get_stream(&name).await.expect("stream");
    stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("workers".into()),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
            max_batch: 4,
            max_expires: Duration::from_millis(500),
            ..Default::default()
        })
        .await
        .expect("consumer");
    let store = shared(redis_store(&format!("{}:", unique("idem-nats-limits"))).await);
    for (options, field) in [
        (options(), "max_in_flight"),
        (options().with_max_in_flight(4), "pull_expiry"),
    ] {
        let runner = plain_runner(client.clone(), &name, store.clone(), options);
        let run = tokio::time::timeout(Duration::from_secs(10), runner.run(std::future::pending()));
        match run.await.expect("returns at once") {
            Err(idem_nats::RunnerError::Config { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{other:?}"),
        }
    }
    let runner = plain_runner(
        client,
        &name,
        store,
        options()
            .with_max_in_flight(4)
            .with_pull_expiry(Duration::from_millis(500)),
    );
    let stats = runner.stats();
    publish(&js, &name, &[Msg::keyed("k1", "{}")]).await;
    run_until_executed(&stats, 1, |stop| runner.run(stop)).await;
    delete_streams(&js, &name).await;
}

/// Runs `runner` until it returns by itself (at most `timeout`); `None` (the runner aborted)
/// when it did not.
async fn returns_within(
    mut task: tokio::task::JoinHandle<Result<(), idem_nats::RunnerError>>,
    timeout: Duration,
) -> Option<Result<(), idem_nats::RunnerError>> {
    match tokio::time::timeout(timeout, &mut task).await {
        Ok(joined) => Some(joined.expect("the runner task")),
        Err(_) => {
            task.abort();
            None
        }
    }
}

/// The consumer deleted while the runner runs, after the store dropped the records of the
/// messages it had processed (a short retention): the runner stops with
/// `RunnerError::ConsumerDeleted` and no handler runs twice. Before, it created the consumer
/// again, which delivered the stream from its start: every message ran its handler again (10
/// runs for 5 messages).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_deleted_while_running_stops_the_runner_and_no_message_runs_twice() {
    let Some((client, js, name)) = streams_for("runner_consumer_deleted").await else {
        return;
    };
    let first: Vec<Msg> = (0..5).map(|i| Msg::keyed(&format!("a{i}"), "{}")).collect();
    publish(&js, &name, &first).await;
    let runs = Arc::new(std::sync::Mutex::new(BTreeMap::<String, u32>::new()));
    let seen = Arc::clone(&runs);
    let handler = move |_msg: NatsMessage, ctx: HandlerContext| {
        let seen = Arc::clone(&seen);
        async move {
            let key = ctx.key().unwrap().id().to_owned();
            *seen.lock().unwrap().entry(key).or_default() += 1;
            Ok::<_, HandlerError>(())
        }
    };
    // Records kept for 2 s: a message delivered again after that runs its handler again.
    let config =
        ExecutorConfig::new("nats-consumer-deleted").with_retention(Duration::from_secs(2));
    let store = shared(idem_core::MemoryStore::new());
    let runner = NatsRunner::builder(
        client.clone(),
        &name,
        "workers",
        executor(store, config),
        handler,
    )
    .options(
        options().with_reconnect_delays(Duration::from_millis(100), Duration::from_millis(500)),
    )
    .build()
    .expect("runner");
    let stats = runner.stats();
    let task = tokio::spawn(runner.run(std::future::pending()));
    let s = Arc::clone(&stats);
    assert!(
        wait_for(Duration::from_secs(20), || {
            let s = Arc::clone(&s);
            async move { s.executed() == 5 }
        })
        .await,
        "{stats:?}"
    );
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let stream = js.get_stream(&name).await.expect("stream");
    stream.delete_consumer("workers").await.expect("deleted");
    let ended = returns_within(task, Duration::from_secs(20)).await;
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 5, "{runs:?}");
    assert!(
        runs.values().all(|n| *n == 1),
        "no handler runs twice: {runs:?} ({stats:?})"
    );
    match ended {
        Some(Err(e @ idem_nats::RunnerError::ConsumerDeleted { .. })) => {
            let text = e.to_string();
            let idem_nats::RunnerError::ConsumerDeleted {
                stream: s,
                consumer,
                ack_floor,
            } = e
            else {
                unreachable!()
            };
            assert_eq!((s.as_str(), consumer.as_str()), (name.as_str(), "workers"));
            assert!(ack_floor <= 5, "{ack_floor}");
            assert!(
                text.contains("workers") && text.contains("recreated by the operator"),
                "{text}"
            );
        }
        other => panic!("the runner stops with ConsumerDeleted: {other:?} ({stats:?})"),
    }
    assert!(
        stream.consumer_info("workers").await.is_err(),
        "the consumer was not created again"
    );
    delete_streams(&js, &name).await;
}

/// A consumer deleted and at once created again under the same name while the runner runs (by
/// an operator, or by a runner starting elsewhere) is a new consumer whose position the runner
/// cannot know: it stops with `RunnerError::ConsumerDeleted` too. The same with
/// `create_consumer` off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_created_again_while_running_stops_the_runner() {
    let Some((client, js, name)) = streams_for("runner_consumer_recreated").await else {
        return;
    };
    let stream = js.get_stream(&name).await.expect("stream");
    let config = async_nats::jetstream::consumer::pull::Config {
        durable_name: Some("workers".into()),
        ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
        ..Default::default()
    };
    stream
        .create_consumer(config.clone())
        .await
        .expect("consumer");
    let store = shared(redis_store(&format!("{}:", unique("idem-nats-recreated"))).await);
    let runner = plain_runner(client, &name, store, options().with_create_consumer(false));
    let task = tokio::spawn(runner.run(std::future::pending()));
    let waiting = wait_for(Duration::from_secs(10), || {
        let stream = stream.clone();
        async move {
            stream
                .consumer_info("workers")
                .await
                .is_ok_and(|i| i.num_waiting > 0)
        }
    })
    .await;
    assert!(waiting, "the runner pulls");
    stream.delete_consumer("workers").await.expect("deleted");
    stream.create_consumer(config).await.expect("created again");
    let ended = returns_within(task, Duration::from_secs(30)).await;
    assert!(
        matches!(
            ended,
            Some(Err(idem_nats::RunnerError::ConsumerDeleted { .. }))
        ),
        "{ended:?}"
    );
    delete_streams(&js, &name).await;
}

/// Runs a plain runner over `name`'s existing consumer "workers" with `config`, expecting a
/// configuration error naming `field` at once.
async fn refused_at_the_start(
    client: async_nats::Client,
    js: &async_nats::jetstream::Context,
    name: &str,
    config: async_nats::jetstream::consumer::pull::Config,
    executor_config: ExecutorConfig,
    field: &str,
) {
    let stream = js.get_stream(name).await.expect("stream");
    stream.create_consumer(config).await.expect("consumer");
    let store = shared(idem_core::MemoryStore::new());
    let handler = |_msg: NatsMessage, _ctx: HandlerContext| async { Ok::<_, HandlerError>(()) };
    let runner = NatsRunner::builder(
        client,
        name,
        "workers",
        executor(store, executor_config),
        handler,
    )
    .options(options())
    .build()
    .expect("runner");
    let run = tokio::time::timeout(Duration::from_secs(10), runner.run(std::future::pending()));
    match run.await {
        Ok(Err(idem_nats::RunnerError::Config { field: f, reason })) => {
            assert_eq!(f, field, "{reason}")
        }
        other => panic!("a config error naming {field} at once: {other:?}"),
    }
}

/// A consumer with a `backoff` entry not above the executor's heartbeat interval is refused:
/// the server makes each entry the ack deadline of a redelivery, under the progress acks' pace,
/// and redelivered copies of a message whose handler still ran met the key in progress until
/// `max_deliver`, one of them dead-lettered as undelivered while the original completed. One
/// whose entries are all above the heartbeat runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_with_a_backoff_under_the_heartbeat_is_a_config_error() {
    let Some((client, js, name)) = streams_for("runner_backoff").await else {
        return;
    };
    let executor_config = || {
        ExecutorConfig::new("nats-backoff")
            .with_lease_ttl(Duration::from_secs(3))
            .with_heartbeat_interval(Duration::from_secs(1))
            .with_max_attempts(3)
    };
    let consumer = |backoff: Vec<Duration>| async_nats::jetstream::consumer::pull::Config {
        durable_name: Some("workers".into()),
        ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
        max_deliver: 10,
        backoff,
        ..Default::default()
    };
    let short = vec![Duration::from_secs(3), Duration::from_millis(500)];
    refused_at_the_start(
        client.clone(),
        &js,
        &name,
        consumer(short),
        executor_config(),
        "backoff",
    )
    .await;
    let stream = js.get_stream(&name).await.expect("stream");
    stream.delete_consumer("workers").await.expect("deleted");
    stream
        .create_consumer(consumer(vec![
            Duration::from_secs(3),
            Duration::from_secs(2),
        ]))
        .await
        .expect("consumer");
    let handler = |_msg: NatsMessage, _ctx: HandlerContext| async { Ok::<_, HandlerError>(()) };
    let store = shared(idem_core::MemoryStore::new());
    let runner = NatsRunner::builder(
        client,
        &name,
        "workers",
        executor(store, executor_config()),
        handler,
    )
    .options(options())
    .build()
    .expect("runner");
    let stats = runner.stats();
    publish(&js, &name, &[Msg::keyed("k1", "{}")]).await;
    run_until_executed(&stats, 1, |stop| runner.run(stop)).await;
    delete_streams(&js, &name).await;
}

/// A consumer that delivers headers only is refused: handlers ran on an empty payload, and
/// dead letters carried it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_headers_only_consumer_is_a_config_error() {
    let Some((client, js, name)) = streams_for("runner_headers_only").await else {
        return;
    };
    let config = async_nats::jetstream::consumer::pull::Config {
        durable_name: Some("workers".into()),
        ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
        headers_only: true,
        ..Default::default()
    };
    refused_at_the_start(
        client,
        &js,
        &name,
        config,
        ExecutorConfig::new("nats-headers-only"),
        "headers_only",
    )
    .await;
    delete_streams(&js, &name).await;
}

/// A dead-letter subject the consumer itself receives (the source stream captures it and the
/// filter lets it through) is refused at the start, fixed or prefixed: one poison message made
/// thousands of dead letters a second. With a filter that keeps the dead letters out, the same
/// subject is accepted (they are stored in the source stream, and the consumer never sees them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_subject_the_consumer_receives_is_a_config_error() {
    let Some((client, js, name)) = streams_for("runner_dlq_loop").await else {
        return;
    };
    let store = shared(idem_core::MemoryStore::new());
    for dead_letters in [
        DeadLetterSubject::Fixed(format!("{name}.dead")),
        DeadLetterSubject::Prefix(format!("{name}.dlq.")),
    ] {
        let runner = plain_runner(
            client.clone(),
            &name,
            store.clone(),
            options().with_dead_letter_subject(dead_letters.clone()),
        );
        let run = tokio::time::timeout(Duration::from_secs(10), runner.run(std::future::pending()));
        match run.await {
            Ok(Err(idem_nats::RunnerError::Config { field, reason })) => {
                assert_eq!(field, "dead_letter_subject", "{reason}");
                assert!(reason.contains("come back"), "{reason}");
            }
            other => panic!("{dead_letters:?}: a config error at once: {other:?}"),
        }
        // (The runner created the consumer before checking it.)
        let stream = js.get_stream(&name).await.expect("stream");
        stream.delete_consumer("workers").await.expect("deleted");
    }
    // Filtered to `<name>.orders`, the consumer never receives `<name>.dead`.
    publish(&js, &name, &[Msg::keyed("poison", "{}")]).await;
    let handler = |_msg: NatsMessage, _ctx: HandlerContext| async {
        Err::<(), _>(HandlerError::terminal("poison"))
    };
    let runner = NatsRunner::builder(
        client,
        &name,
        "workers",
        executor(store, ExecutorConfig::new("nats-dlq-loop")),
        handler,
    )
    .options(
        options()
            .with_filter_subject(format!("{name}.orders"))
            .with_dead_letter_subject(DeadLetterSubject::Fixed(format!("{name}.dead"))),
    )
    .build()
    .expect("runner");
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));
    let watched = Arc::clone(&stats);
    let done = run_until(task, stop, Duration::from_secs(20), move || {
        let s = Arc::clone(&watched);
        Box::pin(async move { s.dead_lettered() == 1 })
    })
    .await;
    assert!(done, "{stats:?}");
    let stored = read_stream(&js, &name).await;
    assert_eq!(stored.len(), 2, "the message and its dead letter");
    assert_eq!(stored[1].subject, format!("{name}.dead"));
    assert_eq!(stats.dead_lettered(), 1, "{stats:?}");
    assert_eq!(consumer_state(&js, &name, "workers").await, (0, 0));
    delete_streams(&js, &name).await;
}

/// The source stream made to capture the dead-letter subject while the runner runs: the dead
/// letter that comes back (it carries `idem-dlq-reason`) is terminated, not dead-lettered
/// again. Before, one poison message made thousands of dead letters a second, without end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_that_comes_back_is_terminated_not_dead_lettered_again() {
    let Some((client, js, name)) = streams_for("runner_dlq_back").await else {
        return;
    };
    let dead = format!("dlq.{name}.dead");
    let handler = |_msg: NatsMessage, _ctx: HandlerContext| async {
        Err::<(), _>(HandlerError::terminal("poison"))
    };
    let runner = NatsRunner::builder(
        client,
        &name,
        "workers",
        executor(
            shared(idem_core::MemoryStore::new()),
            ExecutorConfig::new("nats-dlq-back"),
        ),
        handler,
    )
    .options(options().with_dead_letter_subject(DeadLetterSubject::Fixed(dead.clone())))
    .build()
    .expect("runner");
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));
    let pulling = wait_for(Duration::from_secs(10), || {
        let js = js.clone();
        let name = name.clone();
        async move {
            let s = js.get_stream(&name).await.expect("stream");
            s.consumer_info("workers")
                .await
                .is_ok_and(|i| i.num_waiting > 0)
        }
    })
    .await;
    assert!(pulling, "the runner started");
    // Now the source stream captures the dead-letter subject.
    js.delete_stream(format!("{name}_dlq"))
        .await
        .expect("dead-letter stream deleted");
    js.update_stream(async_nats::jetstream::stream::Config {
        name: name.clone(),
        subjects: vec![format!("{name}.>"), dead.clone()],
        storage: async_nats::jetstream::stream::StorageType::File,
        ..Default::default()
    })
    .await
    .expect("the source stream captures the dead letters");
    publish(&js, &name, &[Msg::keyed("poison", "{}")]).await;
    let watched = Arc::clone(&stats);
    let settled = wait_for(Duration::from_secs(20), || {
        let s = Arc::clone(&watched);
        async move { s.dead_letter_loops() >= 1 || s.dead_lettered() > 20 }
    })
    .await;
    // Time for a loop to show, had there been one.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let dead_lettered = stats.dead_lettered();
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("drained in time")
        .unwrap()
        .expect("run");
    assert!(settled, "{stats:?}");
    assert_eq!(dead_lettered, 1, "one dead letter, no loop: {stats:?}");
    assert_eq!(stats.dead_letter_loops(), 1, "{stats:?}");
    let stored = read_stream(&js, &name).await;
    assert_eq!(stored.len(), 2, "the message and its one dead letter");
    assert_eq!(stored[1].subject, dead);
    assert_eq!(consumer_state(&js, &name, "workers").await, (0, 0));
    delete_streams(&js, &name).await;
}

/// A message whose subject is so long that `dlq.` + subject would take the dead letter's
/// publication over the server's 4,096-byte protocol line is dead-lettered to the subject cut
/// short (`dlq.<stream>.idem-subject-too-long`), its subject whole in `idem-dlq-source-subject`.
/// Before, the server closed the connection at every try (disrupting every ack and pull), and
/// the runner tried again forever, holding the message and its slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_subject_too_long_for_the_protocol_line_is_cut_short() {
    let Some((client, js, name)) = streams_for("runner_long_subject").await else {
        return;
    };
    // A core publication (no reply subject) within the line: `HPUB <subject> <sizes>`.
    let subject = format!("{name}.{}", "a".repeat(4096 - 40 - name.len()));
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("idempotency-key", "long");
    let producer = connect(&nats_url()).await;
    producer
        .publish_with_headers(subject.clone(), headers, "{}".into())
        .await
        .expect("published");
    producer.flush().await.expect("flushed");
    let stored = wait_for(Duration::from_secs(5), || {
        let js = js.clone();
        let name = name.clone();
        async move {
            let mut s = js.get_stream(&name).await.expect("stream");
            s.info().await.expect("info").state.messages == 1
        }
    })
    .await;
    assert!(stored, "the stream holds the message");
    let dead = dead_letter_the_one_message(client, &js, &name, "workers").await;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].subject,
        format!("dlq.{name}.{}", idem_nats::SUBJECT_TOO_LONG)
    );
    assert_eq!(
        dead[0].header(idem_nats::HEADER_SOURCE_SUBJECT).as_deref(),
        Some(subject.as_str())
    );
    assert_eq!(consumer_state(&js, &name, "workers").await, (0, 0));
    delete_streams(&js, &name).await;
}

/// A slow handler holds only its own message and slot: each message of a group is settled,
/// and its slot freed, as soon as its outcome is recorded, so the others of its group, and the
/// groups pulled into the freed slots, run meanwhile. Before, every message of a group waited
/// for the slowest handler, and its slots with them: the 4 messages after the first group
/// started only once the slow one was done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handler_holds_back_no_other_message_of_its_group() {
    let Some((client, js, name)) = streams_for("runner_slow_one").await else {
        return;
    };
    let msgs: Vec<Msg> = (0..8).map(|i| Msg::keyed(&format!("k{i}"), "{}")).collect();
    publish(&js, &name, &msgs).await;
    // The slow handler runs until the others are done (or the wait for them gives up).
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let g = Arc::clone(&gate);
    let handler = move |msg: NatsMessage, _ctx: HandlerContext| {
        let gate = Arc::clone(&g);
        async move {
            if msg.stream_sequence() == 1 {
                gate.acquire().await.expect("gate open").forget();
            }
            Ok::<_, HandlerError>(())
        }
    };
    let runner = NatsRunner::builder(
        client,
        &name,
        "workers",
        executor(
            shared(idem_core::MemoryStore::new()),
            ExecutorConfig::new("nats-slow-one"),
        ),
        handler,
    )
    .options(options().with_max_in_flight(4))
    .build()
    .expect("runner");
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));
    let started = Instant::now();
    let s = Arc::clone(&stats);
    let others = wait_for(Duration::from_secs(30), || {
        let s = Arc::clone(&s);
        async move { s.executed() == 7 }
    })
    .await;
    let others_in = started.elapsed();
    gate.add_permits(1);
    let watched = Arc::clone(&stats);
    let all = run_until(task, stop, Duration::from_secs(20), move || {
        let s = Arc::clone(&watched);
        Box::pin(async move { s.executed() == 8 })
    })
    .await;
    assert!(
        others,
        "the 7 others ran while the slow one did ({others_in:?}): {stats:?}"
    );
    assert!(all, "{stats:?}");
    assert_eq!(consumer_state(&js, &name, "workers").await, (0, 0));
    delete_streams(&js, &name).await;
}

/// A message near the server's payload limit (1 MiB here; headers count towards it) is
/// dead-lettered: over the limit with its original headers plus the runner's, it is published
/// with the runner's only, naming the others. Before, the publication failed every second,
/// forever, and the runner held the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_over_the_payload_limit_goes_without_the_original_headers() {
    let Some((client, js, name)) = streams_for("runner_large").await else {
        return;
    };
    let body = "x".repeat(1_040_000);
    let mut msg = Msg::keyed("big", body.as_str());
    // The original fits with about 180 bytes to spare, fewer than the runner's headers take.
    msg.headers.push(("blob".into(), "y".repeat(8_350)));
    publish(&js, &name, &[msg]).await;

    let dead = dead_letter_the_one_message(client, &js, &name, "workers").await;
    assert_eq!(dead.len(), 1);
    let d = &dead[0];
    assert_eq!(d.body.len(), body.len(), "the payload whole");
    assert_eq!(
        d.header(idem_nats::HEADER_REASON).as_deref(),
        Some("failed")
    );
    assert_eq!(d.header(idem_nats::HEADER_KEY).as_deref(), Some("big"));
    assert_eq!(
        d.header(idem_nats::HEADER_DROPPED).as_deref(),
        Some("blob,idempotency-key")
    );
    assert_eq!(d.header("blob"), None);
    assert_eq!(consumer_state(&js, &name, "workers").await, (0, 0));
    delete_streams(&js, &name).await;
}

/// Sets the `max_msg_size` of `name`'s dead-letter stream to `max` bytes.
async fn limit_dead_letters(js: &async_nats::jetstream::Context, name: &str, max: i32) {
    use async_nats::jetstream::stream;
    js.update_stream(stream::Config {
        name: format!("{name}_dlq"),
        subjects: vec![format!("dlq.{name}.>")],
        storage: stream::StorageType::File,
        max_message_size: max,
        ..Default::default()
    })
    .await
    .expect("limit the dead-letter stream");
}

/// The same when the dead-letter stream's `max_msg_size` is what refuses it (the refusal comes
/// from the stream, not the client).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_over_the_stream_size_limit_goes_without_the_original_headers() {
    let Some((client, js, name)) = streams_for("runner_stream_limit").await else {
        return;
    };
    limit_dead_letters(&js, &name, 20_000).await;
    let mut msg = Msg::keyed("big", "x".repeat(15_000));
    msg.headers.push(("blob".into(), "y".repeat(5_000)));
    publish(&js, &name, &[msg]).await;

    let dead = dead_letter_the_one_message(client, &js, &name, "workers").await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].body.len(), 15_000);
    assert_eq!(
        dead[0].header(idem_nats::HEADER_DROPPED).as_deref(),
        Some("blob,idempotency-key")
    );
    delete_streams(&js, &name).await;
}

/// Still over the dead-letter stream's size limit with the runner's headers only (a long error
/// and a message near the limit), a dead letter is published with the error and the key cut to
/// `COMPACT_TEXT` bytes. Before, the publication failed every second, forever, and the runner
/// held the message (and its slot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_still_too_large_goes_with_its_error_cut_short() {
    let Some((client, js, name)) = streams_for("runner_compact").await else {
        return;
    };
    limit_dead_letters(&js, &name, 20_000).await;
    // 16,500 bytes of payload and a 4,096-byte error header: over 20,000 with or without the
    // original headers.
    publish(&js, &name, &[Msg::keyed("big", "x".repeat(16_500))]).await;
    static LONG: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| "e".repeat(8_000));
    let dead = dead_letter_the_one_message_with(client, &js, &name, "workers", LONG.as_str()).await;
    assert_eq!(dead.len(), 1);
    let d = &dead[0];
    assert_eq!(d.body.len(), 16_500, "the payload whole");
    let error = d.header(idem_nats::HEADER_ERROR).expect("error header");
    assert!(
        error.len() <= idem_nats::COMPACT_TEXT && error.starts_with("eee") && error.ends_with('…'),
        "{} bytes",
        error.len()
    );
    assert_eq!(d.header(idem_nats::HEADER_KEY).as_deref(), Some("big"));
    assert_eq!(
        d.header(idem_nats::HEADER_DROPPED).as_deref(),
        Some("idempotency-key")
    );
    assert_eq!(consumer_state(&js, &name, "workers").await, (0, 0));
    delete_streams(&js, &name).await;
}

/// A handler that runs well past the consumer's ack deadline is not redelivered while it holds
/// its lease: the runner sends a progress ack at every heartbeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handler_past_the_ack_deadline_is_not_redelivered() {
    let Some((client, js, name)) = streams_for("slow").await else {
        return;
    };
    let store = shared(redis_store(&format!("{}:", unique("idem-nats-slow"))).await);
    let ack_wait = Duration::from_secs(2);
    // Heartbeats every 150 ms: a stall shorter than about 1.2 s (a loaded machine) keeps the
    // lease.
    let config = ExecutorConfig::new("slow")
        .with_lease_ttl(Duration::from_millis(1500))
        .with_heartbeat_interval(Duration::from_millis(150));
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

/// Another worker's lease on `key`, for a minute.
async fn hold_elsewhere(
    store: &idem_redis::RedisStore,
    key: idem_core::IdempotencyKey,
) -> idem_core::Lease {
    match store
        .acquire(&AcquireRequest::new(key, "someone-else").with_lease_ttl(Duration::from_secs(60)))
        .await
        .unwrap()
    {
        idem_core::AcquireOutcome::Acquired { lease, .. } => lease,
        other => panic!("{other:?}"),
    }
}

/// A store outage shorter than the pause it causes: the runner holds its pulls back while the
/// store fails, so the messages pulled into the outage come back once it ended, well within
/// `max_deliver`, and every one executes. Without the pause they were delivered again every
/// nak delay (50 ms here), used up their four deliveries within the outage and were all
/// dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_pauses_pulls_and_spends_no_deliveries_while_it_lasts() {
    use idem_conformance::faults::FaultyStore;
    let Some((client, js, name)) = streams_for("outagepause").await else {
        return;
    };
    let store = Arc::new(FaultyStore::new(idem_core::MemoryStore::new()));
    store.set_outage(true);
    let msgs: Vec<Msg> = (0..5).map(|i| Msg::keyed(&format!("k{i}"), "{}")).collect();
    publish(&js, &name, &msgs).await;
    let config = ExecutorConfig::new("outagepause")
        .with_max_attempts(3)
        .with_fingerprint(idem_executor::FingerprintPolicy::Off);
    let handler = |_msg: NatsMessage, _ctx: HandlerContext| async { Ok::<_, HandlerError>(()) };
    let runner = NatsRunner::builder(
        client,
        &name,
        "workers",
        executor(Arc::clone(&store) as idem_core::DynStore, config),
        handler,
    )
    .options(
        options()
            .with_max_deliver(Some(4))
            .with_retry_delays(Duration::from_millis(50), Duration::from_millis(100))
            .with_reconnect_delays(Duration::from_millis(300), Duration::from_secs(3)),
    )
    .build()
    .unwrap();
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runner.run(stop.clone().cancelled_owned()));
    // The first deliveries meet the outage.
    assert!(
        wait_for(Duration::from_secs(10), || {
            let s = Arc::clone(&stats);
            Box::pin(async move { s.naks() >= 1 })
        })
        .await,
        "{stats:?}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    store.set_outage(false);
    let watched = Arc::clone(&stats);
    let done = run_until(task, stop, Duration::from_secs(20), move || {
        let s = Arc::clone(&watched);
        Box::pin(async move { s.executed() == 5 })
    })
    .await;
    assert!(done, "{stats:?}");
    assert_eq!(stats.dead_lettered(), 0, "{stats:?}");
    assert!(stats.store_pauses() >= 1, "{stats:?}");
    assert!(read_stream(&js, &format!("{name}_dlq")).await.is_empty());
    assert_eq!(consumer_state(&js, &name, "workers").await, (0, 0));
    delete_streams(&js, &name).await;
}

/// A message whose key stays held elsewhere is nak'ed until its last allowed delivery, then
/// dead-lettered (reason `undelivered`) rather than dropped by the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_allowed_delivery_is_dead_lettered_not_dropped() {
    let Some((client, js, name)) = streams_for("maxdeliver").await else {
        return;
    };
    let store = redis_store(&format!("{}:", unique("idem-nats-maxdeliver"))).await;
    // Another worker holds the key for a minute.
    hold_elsewhere(
        &store,
        Namespace::new("maxdeliver").unwrap().key("held").unwrap(),
    )
    .await;
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
        Some("undelivered")
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

/// Messages on their last allowed delivery in one group, handlers one at a time, and a stop
/// whose drain times out: the running handler is signalled (its message then has no final
/// outcome) and the others are abandoned before their handlers start. None is nak'ed (the
/// server would stop delivering it): all are dead-lettered (reason `undelivered`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_deliveries_cut_short_by_the_drain_are_dead_lettered_not_dropped() {
    let Some((client, js, name)) = streams_for("lastdrain").await else {
        return;
    };
    let store = redis_store(&format!("{}:", unique("idem-nats-lastdrain"))).await;
    let ns = Namespace::new("lastdrain").unwrap();
    // Other workers hold the keys, so that a first runner naks every first delivery, with a
    // delay that outlasts it.
    const IDS: [&str; 4] = ["a", "b", "c", "d"];
    let mut held = Vec::new();
    for id in IDS {
        held.push(hold_elsewhere(&store, ns.key(id).unwrap()).await);
    }
    let msgs: Vec<Msg> = IDS.iter().map(|id| Msg::keyed(id, "{}")).collect();
    publish(&js, &name, &msgs).await;
    let started = Arc::new(AtomicU32::new(0));
    let runner = |client: idem_nats::async_nats::Client, nak_delay: Duration| {
        let counter = Arc::clone(&started);
        let handler = move |_msg: NatsMessage, _ctx: HandlerContext| {
            let counter = Arc::clone(&counter);
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(60)).await;
                Ok::<_, HandlerError>(())
            }
        };
        let config = ExecutorConfig::new("lastdrain")
            .with_max_attempts(1)
            .with_fingerprint(idem_executor::FingerprintPolicy::Off)
            .with_batch(idem_executor::BatchConfig::default().with_concurrency(1));
        NatsRunner::builder(
            client,
            &name,
            "workers",
            executor(shared(store.clone()), config),
            handler,
        )
        .options(
            options()
                .with_max_deliver(Some(2))
                .with_retry_delays(nak_delay, nak_delay)
                .with_drain_timeout(Duration::from_millis(300)),
        )
        .build()
        .unwrap()
    };
    let first = runner(client.clone(), Duration::from_secs(1));
    let stats = first.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(first.run(stop.clone().cancelled_owned()));
    let watched = Arc::clone(&stats);
    let naked = run_until(task, stop, Duration::from_secs(10), move || {
        let s = Arc::clone(&watched);
        Box::pin(async move { s.naks() == 4 })
    })
    .await;
    assert!(naked, "{stats:?}");
    for lease in &held {
        store.release(lease).await.unwrap();
    }
    // The second (last) deliveries come back together: one pull brings them as one group.
    let second = runner(client, Duration::from_millis(50));
    let stats = second.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(second.run(stop.clone().cancelled_owned()));
    let counter = Arc::clone(&started);
    let ran = run_until(task, stop, Duration::from_secs(10), move || {
        let n = Arc::clone(&counter);
        Box::pin(async move { n.load(Ordering::SeqCst) >= 1 })
    })
    .await;
    assert!(ran, "{stats:?}");
    // One handler at a time in a group: usually the four form one group (one handler runs,
    // three never start); a pull read in parts makes more groups, each running one.
    let ran = u64::from(started.load(Ordering::SeqCst));
    assert_eq!(
        stats.abandoned(),
        4 - ran,
        "the others never started: {stats:?}"
    );
    assert_eq!(stats.naks(), 0, "no nak of a last delivery: {stats:?}");
    assert_eq!(stats.dead_lettered(), 4, "{stats:?}");
    let dead = read_stream(&js, &format!("{name}_dlq")).await;
    assert_eq!(dead.len(), 4);
    for d in &dead {
        assert_eq!(
            d.header(idem_nats::HEADER_REASON).as_deref(),
            Some("undelivered")
        );
        assert!(
            d.header(idem_nats::HEADER_ERROR)
                .unwrap()
                .contains("max_deliver"),
            "{dead:?}"
        );
    }
    let abandoned = dead
        .iter()
        .filter(|d| {
            d.header(idem_nats::HEADER_ERROR)
                .unwrap()
                .contains("abandoned by the drain")
        })
        .count();
    assert_eq!(abandoned as u64, 4 - ran, "{dead:?}");
    assert_eq!(consumer_state(&js, &name, "workers").await, (0, 0));
    delete_streams(&js, &name).await;
}

/// A message on its last allowed delivery that arrives while the runner stops (in the pull it
/// reads to its end) is run, not nak'ed for an immediate redelivery, which would make the
/// server stop delivering it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_last_delivery_arriving_during_the_stop_is_run_not_nacked() {
    let Some((client, js, name)) = streams_for("laststop").await else {
        return;
    };
    let store = redis_store(&format!("{}:", unique("idem-nats-laststop"))).await;
    let key = Namespace::new("laststop").unwrap().key("late").unwrap();
    let held = hold_elsewhere(&store, key.clone()).await;
    publish(&js, &name, &[Msg::keyed("late", "{}")]).await;
    let runner = |client: idem_nats::async_nats::Client, pull_expiry: Duration| {
        let config = ExecutorConfig::new("laststop")
            .with_max_attempts(1)
            .with_fingerprint(idem_executor::FingerprintPolicy::Off);
        let handler = |_msg: NatsMessage, _ctx: HandlerContext| async { Ok::<_, HandlerError>(()) };
        NatsRunner::builder(
            client,
            &name,
            "workers",
            executor(shared(store.clone()), config),
            handler,
        )
        .options(
            options()
                .with_max_deliver(Some(2))
                .with_retry_delays(Duration::from_secs(3), Duration::from_secs(3))
                .with_pull_expiry(pull_expiry),
        )
        .build()
        .unwrap()
    };
    // The first delivery meets the key held elsewhere: nak'ed, back in 3 s (after this runner
    // ended, its pulls lasting 1 s).
    let first = runner(client.clone(), Duration::from_secs(1));
    let stats = first.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(first.run(stop.clone().cancelled_owned()));
    let watched = Arc::clone(&stats);
    let naked = run_until(task, stop, Duration::from_secs(10), move || {
        let s = Arc::clone(&watched);
        Box::pin(async move { s.naks() == 1 })
    })
    .await;
    assert!(naked, "{stats:?}");
    store.release(&held).await.unwrap();
    // A second runner waits in a pull, and is told to stop before the redelivery comes: it
    // reads that pull to its end, and the redelivery (the last allowed) arrives in it.
    let second = runner(client, Duration::from_secs(8));
    let stats = second.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(second.run(stop.clone().cancelled_owned()));
    let waiting = wait_for(Duration::from_secs(10), || {
        let js = js.clone();
        let name = name.clone();
        async move {
            let s = js.get_stream(&name).await.expect("stream");
            let mut c: idem_nats::async_nats::jetstream::consumer::PullConsumer =
                s.get_consumer("workers").await.expect("consumer");
            c.info().await.expect("consumer info").num_waiting > 0
        }
    })
    .await;
    assert!(waiting, "the second runner pulls");
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("drained in time")
        .unwrap()
        .expect("run");
    assert_eq!(stats.executed(), 1, "{stats:?}");
    assert_eq!(stats.naks(), 0, "{stats:?}");
    assert!(matches!(
        store.get(&key).await.unwrap().map(|r| r.state),
        Some(RecordState::Completed { .. })
    ));
    assert_eq!(consumer_state(&js, &name, "workers").await, (0, 0));
    delete_streams(&js, &name).await;
}

/// Runs a runner (`run`, given the stop signal) until `stats` count `n` messages executed (at
/// most 30 s), then stops it and waits for its drain.
async fn run_until_executed<F, Fut>(stats: &Arc<RunnerStats>, n: u64, run: F)
where
    F: FnOnce(WaitForCancellationFutureOwned) -> Fut,
    Fut: std::future::Future<Output = Result<(), idem_nats::RunnerError>> + Send + 'static,
{
    let stop = CancellationToken::new();
    let task = tokio::spawn(run(stop.clone().cancelled_owned()));
    let watched = Arc::clone(stats);
    let done = run_until(task, stop, Duration::from_secs(30), move || {
        let s = Arc::clone(&watched);
        Box::pin(async move { s.executed() == n })
    })
    .await;
    assert!(done, "{stats:?}");
}

/// Fresh streams named after `kind` holding `n` messages keyed `{letter}0`, `{letter}1`, ...
/// (payload `{"n":i}`), and a Redis store of the test's own; `None` without the servers.
async fn published(
    kind: &str,
    letter: &str,
    n: usize,
) -> Option<(
    idem_nats::async_nats::Client,
    idem_nats::async_nats::jetstream::Context,
    String,
    idem_core::DynStore,
)> {
    let (client, js, name) = streams_for(kind).await?;
    let msgs: Vec<Msg> = (0..n)
        .map(|i| Msg::keyed(&format!("{letter}{i}"), format!(r#"{{"n":{i}}}"#)))
        .collect();
    publish(&js, &name, &msgs).await;
    let store = shared(redis_store(&format!("{}:", unique(&format!("idem-nats-{kind}")))).await);
    Some((client, js, name, store))
}

/// Shutdown drains: the handlers in process finish and are acknowledged, nothing else starts,
/// and what was not processed is still pending for the consumer, with no key left in progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_in_flight_messages() {
    let Some((client, js, name, store)) = published("drain", "d", 20).await else {
        return;
    };
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
    // The naks of the buffered messages are not confirmed by the server: wait for them to land.
    let expected = (20 - ran, 0);
    let (js2, name2) = (js.clone(), name.clone());
    wait_for(Duration::from_secs(10), || {
        let (js, name) = (js2.clone(), name2.clone());
        async move { consumer_state(&js, &name, "workers").await == expected }
    })
    .await;
    assert_eq!(
        consumer_state(&js, &name, "workers").await,
        expected,
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

/// At most `max_in_flight` handlers run at once, and the runner does fill its slots: a slot is
/// freed as its message's ack is sent (before the server confirms it), never earlier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_run_at_most_max_in_flight_at_once() {
    let Some((client, js, name, store)) = published("in-flight", "f", 120).await else {
        return;
    };
    let running = Arc::new(AtomicU32::new(0));
    let most = Arc::new(AtomicU32::new(0));
    let (now, peak) = (Arc::clone(&running), Arc::clone(&most));
    let handler = move |_msg: NatsMessage, _ctx: HandlerContext| {
        let (now, peak) = (Arc::clone(&now), Arc::clone(&peak));
        async move {
            let at_once = now.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(at_once, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(20)).await;
            now.fetch_sub(1, Ordering::SeqCst);
            Ok::<_, HandlerError>(1u8)
        }
    };
    let runner = NatsRunner::builder(
        client,
        &name,
        "workers",
        executor(store, ExecutorConfig::new("in-flight")),
        handler,
    )
    .options(options().with_max_in_flight(8))
    .build()
    .unwrap();
    let stats = runner.stats();
    run_until_executed(&stats, 120, |stop| runner.run(stop)).await;
    assert_eq!(
        most.load(Ordering::SeqCst),
        8,
        "handlers at once: never more than max_in_flight, and that many reached"
    );
    assert_eq!(consumer_state(&js, &name, "workers").await, (0, 0));
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
    run_until_executed(&stats, 200, |stop| runner.run(stop)).await;
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
