//! The executor on Redis, batched against unbatched, in the same run.
//!
//! ```text
//! cargo bench -p idem-executor --bench redis_batch
//! ```
//!
//! Needs Redis at `IDEM_REDIS_URL` (default `redis://127.0.0.1:6379`); outside CI it prints one
//! line and measures nothing when Redis is not there.
//!
//! Each message has a fresh key and a no-op handler, so every one costs an acquire and a
//! completion. In alternating rounds (so that both see the same machine and server state):
//!
//! - **unbatched**: 64 tasks, each calling [`Executor::run`] one message at a time;
//! - **batched**: 64 tasks, each calling [`Executor::run_batch`] on 100 messages at a time
//!   (one `acquire_many`, handlers 64 at once, completions grouped into `complete_many`);
//! - for scale, one task calling `run_batch` on 100 messages at a time (one partition's worth).
//!
//! Prints messages per second for each and the ratio batched / unbatched. Asserts nothing.
//! Environment: `IDEM_BENCH_SECONDS` (default 3) per measurement, `IDEM_BENCH_ROUNDS` (default 2).

#![allow(missing_docs)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idem_executor::{Executor, ExecutorConfig, HandlerError, Outcome, RawMessage};
use idem_redis::RedisStore;

const TASKS: usize = 64;
const BATCH: usize = 100;
/// Short: the bench's records expire soon after the run.
const RETENTION: Duration = Duration::from_secs(120);

fn env_or<T: std::str::FromStr>(var: &str, default: T) -> T {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn message(key: String) -> RawMessage {
    RawMessage::new(Vec::new()).with_header("idempotency-key", key)
}

/// `tasks` tasks, each processing batches of `batch` messages (`None`: one message per
/// `run` call) for `seconds`; messages per second.
async fn rate(
    executor: &Executor,
    run: &str,
    tasks: usize,
    batch: Option<usize>,
    seconds: f64,
) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let mut handles = Vec::new();
    for task in 0..tasks {
        let (executor, done, run) = (executor.clone(), done.clone(), run.to_owned());
        handles.push(tokio::spawn(async move {
            let mut i = 0u64;
            while Instant::now() < deadline {
                match batch {
                    None => {
                        let msg = message(format!("{run}-{task}-{i}"));
                        i += 1;
                        let outcome = executor
                            .run(&msg, |_| async { Ok::<_, HandlerError>(()) })
                            .await
                            .expect("run");
                        assert!(matches!(outcome, Outcome::Executed(())), "{outcome:?}");
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    Some(len) => {
                        let msgs: Vec<RawMessage> = (0..len)
                            .map(|_| {
                                i += 1;
                                message(format!("{run}-{task}-{i}"))
                            })
                            .collect();
                        let outcomes = executor
                            .run_batch(&msgs, |_, _| async { Ok::<_, HandlerError>(()) })
                            .await
                            .expect("batch size");
                        for outcome in outcomes {
                            let outcome = outcome.expect("run");
                            assert!(matches!(outcome, Outcome::Executed(())), "{outcome:?}");
                        }
                        done.fetch_add(len as u64, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    for h in handles {
        h.await.expect("task");
    }
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    let Some(url) =
        idem_conformance::servers::endpoint("redis", "IDEM_REDIS_URL", "redis://127.0.0.1:6379")
    else {
        return;
    };
    let seconds: f64 = env_or("IDEM_BENCH_SECONDS", 3.0);
    let rounds: usize = env_or("IDEM_BENCH_ROUNDS", 2);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let store = Arc::new(RedisStore::connect(&url).await.expect("connect"));
        let stamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock")
            .as_millis();
        let executor = Executor::new(
            store,
            ExecutorConfig::new(format!("bench-batch-{stamp}"))
                .with_owner("bench")
                .with_retention(RETENTION),
        )
        .expect("config");
        // Warm-up: connections, scripts loaded.
        rate(&executor, "warm", TASKS, Some(BATCH), 0.5).await;
        rate(&executor, "warm1", TASKS, None, 0.5).await;
        let (mut single, mut batched, mut one) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            single.push(rate(&executor, &format!("s{round}"), TASKS, None, seconds).await);
            batched.push(rate(&executor, &format!("b{round}"), TASKS, Some(BATCH), seconds).await);
            one.push(rate(&executor, &format!("o{round}"), 1, Some(BATCH), seconds).await);
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let (single, batched, one) = (mean(&single), mean(&batched), mean(&one));
        println!(
            "executor on Redis ({url}), fresh keys, no-op handler, {rounds} rounds of {seconds} s:"
        );
        println!("  unbatched: {TASKS} tasks x run()                 {single:>10.0} msgs/s");
        println!("  batched:   {TASKS} tasks x run_batch({BATCH})     {batched:>10.0} msgs/s");
        println!("  batched:    1 task  x run_batch({BATCH})     {one:>10.0} msgs/s");
        println!(
            "  ratio batched / unbatched ({TASKS} tasks): {:.2}x",
            batched / single
        );
    });
}
