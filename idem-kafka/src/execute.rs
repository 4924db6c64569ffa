//! Everything the runner asks of the executor, in one place: one executor batch per try of a
//! partition's records (with the handler wrapped for revocations), the record's key id for the dead-letter
//! headers, and the attempt count the store holds. The rest of the runner sees only what a try
//! came to ([`Step`]) and its [`BrokerAction`](idem_executor::BrokerAction).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use idem_executor::{
    Codec, Executor, ExecutorError, Handler, HandlerError, Outcome, Plain, Recorder, StoreStage,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use crate::message::KafkaMessage;
use crate::options::RunnerOptions;
use crate::stats::{RunnerStats, metric_names as m};

/// The executor and the handler of a runner, shared by its partition workers.
pub(crate) struct Execution<H, C, R = Plain> {
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

/// How one try of a record ended.
pub(crate) enum Step<T> {
    /// The executor batch returned: per record, in order, what it came to and the attempt of
    /// the handler run for it in this batch (0 when the handler did not run).
    Done {
        results: Vec<(Result<Outcome<T>, ExecutorError>, u32)>,
    },
    /// The partition was revoked and the batch dropped past the revoke timeout (its leases are
    /// left to expire).
    Revoked,
}

impl<H, C: Codec, R: Recorder> Execution<H, C, R> {
    pub(crate) fn new(executor: Executor<C, R>, handler: H) -> Self {
        Self {
            executor,
            handler: Arc::new(handler),
        }
    }

    /// One executor batch for `msgs` (records of one partition, in offset order), with each
    /// handler wrapped for revocations (`revoke`):
    ///
    /// - revoked before its handler was called: the lease is released (no attempt counted) and
    ///   the handler is not run; it reports a failure, which the store refuses on the released
    ///   lease (`LeaseLost`: nothing recorded), so the next owner acquires the key at once. Should
    ///   the release fail, that failure is recorded instead (retryable: one attempt counted, as
    ///   a takeover after the lease expired would count it, and the key is free at once);
    /// - revoked while the handler runs: it is let finish for half the revoke timeout, then
    ///   signalled through [`HandlerContext::cancellation_token`](idem_executor::HandlerContext::cancellation_token)
    ///   (the executor then takes its result if it returns at once, else drops it and records
    ///   nothing). A result is recorded and resolved as usual. The lease is **never** released
    ///   once the handler started: if the call still has to be dropped, the lease expires and the
    ///   next owner sees a takeover and the next attempt number.
    pub(crate) async fn try_batch<T>(
        &self,
        msgs: &[KafkaMessage],
        revoke: &CancellationToken,
        options: &RunnerOptions,
        stats: &Arc<RunnerStats>,
    ) -> Step<T>
    where
        H: Handler<KafkaMessage, R::Returns<T>>,
        T: Serialize + DeserializeOwned + Send + 'static,
        R::Returns<T>: Send,
    {
        let attempts: Vec<AtomicU32> = msgs.iter().map(|_| AtomicU32::new(0)).collect();
        let release_timeout = options.release_timeout;
        let revoke_timeout = options.revoke_timeout;
        let attempts_ref = &attempts;
        let call = self.executor.run_batch(msgs, |i, ctx| {
            attempts_ref[i].store(ctx.attempt(), Ordering::Relaxed);
            let handler = Arc::clone(&self.handler);
            let store = self.executor.store().clone();
            let stats = Arc::clone(stats);
            let record = msgs[i].clone();
            let watched = revoke.clone();
            async move {
                if !watched.is_cancelled() {
                    let cancel = ctx.cancellation_token().clone();
                    let mut run = std::pin::pin!(handler.call(record, ctx));
                    tokio::select! {
                        biased;
                        result = &mut run => return result,
                        () = watched.cancelled() => {}
                    }
                    // Revoked while it runs: let it finish, then ask it to stop. Never release.
                    if let Ok(result) = tokio::time::timeout(revoke_timeout / 2, &mut run).await {
                        return result;
                    }
                    tracing::warn!(
                        "partition revoked: the handler is still running; signalling its cancellation token"
                    );
                    cancel.cancel();
                    return run.await;
                }
                // Revoked before the handler was called: give the key back without counting an
                // attempt; the failure reported next is refused on the released lease.
                if let Some(lease) = ctx.lease().cloned() {
                    match tokio::time::timeout(release_timeout, store.release(&lease)).await {
                        Ok(Ok(())) => {
                            RunnerStats::count(&stats.released, m::RELEASED);
                            tracing::info!(key = %lease.key, token = %lease.token, "partition revoked before the handler started: lease released");
                        }
                        Ok(Err(e)) => {
                            tracing::warn!(key = %lease.key, error = %e, "partition revoked: lease release failed; recording a retryable failure instead");
                        }
                        Err(_) => {
                            tracing::warn!(key = %lease.key, "partition revoked: lease release timed out; recording a retryable failure instead");
                        }
                    }
                }
                Err(HandlerError::retryable(
                    "the partition was revoked before the handler started",
                ))
            }
        });
        // Once revoked, the call gets most of the revoke timeout (the revocation waits for the
        // worker that long), then it is dropped and its leases left to expire.
        let revoke = revoke.clone();
        let deadline = async move {
            revoke.cancelled().await;
            tokio::time::sleep(revoke_timeout.mul_f64(0.9)).await;
        };
        let results = tokio::select! {
            biased;
            results = call => results,
            () = deadline => {
                tracing::warn!(
                    "partition revoked: the executor batch did not end in time and is dropped; its leases (not released) expire and the next owner takes them over"
                );
                return Step::Revoked;
            }
        };
        let results = match results {
            Ok(results) => results,
            // The worker never makes a batch larger than the store takes.
            Err(e) => {
                let retry_after = self.executor.config().retry_delay;
                msgs.iter()
                    .map(|_| {
                        Err(ExecutorError::Store {
                            stage: StoreStage::Acquire,
                            handler_ran: false,
                            retry_after,
                            source: idem_core::Error::invalid("batch", e.to_string()),
                        })
                    })
                    .collect()
            }
        };
        Step::Done {
            results: results
                .into_iter()
                .zip(attempts)
                .map(|(result, attempt)| (result, attempt.into_inner()))
                .collect(),
        }
    }

    /// The largest batch the store takes.
    pub(crate) fn max_batch(&self) -> usize {
        self.executor.store().limits().max_batch
    }

    /// The record's idempotency key id, when it has a readable one.
    pub(crate) fn key_id(&self, msg: &KafkaMessage) -> Option<String> {
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
