//! The runner against a real Kafka-protocol broker (`IDEM_KAFKA_BROKERS`, default
//! `127.0.0.1:9092`; start one with `scripts/services.sh kafka`) and Redis (`IDEM_REDIS_URL`).
//! Without them every test returns at once after one "skipped" line; with `CI=true` a missing
//! server fails the test.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use common::*;
use idem_core::{IdempotencyStore, MemoryStore, RecordState};
use idem_executor::KeySource;
use idem_executor::{ExecutorConfig, HandlerContext, HandlerError};
use idem_kafka::{KafkaMessage, KafkaRunner, RunnerOptions};
use tokio::sync::oneshot;

fn fast_options() -> RunnerOptions {
    RunnerOptions::default()
        .with_commit_interval(Duration::from_millis(100))
        .with_retry_delays(Duration::from_millis(20), Duration::from_millis(500))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_each_key_once_and_commits_to_the_end() {
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    let topic = unique("basic");
    let group = unique("g");
    create_topic(&topic, 3).await;
    let mut recs = Vec::new();
    for i in 0..30 {
        recs.push(Rec::keyed(
            i % 3,
            &format!("k{i}"),
            format!("{{\"n\":{i}}}"),
        ));
    }
    // duplicates
    for i in 0..10 {
        recs.push(Rec::keyed(
            i % 3,
            &format!("k{i}"),
            format!("{{\"n\":{i}}}"),
        ));
    }
    let ends = ends(&produce(&topic, &recs).await);

    let store = shared(redis_store(&unique("idem-kafka-test")).await);
    let runs = Arc::new(AtomicU32::new(0));
    let r = Arc::clone(&runs);
    let handler = move |msg: KafkaMessage, _ctx: HandlerContext| {
        let r = Arc::clone(&r);
        async move {
            r.fetch_add(1, Ordering::SeqCst);
            Ok::<_, HandlerError>(msg.payload().len())
        }
    };
    let runner = KafkaRunner::builder(
        consumer_config(&group),
        executor(store, ExecutorConfig::new("basic")),
        handler,
    )
    .topic(&topic)
    .options(fast_options())
    .build()
    .unwrap();
    let stats = runner.stats();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let task = tokio::spawn(runner.run(async {
        let _ = stop_rx.await;
    }));
    let started = Instant::now();
    let done = wait_for(Duration::from_secs(60), || {
        let s = Arc::clone(&stats);
        async move { s.resolved() >= 40 }
    })
    .await;
    assert!(
        done,
        "resolved {} of 40 in {:?}",
        stats.resolved(),
        started.elapsed()
    );
    stop_tx.send(()).unwrap();
    task.await.unwrap().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 30);
    assert_eq!((stats.executed(), stats.replayed()), (30, 10));
    let committed = committed(&group, &topic, 3);
    assert_eq!(
        committed, ends,
        "committed offsets at the end of each partition"
    );
}

/// Starts `runner` in the background; returns the stop signal and the task.
fn start<H, T>(
    runner: KafkaRunner<H, T>,
) -> (
    oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), idem_kafka::RunnerError>>,
)
where
    H: idem_kafka::Handler<KafkaMessage, T>,
    T: serde::Serialize + serde::de::DeserializeOwned + Send + 'static,
{
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let task = tokio::spawn(runner.run(async {
        let _ = stop_rx.await;
    }));
    (stop_tx, task)
}

async fn stop(
    (tx, task): (
        oneshot::Sender<()>,
        tokio::task::JoinHandle<Result<(), idem_kafka::RunnerError>>,
    ),
) {
    let _ = tx.send(());
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("runner stops within 30 s")
        .unwrap()
        .unwrap();
}

