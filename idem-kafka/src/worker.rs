//! One partition's worker: takes its records in offset order and resolves them one at a time.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use idem_executor::{BrokerAction, Codec, ExecutorError, Handler, Outcome, Plain, Recorder};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::dead_letter::{self, DeadLetterInfo, DeadLetterProducer};
use crate::execute::{Execution, Step};
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
    /// gets the revoke timeout to finish (see [`Execution::try_once`]), nothing more starts.
    pub(crate) revoke: CancellationToken,
    /// Dropped when the worker ends; the poll thread waits on it.
    pub(crate) _exited: std::sync::mpsc::Sender<()>,
    pub(crate) _result: PhantomData<fn() -> T>,
}

/// Pause before writing to the dead-letter topic again after a failed write (clamped to the
/// retry delays).
const DEAD_LETTER_RETRY_HINT: std::time::Duration = std::time::Duration::from_secs(1);

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
            lock(&self.flow).taken();
            let span = tracing::debug_span!(
                "idem_kafka_record",
                topic = msg.topic(),
                partition = msg.partition(),
                offset = msg.offset()
            );
            match self.process(&msg).instrument(span).await {
                Next::Continue => {}
                Next::Stop => return,
                Next::Abandoned => {
                    RunnerStats::bump(&self.common.stats.abandoned);
                    return;
                }
            }
        }
    }

    /// Processes one record until it is resolved or the worker must stop.
    async fn process(&self, msg: &KafkaMessage) -> Next {
        let common = &self.common;
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
            let step = common
                .execution
                .try_once(msg, &self.revoke, &common.options, &common.stats)
                .await;
            drop(permit);
            let (result, attempt) = match step {
                Step::Revoked => return Next::Abandoned,
                Step::Done { result, attempt } => (result, attempt),
            };
            let revoked = self.revoke.is_cancelled();
            let delay = match BrokerAction::of(&result) {
                BrokerAction::Ack => {
                    match &result {
                        Ok(Outcome::Executed(_)) => {
                            RunnerStats::count(&common.stats.executed, m::EXECUTED);
                        }
                        Ok(Outcome::Replayed(_)) => {
                            RunnerStats::count(&common.stats.replayed, m::REPLAYED);
                        }
                        _ => RunnerStats::bump(&common.stats.acked_other),
                    }
                    self.resolved(msg);
                    tracing::debug!(outcome = outcome_name(&result), "resolved");
                    // Resolved even when revoked meanwhile: the revocation commits it.
                    return if revoked { Next::Stop } else { Next::Continue };
                }
                _ if revoked => return Next::Abandoned,
                BrokerAction::DeadLetter { reason, error } => {
                    let info = dead_letter::classify(&result, reason, error, attempt);
                    drop(result);
                    // The outcome is final: only the dead-letter write is tried again, never the
                    // executor call (which, for an un-deduplicated record, would run the handler
                    // again).
                    return self.dead_letter_until_written(msg, &info).await;
                }
                BrokerAction::Retry { after } => {
                    tracing::debug!(
                        outcome = outcome_name(&result),
                        hint = ?after,
                        "not resolved: pausing the partition before trying again"
                    );
                    common.options.retry_delay(after)
                }
                _ => common.options.min_retry_delay,
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

    /// Keeps the partition paused for `delay`. `false` when the worker must stop instead
    /// (revoked or shutting down).
    async fn pause_before_retry(&self, delay: std::time::Duration) -> bool {
        let common = &self.common;
        if common.drain.is_cancelled() || self.revoke.is_cancelled() {
            return false;
        }
        RunnerStats::count(&common.stats.retries, m::RETRIES);
        lock(&self.flow).set_retry_wait(true);
        let slept = tokio::select! {
            biased;
            () = self.revoke.cancelled() => false,
            () = common.drain.cancelled() => false,
            () = tokio::time::sleep(delay) => true,
        };
        lock(&self.flow).set_retry_wait(false);
        slept
    }

    /// Writes the record to the dead-letter topic; on success it is resolved.
    async fn dead_letter(&self, msg: &KafkaMessage, info: &DeadLetterInfo) -> Result<(), ()> {
        let common = &self.common;
        let key_id = common.execution.key_id(msg);
        let attempts = match info.attempts {
            Some(n) => Some(n),
            None => common.execution.stored_attempts(key_id.as_deref()).await,
        };
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

fn outcome_name<T>(result: &Result<Outcome<T>, ExecutorError>) -> &'static str {
    match result {
        Ok(outcome) => outcome.name(),
        Err(ExecutorError::Store { .. }) => "store_error",
        Err(_) => "error",
    }
}

/// Locks a flow; a poisoned lock (a panic while holding it, which only bookkeeping does) is
/// still usable.
pub(crate) fn lock(flow: &Mutex<Flow>) -> std::sync::MutexGuard<'_, Flow> {
    flow.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
