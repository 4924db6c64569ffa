//! One partition's worker: takes its records in offset order, in batches, and resolves them in
//! order.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

use idem_executor::{BrokerAction, Codec, Handler, Outcome, Plain, Recorder};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use idem_executor::broker::{self, DeadLetterInfo, Execution, LostTimeouts, Step};

use crate::dead_letter::{self, DeadLetterProducer};
use crate::flow::Flow;
use crate::message::KafkaMessage;
use crate::options::RunnerOptions;
use crate::stats::{RunnerStats, metric_names as m};

/// Everything a worker shares with the other workers of its runner.
pub(crate) struct Common<H, C, R = Plain> {
    /// The executor and the handler: every executor call goes through it.
    pub(crate) execution: Execution<H, C, R>,
    pub(crate) dead_letter: Arc<DeadLetterProducer>,
    pub(crate) in_flight: Arc<Semaphore>,
    pub(crate) options: Arc<RunnerOptions>,
    pub(crate) stats: Arc<RunnerStats>,
    /// Cancelled when the runner shuts down: finish the record in process, start no other.
    pub(crate) drain: CancellationToken,
}

impl<H, C, R> Clone for Common<H, C, R> {
    fn clone(&self) -> Self {
        Self {
            execution: self.execution.clone(),
            dead_letter: Arc::clone(&self.dead_letter),
            in_flight: Arc::clone(&self.in_flight),
            options: Arc::clone(&self.options),
            stats: Arc::clone(&self.stats),
            drain: self.drain.clone(),
        }
    }
}

pub(crate) struct Worker<H, T, C, R = Plain> {
    pub(crate) common: Common<H, C, R>,
    pub(crate) flow: Arc<Mutex<Flow>>,
    pub(crate) records: mpsc::UnboundedReceiver<KafkaMessage>,
    /// Cancelled when the partition is revoked (or the drain timed out): the record in process
    /// gets the revoke timeout to finish (see [`Execution::try_batch`]), nothing more starts.
    pub(crate) revoke: CancellationToken,
    /// Dropped when the worker ends; the poll thread waits on it.
    pub(crate) _exited: std::sync::mpsc::Sender<()>,
    pub(crate) _result: PhantomData<fn() -> T>,
}

/// Pause before writing to the dead-letter topic again after a failed write (clamped to the
/// retry delays).
const DEAD_LETTER_RETRY_HINT: Duration = Duration::from_secs(1);

/// Retry waits shorter than this keep the partition fetching: a pause drops what the client
/// prefetched, and the refetch after the resume can wait up to `fetch.wait.max.ms` (500 ms by
/// default). The buffer bound still holds meanwhile.
const PAUSE_FROM: Duration = Duration::from_millis(500);

/// What the worker does after a record.
enum Next {
    /// The record is resolved: take the next one.
    Continue,
    /// The record is resolved but the partition was revoked meanwhile: stop.
    Stop,
    /// The record is left unresolved (revoked, or shutting down): stop.
    Abandoned,
}

