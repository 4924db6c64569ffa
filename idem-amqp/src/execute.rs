//! Everything the runner asks of the executor, in one place: one executor call per delivery
//! (with the handler wrapped for lost deliveries), the key id for the dead-letter headers, and
//! the attempt count the store holds.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem_executor::{Codec, Executor, ExecutorError, Handler, Message, Outcome, Recorder};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use crate::stats::{RunnerStats, metric_names as m};

/// The executor and the handler of a runner, shared by its delivery tasks.
pub(crate) struct Execution<H, C, R> {
    executor: Executor<C, R>,
    handler: Arc<H>,
}

impl<H, C, R> Clone for Execution<H, C, R> {
    fn clone(&self) -> Self {
        Self {
            executor: self.executor.clone(),
            handler: Arc::clone(&self.handler),
        }
    }
}

/// How one executor call for a delivery ended.
pub(crate) enum Step<T> {
    /// The executor call returned.
    Done {
        /// What it returned.
        result: Result<Outcome<T>, ExecutorError>,
        /// The attempt of the handler run in this call; 0 when the handler did not run.
        attempt: u32,
    },
    /// The delivery was lost and the call dropped: before the handler started (the lease was
    /// released, or its release tried), or past the orphan timeout (the lease is left to expire).
    Abandoned,
}

/// The timeouts of a lost delivery.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LostTimeouts {
    /// How long a started handler may go on after the loss (signalled half-way).
    pub(crate) orphan: Duration,
    /// Longest wait for the release of a lease whose handler had not started.
    pub(crate) release: Duration,
}

impl<H, C: Codec, R: Recorder> Execution<H, C, R> {
    pub(crate) fn new(executor: Executor<C, R>, handler: H) -> Self {
        Self {
            executor,
            handler: Arc::new(handler),
        }
    }

    /// One executor call for `msg`, with the handler wrapped for a loss of the delivery
    /// (`lost`: its channel closed, or the drain timed out):
    ///
    /// - lost before the handler was called: the lease is released (no attempt counted) and the
    ///   call abandoned, so the redelivery acquires the key at once;
    /// - lost while the handler runs: it is let finish for half the orphan timeout (its result is
    ///   recorded, and the redelivery replays it), then signalled through
    ///   [`HandlerContext::cancellation_token`](idem_executor::HandlerContext::cancellation_token);
    ///   the lease is **never** released once the handler started: if the call still has to be
    ///   dropped, the lease expires and the next owner sees a takeover.
    pub(crate) async fn try_once<M, T>(
        &self,
        msg: &M,
        lost: &CancellationToken,
        timeouts: LostTimeouts,
        stats: &Arc<RunnerStats>,
    ) -> Step<T>
    where
        M: Message + Clone + Send + Sync + 'static,
        H: Handler<M, R::Returns<T>>,
        T: Serialize + DeserializeOwned + Send + 'static,
    {
        let attempt = Arc::new(AtomicU32::new(0));
        let released = CancellationToken::new();
        let handler = Arc::clone(&self.handler);
        let store = self.executor.store().clone();
        let stats = Arc::clone(stats);
        let record = msg.clone();
        let signal = released.clone();
        let ran = Arc::clone(&attempt);
        let watched = lost.clone();
        let call = self.executor.run(msg, move |ctx| async move {
            ran.store(ctx.attempt(), Ordering::Relaxed);
            if !watched.is_cancelled() {
                let cancel = ctx.cancellation_token().clone();
                let mut run = std::pin::pin!(handler.call(record, ctx));
                tokio::select! {
                    biased;
                    result = &mut run => return result,
                    () = watched.cancelled() => {}
                }
                // Lost while it runs: let it finish, then ask it to stop. Never release.
                if let Ok(result) = tokio::time::timeout(timeouts.orphan / 2, &mut run).await {
                    return result;
                }
                tracing::warn!(
                    "delivery lost: the handler is still running; signalling its cancellation token"
                );
                cancel.cancel();
                return run.await;
            }
            // Lost before the handler was called: give the key back without counting an
            // attempt, then never return, so the executor records nothing (the caller drops this
            // call).
            if let Some(lease) = ctx.lease().cloned() {
                match tokio::time::timeout(timeouts.release, store.release(&lease)).await {
                    Ok(Ok(())) => {
                        RunnerStats::count(&stats.released, m::RELEASED);
                        tracing::info!(key = %lease.key, token = %lease.token, "delivery lost before the handler started: lease released");
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(key = %lease.key, error = %e, "delivery lost: lease release failed; the key stays held until its lease expires");
                    }
                    Err(_) => {
                        tracing::warn!(key = %lease.key, "delivery lost: lease release timed out; the key stays held until its lease expires");
                    }
                }
            }
            signal.cancel();
            std::future::pending().await
        });
        // Once lost, the call gets most of the orphan timeout, then it is dropped and its lease
        // left to expire.
        let lost = lost.clone();
        let deadline = async move {
            lost.cancelled().await;
            tokio::time::sleep(timeouts.orphan.mul_f64(0.9)).await;
        };
        tokio::select! {
            biased;
            result = call => Step::Done { result, attempt: attempt.load(Ordering::Relaxed) },
            () = released.cancelled() => Step::Abandoned,
            () = deadline => {
                tracing::warn!(
                    "delivery lost: the executor call did not end in time and is dropped; its lease (not released) expires and the next owner takes it over"
                );
                Step::Abandoned
            }
        }
    }