async fn resolved_at_least(stats: &Arc<idem_kafka::RunnerStats>, n: u64, timeout: Duration) {
    let ok = wait_for(timeout, || {
        let s = Arc::clone(stats);
        async move { s.resolved() >= n }
    })
    .await;
    assert!(
        ok,
        "resolved {} of {n} within {timeout:?}: {stats:?}",
        stats.resolved()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_message_is_dead_lettered_after_max_attempts_without_blocking_its_partition() {
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    let topic = unique("poison");
    let group = unique("g");
    create_topic(&topic, 1).await;
    create_topic(&format!("{topic}.dlq"), 1).await;
    let mut poison = Rec::keyed(0, "poison", "{\"always\":\"fails\"}");
    poison.headers.push(("trace-id".into(), "t-1".into()));
    let keyless = Rec {
        partition: 0,
        key: None,
        value: "no key".into(),
        headers: vec![],
    };
    let mut recs = vec![poison, Rec::keyed(0, "bad", "{\"terminal\":true}"), keyless];
    for i in 0..5 {
        recs.push(Rec::keyed(0, &format!("ok{i}"), "{}"));
    }
    let ends = ends(&produce(&topic, &recs).await);

    let store = shared(redis_store(&unique("idem-kafka-test")).await);
    let poison_runs = Arc::new(AtomicU32::new(0));
    let p = Arc::clone(&poison_runs);
    let handler = move |msg: KafkaMessage, _ctx: HandlerContext| {
        let p = Arc::clone(&p);
        async move {
            match msg.key() {
                Some(b"poison") => {
                    p.fetch_add(1, Ordering::SeqCst);
                    Err(HandlerError::retryable(std::io::Error::other(
                        "downstream says no",
                    )))
                }
                Some(b"bad") => Err(HandlerError::terminal(std::io::Error::other(
                    "malformed amount",
                ))),
                _ => Ok(()),
            }
        }
    };
    let config = ExecutorConfig::new("poison")
        .with_max_attempts(3)
        .with_retry_delay(Duration::from_millis(50));
    let runner = KafkaRunner::builder(
        consumer_config(&group),
        executor(store.clone(), config),
        handler,
    )
    .topic(&topic)
    .options(fast_options())
    .build()
    .unwrap();
    let stats = runner.stats();
    let running = start(runner);
    resolved_at_least(&stats, 8, Duration::from_secs(60)).await;
    stop(running).await;

    assert_eq!(
        poison_runs.load(Ordering::SeqCst),
        3,
        "ran max_attempts times"
    );
    assert_eq!(
        (stats.executed(), stats.dead_lettered()),
        (5, 3),
        "{stats:?}"
    );
    assert_eq!(committed(&group, &topic, 1), ends);

    let dlq = read_topic(&format!("{topic}.dlq"), 3, Duration::from_secs(20)).await;
    assert_eq!(dlq.len(), 3, "three dead-letter records");
    use idem_kafka::rdkafka::message::Message as _;
    let p = dlq
        .iter()
        .find(|m| m.key() == Some(b"poison"))
        .expect("poison dead-lettered");
    assert_eq!(
        p.payload(),
        Some(&b"{\"always\":\"fails\"}"[..]),
        "original value"
    );
    assert_eq!(
        header(p, "idempotency-key").as_deref(),
        Some("poison"),
        "original headers"
    );
    assert_eq!(header(p, "trace-id").as_deref(), Some("t-1"));
    assert_eq!(
        header(p, idem_kafka::HEADER_REASON).as_deref(),
        Some("exhausted")
    );
    assert_eq!(header(p, idem_kafka::HEADER_ATTEMPTS).as_deref(), Some("3"));
    assert_eq!(
        header(p, idem_kafka::HEADER_ERROR).as_deref(),
        Some("downstream says no")
    );
    assert_eq!(header(p, idem_kafka::HEADER_KEY).as_deref(), Some("poison"));
    assert_eq!(
        header(p, idem_kafka::HEADER_SOURCE_TOPIC).as_deref(),
        Some(topic.as_str())
    );
    assert_eq!(
        header(p, idem_kafka::HEADER_SOURCE_OFFSET).as_deref(),
        Some("0")
    );
    let b = dlq
        .iter()
        .find(|m| m.key() == Some(b"bad"))
        .expect("terminal failure dead-lettered");
    assert_eq!(
        header(b, idem_kafka::HEADER_REASON).as_deref(),
        Some("failed")
    );
    assert_eq!(header(b, idem_kafka::HEADER_ATTEMPTS).as_deref(), Some("1"));
    assert_eq!(
        header(b, idem_kafka::HEADER_ERROR).as_deref(),
        Some("malformed amount")
    );
    let k = dlq
        .iter()
        .find(|m| m.key().is_none())
        .expect("keyless record dead-lettered");
    assert_eq!(k.payload(), Some(&b"no key"[..]));
    assert_eq!(
        header(k, idem_kafka::HEADER_REASON).as_deref(),
        Some("missing_key")
    );
    assert_eq!(header(k, idem_kafka::HEADER_ATTEMPTS).as_deref(), Some("0"));
    assert_eq!(header(k, idem_kafka::HEADER_KEY), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_slower_than_the_lease_keeps_it_and_the_duplicate_waits_paused() {
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    let topic = unique("slow");
    let group = unique("g");
    create_topic(&topic, 2).await;
    // The same delivery twice, on two partitions, so both copies are in process at once.
    let recs = vec![Rec::keyed(0, "slow", "{}"), Rec::keyed(1, "slow", "{}")];
    let ends = ends(&produce(&topic, &recs).await);

    let store = shared(redis_store(&unique("idem-kafka-test")).await);
    let runs = Arc::new(AtomicU32::new(0));
    let tokens = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (r, t) = (Arc::clone(&runs), Arc::clone(&tokens));
    let handler = move |_msg: KafkaMessage, ctx: HandlerContext| {
        let (r, t) = (Arc::clone(&r), Arc::clone(&t));
        async move {
            r.fetch_add(1, Ordering::SeqCst);
            t.lock().unwrap().push(ctx.token().unwrap());
            // Three leases long: only heartbeats keep the key.
            tokio::time::sleep(Duration::from_secs(3)).await;
            Ok::<_, HandlerError>("done".to_owned())
        }
    };
    // Heartbeats every 100 ms: a stall shorter than about 800 ms (a loaded machine) keeps the
    // lease.
    let config = ExecutorConfig::new("slow")
        .with_lease_ttl(Duration::from_secs(1))
        .with_heartbeat_interval(Duration::from_millis(100));
    let runner = KafkaRunner::builder(
        consumer_config(&group),
        executor(store.clone(), config),
        handler,
    )
    .topic(&topic)
    .options(fast_options())
    .build()
    .unwrap();
    let stats = runner.stats();
    let started = Instant::now();
    let running = start(runner);
    resolved_at_least(&stats, 2, Duration::from_secs(60)).await;
    let elapsed = started.elapsed();
    stop(running).await;

    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "no takeover: the handler ran once"
    );
    assert_eq!((stats.executed(), stats.replayed()), (1, 1), "{stats:?}");
    assert!(
        stats.retries() >= 1,
        "the duplicate met InProgress and waited: {stats:?}"
    );
    assert!(
        stats.retries() <= 20,
        "it waited paused, it did not spin: {stats:?}"
    );
    assert!(elapsed >= Duration::from_secs(3), "{elapsed:?}");
    let key = idem_core::Namespace::new("slow")
        .unwrap()
        .key("slow")
        .unwrap();
    let record = store.get(&key).await.unwrap().expect("record");
    assert!(
        matches!(record.state, RecordState::Completed { .. }),
        "{record:?}"
    );
    assert_eq!(record.attempts, 1, "{record:?}");
    assert_eq!(
        record.token,
        tokens.lock().unwrap()[0],
        "the lease was never taken over"
    );
    assert_eq!(committed(&group, &topic, 2), ends);
}

/// What consumer A's handler does with the "held" record when its partition is revoked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OnRevoke {
    /// Watches its context's cancellation token and returns (a retryable error) when signalled.
    HonoursCancellation,
    /// Ignores the signal: the runner has to drop it.
    Ignores,
}

/// Consumer A blocks on "held" until it is revoked by consumer B joining. The lease is never
/// released once A's handler started: either A's result is recorded (it honours the cancellation
/// signal: B runs attempt 2 at once) or the lease expires (B takes it over as attempt 2).
async fn revoked_running_handler(on_revoke: OnRevoke, lease_ttl: Duration) {
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    let topic = unique("revoke");
    let group = unique("g");
    create_topic(&topic, 2).await;
    let recs = vec![
        Rec::keyed(0, "held", "{}"),
        Rec::keyed(1, "other-1", "{}"),
        Rec::keyed(1, "other-2", "{}"),
    ];
    let ends = ends(&produce(&topic, &recs).await);
    let store = shared(redis_store(&unique("idem-kafka-test")).await);
    let config = ExecutorConfig::new("revoke")
        .with_lease_ttl(lease_ttl)
        .with_heartbeat_interval(lease_ttl / 4);
    let options = fast_options()
        .with_revoke_timeout(Duration::from_secs(2))
        .with_release_timeout(Duration::from_millis(500));

    let a_runs = Arc::new(AtomicU32::new(0));
    // (attempt, takeover) of the runs of "held" after the revoked one, by either consumer.
    let later_runs = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (entered_tx, entered_rx) = tokio::sync::watch::channel(false);
    let a = Arc::clone(&a_runs);
    let seen_a = Arc::clone(&later_runs);
    let handler_a = move |msg: KafkaMessage, ctx: HandlerContext| {
        let a = Arc::clone(&a);
        let seen = Arc::clone(&seen_a);
        let entered = entered_tx.clone();
        async move {
            let first = msg.key() == Some(b"held") && a.fetch_add(1, Ordering::SeqCst) == 0;
            if msg.key() == Some(b"held") && !first {
                seen.lock()
                    .unwrap()
                    .push((ctx.attempt(), ctx.is_takeover()));
            }
            if first {
                let _ = entered.send(true);
                match on_revoke {
                    OnRevoke::HonoursCancellation => {
                        ctx.cancellation_token().cancelled().await;
                        return Err(HandlerError::retryable("cancelled: partition revoked"));
                    }
                    OnRevoke::Ignores => std::future::pending::<()>().await,
                }
            }
            Ok::<_, HandlerError>("a".to_owned())
        }
    };
    let runner_a = KafkaRunner::builder(
        consumer_config(&group),
        executor(store.clone(), config.clone().with_owner("consumer-a")),
        handler_a,
    )
    .topic(&topic)
    .options(options.clone())
    .build()
    .unwrap();
    let stats_a = runner_a.stats();
    let running_a = start(runner_a);
    let mut entered = entered_rx;
    tokio::time::timeout(Duration::from_secs(30), entered.wait_for(|e| *e))
        .await
        .expect("A starts the held record")
        .unwrap();

    let b_runs = Arc::new(AtomicU32::new(0));
    let (b, seen) = (Arc::clone(&b_runs), Arc::clone(&later_runs));
    let handler_b = move |msg: KafkaMessage, ctx: HandlerContext| {
        let b = Arc::clone(&b);
        let seen = Arc::clone(&seen);
        async move {
            if msg.key() == Some(b"held") {
                b.fetch_add(1, Ordering::SeqCst);
                seen.lock()
                    .unwrap()
                    .push((ctx.attempt(), ctx.is_takeover()));
            }
            Ok::<_, HandlerError>("b".to_owned())
        }
    };
    let runner_b = KafkaRunner::builder(
        consumer_config(&group),
        executor(store.clone(), config.clone().with_owner("consumer-b")),
        handler_b,
    )
    .topic(&topic)
    .options(options)
    .build()
    .unwrap();
    let stats_b = runner_b.stats();
    let joined = Instant::now();
    let running_b = start(runner_b);

    let key = idem_core::Namespace::new("revoke")
        .unwrap()
        .key("held")
        .unwrap();
    let s = store.clone();
    let k = key.clone();
    let completed = wait_for(Duration::from_secs(40), || {
        let (s, k) = (s.clone(), k.clone());
        async move {
            matches!(s.get(&k).await, Ok(Some(r)) if matches!(r.state, RecordState::Completed { .. }))
        }
    })
    .await;
    let took = joined.elapsed();
    assert!(
        completed,
        "{on_revoke:?}: the held key completed after the rebalance: A {stats_a:?} B {stats_b:?}"
    );
    assert_eq!(
        stats_a.released(),
        0,
        "{on_revoke:?}: a handler that started never has its lease released: {stats_a:?}"
    );
    let record = store.get(&key).await.unwrap().unwrap();
    assert_eq!(
        record.attempts, 2,
        "{on_revoke:?}: the revoked run counted as attempt 1: {record:?}"
    );
    let second_runs = a_runs.load(Ordering::SeqCst) - 1 + b_runs.load(Ordering::SeqCst);
    assert_eq!(
        second_runs, 1,
        "{on_revoke:?}: exactly one owner ran it after the revocation"
    );
    let takeover = on_revoke == OnRevoke::Ignores;
    assert_eq!(
        later_runs.lock().unwrap().clone(),
        vec![(2, takeover)],
        "{on_revoke:?}: the next owner sees attempt 2 (a takeover when A's run was dropped)"
    );
    eprintln!(
        "{on_revoke:?}: held key completed {took:?} after B joined, by {} (A runs {}, B runs {})",
        record.owner,
        a_runs.load(Ordering::SeqCst),
        b_runs.load(Ordering::SeqCst)
    );
    let both = Arc::clone(&stats_a);
    let sb = Arc::clone(&stats_b);
    assert!(
        wait_for(Duration::from_secs(20), || {
            let (a, b) = (Arc::clone(&both), Arc::clone(&sb));
            let (group, topic) = (group.clone(), topic.clone());
            let ends = ends.clone();
            async move {
                let _ = (a, b);
                tokio::task::spawn_blocking(move || committed(&group, &topic, 2) == ends)
                    .await
                    .unwrap()
            }
        })
        .await,
        "committed offsets reach the end of both partitions"
    );
    stop(running_b).await;
    stop(running_a).await;
    if on_revoke == OnRevoke::HonoursCancellation {
        assert!(
            took < lease_ttl / 2,
            "no wait for the lease to expire: {took:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoked_handler_that_honours_cancellation_is_recorded_and_the_next_owner_runs_at_once() {
    // A 60 s lease: waiting for it to expire would blow the test's time limits, so completing
    // shows that no expiry was waited for.
    revoked_running_handler(OnRevoke::HonoursCancellation, Duration::from_secs(60)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoked_handler_that_ignores_cancellation_is_dropped_and_its_lease_expires() {
    revoked_running_handler(OnRevoke::Ignores, Duration::from_secs(4)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_stops_the_runner_instead_of_stalling_its_partition() {
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    let topic = unique("dead");
    create_topic(&topic, 1).await;
    let recs = vec![Rec::keyed(0, "fine", "{}"), Rec::keyed(0, "boom", "{}")];
    produce(&topic, &recs).await;
    let store = shared(redis_store(&unique("idem-kafka-test")).await);
    // A key source that panics inside the executor's call (which catches handler panics only),
    // not when the runner reads the key first (that panic dead-letters the record): the
    // partition's worker task dies.
    let calls = Arc::new(AtomicU32::new(0));
    let source = KeySource::from_fn(move |m| {
        let key = std::str::from_utf8(m.message_key()?).ok()?.to_owned();
        if key == "boom" && calls.fetch_add(1, Ordering::SeqCst) > 0 {
            panic!("key source panics on purpose");
        }
        Some(key)
    });
    let handler = |_msg: KafkaMessage, _ctx: HandlerContext| async { Ok::<_, HandlerError>(()) };
    let runner = KafkaRunner::builder(
        consumer_config(&unique("g")),
        executor(store, ExecutorConfig::new("dead").with_key_source(source)),
        handler,
    )
    .topic(&topic)
    // One record per batch: the first record is processed before the second kills the worker.
    .options(fast_options().with_max_batch(1))
    .build()
    .unwrap();
    let stats = runner.stats();
    let (_tx, task) = start(runner);
    let result = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the runner stops by itself")
        .unwrap();
    assert!(
        matches!(
            &result,
            Err(idem_kafka::RunnerError::WorkerDied { partition: 0, .. })
        ),
        "{result:?}"
    );
    assert_eq!(stats.executed(), 1, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_outage_pauses_the_partition_and_commits_nothing_until_it_is_back() {
    if !kafka_only() {
        return;
    }
    init_tracing();
    let topic = unique("outage");
    let group = unique("g");
    create_topic(&topic, 1).await;
    let recs: Vec<Rec> = (0..50)
        .map(|i| Rec::keyed(0, &format!("k{i}"), "{}"))
        .collect();
    let ends = ends(&produce(&topic, &recs).await);
    let memory = MemoryStore::new();
    memory.set_available(false);
    let store = shared(memory.clone());
    let config = ExecutorConfig::new("outage").with_retry_delay(Duration::from_millis(200));
    let handler = |_msg: KafkaMessage, _ctx: HandlerContext| async { Ok::<_, HandlerError>(()) };
    let runner = KafkaRunner::builder(consumer_config(&group), executor(store, config), handler)
        .topic(&topic)
        .options(fast_options().with_max_buffered_per_partition(4))
        .build()
        .unwrap();
    let stats = runner.stats();
    let running = start(runner);
    // Wait until the runner met the outage, then watch it for two seconds.
    assert!(
        wait_for(Duration::from_secs(30), || {
            let s = Arc::clone(&stats);
            async move { s.retries() >= 1 }
        })
        .await
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(stats.resolved(), 0, "{stats:?}");
    assert!(
        stats.retries() <= 15,
        "one try per hinted delay (200 ms), no spinning: {stats:?}"
    );
    assert!(
        stats.received() <= 4 + 2,
        "the paused partition stopped fetching at the buffer bound: {stats:?}"
    );
    assert_eq!(
        committed(&group, &topic, 1).get(&0),
        Some(&-1),
        "nothing committed"
    );

    memory.set_available(true);
    resolved_at_least(&stats, 50, Duration::from_secs(60)).await;
    stop(running).await;
    assert_eq!(stats.executed(), 50, "{stats:?}");
    assert_eq!(committed(&group, &topic, 1), ends);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_the_record_in_process_and_commits_what_finished() {
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    let topic = unique("drain");
    let group = unique("g");
    create_topic(&topic, 1).await;
    let recs: Vec<Rec> = (0..3)
        .map(|i| Rec::keyed(0, &format!("k{i}"), "{}"))
        .collect();
    let ends = ends(&produce(&topic, &recs).await);
    let store = shared(redis_store(&unique("idem-kafka-test")).await);
    let runs = Arc::new(AtomicU32::new(0));
    let (entered_tx, mut entered_rx) = tokio::sync::watch::channel(0u32);
    // The slow handler runs until the test lets it finish, a second after the stop.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let make_handler = |slow: bool| {
        let r = Arc::clone(&runs);
        let entered = entered_tx.clone();
        let gate = Arc::clone(&gate);
        move |_msg: KafkaMessage, _ctx: HandlerContext| {
            let r = Arc::clone(&r);
            let entered = entered.clone();
            let gate = Arc::clone(&gate);
            async move {
                let n = r.fetch_add(1, Ordering::SeqCst) + 1;
                let _ = entered.send(n);
                if slow {
                    gate.acquire().await.expect("gate open").forget();
                }
                Ok::<_, HandlerError>(())
            }
        }
    };
    let runner = KafkaRunner::builder(
        consumer_config(&group),
        executor(store.clone(), ExecutorConfig::new("drain")),
        make_handler(true),
    )
    .topic(&topic)
    // One record per batch, so that exactly one is in process at the shutdown. The drain and
    // the final stop of the partitions' workers have no time limit (`Duration::MAX`): they
    // wait, where a deadline taken as `now + timeout` would panic.
    .options(
        fast_options()
            .with_commit_interval(Duration::from_secs(60))
            .with_max_batch(1)
            .with_drain_timeout(Duration::MAX)
            .with_revoke_timeout(Duration::MAX),
    )
    .build()
    .unwrap();
    let stats = runner.stats();
    let (tx, task) = start(runner);
    tokio::time::timeout(Duration::from_secs(30), entered_rx.wait_for(|n| *n >= 1))
        .await
        .expect("first record started")
        .unwrap();
    let asked = Instant::now();
    tx.send(()).unwrap();
    let release = Arc::clone(&gate);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        release.add_permits(1);
    });
    task.await.unwrap().unwrap();
    assert!(
        asked.elapsed() >= Duration::from_millis(1000),
        "waited for the record in process"
    );
    assert_eq!(
        (stats.executed(), runs.load(Ordering::SeqCst)),
        (1, 1),
        "{stats:?}"
    );
    // The commit interval is long: only the shutdown commit can have committed offset 1.
    assert_eq!(committed(&group, &topic, 1).get(&0), Some(&1));

    // A new runner in the same group continues after the committed record.
    let runner = KafkaRunner::builder(
        consumer_config(&group),
        executor(store, ExecutorConfig::new("drain")),
        make_handler(false),
    )
    .topic(&topic)
    .options(fast_options())
    .build()
    .unwrap();
    let stats = runner.stats();
    let running = start(runner);
    resolved_at_least(&stats, 2, Duration::from_secs(30)).await;
    stop(running).await;
    assert_eq!((stats.executed(), stats.replayed()), (2, 0), "{stats:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    assert_eq!(committed(&group, &topic, 1), ends);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_from_the_record_key_or_a_closure() {
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    let topic = unique("keys");
    create_topic(&topic, 1).await;
    let rec = |key: &str, value: &str| Rec {
        partition: 0,
        key: Some(key.to_owned()),
        value: value.to_owned(),
        headers: vec![("tenant".into(), "acme".into())],
    };
    let recs = vec![
        rec("a", "1"),
        rec("b", "2"),
        rec("a", "1"),
        rec("a", "other"),
    ];
    produce(&topic, &recs).await;
    create_topic(&format!("{topic}.dlq"), 1).await;
    for (name, source) in [
        ("record-key", KeySource::message_key()),
        (
            "closure",
            KeySource::from_fn(|m| {
                let tenant = std::str::from_utf8(m.header("tenant")?).ok()?;
                let key = std::str::from_utf8(m.message_key()?).ok()?;
                Some(format!("{tenant}/{key}"))
            }),
        ),
    ] {
        let store = shared(redis_store(&unique("idem-kafka-test")).await);
        let handler = |msg: KafkaMessage, _ctx: HandlerContext| async move {
            Ok::<_, HandlerError>(msg.payload().to_vec())
        };
        let config = ExecutorConfig::new("keys").with_key_source(source);
        let runner = KafkaRunner::builder(
            consumer_config(&unique("g")),
            executor(store.clone(), config),
            handler,
        )
        .topic(&topic)
        .options(fast_options())
        .build()
        .unwrap();
        let stats = runner.stats();
        let running = start(runner);
        resolved_at_least(&stats, 4, Duration::from_secs(30)).await;
        stop(running).await;
        assert_eq!(
            (stats.executed(), stats.replayed(), stats.dead_lettered()),
            (2, 1, 1),
            "{name}: {stats:?}"
        );
        let id = if name == "closure" { "acme/a" } else { "a" };
        let key = idem_core::Namespace::new("keys").unwrap().key(id).unwrap();
        assert!(
            store.get(&key).await.unwrap().is_some(),
            "{name}: key {id} stored"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_is_bounded_across_partitions_and_order_kept_within_each() {
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    let topic = unique("order");
    let group = unique("g");
    create_topic(&topic, 3).await;
    let recs: Vec<Rec> = (0..60)
        .map(|i| Rec::keyed(i % 3, &format!("k{i}"), "{}"))
        .collect();
    let ends = ends(&produce(&topic, &recs).await);
    let store = shared(redis_store(&unique("idem-kafka-test")).await);
    let in_flight = Arc::new(AtomicU32::new(0));
    let max_seen = Arc::new(AtomicU32::new(0));
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (f, m, o) = (
        Arc::clone(&in_flight),
        Arc::clone(&max_seen),
        Arc::clone(&order),
    );
    let handler = move |msg: KafkaMessage, _ctx: HandlerContext| {
        let (f, m, o) = (Arc::clone(&f), Arc::clone(&m), Arc::clone(&o));
        async move {
            let now = f.fetch_add(1, Ordering::SeqCst) + 1;
            m.fetch_max(now, Ordering::SeqCst);
            o.lock().unwrap().push((msg.partition(), msg.offset()));
            tokio::time::sleep(Duration::from_millis(10)).await;
            f.fetch_sub(1, Ordering::SeqCst);
            Ok::<_, HandlerError>(())
        }
    };
    let runner = KafkaRunner::builder(
        consumer_config(&group),
        executor(store, ExecutorConfig::new("order")),
        handler,
    )
    .topic(&topic)
    // One record per batch: strictly one record at a time within each partition.
    .options(fast_options().with_max_in_flight(2).with_max_batch(1))
    .build()
    .unwrap();
    let stats = runner.stats();
    let running = start(runner);
    resolved_at_least(&stats, 60, Duration::from_secs(60)).await;
    stop(running).await;
    let max = max_seen.load(Ordering::SeqCst);
    assert_eq!(
        max, 2,
        "at most max_in_flight at once, and partitions did run in parallel"
    );
    let order = order.lock().unwrap();
    for p in 0..3 {
        let offsets: Vec<i64> = order
            .iter()
            .filter(|(q, _)| *q == p)
            .map(|(_, o)| *o)
            .collect();
        assert_eq!(
            offsets,
            (0..20).collect::<Vec<i64>>(),
            "partition {p} ran in offset order"
        );
    }
    assert_eq!(committed(&group, &topic, 3), ends);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_dead_letter_topic_keeps_the_record_unresolved_until_it_exists() {
    if !kafka_only() {
        return;
    }
    init_tracing();
    let topic = unique("nodlq");
    let group = unique("g");
    create_topic(&topic, 1).await;
    // A record without a key (dead-lettered as `missing_key`), then a good one behind it.
    let keyless = Rec {
        partition: 0,
        key: None,
        value: "no key".into(),
        headers: vec![],
    };
    let ends = ends(&produce(&topic, &[keyless, Rec::keyed(0, "ok", "{}")]).await);
    let store = shared(MemoryStore::new());
    let handler = |_msg: KafkaMessage, _ctx: HandlerContext| async { Ok::<_, HandlerError>(()) };
    // Tansu creates a topic on a producer's first write unless the producer asks it not to.
    let mut producer = idem_kafka::rdkafka::ClientConfig::new();
    producer
        .set("bootstrap.servers", brokers())
        .set("allow.auto.create.topics", "false");
    let runner = KafkaRunner::builder(
        consumer_config(&group),
        executor(store, ExecutorConfig::new("nodlq")),
        handler,
    )
    .topic(&topic)
    .producer_config(producer)
    .options(fast_options().with_dead_letter_timeout(Duration::from_secs(1)))
    .build()
    .unwrap();
    let stats = runner.stats();
    let running = start(runner);
    assert!(
        wait_for(Duration::from_secs(30), || {
            let s = Arc::clone(&stats);
            async move { s.retries() >= 2 }
        })
        .await,
        "the dead-letter write failed and was tried again: {stats:?}"
    );
    assert_eq!(stats.resolved(), 0, "nothing resolved past it: {stats:?}");
    assert_eq!(
        committed(&group, &topic, 1).get(&0),
        Some(&-1),
        "nothing committed"
    );

    create_topic(&format!("{topic}.dlq"), 1).await;
    resolved_at_least(&stats, 2, Duration::from_secs(60)).await;
    stop(running).await;
    assert_eq!(
        (stats.dead_lettered(), stats.executed()),
        (1, 1),
        "{stats:?}"
    );
    assert_eq!(committed(&group, &topic, 1), ends);
    let dlq = read_topic(&format!("{topic}.dlq"), 1, Duration::from_secs(20)).await;
    assert_eq!(dlq.len(), 1);
    assert_eq!(
        header(&dlq[0], idem_kafka::HEADER_REASON).as_deref(),
        Some("missing_key")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_runs_its_batches_concurrently_keeps_each_key_in_order_and_commits_in_order() {
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    let topic = unique("batch");
    let group = unique("g");
    create_topic(&topic, 1).await;
    // 40 keys, then the first 10 again, then a key met three times in a row.
    let mut recs: Vec<Rec> = (0..40)
        .map(|i| Rec::keyed(0, &format!("k{i}"), format!("{{\"n\":{i}}}")))
        .collect();
    recs.extend((0..10).map(|i| Rec::keyed(0, &format!("k{i}"), format!("{{\"n\":{i}}}"))));
    recs.extend((0..3).map(|_| Rec::keyed(0, "again", "{}")));
    let ends = ends(&produce(&topic, &recs).await);
    let store = shared(redis_store(&unique("idem-kafka-test")).await);
    let in_flight = Arc::new(AtomicU32::new(0));
    let max_seen = Arc::new(AtomicU32::new(0));
    let runs = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (f, m, r) = (
        Arc::clone(&in_flight),
        Arc::clone(&max_seen),
        Arc::clone(&runs),
    );
    let handler = move |msg: KafkaMessage, _ctx: HandlerContext| {
        let (f, m, r) = (Arc::clone(&f), Arc::clone(&m), Arc::clone(&r));
        async move {
            let now = f.fetch_add(1, Ordering::SeqCst) + 1;
            m.fetch_max(now, Ordering::SeqCst);
            let key = String::from_utf8(msg.key().unwrap().to_vec()).unwrap();
            r.lock().unwrap().push((key, msg.offset()));
            tokio::time::sleep(Duration::from_millis(20)).await;
            f.fetch_sub(1, Ordering::SeqCst);
            Ok::<_, HandlerError>(())
        }
    };
    let runner = KafkaRunner::builder(
        consumer_config(&group),
        executor(store, ExecutorConfig::new("batch")),
        handler,
    )
    .topic(&topic)
    .options(fast_options())
    .build()
    .unwrap();
    let stats = runner.stats();
    let running = start(runner);
    resolved_at_least(&stats, recs.len() as u64, Duration::from_secs(60)).await;
    stop(running).await;
    assert_eq!((stats.executed(), stats.replayed()), (41, 12), "{stats:?}");
    assert!(
        max_seen.load(Ordering::SeqCst) > 1,
        "handlers of one partition's batch ran at once"
    );
    let runs = runs.lock().unwrap();
    let mut keys: Vec<&str> = runs.iter().map(|(k, _)| k.as_str()).collect();
    keys.sort_unstable();
    let before = keys.len();
    keys.dedup();
    assert_eq!(before, keys.len(), "each key ran once: {runs:?}");
    // In order: each key ran for its first record (k0..k39 at offsets 0..39, "again" at 50),
    // never for a later copy.
    for (key, offset) in runs.iter() {
        let first = match key.strip_prefix('k') {
            Some(n) => n.parse::<i64>().unwrap(),
            None => 50,
        };
        assert_eq!(*offset, first, "{key} ran for its first record: {runs:?}");
    }
    assert_eq!(committed(&group, &topic, 1), ends);
}

/// Runs `recs` on one partition through a runner over Redis with batches of 5 (and `options`
/// on top), every handler taking 50 ms; returns the runner's stats, the most handlers seen
/// running at once, and whether two handlers of one key ever ran at once.
async fn run_in_batches_of_five(
    recs: &[Rec],
    per_partition: usize,
) -> (Arc<idem_kafka::RunnerStats>, u32, bool) {
    let topic = unique("pipeline");
    let group = unique("g");
    create_topic(&topic, 1).await;
    let ends = ends(&produce(&topic, recs).await);
    let store = shared(redis_store(&unique("idem-kafka-test")).await);
    let in_flight = Arc::new(AtomicU32::new(0));
    let max_seen = Arc::new(AtomicU32::new(0));
    let running = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
    let overlapped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (f, m, r, o) = (
        Arc::clone(&in_flight),
        Arc::clone(&max_seen),
        Arc::clone(&running),
        Arc::clone(&overlapped),
    );
    let handler = move |msg: KafkaMessage, _ctx: HandlerContext| {
        let (f, m, r, o) = (
            Arc::clone(&f),
            Arc::clone(&m),
            Arc::clone(&r),
            Arc::clone(&o),
        );
        async move {
            let key = String::from_utf8(msg.key().unwrap().to_vec()).unwrap();
            if !r.lock().unwrap().insert(key.clone()) {
                o.store(true, Ordering::SeqCst);
            }
            let now = f.fetch_add(1, Ordering::SeqCst) + 1;
            m.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(50)).await;
            f.fetch_sub(1, Ordering::SeqCst);
            r.lock().unwrap().remove(&key);
            Ok::<_, HandlerError>(())
        }
    };
    let runner = KafkaRunner::builder(
        consumer_config(&group),
        executor(store, ExecutorConfig::new("pipeline")),
        handler,
    )
    .topic(&topic)
    .options(
        fast_options()
            .with_max_batch(5)
            .with_max_batches_per_partition(per_partition),
    )
    .build()
    .unwrap();
    let stats = runner.stats();
    let running = start(runner);
    resolved_at_least(&stats, recs.len() as u64, Duration::from_secs(60)).await;
    stop(running).await;
    assert_eq!(committed(&group, &topic, 1), ends, "committed to the end");
    (
        stats,
        max_seen.load(Ordering::SeqCst),
        overlapped.load(Ordering::SeqCst),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_overlaps_its_batches_up_to_the_bound() {
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    let recs: Vec<Rec> = (0..40)
        .map(|i| Rec::keyed(0, &format!("k{i}"), "{}"))
        .collect();
    let (stats, max_seen, _) = run_in_batches_of_five(&recs, 2).await;
    assert_eq!(stats.executed(), 40, "{stats:?}");
    assert!(
        max_seen > 5 && max_seen <= 10,
        "two batches of 5 of the partition ran at once, never more: {max_seen}"
    );
    let (stats, max_seen, _) = run_in_batches_of_five(&recs, 1).await;
    assert_eq!(stats.executed(), 40, "{stats:?}");
    assert!(
        max_seen <= 5,
        "one batch at a time when max_batches_per_partition is 1: {max_seen}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_batches_never_hold_one_key_at_once() {
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    // Blocks of five fresh keys, two more, then copies of the block's first three: with batches
    // of 5, the batch after a block's first five holds the two and must end before the copies,
    // whose originals are still in process.
    let recs: Vec<Rec> = (0..8)
        .flat_map(|block| {
            let x = |i: usize| format!("x{block}-{i}");
            let y = |i: usize| format!("y{block}-{i}");
            (0..5)
                .map(x)
                .chain((0..2).map(y))
                .chain((0..3).map(x))
                .collect::<Vec<_>>()
        })
        .map(|key| Rec::keyed(0, &key, "{}"))
        .collect();
    let (stats, max_seen, overlapped) = run_in_batches_of_five(&recs, 3).await;
    assert!(!overlapped, "two handlers of one key ran at once");
    assert_eq!((stats.executed(), stats.replayed()), (56, 24), "{stats:?}");
    assert_eq!(
        stats.retries(),
        0,
        "no batch met its own partition's key in progress: {stats:?}"
    );
    assert!(max_seen > 1, "handlers ran at once: {max_seen}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_run_ahead_of_an_unresolved_record_is_not_committed_past_it() {
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    let topic = unique("ahead");
    let group = unique("g");
    create_topic(&topic, 1).await;
    // The first record fails (retryable) while the records after it run, in its batch and the
    // ones after it; the runner shuts down during the first record's pause.
    let mut recs = vec![Rec::keyed(0, "stuck", "{}")];
    recs.extend((1..10).map(|i| Rec::keyed(0, &format!("k{i}"), "{}")));
    let ends = ends(&produce(&topic, &recs).await);
    let store = shared(redis_store(&unique("idem-kafka-test")).await);
    let handler = |msg: KafkaMessage, _ctx: HandlerContext| async move {
        if msg.key() == Some(b"stuck".as_slice()) {
            return Err(HandlerError::retryable("not yet"));
        }
        Ok::<_, HandlerError>(())
    };
    let runner = KafkaRunner::builder(
        consumer_config(&group),
        executor(store.clone(), ExecutorConfig::new("ahead")),
        handler,
    )
    .topic(&topic)
    .options(
        fast_options()
            .with_max_batch(5)
            .with_max_batches_per_partition(10)
            .with_retry_delays(Duration::from_secs(20), Duration::from_secs(30)),
    )
    .build()
    .unwrap();
    let stats = runner.stats();
    let running = start(runner);
    // However the records split into batches, up to 10 batches run at once: all of them.
    let namespace = idem_core::Namespace::new("ahead").unwrap();
    let last = namespace.key("k9").unwrap();
    let s = store.clone();
    let ran_ahead = wait_for(Duration::from_secs(15), || {
        let (s, k) = (s.clone(), last.clone());
        async move { matches!(s.get(&k).await, Ok(Some(r)) if matches!(r.state, RecordState::Completed { .. })) }
    })
    .await;
    assert!(
        ran_ahead,
        "the batches after the first ran while its first record waited: {stats:?}"
    );
    stop(running).await;
    assert_eq!(
        stats.resolved(),
        0,
        "nothing resolved past the first record: {stats:?}"
    );
    assert_eq!(
        committed(&group, &topic, 1).get(&0),
        Some(&-1),
        "nothing committed past the unresolved first record"
    );

    // The next runner of the group starts again from the first record; what ran ahead is
    // replayed, not run again.
    let runner = KafkaRunner::builder(
        consumer_config(&group),
        executor(store, ExecutorConfig::new("ahead")),
        |_msg: KafkaMessage, _ctx: HandlerContext| async { Ok::<_, HandlerError>(()) },
    )
    .topic(&topic)
    .options(fast_options())
    .build()
    .unwrap();
    let stats = runner.stats();
    let running = start(runner);
    resolved_at_least(&stats, 10, Duration::from_secs(30)).await;
    stop(running).await;
    assert_eq!((stats.executed(), stats.replayed()), (1, 9), "{stats:?}");
    assert_eq!(committed(&group, &topic, 1), ends);
}

/// A record whose attempt failed is tried again after its own retry delay, however often the
/// records before it in its batch are tried: here a busy key at the head of the batch is tried
/// every few milliseconds, then less often, for about two seconds, and the failing record behind
/// it (and its duplicate, which waits for the batch after) runs once per retry delay. Before, each try of the busy head
/// ran the record behind it again, spending its attempts in milliseconds, and the duplicate in
/// the same batch ran the next attempt right after the first failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_record_behind_a_busy_key_retries_at_its_own_pace() {
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    let topic = unique("pace");
    let group = unique("g");
    create_topic(&topic, 1).await;
    let recs = vec![
        Rec::keyed(0, "busy", "{}"),
        Rec::keyed(0, "flaky", "{}"),
        Rec::keyed(0, "flaky", "{}"),
    ];
    let ends = ends(&produce(&topic, &recs).await);
    let store = shared(redis_store(&unique("idem-kafka-test")).await);
    let namespace = idem_core::Namespace::new("pace").unwrap();
    let held = match store
        .acquire(
            &idem_core::AcquireRequest::new(namespace.key("busy").unwrap(), "someone-else")
                .with_lease_ttl(Duration::from_secs(60)),
        )
        .await
        .unwrap()
    {
        idem_core::AcquireOutcome::Acquired { lease, .. } => lease,
        other => panic!("{other:?}"),
    };
    let runs = Arc::new(std::sync::Mutex::new(Vec::new()));
    let r = Arc::clone(&runs);
    let handler = move |msg: KafkaMessage, _ctx: HandlerContext| {
        let r = Arc::clone(&r);
        async move {
            if msg.key() != Some(b"flaky".as_slice()) {
                return Ok::<_, HandlerError>(());
            }
            let mut runs = r.lock().unwrap();
            runs.push(Instant::now());
            if runs.len() <= 2 {
                return Err(HandlerError::retryable("downstream briefly down"));
            }
            Ok(())
        }
    };
    const RETRY_DELAY: Duration = Duration::from_millis(1500);
    let runner = KafkaRunner::builder(
        consumer_config(&group),
        executor(
            store.clone(),
            ExecutorConfig::new("pace").with_retry_delay(RETRY_DELAY),
        ),
        handler,
    )
    .topic(&topic)
    .options(
        fast_options()
            .with_max_batch(5)
            .with_retry_delays(Duration::from_millis(5), Duration::from_secs(5)),
    )
    .build()
    .unwrap();
    let stats = runner.stats();
    let running = start(runner);
    // The busy key is released once it has been tried eight times, about two seconds from its
    // first try (its backoff doubles from a few milliseconds). Whether the failing record is
    // tried again meanwhile depends on how the poll cut the batches: behind the busy key in its
    // batch, it is, at its own pace; in the batch after, its retries wait for that batch.
    let tried = wait_for(Duration::from_secs(30), || {
        let s = Arc::clone(&stats);
        async move { s.retries() >= 8 }
    })
    .await;
    assert!(tried, "the busy key was tried again: {stats:?}");
    store.release(&held).await.unwrap();
    resolved_at_least(&stats, 3, Duration::from_secs(30)).await;
    stop(running).await;

    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 3, "two failed attempts, then the success");
    for pair in runs.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(
            gap >= RETRY_DELAY,
            "an attempt ran {gap:?} after the one that failed, under the retry delay: {stats:?}"
        );
    }
    assert_eq!((stats.executed(), stats.replayed()), (2, 1), "{stats:?}");
    let record = store
        .get(&namespace.key("flaky").unwrap())
        .await
        .unwrap()
        .expect("record");
    assert!(
        matches!(record.state, RecordState::Completed { .. }),
        "{record:?}"
    );
    assert_eq!(record.attempts, 3, "{record:?}");
    assert_eq!(committed(&group, &topic, 1), ends);
}

/// A header name that is not UTF-8 (rdkafka panics when it reads one) is passed over: the key
/// header after it is read, and a record with no other header has no key.
#[test]
fn a_header_name_that_is_not_utf8_is_passed_over_not_a_panic() {
    use idem_kafka::rdkafka::Timestamp;
    use idem_kafka::rdkafka::message::{OwnedHeaders, OwnedMessage};
    let record = |headers| {
        KafkaMessage::new(OwnedMessage::new(
            Some(b"{}".to_vec()),
            None,
            "payments".into(),
            Timestamp::NotAvailable,
            0,
            5,
            Some(headers),
        ))
    };
    let keyed = record(headers_with_a_name_that_is_not_utf8(Some("tx-1")));
    assert!(!keyed.headers_readable());
    assert_eq!(keyed.header("idempotency-key"), Some(&b"tx-1"[..]));
    assert_eq!(
        KeySource::default().extract(&keyed).unwrap().as_deref(),
        Some("tx-1")
    );
    let keyless = record(headers_with_a_name_that_is_not_utf8(None));
    assert_eq!(keyless.header("idempotency-key"), None);
    assert_eq!(KeySource::default().extract(&keyless).unwrap(), None);
    assert!(record(OwnedHeaders::new()).headers_readable());
}

/// Runs a runner over `topic` (a store and executor named after `name`; its handler fails
/// every record terminally when `fail`, else succeeds) until `resolved` records are resolved
/// (within `within`), stops it, and reads `dead_letters` records from `<topic>.dlq`. `producer_config`: the
/// dead-letter producer's, when the test sets one.
async fn run_and_read_dead_letters(
    topic: &str,
    group: &str,
    name: &str,
    fail: bool,
    producer_config: Option<idem_kafka::rdkafka::ClientConfig>,
    (resolved, within): (u64, Duration),
    dead_letters: usize,
) -> (
    Arc<idem_kafka::RunnerStats>,
    Vec<idem_kafka::rdkafka::message::OwnedMessage>,
) {
    let store = shared(redis_store(&unique(&format!("idem-kafka-{name}"))).await);
    let handler = move |_msg: KafkaMessage, _ctx: HandlerContext| async move {
        match fail {
            true => Err(HandlerError::terminal(std::io::Error::other("malformed"))),
            false => Ok(()),
        }
    };
    let mut builder = KafkaRunner::builder(
        consumer_config(group),
        executor(store, ExecutorConfig::new(name)),
        handler,
    )
    .topic(topic)
    .options(fast_options());
    if let Some(config) = producer_config {
        builder = builder.producer_config(config);
    }
    let runner = builder.build().unwrap();
    let stats = runner.stats();
    let running = start(runner);
    resolved_at_least(&stats, resolved, within).await;
    stop(running).await;
    let dlq = read_topic(
        &format!("{topic}.dlq"),
        dead_letters,
        Duration::from_secs(20),
    )
    .await;
    (stats, dlq)
}

/// Records with a header name that is not UTF-8 run (their key header is read past it) or are
/// dead-lettered with their headers as they came, and the partition goes on. Before, looking
/// for the key header panicked in rdkafka and the runner stopped with a dead worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_with_a_header_name_that_is_not_utf8_run_or_dead_letter_and_the_partition_goes_on()
{
    use idem_kafka::rdkafka::message::{Headers as _, Message as _};
    use idem_kafka::rdkafka::producer::FutureRecord;
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    let topic = unique("bad-header");
    let group = unique("g");
    create_topic(&topic, 1).await;
    create_topic(&format!("{topic}.dlq"), 1).await;
    let producer = producer();
    for key in [Some("keyed"), None] {
        let record = FutureRecord::<str, str>::to(&topic)
            .partition(0)
            .key(key.unwrap_or("keyless"))
            .payload("{}")
            .headers(headers_with_a_name_that_is_not_utf8(key));
        producer
            .send(record, Duration::from_secs(10))
            .await
            .expect("produced");
    }
    let recs: Vec<Rec> = (0..3)
        .map(|i| Rec::keyed(0, &format!("ok{i}"), "{}"))
        .collect();
    let ends = ends(&produce(&topic, &recs).await);

    let (stats, dlq) = run_and_read_dead_letters(
        &topic,
        &group,
        "bad-header",
        false,
        None,
        (5, Duration::from_secs(60)),
        1,
    )
    .await;
    assert_eq!(
        (stats.executed(), stats.dead_lettered()),
        (4, 1),
        "{stats:?}"
    );
    assert_eq!(committed(&group, &topic, 1), ends);
    assert_eq!(dlq.len(), 1);
    let d = &dlq[0];
    assert_eq!(d.key(), Some(&b"keyless"[..]));
    assert_eq!(
        header(d, idem_kafka::HEADER_REASON).as_deref(),
        Some("missing_key")
    );
    assert_eq!(
        d.headers().map(|h| h.count()),
        Some(1 + 6),
        "the original header, then the runner's (no key)"
    );
}

/// A record over librdkafka's default `message.max.bytes` (1,000,000 bytes) that the topic took
/// is dead-lettered: the dead-letter producer leaves the limit to the broker. Before, the write
/// was refused before it was sent, every time, and the partition stalled on the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_over_the_client_default_size_is_dead_lettered() {
    use idem_kafka::rdkafka::ClientConfig;
    use idem_kafka::rdkafka::message::Message as _;
    use idem_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    let topic = unique("large");
    let group = unique("g");
    create_topic(&topic, 1).await;
    create_topic(&format!("{topic}.dlq"), 1).await;
    let value = "x".repeat(1_010_000);
    let large: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .set("message.max.bytes", "2000000")
        .create()
        .expect("producer");
    let record = FutureRecord::<str, str>::to(&topic)
        .partition(0)
        .key("big")
        .payload(&value)
        .headers(idem_kafka::rdkafka::message::OwnedHeaders::new().insert(
            idem_kafka::rdkafka::message::Header {
                key: "idempotency-key",
                value: Some("big"),
            },
        ));
    let offset = large
        .send(record, Duration::from_secs(10))
        .await
        .expect("produced")
        .offset;

    let (stats, dlq) = run_and_read_dead_letters(
        &topic,
        &group,
        "large",
        true,
        None,
        (1, Duration::from_secs(30)),
        1,
    )
    .await;
    assert_eq!(stats.dead_lettered(), 1, "{stats:?}");
    assert_eq!(
        committed(&group, &topic, 1),
        [(0, offset + 1)].into_iter().collect()
    );
    assert_eq!(dlq.len(), 1);
    assert_eq!(dlq[0].payload().map(<[u8]>::len), Some(value.len()));
    assert_eq!(
        header(&dlq[0], idem_kafka::HEADER_REASON).as_deref(),
        Some("failed")
    );
}

/// Runs `rec` (on partition 0 of a new topic named from `name`) through a runner whose
/// dead-letter producer takes records of at most 23,000 bytes, its handler failing (`fail`) or
/// not; asserts the record was dead-lettered once and its offset committed, and returns the dead
/// letter.
async fn dead_letter_under_a_23_000_byte_limit(
    name: &str,
    rec: Rec,
    fail: bool,
) -> idem_kafka::rdkafka::message::OwnedMessage {
    let topic = unique(name);
    let group = unique("g");
    create_topic(&topic, 1).await;
    create_topic(&format!("{topic}.dlq"), 1).await;
    let ends = ends(&produce(&topic, &[rec]).await);
    let mut producer_config = idem_kafka::rdkafka::ClientConfig::new();
    producer_config
        .set("bootstrap.servers", brokers())
        .set("message.max.bytes", "23000");
    let (stats, mut dlq) = run_and_read_dead_letters(
        &topic,
        &group,
        name,
        fail,
        Some(producer_config),
        (1, Duration::from_secs(30)),
        1,
    )
    .await;
    assert_eq!(stats.dead_lettered(), 1, "{stats:?}");
    assert_eq!(committed(&group, &topic, 1), ends);
    assert_eq!(dlq.len(), 1);
    dlq.remove(0)
}

/// A dead letter refused as too large with the original headers is written with the runner's
/// only, naming the others. The limit here is the dead-letter producer's own; a broker's
/// refusal has the same code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_too_large_with_the_original_headers_goes_without_them() {
    use idem_kafka::rdkafka::message::Message as _;
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    // 23,000 bytes: the value and the runner's headers fit, not with the original ones too.
    let mut rec = Rec::keyed(0, "big", "x".repeat(20_000));
    rec.headers.push(("blob".into(), "y".repeat(5_000)));
    let d = &dead_letter_under_a_23_000_byte_limit("large-headers", rec, true).await;
    assert_eq!(d.payload().map(<[u8]>::len), Some(20_000));
    assert_eq!(header(d, "blob"), None);
    assert_eq!(
        header(d, idem_kafka::HEADER_DROPPED).as_deref(),
        Some("idempotency-key,blob")
    );
    assert_eq!(header(d, idem_kafka::HEADER_KEY).as_deref(), Some("big"));
}

/// A dead letter still too large without the original headers (here a 20,000-byte value under a
/// 23,000-byte limit, with a 10,000-byte key: invalid, so its 4,096-byte cut goes into
/// `idem-dlq-key`) is written with the error, the key and the dropped names cut to 256 bytes.
/// Before, it was refused every time and the partition stalled on the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_still_too_large_goes_with_its_texts_cut_short() {
    use idem_kafka::rdkafka::message::Message as _;
    if !kafka_and_redis() {
        return;
    }
    init_tracing();
    let rec = Rec {
        partition: 0,
        key: Some("short".into()),
        value: "x".repeat(20_000),
        headers: vec![("idempotency-key".into(), "k".repeat(10_000))],
    };
    let d = &dead_letter_under_a_23_000_byte_limit("large-key", rec, false).await;
    assert_eq!(d.payload().map(<[u8]>::len), Some(20_000));
    assert_eq!(
        header(d, idem_kafka::HEADER_REASON).as_deref(),
        Some("invalid_key")
    );
    assert_eq!(
        header(d, idem_kafka::HEADER_DROPPED).as_deref(),
        Some("idempotency-key")
    );
    let cut = header(d, idem_kafka::HEADER_KEY).expect("the key header");
    assert!(
        cut.len() <= idem_kafka::COMPACT_TEXT && cut.starts_with("kkk") && cut.ends_with('…'),
        "the key cut short: {} bytes",
        cut.len()
    );
}

/// A record that reached its final outcome in a try of its batch keeps it: the tries of the
/// batch after it (behind a record whose key another consumer holds) never hand it to the
/// executor again. Before, each retry of the busy key ran again the keyless (pass-through)
/// records behind it, which have no store entry to replay: here seven runs of each keyless
/// transfer for one delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_resolved_behind_a_busy_key_are_not_run_again_by_its_retries() {
    if !kafka_only() {
        return;
    }
    init_tracing();
    let topic = unique("settled");
    let group = unique("g");
    create_topic(&topic, 1).await;
    create_topic(&format!("{topic}.dlq"), 1).await;
    // `slow`: a record whose handler takes a second, so that (one slot) the next batch holds
    // all the others; `busy`: its key held by another consumer until it has been tried three
    // times; then three keyless transfers (passed through, not deduplicated).
    let mut recs = vec![Rec::keyed(0, "slow", "{}"), Rec::keyed(0, "busy", "{}")];
    for i in 0..3 {
        recs.push(Rec {
            partition: 0,
            key: None,
            value: format!("keyless-transfer-{i}"),
            headers: vec![],
        });
    }
    let ends = ends(&produce(&topic, &recs).await);
    let store = shared(MemoryStore::new());
    let namespace = idem_core::Namespace::new("settled").unwrap();
    let held = match store
        .acquire(
            &idem_core::AcquireRequest::new(namespace.key("busy").unwrap(), "someone-else")
                .with_lease_ttl(Duration::from_secs(60)),
        )
        .await
        .unwrap()
    {
        idem_core::AcquireOutcome::Acquired { lease, .. } => lease,
        other => panic!("{other:?}"),
    };
    let runs = Arc::new(std::sync::Mutex::new(
        std::collections::BTreeMap::<i64, u32>::new(),
    ));
    let r = Arc::clone(&runs);
    let handler = move |msg: KafkaMessage, _ctx: HandlerContext| {
        let r = Arc::clone(&r);
        async move {
            *r.lock().unwrap().entry(msg.offset()).or_default() += 1;
            if msg.key() == Some(b"slow".as_slice()) {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Ok::<_, HandlerError>(())
        }
    };
    let runner = KafkaRunner::builder(
        consumer_config(&group),
        executor(
            store.clone(),
            ExecutorConfig::new("settled")
                .with_missing_key(idem_executor::MissingKeyPolicy::PassThrough),
        ),
        handler,
    )
    .topic(&topic)
    .options(
        fast_options()
            .with_max_in_flight(1)
            .with_retry_delays(Duration::from_millis(5), Duration::from_secs(5)),
    )
    .build()
    .unwrap();
    let stats = runner.stats();
    let running = start(runner);
    // The busy key is tried a few times while the keyless records wait behind it.
    let tried = wait_for(Duration::from_secs(30), || {
        let s = Arc::clone(&stats);
        async move { s.retries() >= 3 }
    })
    .await;
    assert!(tried, "the busy key was tried again meanwhile: {stats:?}");
    store.release(&held).await.unwrap();
    resolved_at_least(&stats, 5, Duration::from_secs(30)).await;
    stop(running).await;

    let runs = runs.lock().unwrap().clone();
    let expected: std::collections::BTreeMap<i64, u32> = (0..5).map(|o| (o, 1)).collect();
    assert_eq!(
        runs, expected,
        "each record's handler ran once (per offset): {stats:?}"
    );
    assert_eq!(
        (stats.executed(), stats.replayed(), stats.acked_other()),
        (2, 0, 3),
        "{stats:?}"
    );
    assert_eq!(committed(&group, &topic, 1), ends);
}

/// The same for a record run under `StoreErrorPolicy::FailOpen` (the store down, the handler
/// run without it) behind a record whose attempt failed: when the store is back, the retry of
/// the failed record does not acquire the other one fresh and run it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_run_fail_open_behind_a_failed_one_is_not_run_again_by_its_retry() {
    if !kafka_only() {
        return;
    }
    init_tracing();
    let topic = unique("settled-open");
    let group = unique("g");
    create_topic(&topic, 1).await;
    // `slow` fills the one slot for a second, so that `flaky` and `transfer` share a batch.
    let recs = vec![
        Rec::keyed(0, "slow", "{}"),
        Rec::keyed(0, "flaky", "{}"),
        Rec::keyed(0, "transfer", "{}"),
    ];
    let ends = ends(&produce(&topic, &recs).await);
    let memory = MemoryStore::new();
    memory.set_available(false);
    let runs = Arc::new(std::sync::Mutex::new(
        std::collections::BTreeMap::<i64, u32>::new(),
    ));
    let r = Arc::clone(&runs);
    let handler = move |msg: KafkaMessage, _ctx: HandlerContext| {
        let r = Arc::clone(&r);
        async move {
            let run = {
                let mut runs = r.lock().unwrap();
                let run = runs.entry(msg.offset()).or_default();
                *run += 1;
                *run
            };
            match msg.key() {
                Some(b"slow") => tokio::time::sleep(Duration::from_secs(1)).await,
                Some(b"flaky") if run == 1 => {
                    return Err(HandlerError::retryable("downstream briefly down"));
                }
                _ => {}
            }
            Ok::<_, HandlerError>(())
        }
    };
    let runner = KafkaRunner::builder(
        consumer_config(&group),
        executor(
            shared(memory.clone()),
            ExecutorConfig::new("settled-open")
                .with_store_errors(idem_executor::StoreErrorPolicy::FailOpen)
                .with_retry_delay(Duration::from_secs(1)),
        ),
        handler,
    )
    .topic(&topic)
    .options(fast_options().with_max_in_flight(1))
    .build()
    .unwrap();
    let stats = runner.stats();
    let running = start(runner);
    // The store comes back once `transfer` ran without it, before `flaky` is tried again.
    assert!(
        wait_for(Duration::from_secs(30), || {
            let runs = Arc::clone(&runs);
            async move { runs.lock().unwrap().contains_key(&2) }
        })
        .await
    );
    memory.set_available(true);
    resolved_at_least(&stats, 3, Duration::from_secs(30)).await;
    stop(running).await;

    let runs = runs.lock().unwrap().clone();
    assert_eq!(
        runs,
        [(0, 1), (1, 2), (2, 1)].into_iter().collect(),
        "`flaky` ran twice (a failure, then its retry), the others once: {stats:?}"
    );
    assert_eq!(committed(&group, &topic, 1), ends);
}

/// A key source closure that panics on a record dead-letters it as `invalid_message` and the
/// partition goes on. Before, the panic (outside the handler's guard) killed the partition's
/// worker and stopped the runner with `WorkerDied`, on the same record after every restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_source_that_panics_dead_letters_the_record_and_the_partition_goes_on() {
    use idem_kafka::rdkafka::message::Message as _;
    if !kafka_only() {
        return;
    }
    init_tracing();
    let topic = unique("key-panic");
    let group = unique("g");
    create_topic(&topic, 1).await;
    create_topic(&format!("{topic}.dlq"), 1).await;
    let recs = vec![
        Rec::keyed(0, "fine", "{}"),
        Rec::keyed(0, "boom", "{}"),
        Rec::keyed(0, "after", "{}"),
    ];
    let ends = ends(&produce(&topic, &recs).await);
    let source = KeySource::from_fn(|m| {
        let key = std::str::from_utf8(m.message_key()?).ok()?.to_owned();
        assert_ne!(key, "boom", "key source panics on purpose");
        Some(key)
    });
    let runs = Arc::new(AtomicU32::new(0));
    let r = Arc::clone(&runs);
    let handler = move |_msg: KafkaMessage, _ctx: HandlerContext| {
        let r = Arc::clone(&r);
        async move {
            r.fetch_add(1, Ordering::SeqCst);
            Ok::<_, HandlerError>(())
        }
    };
    let runner = KafkaRunner::builder(
        consumer_config(&group),
        executor(
            shared(MemoryStore::new()),
            ExecutorConfig::new("key-panic").with_key_source(source),
        ),
        handler,
    )
    .topic(&topic)
    .options(fast_options())
    .build()
    .unwrap();
    let stats = runner.stats();
    let running = start(runner);
    resolved_at_least(&stats, 3, Duration::from_secs(30)).await;
    stop(running).await;
    assert_eq!(runs.load(Ordering::SeqCst), 2, "{stats:?}");
    assert_eq!(
        (stats.executed(), stats.dead_lettered()),
        (2, 1),
        "{stats:?}"
    );
    assert_eq!(committed(&group, &topic, 1), ends);
    let dlq = read_topic(&format!("{topic}.dlq"), 1, Duration::from_secs(20)).await;
    assert_eq!(dlq.len(), 1);
    assert_eq!(dlq[0].key(), Some(&b"boom"[..]));
    assert_eq!(
        header(&dlq[0], idem_kafka::HEADER_REASON).as_deref(),
        Some("invalid_message")
    );
    let error = header(&dlq[0], idem_kafka::HEADER_ERROR).unwrap_or_default();
    assert!(
        error.contains("the key source panicked") && error.contains("on purpose"),
        "{error}"
    );
}

/// The names of a record's headers are read within bounds: past `MAX_HEADERS` headers none is
/// read, and past `MAX_UNREADABLE_HEADER_NAMES` names that are not UTF-8 the reading stops (each
/// costs a panic); such headers are refused (nothing found in them). Before, every name was read
/// with a panic per name that is not UTF-8, and each lookup passed over them with a linear
/// search: a 1 MB record of one-byte names held the poll thread for minutes.
#[test]
fn headers_past_the_bounds_are_refused_without_reading_them_all() {
    use idem_kafka::rdkafka::Timestamp;
    use idem_kafka::rdkafka::message::{OwnedHeaders, OwnedMessage};
    let record = |headers: OwnedHeaders| {
        KafkaMessage::new(OwnedMessage::new(
            Some(b"{}".to_vec()),
            None,
            "payments".into(),
            Timestamp::NotAvailable,
            0,
            5,
            Some(headers),
        ))
    };
    // At the bound: read.
    let at_bound = record(many_headers(KafkaMessage::MAX_HEADERS - 1, "tx-1"));
    assert_eq!(at_bound.invalid_headers(), None);
    assert!(at_bound.headers_readable());
    assert_eq!(at_bound.header("idempotency-key"), Some(&b"tx-1"[..]));
    // One more header: refused.
    let over = record(many_headers(KafkaMessage::MAX_HEADERS, "tx-1"));
    let reason = over.invalid_headers().expect("refused");
    assert!(reason.contains("10001 headers"), "{reason}");
    assert!(!over.headers_readable());
    assert_eq!(over.header("idempotency-key"), None);
    // The hostile record: a megabyte of one-byte names that are not UTF-8 (two bytes here).
    let hostile = record(headers_with_names_that_are_not_utf8(330_000, Some("tx-1")));
    assert!(hostile.invalid_headers().is_some());
    assert_eq!(hostile.header("idempotency-key"), None);
    // Names that are not UTF-8: up to the bound passed over, past it refused.
    let tolerated = record(headers_with_names_that_are_not_utf8(
        KafkaMessage::MAX_UNREADABLE_HEADER_NAMES,
        Some("tx-1"),
    ));
    assert_eq!(tolerated.invalid_headers(), None);
    assert_eq!(tolerated.header("idempotency-key"), Some(&b"tx-1"[..]));
    let refused = record(headers_with_names_that_are_not_utf8(
        KafkaMessage::MAX_UNREADABLE_HEADER_NAMES + 1,
        Some("tx-1"),
    ));
    let reason = refused.invalid_headers().expect("refused");
    assert!(reason.contains("not UTF-8"), "{reason}");
    assert_eq!(refused.header("idempotency-key"), None);
    assert_eq!(
        KeySource::default().extract(&refused).unwrap(),
        None,
        "no key is read from refused headers"
    );
}

/// Records whose headers are refused (too many headers, too many names that are not UTF-8) are
/// dead-lettered as `invalid_message` without running the handler, and the partition goes on.
/// Before, the first was handled like any record and the second held the poll thread with a
/// panic per name that is not UTF-8, then ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_with_refused_headers_are_dead_lettered_as_invalid_and_the_partition_goes_on() {
    use idem_kafka::rdkafka::message::Message as _;
    use idem_kafka::rdkafka::producer::FutureRecord;
    if !kafka_only() {
        return;
    }
    init_tracing();
    let topic = unique("many-headers");
    let group = unique("g");
    create_topic(&topic, 1).await;
    create_topic(&format!("{topic}.dlq"), 1).await;
    let producer = producer();
    for (key, headers) in [
        ("many", many_headers(KafkaMessage::MAX_HEADERS, "many")),
        (
            "unreadable",
            headers_with_names_that_are_not_utf8(
                KafkaMessage::MAX_UNREADABLE_HEADER_NAMES + 1,
                Some("unreadable"),
            ),
        ),
    ] {
        let record = FutureRecord::<str, str>::to(&topic)
            .partition(0)
            .key(key)
            .payload("{}")
            .headers(headers);
        producer
            .send(record, Duration::from_secs(10))
            .await
            .expect("produced");
    }
    let ends = ends(&produce(&topic, &[Rec::keyed(0, "fine", "{}")]).await);
    let runs = Arc::new(AtomicU32::new(0));
    let r = Arc::clone(&runs);
    let handler = move |_msg: KafkaMessage, _ctx: HandlerContext| {
        let r = Arc::clone(&r);
        async move {
            r.fetch_add(1, Ordering::SeqCst);
            Ok::<_, HandlerError>(())
        }
    };
    let runner = KafkaRunner::builder(
        consumer_config(&group),
        executor(
            shared(MemoryStore::new()),
            // Even when the key is the record key, which is readable.
            ExecutorConfig::new("many-headers").with_key_source(KeySource::message_key()),
        ),
        handler,
    )
    .topic(&topic)
    .options(fast_options())
    .build()
    .unwrap();
    let stats = runner.stats();
    let running = start(runner);
    resolved_at_least(&stats, 3, Duration::from_secs(60)).await;
    stop(running).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{stats:?}");
    assert_eq!(
        (stats.executed(), stats.dead_lettered()),
        (1, 2),
        "{stats:?}"
    );
    assert_eq!(committed(&group, &topic, 1), ends);
    let dlq = read_topic(&format!("{topic}.dlq"), 2, Duration::from_secs(20)).await;
    let mut got: Vec<(Vec<u8>, Option<String>)> = dlq
        .iter()
        .map(|d| {
            (
                d.key().unwrap_or_default().to_vec(),
                header(d, idem_kafka::HEADER_REASON),
            )
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            (b"many".to_vec(), Some("invalid_message".to_owned())),
            (b"unreadable".to_vec(), Some("invalid_message".to_owned())),
        ]
    );
}

/// A partition is paused once the records the runner holds for it reach
/// `max_buffered_bytes_per_partition` bytes, whatever their count: with a handler stuck on the
/// first record, the runner takes in records of 100 KB up to the one that crosses 1 MiB, and no
/// more. Before, only the count was bounded (100,000 records by default): every record of the
/// topic was taken in (10 GB for a partition of 100 KB records).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_is_paused_at_the_byte_bound_of_its_buffer() {
    if !kafka_only() {
        return;
    }
    init_tracing();
    let topic = unique("bytes");
    let group = unique("g");
    create_topic(&topic, 1).await;
    const SIZE: usize = 100_000;
    const BOUND: usize = 1024 * 1024;
    let recs: Vec<Rec> = (0..30)
        .map(|i| Rec::keyed(0, &format!("k{i}"), "x".repeat(SIZE)))
        .collect();
    produce(&topic, &recs).await;
    let handler = |_msg: KafkaMessage, ctx: HandlerContext| async move {
        ctx.cancellation_token().cancelled().await;
        Err::<(), _>(HandlerError::retryable("stopped"))
    };
    let runner = KafkaRunner::builder(
        consumer_config(&group),
        executor(shared(MemoryStore::new()), ExecutorConfig::new("bytes")),
        handler,
    )
    .topic(&topic)
    .options(
        fast_options()
            .with_max_buffered_bytes_per_partition(BOUND)
            .with_drain_timeout(Duration::from_millis(100))
            .with_revoke_timeout(Duration::from_secs(2))
            .with_release_timeout(Duration::from_secs(1)),
    )
    .build()
    .unwrap();
    let stats = runner.stats();
    let running = start(runner);
    // A record counts its key and value, and its one header (name, value, overhead).
    let record = SIZE + "k10".len() + "idempotency-key".len() + "k10".len() + 48;
    assert!(
        wait_for(Duration::from_secs(30), || {
            let s = Arc::clone(&stats);
            async move { (s.received() as usize + 1) * record > BOUND }
        })
        .await,
        "the runner took in records up to the bound: {stats:?}"
    );
    // Time to take in everything, were the partition not paused.
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop(running).await;
    let received = stats.received() as usize;
    assert!(
        received * record <= BOUND + record,
        "{received} records of {record} bytes received, past the bound of {BOUND} by more than one: {stats:?}"
    );
    // Every record taken in was left unresolved by the stuck handler, and is counted so once.
    assert_eq!(stats.abandoned(), received as u64, "{stats:?}");
}