impl<H, T, C, R> Worker<H, T, C, R>
where
    H: Handler<KafkaMessage, R::Returns<T>>,
    T: Serialize + DeserializeOwned + Send + 'static,
    R::Returns<T>: Send,
    C: Codec,
    R: Recorder,
{
    pub(crate) async fn run(mut self) {
        let max_batch = self
            .common
            .options
            .max_batch
            .min(self.common.execution.max_batch())
            .max(1);
        let mut batch = Vec::with_capacity(max_batch);
        loop {
            let msg = tokio::select! {
                biased;
                () = self.revoke.cancelled() => return,
                () = self.common.drain.cancelled() => return,
                msg = self.records.recv() => match msg {
                    Some(msg) => msg,
                    None => return,
                },
            };
            batch.clear();
            batch.push(msg);
            // Whatever else waits, up to a batch.
            while batch.len() < max_batch {
                match self.records.try_recv() {
                    Ok(msg) => batch.push(msg),
                    Err(_) => break,
                }
            }
            let span = tracing::debug_span!(
                "idem_kafka_batch",
                topic = batch[0].topic(),
                partition = batch[0].partition(),
                offset = batch[0].offset(),
                records = batch.len()
            );
            match self.process(&batch).instrument(span).await {
                Next::Continue => {}
                Next::Stop => return,
                Next::Abandoned => {
                    RunnerStats::bump(&self.common.stats.abandoned);
                    return;
                }
            }
        }
    }

    /// Processes a batch of records (in offset order) until every one is resolved or the worker
    /// must stop. Records are resolved in order: the first one that is not (busy key, retryable
    /// failure, store error) is tried again after a pause together with every record after it
    /// (those that completed meanwhile are then replayed from the store).
    async fn process(&self, batch: &[KafkaMessage]) -> Next {
        let common = &self.common;
        let mut start = 0;
        // Backoff on a busy key, for the record at `start`.
        let mut busy = BusyWait::default();
        // Records whose handler ran and completed here, possibly in a try of the batch that left
        // them unresolved (behind an unresolved record): counted as executed when resolved.
        let mut executed = vec![false; batch.len()];
        loop {
            let permit = tokio::select! {
                biased;
                () = self.revoke.cancelled() => return Next::Abandoned,
                () = common.drain.cancelled() => return Next::Abandoned,
                permit = common.in_flight.acquire() => match permit {
                    Ok(permit) => permit,
                    Err(_) => return Next::Abandoned,
                },
            };
            let timeouts = LostTimeouts {
                orphan: common.options.revoke_timeout,
                release: common.options.release_timeout,
            };
            let steps = common
                .execution
                .try_batch(&batch[start..], &self.revoke, timeouts)
                .await;
            drop(permit);
            let revoked = self.revoke.is_cancelled();
            for (at, step) in steps.iter().enumerate() {
                match step {
                    Step::Done {
                        result: Ok(Outcome::Executed(_)),
                        ..
                    } => executed[start + at] = true,
                    Step::Abandoned {
                        lease_released: true,
                    } => RunnerStats::count(&common.stats.released, m::RELEASED),
                    _ => {}
                }
            }
            let mut delay = None;
            for step in steps {
                // Only a revocation abandons a record (its lease released, or the whole batch
                // dropped past the revoke timeout): the records before it are resolved.
                let Step::Done { result, attempt } = step else {
                    return Next::Abandoned;
                };
                let msg = &batch[start];
                match BrokerAction::of(&result) {
                    BrokerAction::Ack => {
                        match &result {
                            // A replay of what this worker executed in an earlier try of the
                            // batch is counted as the execution it is.
                            Ok(Outcome::Executed(_)) | Ok(Outcome::Replayed(_))
                                if executed[start] =>
                            {
                                RunnerStats::count(&common.stats.executed, m::EXECUTED);
                            }
                            Ok(Outcome::Replayed(_)) => {
                                RunnerStats::count(&common.stats.replayed, m::REPLAYED);
                            }
                            _ => RunnerStats::bump(&common.stats.acked_other),
                        }
                        // Resolved even when revoked meanwhile: the revocation commits it.
                        self.resolved(msg);
                        tracing::debug!(
                            offset = msg.offset(),
                            outcome = broker::outcome_name(&result),
                            "resolved"
                        );
                        start += 1;
                    }
                    _ if revoked => return Next::Abandoned,
                    BrokerAction::DeadLetter { reason, error } => {
                        let info = broker::classify(&result, reason, error, attempt);
                        drop(result);
                        // The outcome is final: only the dead-letter write is tried again, never
                        // the executor call (which, for an un-deduplicated record, would run the
                        // handler again).
                        match self.dead_letter_until_written(msg, &info).await {
                            Next::Continue => start += 1,
                            other => return other,
                        }
                    }
                    BrokerAction::Retry { after } => {
                        tracing::debug!(
                            offset = msg.offset(),
                            outcome = broker::outcome_name(&result),
                            hint = ?after,
                            "not resolved: pausing before trying it again"
                        );
                        delay = Some(match &result {
                            Ok(Outcome::InProgress { retry_after, .. }) => {
                                busy.delay(&common.options, start, *retry_after)
                            }
                            _ => common.options.retry_delay(after),
                        });
                        break;
                    }
                    _ => {
                        delay = Some(common.options.min_retry_delay);
                        break;
                    }
                }
            }
            let Some(delay) = delay else {
                return if revoked { Next::Stop } else { Next::Continue };
            };
            if !self.pause_before_retry(delay).await {
                return Next::Abandoned;
            }
        }
    }

    /// Writes the record to the dead-letter topic until the write succeeds, pausing the partition
    /// between tries; stops (abandoning the record) on revocation or shutdown.
    async fn dead_letter_until_written(&self, msg: &KafkaMessage, info: &DeadLetterInfo) -> Next {
        loop {
            match self.dead_letter(msg, info).await {
                Ok(()) => return Next::Continue,
                Err(()) if self.revoke.is_cancelled() => return Next::Abandoned,
                Err(()) => {}
            }
            let delay = self.common.options.retry_delay(DEAD_LETTER_RETRY_HINT);
            if !self.pause_before_retry(delay).await {
                return Next::Abandoned;
            }
        }
    }

    /// Waits `delay` before a retry, with the partition paused when the wait is long (from
    /// [`PAUSE_FROM`]). `false` when the worker must stop instead
    /// (revoked or shutting down).
    async fn pause_before_retry(&self, delay: Duration) -> bool {
        let common = &self.common;
        if common.drain.is_cancelled() || self.revoke.is_cancelled() {
            return false;
        }
        RunnerStats::count(&common.stats.retries, m::RETRIES);
        let pause = delay >= PAUSE_FROM;
        if pause {
            lock(&self.flow).set_retry_wait(true);
        }
        let slept = tokio::select! {
            biased;
            () = self.revoke.cancelled() => false,
            () = common.drain.cancelled() => false,
            () = tokio::time::sleep(delay) => true,
        };
        if pause {
            lock(&self.flow).set_retry_wait(false);
        }
        slept
    }

    /// Writes the record to the dead-letter topic; on success it is resolved.
    async fn dead_letter(&self, msg: &KafkaMessage, info: &DeadLetterInfo) -> Result<(), ()> {
        let common = &self.common;
        let key_id = common.execution.key_id(msg);
        let attempts = common
            .execution
            .dead_letter_attempts(info, key_id.as_deref())
            .await;
        let headers = dead_letter::headers(msg, info, attempts, key_id.as_deref());
        let sent = tokio::select! {
            biased;
            () = self.revoke.cancelled() => return Err(()),
            sent = common.dead_letter.send(msg, headers) => sent,
        };
        match sent {
            Ok(topic) => {
                RunnerStats::bump(&common.stats.dead_lettered);
                metrics::counter!(m::DEAD_LETTERED, "reason" => info.reason.as_str()).increment(1);
                tracing::warn!(
                    reason = info.reason.as_str(),
                    error = %info.error,
                    attempts = ?attempts,
                    key = key_id.as_deref(),
                    dead_letter_topic = %topic,
                    "record dead-lettered"
                );
                self.resolved(msg);
                Ok(())
            }
            Err(e) => {
                tracing::error!(error = %e, "dead-letter write failed; pausing the partition and trying again");
                Err(())
            }
        }
    }

    fn resolved(&self, msg: &KafkaMessage) {
        lock(&self.flow).resolved(msg.offset());
    }
}

