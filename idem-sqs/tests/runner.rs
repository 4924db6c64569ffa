//! The runner against SQS on LocalStack (`IDEM_LOCALSTACK_ENDPOINT`, started by
//! `scripts/services.sh localstack`), with `MemoryStore` as the store: acknowledgements and
//! replays, every dead-letter reason with its attributes, retries made visible after the
//! outcome's delay, a slow handler's message kept invisible, FIFO group order, the drain, the
//! transactional executor, a dead-letter queue that refuses for good stopping the runner, and a
//! dead-letter retry ending once its message is no longer this receive's. Without LocalStack
//! each test returns after one "skipped" line; with `CI=true` it fails.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use idem_core::{MemoryStore, MemoryWrites};
use idem_executor::{
    Commit, Executor, ExecutorConfig, HandlerContext, HandlerError, JsonCodec, Message as _,
    Recorder,
};
use idem_sqs::{
    ATTR_ATTEMPTS, ATTR_ERROR, ATTR_KEY, ATTR_REASON, ATTR_SOURCE_MESSAGE_ID, Handler, RunnerError,
    RunnerOptions, RunnerStats, SqsMessage, SqsRunner,
};
use tokio_util::sync::CancellationToken;

type Running = (
    tokio::task::JoinHandle<Result<(), RunnerError>>,
    Arc<RunnerStats>,
    CancellationToken,
);

fn options() -> RunnerOptions {
    RunnerOptions::default()
        .with_wait_time(Duration::from_secs(1))
        .with_visibility_timeout(Duration::from_secs(10))
        .with_drain_timeout(Duration::from_secs(10))
}

fn config(namespace: &str) -> ExecutorConfig {
    ExecutorConfig::new(namespace)
        .with_lease_ttl(Duration::from_secs(6))
        .with_retry_delay(Duration::from_secs(1))
        .with_max_attempts(2)
}

/// Starts a runner on `queue` in the background.
fn start<H, T, R>(
    executor: Executor<JsonCodec, R>,
    queue: &str,
    dlq: &str,
    options: RunnerOptions,
    handler: H,
) -> Running
where
    R: Recorder,
    H: Handler<SqsMessage, R::Returns<T>>,
    R::Returns<T>: Send,
    T: serde::Serialize + serde::de::DeserializeOwned + Send + 'static,
{
    let runner = SqsRunner::builder(client(), queue, executor, handler)
        .dead_letter_queue(dlq)
        .options(options)
        .build()
        .expect("runner");
    start_with(runner)
}

/// Runs `runner` in the background.
fn start_with<H, T, R>(runner: SqsRunner<H, T, JsonCodec, R>) -> Running
where
    R: Recorder,
    H: Handler<SqsMessage, R::Returns<T>>,
    R::Returns<T>: Send,
    T: serde::Serialize + serde::de::DeserializeOwned + Send + 'static,
{
    let stats = runner.stats();
    let stop = CancellationToken::new();
    let shutdown = stop.clone();
    let task = tokio::spawn(runner.run(async move { shutdown.cancelled().await }));
    (task, stats, stop)
}

async fn stop((task, _, stop): Running) {
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the runner stops within 30 s")
        .expect("no panic")
        .expect("the runner ends without error");
}

/// Handler calls per key.
type Calls = Arc<Mutex<BTreeMap<String, u32>>>;