    /// The message's idempotency key id, when it has a readable one.
    pub(crate) fn key_id<M: Message>(&self, msg: &M) -> Option<String> {
        self.executor
            .config()
            .key_source
            .extract(msg)
            .ok()
            .flatten()
    }

    /// The attempt count the store holds for the key (best effort, for the dead-letter header).
    pub(crate) async fn stored_attempts(&self, key_id: Option<&str>) -> Option<u32> {
        let key = self.executor.namespace().key(key_id?).ok()?;
        match self.executor.store().get(&key).await {
            Ok(Some(record)) => Some(record.attempts),
            _ => None,
        }
    }
}

/// The outcome's name for logs, or `store_error` / `error`.
pub(crate) fn outcome_name<T>(result: &Result<Outcome<T>, ExecutorError>) -> &'static str {
    match result {
        Ok(outcome) => outcome.name(),
        Err(ExecutorError::Store { .. }) => "store_error",
        Err(_) => "error",
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use idem_core::{IdempotencyStore, MemoryStore, RecordState};
    use idem_executor::{ExecutorConfig, HandlerContext, HandlerError, RawMessage};

    use super::*;

    fn execution(
        store: Arc<MemoryStore>,
        handler: impl Fn(
            RawMessage,
            HandlerContext,
        ) -> futures::future::BoxFuture<'static, Result<u32, HandlerError>>
        + Send
        + Sync
        + 'static,
    ) -> Execution<impl Handler<RawMessage, u32>, idem_executor::JsonCodec, idem_executor::Plain>
    {
        let executor = Executor::new(store, ExecutorConfig::new("t")).unwrap();
        Execution::new(executor, handler)
    }

    const TIMEOUTS: LostTimeouts = LostTimeouts {
        orphan: Duration::from_millis(400),
        release: Duration::from_millis(200),
    };

    fn msg() -> RawMessage {
        RawMessage::new("{}").with_header("idempotency-key", "k")
    }

    async fn state(store: &MemoryStore) -> (RecordState, u32) {
        let key = idem_core::Namespace::new("t").unwrap().key("k").unwrap();
        let record = store.get(&key).await.unwrap().unwrap();
        (record.state, record.attempts)
    }

    #[tokio::test]
    async fn lost_before_the_handler_starts_releases_without_counting() {
        let store = Arc::new(MemoryStore::new());
        let exec = execution(store.clone(), |_, ctx| {
            Box::pin(async move { Ok(ctx.attempt()) })
        });
        let stats = Arc::new(RunnerStats::default());
        let lost = CancellationToken::new();
        lost.cancel();
        let step = exec
            .try_once::<_, u32>(&msg(), &lost, TIMEOUTS, &stats)
            .await;
        assert!(matches!(step, Step::Abandoned));
        assert_eq!(stats.released(), 1);
        assert!(matches!(state(&store).await.0, RecordState::Released));
        // The next delivery runs at once, as the same first attempt.
        let step = exec
            .try_once::<_, u32>(&msg(), &CancellationToken::new(), TIMEOUTS, &stats)
            .await;
        match step {
            Step::Done {
                result: Ok(Outcome::Executed(attempt)),
                attempt: ran,
            } => assert_eq!((attempt, ran), (1, 1)),
            _ => panic!("not executed"),
        }
    }

    #[tokio::test]
    async fn lost_while_running_lets_the_handler_finish_and_record() {
        let store = Arc::new(MemoryStore::new());
        let exec = execution(store.clone(), |_, _| {
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok(7)
            })
        });
        let stats = Arc::new(RunnerStats::default());
        let lost = CancellationToken::new();
        let cancel = lost.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            cancel.cancel();
        });
        let step = exec
            .try_once::<_, u32>(&msg(), &lost, TIMEOUTS, &stats)
            .await;
        assert!(matches!(
            step,
            Step::Done {
                result: Ok(Outcome::Executed(7)),
                ..
            }
        ));
        assert!(matches!(
            state(&store).await.0,
            RecordState::Completed { .. }
        ));
        assert_eq!(stats.released(), 0, "a started handler is never released");
    }

    #[tokio::test]
    async fn a_handler_still_running_past_the_orphan_timeout_is_dropped_not_released() {
        let store = Arc::new(MemoryStore::new());
        let exec = execution(store.clone(), |_, _| {
            Box::pin(async move {
                tokio::time::sleep(Duration::from_secs(30)).await;
                Ok(0)
            })
        });
        let stats = Arc::new(RunnerStats::default());
        let lost = CancellationToken::new();
        let cancel = lost.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            cancel.cancel();
        });
        let started = std::time::Instant::now();
        let step = exec
            .try_once::<_, u32>(&msg(), &lost, TIMEOUTS, &stats)
            .await;
        // Signalled half-way: the executor drops the handler (nothing recorded).
        assert!(matches!(
            step,
            Step::Abandoned
                | Step::Done {
                    result: Ok(Outcome::LeaseLost { .. }),
                    ..
                }
        ));
        assert!(started.elapsed() < Duration::from_secs(2));
        assert!(
            matches!(state(&store).await, (RecordState::InProgress, _)),
            "left to expire"
        );
        assert_eq!(stats.released(), 0);
    }
}