/// The waits before trying again a record whose key another consumer holds: exponential backoff
/// with jitter from `min_retry_delay` to `max_retry_delay`, kept while the same record waits,
/// and never past the holder's lease (`retry_after`): a holder that finishes soon is followed
/// soon, and a crashed one is taken over as soon as its lease ends.
#[derive(Default)]
struct BusyWait {
    /// The record waiting (its index in the batch) and its backoff.
    waiting: Option<(usize, ExponentialBackoff)>,
}

impl BusyWait {
    /// The next wait for the record at `at`, whose key's holder has `retry_after` of lease left.
    fn delay(&mut self, options: &RunnerOptions, at: usize, retry_after: Duration) -> Duration {
        if self
            .waiting
            .as_ref()
            .is_none_or(|(waiting, _)| *waiting != at)
        {
            let backoff = ExponentialBuilder::new()
                .with_min_delay(options.min_retry_delay)
                .with_max_delay(options.max_retry_delay)
                .with_jitter()
                .without_max_times()
                .build();
            self.waiting = Some((at, backoff));
        }
        let next = self
            .waiting
            .as_mut()
            .and_then(|(_, backoff)| backoff.next())
            .unwrap_or(options.max_retry_delay);
        next.min(retry_after + Duration::from_millis(1))
            .clamp(options.min_retry_delay, options.max_retry_delay)
    }
}

/// Locks a flow; a poisoned lock (a panic while holding it, which only bookkeeping does) is
/// still usable.
pub(crate) fn lock(flow: &Mutex<Flow>) -> std::sync::MutexGuard<'_, Flow> {
    flow.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_key_is_looked_at_again_from_milliseconds_up_to_the_cap() {
        let options = RunnerOptions::default();
        let min = options.min_retry_delay;
        let lease_left = Duration::from_secs(30);
        let mut busy = BusyWait::default();
        let first = busy.delay(&options, 0, lease_left);
        // Jitter adds at most the delay itself.
        assert!(first >= min && first <= min * 2, "{first:?}");
        let waits: Vec<Duration> = (0..20)
            .map(|_| busy.delay(&options, 0, lease_left))
            .collect();
        assert!(waits[3] > first, "it grows: {waits:?}");
        assert!(
            waits.iter().all(|w| *w <= options.max_retry_delay),
            "capped: {waits:?}"
        );
        assert_eq!(waits[19], options.max_retry_delay, "{waits:?}");
        // Never past the holder's lease.
        assert_eq!(
            busy.delay(&options, 0, Duration::from_millis(40)),
            Duration::from_millis(41)
        );
        // Another record starts from the shortest wait again.
        let other = busy.delay(&options, 1, lease_left);
        assert!(other <= min * 2, "{other:?}");
    }
}