fn key_of(ctx: &HandlerContext) -> String {
    ctx.key().map(|k| k.id().to_owned()).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledges_replays_and_dead_letters_with_reasons() {
    if !localstack() {
        return;
    }
    init_tracing();
    let sqs = client();
    let queue = queue(&sqs, "idem-runner", false).await;
    let dlq = common::queue(&sqs, "idem-runner-dlq", false).await;
    let calls: Calls = Arc::default();
    let seen = Arc::clone(&calls);
    let handler = move |msg: SqsMessage, ctx: HandlerContext| {
        let seen = Arc::clone(&seen);
        async move {
            let key = key_of(&ctx);
            *seen.lock().unwrap().entry(key.clone()).or_default() += 1;
            match key.as_str() {
                "k-terminal" => Err(HandlerError::terminal("amount is negative")),
                "k-poison" => Err(HandlerError::retryable(format!(
                    "downstream refused attempt {}",
                    ctx.attempt()
                ))),
                _ => Ok(format!("{} bytes", msg.payload().len())),
            }
        }
    };
    let executor = Executor::new(Arc::new(MemoryStore::new()), config("acks")).unwrap();
    let running = start(executor, &queue, &dlq, options(), handler);
    let stats = Arc::clone(&running.1);

    // The originals first, so that the duplicate and the conflict find the key completed.
    send(
        &sqs,
        &queue,
        &[
            Out::keyed("k-a", r#"{"n":1}"#),
            Out::keyed("k-b", r#"{"n":2}"#).attr("trace", "t-1"),
        ],
    )
    .await;
    assert!(wait_for(Duration::from_secs(20), || async { stats.executed() == 2 }).await);
    send(
        &sqs,
        &queue,
        &[
            Out::keyed("k-a", r#"{"n":1}"#),
            Out::keyed("k-b", r#"{"n":-2}"#).attr("trace", "t-2"),
            Out::keyed("k-terminal", r#"{"n":3}"#),
            Out::new(r#"{"n":4}"#).attr("trace", "no key"),
            Out::keyed("k-poison", r#"{"n":5}"#),
        ],
    )
    .await;
    let resolved = wait_for(Duration::from_secs(30), || async {
        stats.replayed() == 1 && stats.dead_lettered() == 4 && stats.deleted() == 7
    })
    .await;
    assert!(resolved, "{stats:?}");
    stop(running).await;

    assert_eq!(counts(&sqs, &queue).await, (0, 0), "the queue is empty");
    let calls = calls.lock().unwrap().clone();
    let want: BTreeMap<String, u32> = [("k-a", 1), ("k-b", 1), ("k-poison", 2), ("k-terminal", 1)]
        .into_iter()
        .map(|(k, n)| (k.to_owned(), n))
        .collect();
    assert_eq!(
        calls, want,
        "one run per key; the poison key ran its 2 attempts"
    );
    assert_eq!(
        (stats.executed(), stats.replayed(), stats.retries()),
        (2, 1, 1)
    );

    let dead: Vec<In> = read_out(&sqs, &dlq, Duration::from_secs(1)).await;
    let by_reason: HashMap<&str, &In> = dead
        .iter()
        .map(|m| (m.attributes[ATTR_REASON].as_str(), m))
        .collect();
    assert_eq!(dead.len(), 4, "{dead:?}");
    let conflict = by_reason["conflict"];
    assert_eq!(conflict.body, r#"{"n":-2}"#, "the conflicting body itself");
    assert_eq!(conflict.attributes[ATTR_ATTEMPTS], "0");
    assert_eq!(conflict.attributes[ATTR_KEY], "k-b");
    assert_eq!(
        conflict.attributes["trace"], "t-2",
        "original attributes kept"
    );
    assert_eq!(conflict.attributes["idempotency-key"], "k-b");
    assert!(conflict.attributes[ATTR_ERROR].contains("conflict"));
    assert!(!conflict.attributes[ATTR_SOURCE_MESSAGE_ID].is_empty());
    let failed = by_reason["failed"];
    assert_eq!(
        (
            failed.attributes[ATTR_ERROR].as_str(),
            failed.attributes[ATTR_ATTEMPTS].as_str()
        ),
        ("amount is negative", "1")
    );
    let exhausted = by_reason["exhausted"];
    assert_eq!(exhausted.attributes[ATTR_KEY], "k-poison");
    assert_eq!(exhausted.attributes[ATTR_ATTEMPTS], "2");
    assert_eq!(
        exhausted.attributes[ATTR_ERROR],
        "downstream refused attempt 2"
    );
    let missing = by_reason["missing_key"];
    assert_eq!(missing.body, r#"{"n":4}"#);
    assert_eq!(missing.attributes[ATTR_ATTEMPTS], "0");
    assert!(!missing.attributes.contains_key(ATTR_KEY));
}

/// A message near the size limit (1 MiB on LocalStack; attributes count towards it) is
/// dead-lettered: refused with its original attributes plus the runner's, it is sent again with
/// the runner's only, naming the others; refused again (a body closer to the limit, a long
/// error), with the error, the key and those names cut to 256 bytes. Before, the send was
/// refused every second, forever, holding its message and its slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_refused_as_too_large_goes_without_the_original_attributes_then_cut_short() {
    if !localstack() {
        return;
    }
    init_tracing();
    let sqs = client();
    let queue = queue(&sqs, "idem-runner-large", false).await;
    let dlq = common::queue(&sqs, "idem-runner-large-dlq", false).await;
    // "bigger" fails with an error longer than the 4,096 bytes a dead letter carries.
    let handler = |_msg: SqsMessage, ctx: HandlerContext| async move {
        let error = match key_of(&ctx).as_str() {
            "bigger" => "e".repeat(6_000),
            _ => "malformed amount".to_owned(),
        };
        Err::<(), _>(HandlerError::terminal(error))
    };
    let executor = Executor::new(Arc::new(MemoryStore::new()), config("large")).unwrap();
    let running = start(executor, &queue, &dlq, options(), handler);
    let stats = Arc::clone(&running.1);
    let body = "x".repeat(1_040_000);
    // The original fits with 90 bytes to spare; the runner's attributes take about 180.
    let blob = "y".repeat(8_450);
    // LocalStack's limit is 1 MiB (1,048,576 bytes). With its 4,096-byte error the runner's
    // attributes take about 4,300 bytes, so this one is over the limit with or without its own
    // attribute; with the error cut to 256 bytes it fits.
    let bigger = "z".repeat(1_046_000);
    // One call each: a batch is bounded by the same limit.
    send(
        &sqs,
        &queue,
        &[Out::keyed("big", body.as_str()).attr("blob", &blob)],
    )
    .await;
    send(&sqs, &queue, &[Out::keyed("bigger", bigger.as_str())]).await;
    let resolved = wait_for(Duration::from_secs(30), || async {
        stats.dead_lettered() == 2
    })
    .await;
    assert!(resolved, "{stats:?}");
    assert_eq!(stats.dead_letter_failures(), 0, "{stats:?}");
    stop(running).await;

    let mut dead: Vec<In> = read_out(&sqs, &dlq, Duration::from_secs(1)).await;
    assert_eq!(dead.len(), 2);
    dead.sort_by_key(|d| d.body.len());
    let d = &dead[0];
    assert_eq!(d.body.len(), body.len(), "the body whole");
    assert_eq!(d.attributes[ATTR_REASON], "failed");
    assert_eq!(d.attributes[ATTR_KEY], "big");
    assert_eq!(d.attributes[idem_sqs::ATTR_DROPPED], "blob,idempotency-key");
    assert!(!d.attributes.contains_key("blob"));
    assert_eq!(d.attributes[ATTR_ERROR], "malformed amount");

    let d = &dead[1];
    assert_eq!(d.body, bigger, "the body whole");
    assert_eq!(d.attributes[ATTR_REASON], "failed");
    assert_eq!(d.attributes[ATTR_KEY], "bigger");
    assert_eq!(d.attributes[idem_sqs::ATTR_DROPPED], "idempotency-key");
    let error = &d.attributes[ATTR_ERROR];
    assert!(
        error.len() <= idem_sqs::COMPACT_TEXT && error.starts_with("eee") && error.ends_with('…'),
        "the error cut short: {} bytes",
        error.len()
    );
    assert_eq!(counts(&sqs, &queue).await, (0, 0));
}

/// A dead-letter queue deleted while the runner runs refuses every send for good: the runner
/// stops as it does when the source queue is deleted, `run` returning `RunnerError::Sqs` naming
/// the dead-letter queue; the poison message is not deleted (it was not dead-lettered) but made
/// visible again, and the good message in process when it happened is handled in the drain.
/// Before, every poison message looped on the send, holding its slot: once `max_in_flight` of
/// them were in, nothing more was received, and `run` went on (then returned `Ok(())`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_queue_that_refuses_for_good_stops_the_runner_and_keeps_the_messages() {
    if !localstack() {
        return;
    }
    init_tracing();
    let sqs = client();
    let queue = queue(&sqs, "idem-dlq-gone", false).await;
    let dlq = common::queue(&sqs, "idem-dlq-gone-dlq", false).await;
    let slow_started = CancellationToken::new();
    let started = slow_started.clone();
    let handler = move |_msg: SqsMessage, ctx: HandlerContext| {
        let started = started.clone();
        async move {
            let key = key_of(&ctx);
            if key.starts_with("poison") {
                return Err(HandlerError::terminal("amount is negative"));
            }
            if key == "slow" {
                started.cancel();
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            Ok(key)
        }
    };
    let executor = Executor::new(Arc::new(MemoryStore::new()), config("dlq-gone")).unwrap();
    let (task, stats, _stop) = start(
        executor,
        &queue,
        &dlq,
        options().with_max_in_flight(2),
        handler,
    );
    send(
        &sqs,
        &queue,
        &[Out::keyed("good-1", "{}"), Out::keyed("good-2", "{}")],
    )
    .await;
    let good = wait_for(Duration::from_secs(20), || async {
        stats.executed() == 2 && stats.deleted() == 2
    })
    .await;
    assert!(good, "{stats:?}");
    send(&sqs, &queue, &[Out::keyed("slow", "{}")]).await;
    tokio::time::timeout(Duration::from_secs(20), slow_started.cancelled())
        .await
        .expect("the slow handler started");

    sqs.delete_queue().queue_url(&dlq).send().await.unwrap();
    send(
        &sqs,
        &queue,
        &[Out::keyed("poison-1", "{}"), Out::keyed("poison-2", "{}")],
    )
    .await;
    let ended = tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("run returns on its own once the dead-letter queue refuses for good")
        .expect("no panic");
    match &ended {
        Err(RunnerError::Sqs { context, .. }) => {
            assert!(
                context.contains(&dlq),
                "names the dead-letter queue: {context}"
            )
        }
        other => panic!("expected RunnerError::Sqs, got {other:?}"),
    }
    assert_eq!(
        (stats.executed(), stats.deleted(), stats.dead_lettered()),
        (3, 3, 0),
        "the good messages handled and deleted, the slow one in the drain: {stats:?}"
    );
    assert!(
        stats.dead_letter_failures() <= 2,
        "no send tried again: {stats:?}"
    );
    let left: Vec<String> = read_out(&sqs, &queue, Duration::from_secs(1))
        .await
        .into_iter()
        .map(|m| m.attributes["idempotency-key"].clone())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(
        left,
        ["poison-1", "poison-2"],
        "the poison messages are kept, visible again"
    );
}

/// A dead-letter send tried again (a dead-letter queue whose size limit the body is over) stops
/// once the message is no longer this receive's: an extension answered that it does not exist
/// (here, deleted with its receipt handle from outside). Its slot is free again and the message
/// is neither sent nor deleted here. Before, the loop went on with a dead receipt handle, holding
/// its slot for good (after 12 hours SQS gives the message out again, and its copy took another).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_retry_ends_once_the_message_is_no_longer_this_receives() {
    if !localstack() {
        return;
    }
    init_tracing();
    let sqs = client();
    let queue = queue(&sqs, "idem-dlq-handle", false).await;
    let dlq = common::queue(&sqs, "idem-dlq-handle-dlq", false).await;
    sqs.set_queue_attributes()
        .queue_url(&dlq)
        .attributes(
            idem_sqs::aws_sdk_sqs::types::QueueAttributeName::MaximumMessageSize,
            "1024",
        )
        .send()
        .await
        .unwrap();
    let receipt: Arc<Mutex<Option<String>>> = Arc::default();
    let seen = Arc::clone(&receipt);
    let handler = move |msg: SqsMessage, ctx: HandlerContext| {
        let seen = Arc::clone(&seen);
        async move {
            if key_of(&ctx) == "poison" {
                *seen.lock().unwrap() = Some(msg.receipt_handle().to_owned());
                return Err(HandlerError::terminal("malformed amount"));
            }
            Ok(key_of(&ctx))
        }
    };
    let executor = Executor::new(Arc::new(MemoryStore::new()), config("dlq-handle")).unwrap();
    let options = options()
        .with_max_in_flight(1)
        .with_visibility_timeout(Duration::from_secs(6))
        .with_visibility_extend_interval(Duration::from_secs(1));
    let running = start(executor, &queue, &dlq, options, handler);
    let stats = Arc::clone(&running.1);
    send(&sqs, &queue, &[Out::keyed("poison", "p".repeat(2_000))]).await;
    let looping = wait_for(Duration::from_secs(20), || async {
        stats.dead_letter_failures() >= 2
    })
    .await;
    assert!(looping, "the send is refused every time: {stats:?}");
    let handle = receipt
        .lock()
        .unwrap()
        .clone()
        .expect("the poison's handle");
    sqs.delete_message()
        .queue_url(&queue)
        .receipt_handle(handle)
        .send()
        .await
        .unwrap();

    send(&sqs, &queue, &[Out::keyed("good", "{}")]).await;
    let freed = wait_for(Duration::from_secs(20), || async {
        stats.executed() == 1 && stats.deleted() == 1
    })
    .await;
    assert!(
        freed,
        "the slot of the poison message was not given back: {stats:?}"
    );
    let failures = stats.dead_letter_failures();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        stats.dead_letter_failures(),
        failures,
        "no send tried since: {stats:?}"
    );
    assert_eq!(stats.dead_lettered(), 0);
    stop(running).await;
    assert_eq!(counts(&sqs, &queue).await, (0, 0));
}

/// A receive SQS never answers (the SDK bounds no call unless the client's config says so) times
/// out after `wait_time` plus `call_timeout`, and the runner goes on once SQS answers again.
/// Before, the receive in flight never returned and the runner received nothing more, logging
/// nothing. (The other calls go through the same `bounded`, which `call::tests` checks.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_sqs_never_answers_times_out_and_the_runner_goes_on() {
    if !localstack() {
        return;
    }
    init_tracing();
    let sqs = client();
    let queue = queue(&sqs, "idem-hang", false).await;
    let dlq = common::queue(&sqs, "idem-hang-dlq", false).await;
    let proxy = HangingProxy::start(&endpoint()).await;
    let handler = |_msg: SqsMessage, ctx: HandlerContext| async move { Ok(key_of(&ctx)) };
    let executor = Executor::new(Arc::new(MemoryStore::new()), config("hang")).unwrap();
    let runner = SqsRunner::builder(client_at(proxy.url()), &queue, executor, handler)
        .dead_letter_queue(&dlq)
        .options(options().with_call_timeout(Duration::from_secs(1)))
        .build()
        .expect("runner");
    let running = start_with(runner);
    let stats = Arc::clone(&running.1);

    send(&sqs, &queue, &[Out::keyed("k-before", "{}")]).await;
    let first = wait_for(Duration::from_secs(20), || async {
        stats.executed() == 1 && stats.deleted() == 1
    })
    .await;
    assert!(first, "{stats:?}");

    proxy.hang(true);
    let errors = stats.receive_errors();
    // A receive waits 1 s for messages and 1 s more for the answer.
    let timed_out = wait_for(Duration::from_secs(15), || async {
        stats.receive_errors() > errors
    })
    .await;
    assert!(timed_out, "the hung receive never returned: {stats:?}");

    proxy.hang(false);
    send(&sqs, &queue, &[Out::keyed("k-after", "{}")]).await;
    let second = wait_for(Duration::from_secs(30), || async {
        stats.executed() == 2 && stats.deleted() == 2
    })
    .await;
    assert!(second, "the runner did not go on: {stats:?}");
    stop(running).await;
    assert_eq!(counts(&sqs, &queue).await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_comes_back_after_the_retry_delay_not_the_visibility_timeout() {
    if !localstack() {
        return;
    }
    init_tracing();
    let sqs = client();
    let queue = queue(&sqs, "idem-retry", false).await;
    let dlq = common::queue(&sqs, "idem-retry-dlq", false).await;
    let started = Instant::now();
    let at: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let seen = Arc::clone(&at);
    let handler = move |_msg: SqsMessage, ctx: HandlerContext| {
        let seen = Arc::clone(&seen);
        async move {
            seen.lock().unwrap().push(started.elapsed());
            if ctx.attempt() == 1 {
                return Err(HandlerError::retryable("not yet"));
            }
            Ok(ctx.attempt())
        }
    };
    let executor = Executor::new(
        Arc::new(MemoryStore::new()),
        config("retry").with_retry_delay(Duration::from_secs(3)),
    )
    .unwrap();
    let running = start(
        executor,
        &queue,
        &dlq,
        options().with_visibility_timeout(Duration::from_secs(20)),
        handler,
    );
    let stats = Arc::clone(&running.1);
    send(&sqs, &queue, &[Out::keyed("k-retry", "{}")]).await;
    assert!(wait_for(Duration::from_secs(15), || async { stats.executed() == 1 }).await);
    stop(running).await;
    let at = at.lock().unwrap().clone();
    assert_eq!(at.len(), 2, "{at:?}");
    let gap = at[1] - at[0];
    assert!(
        gap >= Duration::from_millis(2900) && gap < Duration::from_secs(10),
        "received again {gap:?} after the failure: the retry delay is 3 s, the visibility timeout 20 s"
    );
    assert_eq!(stats.retries(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handler_keeps_its_message_invisible() {
    if !localstack() {
        return;
    }
    init_tracing();
    let sqs = client();
    let queue = queue(&sqs, "idem-slow", false).await;
    let dlq = common::queue(&sqs, "idem-slow-dlq", false).await;
    let store = Arc::new(MemoryStore::new());
    // A 3 s lease beating every second; a 4 s visibility, extended in step with the lease (every
    // second: a LocalStack slowed by the other tests still answers well within the 3 s left).
    let config = config("slow")
        .with_lease_ttl(Duration::from_secs(3))
        .with_heartbeat_interval(Duration::from_secs(1));
    let runs = Arc::new(AtomicU32::new(0));
    let handler = |runs: Arc<AtomicU32>| {
        move |_msg: SqsMessage, _ctx: HandlerContext| {
            let runs = Arc::clone(&runs);
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(9)).await;
                Ok::<_, HandlerError>("done".to_owned())
            }
        }
    };
    let options = options().with_visibility_timeout(Duration::from_secs(4));
    // Two consumers: a redelivery would go to either.
    let a = start(
        Executor::new(store.clone(), config.clone().with_owner("a")).unwrap(),
        &queue,
        &dlq,
        options.clone(),
        handler(Arc::clone(&runs)),
    );
    let b = start(
        Executor::new(store.clone(), config.with_owner("b")).unwrap(),
        &queue,
        &dlq,
        options,
        handler(Arc::clone(&runs)),
    );
    let (sa, sb) = (Arc::clone(&a.1), Arc::clone(&b.1));
    send(&sqs, &queue, &[Out::keyed("k-slow", "{}")]).await;
    let done = wait_for(Duration::from_secs(20), || async {
        sa.deleted() + sb.deleted() == 1
    })
    .await;
    assert!(done, "a: {sa:?}\nb: {sb:?}");
    stop(a).await;
    stop(b).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        sa.received() + sb.received(),
        1,
        "never delivered again while the handler ran (9 s, over twice the visibility timeout)"
    );
    let extensions = sa.visibility_extensions() + sb.visibility_extensions();
    assert!(extensions >= 6, "{extensions} extensions in 9 s");
    assert_eq!(counts(&sqs, &queue).await, (0, 0));
}

/// Messages of a FIFO group received together wait in memory for the ones before them: they are
/// kept invisible meanwhile, so none is delivered again while its group works through them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_messages_waiting_for_their_group_stay_invisible() {
    if !localstack() {
        return;
    }
    init_tracing();
    const MESSAGES: usize = 5;
    let sqs = client();
    let queue = queue(&sqs, "idem-fifo-wait", true).await;
    let dlq = common::queue(&sqs, "idem-fifo-wait-dlq", true).await;
    let out: Vec<Out> = (0..MESSAGES)
        .map(|seq| Out::keyed(&format!("w-{seq}"), seq.to_string()).group("g"))
        .collect();
    // Sent before the runner starts, so that one receive returns them together.
    send(&sqs, &queue, &out).await;
    // Each handler takes 1.2 s: the last message waits about 5 s behind the others, more than
    // twice the 2 s visibility.
    let handler = |_msg: SqsMessage, _ctx: HandlerContext| async {
        tokio::time::sleep(Duration::from_millis(1200)).await;
        Ok::<_, HandlerError>(())
    };
    let executor = Executor::new(Arc::new(MemoryStore::new()), config("fifo-wait")).unwrap();
    let running = start(
        executor,
        &queue,
        &dlq,
        options().with_visibility_timeout(Duration::from_secs(2)),
        handler,
    );
    let stats = Arc::clone(&running.1);
    let all = wait_for(Duration::from_secs(30), || async {
        stats.executed() == MESSAGES as u64
    })
    .await;
    assert!(all, "{stats:?}");
    stop(running).await;
    assert_eq!(
        stats.received(),
        MESSAGES as u64,
        "no message delivered again while it waited for its group: {stats:?}"
    );
    assert_eq!(stats.replayed(), 0, "{stats:?}");
    assert_eq!(counts(&sqs, &queue).await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_groups_run_in_order_one_message_at_a_time() {
    if !localstack() {
        return;
    }
    init_tracing();
    const GROUPS: usize = 3;
    const PER_GROUP: usize = 15;
    let sqs = client();
    let queue = queue(&sqs, "idem-fifo", true).await;
    let dlq = common::queue(&sqs, "idem-fifo-dlq", true).await;
    let order: Arc<Mutex<HashMap<String, Vec<usize>>>> = Arc::default();
    let busy: Arc<Mutex<HashSet<String>>> = Arc::default();
    let overlaps = Arc::new(AtomicUsize::new(0));
    let most_groups = Arc::new(AtomicUsize::new(0));
    let (o, b, v, g) = (
        Arc::clone(&order),
        Arc::clone(&busy),
        Arc::clone(&overlaps),
        Arc::clone(&most_groups),
    );
    let handler = move |msg: SqsMessage, ctx: HandlerContext| {
        let (order, busy, overlaps, most_groups) = (
            Arc::clone(&o),
            Arc::clone(&b),
            Arc::clone(&v),
            Arc::clone(&g),
        );
        async move {
            let group = msg.message_group_id().unwrap().to_owned();
            let seq: usize = msg.body().parse().unwrap();
            {
                let mut busy = busy.lock().unwrap();
                if !busy.insert(group.clone()) {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                most_groups.fetch_max(busy.len(), Ordering::SeqCst);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            busy.lock().unwrap().remove(&group);
            if group == "g0" && seq == 3 && ctx.attempt() == 1 {
                return Err(HandlerError::retryable("once"));
            }
            order.lock().unwrap().entry(group).or_default().push(seq);
            Ok::<_, HandlerError>(())
        }
    };
    // Sent before the runner starts, so that receives return several messages of a group.
    let mut out = Vec::new();
    for seq in 0..PER_GROUP {
        for group in 0..GROUPS {
            out.push(
                Out::keyed(&format!("g{group}-{seq}"), seq.to_string()).group(&format!("g{group}")),
            );
        }
    }
    send(&sqs, &queue, &out).await;
    let executor = Executor::new(Arc::new(MemoryStore::new()), config("fifo")).unwrap();
    let running = start(
        executor,
        &queue,
        &dlq,
        options().with_max_in_flight(8),
        handler,
    );
    let stats = Arc::clone(&running.1);
    let all = wait_for(Duration::from_secs(30), || async {
        stats.executed() == (GROUPS * PER_GROUP) as u64
    })
    .await;
    assert!(all, "{stats:?}");
    stop(running).await;
    let order = order.lock().unwrap().clone();
    for group in 0..GROUPS {
        assert_eq!(
            order[&format!("g{group}")],
            (0..PER_GROUP).collect::<Vec<_>>(),
            "group g{group} in the order sent, each message once (g0's #3 failed once)"
        );
    }
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "two messages of a group ran at once"
    );
    assert!(
        most_groups.load(Ordering::SeqCst) > 1,
        "the groups ran side by side (the test would prove nothing otherwise)"
    );
    assert_eq!(stats.retries(), 1);
    // When g0's #3 shared its batch with later g0 messages, those waited behind it (given its
    // visibility); either way SQS gave them out again only after #3.
    eprintln!("fifo: {stats:?}");
    assert_eq!(counts(&sqs, &queue).await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_the_messages_in_process() {
    if !localstack() {
        return;
    }
    init_tracing();
    let sqs = client();
    let queue = queue(&sqs, "idem-drain", false).await;
    let dlq = common::queue(&sqs, "idem-drain-dlq", false).await;
    let started = Arc::new(AtomicU32::new(0));
    // The handlers run until the test lets them finish, a second after the stop.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (s, g) = (Arc::clone(&started), Arc::clone(&gate));
    let handler = move |_msg: SqsMessage, _ctx: HandlerContext| {
        let (started, gate) = (Arc::clone(&s), Arc::clone(&g));
        async move {
            started.fetch_add(1, Ordering::SeqCst);
            gate.acquire().await.expect("gate open").forget();
            Ok::<_, HandlerError>(())
        }
    };
    let executor = Executor::new(Arc::new(MemoryStore::new()), config("drain")).unwrap();
    let running = start(executor, &queue, &dlq, options(), handler);
    let stats = Arc::clone(&running.1);
    send(
        &sqs,
        &queue,
        &[
            Out::keyed("d-1", "{}"),
            Out::keyed("d-2", "{}"),
            Out::keyed("d-3", "{}"),
        ],
    )
    .await;
    assert!(
        wait_for(Duration::from_secs(10), || async {
            started.load(Ordering::SeqCst) == 3
        })
        .await
    );
    let stopping = Instant::now();
    let release = Arc::clone(&gate);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        release.add_permits(3);
    });
    stop(running).await;
    let took = stopping.elapsed();
    assert!(
        took >= Duration::from_secs(1),
        "returned before the handlers finished"
    );
    assert_eq!((stats.executed(), stats.deleted()), (3, 3), "{stats:?}");
    assert_eq!(stats.abandoned(), 0);
    assert_eq!(
        counts(&sqs, &queue).await,
        (0, 0),
        "deleted before the runner returned"
    );
    assert!(took < Duration::from_secs(10), "drained in {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transactional_executor_commits_the_effect_once() {
    if !localstack() {
        return;
    }
    init_tracing();
    let sqs = client();
    let queue = queue(&sqs, "idem-tx", false).await;
    let dlq = common::queue(&sqs, "idem-tx-dlq", false).await;
    let store = Arc::new(MemoryStore::new());
    let executor = Executor::transactional(Arc::clone(&store), config("tx")).unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let r = Arc::clone(&runs);
    let handler = move |msg: SqsMessage, ctx: HandlerContext| {
        let runs = Arc::clone(&r);
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            let key = key_of(&ctx);
            let writes = MemoryWrites::new().put(format!("ledger/{key}"), msg.body().to_owned());
            Ok::<_, HandlerError>(Commit::new(format!("booked {key}"), writes))
        }
    };
    let running = start(executor, &queue, &dlq, options(), handler);
    let stats = Arc::clone(&running.1);
    send(&sqs, &queue, &[Out::keyed("tx-1", "-10")]).await;
    assert!(wait_for(Duration::from_secs(10), || async { stats.executed() == 1 }).await);
    send(&sqs, &queue, &[Out::keyed("tx-1", "-10")]).await;
    assert!(wait_for(Duration::from_secs(10), || async { stats.replayed() == 1 }).await);
    stop(running).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        store.effect("ledger/tx-1").as_deref(),
        Some(&b"-10"[..]),
        "the effect committed with the completion"
    );
    assert_eq!(counts(&sqs, &queue).await, (0, 0));
}

/// No server needed: the builder's checks.
#[test]
fn the_builder_wants_a_separate_dead_letter_queue() {
    let executor = Executor::new(Arc::new(MemoryStore::new()), config("build")).unwrap();
    let handler = |_m: SqsMessage, _c: HandlerContext| async { Ok::<_, HandlerError>(()) };
    let r = SqsRunner::builder(client(), "http://q", executor.clone(), handler).build();
    assert!(
        matches!(
            r,
            Err(RunnerError::Config {
                field: "dead_letter_queue",
                ..
            })
        ),
        "{r:?}"
    );
    let r = SqsRunner::builder(client(), "http://q", executor.clone(), handler)
        .dead_letter_queue("http://q")
        .build();
    assert!(
        matches!(
            r,
            Err(RunnerError::Config {
                field: "dead_letter_queue",
                ..
            })
        ),
        "{r:?}"
    );
    let r = SqsRunner::builder(client(), "http://q", executor.clone(), handler)
        .dead_letter_queue("http://dlq")
        .configure(|o| {
            o.with_visibility_timeout(Duration::from_secs(4))
                .with_visibility_extend_interval(Duration::from_secs(2))
        })
        .build();
    assert!(
        matches!(
            r,
            Err(RunnerError::Config {
                field: "visibility_extend_interval",
                ..
            })
        ),
        "an extension every 2 s, more than a third of a 4 s visibility (half was allowed): {r:?}"
    );
    let r = SqsRunner::builder(client(), "http://q", executor, handler)
        .dead_letter_queue("http://dlq")
        .configure(|o| o.with_wait_time(Duration::ZERO))
        .build();
    assert!(
        matches!(
            r,
            Err(RunnerError::Config {
                field: "wait_time",
                ..
            })
        ),
        "short polling, an empty queue asked again at once in a loop: {r:?}"
    );
}
