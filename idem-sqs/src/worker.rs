//! One message from receipt to resolution: the executor call, then the delete, the retry or the
//! dead-letter send, with the message's visibility extended all along.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::ChangeMessageVisibilityBatchRequestEntry;
use idem_executor::broker::{self, DeadLetterInfo, Execution, Fit, Step, outcome_name};
use idem_executor::{BrokerAction, Codec, Handler, Outcome, Recorder};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::call::{self, CallError};
use crate::dead_letter::{self, DeadLetterQueue};
use crate::deleter::Deleter;
use crate::message::SqsMessage;
use crate::options::{MAX_BATCH, RunnerOptions, seconds_up};
use crate::stats::{RunnerStats, metric_names as m};

/// Everything the message tasks of one run share.
pub(crate) struct Common<H, C, R> {
    pub(crate) execution: Execution<H, C, R>,
    pub(crate) client: Client,
    pub(crate) queue_url: Arc<str>,
    pub(crate) dead_letter: DeadLetterQueue,
    pub(crate) options: Arc<RunnerOptions>,
    pub(crate) stats: Arc<RunnerStats>,
    pub(crate) deleter: Deleter,
    /// How often the visibility of a message in process is extended.
    pub(crate) extend_every: Duration,
    /// Cancelled at shutdown: start no other message of a FIFO group.
    pub(crate) drain: CancellationToken,
    /// Cancelled at the drain timeout: the messages in process are lost
    /// ([`Execution::try_once`]).
    pub(crate) lost: CancellationToken,
}

/// Whether the visibility of a message is still extended: `false` once its final change is made
/// (a retry's or a release's). The lock is held while an extension is in flight, so that the
/// final change waits for it and no extension is sent after it: SQS keeps whichever change
/// reaches it last, and an extension after a retry's would undo the retry delay. (An extension
/// that timed out may still reach SQS later; nothing on the client can rule that out.)
type Extending = tokio::sync::Mutex<bool>;

/// How a message ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Done {
    /// Deleted (acknowledged or dead-lettered), or its delete failed: either way the next message
    /// of its FIFO group may go.
    Resolved,
    /// Made visible again after `visibility` seconds: on a FIFO queue the rest of its group
    /// must wait for it.
    Retried {
        /// The visibility timeout set, in seconds.
        visibility: i32,
    },
}

impl<H, C, R> Common<H, C, R>
where
    C: Codec,
    R: Recorder,
{
    /// Processes `msg` until it is resolved or retried, extending its visibility meanwhile;
    /// `waited`: it waited in memory (a FIFO group's message behind others), so its visibility
    /// is extended at once, its last extension being up to an interval old.
    pub(crate) async fn process<T>(&self, msg: &SqsMessage, waited: bool) -> Done
    where
        H: Handler<SqsMessage, R::Returns<T>>,
        R::Returns<T>: Send,
        T: Serialize + DeserializeOwned + Send + 'static,
    {
        let extending = Extending::new(true);
        tokio::select! {
            biased;
            done = self.resolve::<T>(msg, &extending) => done,
            never = self.keep_visible(msg, waited, &extending) => match never {},
        }
    }

    /// Extends the visibility of `msg` every `extend_every`, for as long as it is polled (the
    /// whole processing of the message: the acquire, the handler under its lease, the
    /// completion, the dead-letter send, the delete). A failed extension is logged and counted;
    /// the next one comes at the next interval, before the visibility runs out (the interval is
    /// at most half the visibility timeout). None once the final change is made (`extending`).
    async fn keep_visible(
        &self,
        msg: &SqsMessage,
        at_once: bool,
        extending: &Extending,
    ) -> Infallible {
        let visibility = seconds_up(self.options.visibility_timeout);
        let mut next = Instant::now()
            + if at_once {
                Duration::ZERO
            } else {
                self.extend_every
            };
        loop {
            tokio::time::sleep_until(next).await;
            next += self.extend_every;
            let extending = extending.lock().await;
            if !*extending {
                // Its final change is made: nothing more to do until `resolve` returns.
                drop(extending);
                return std::future::pending().await;
            }
            let sent = self
                .change_visibility(msg, visibility, self.extension_timeout())
                .await;
            drop(extending);
            match sent {
                Ok(_) => RunnerStats::count(
                    &self.stats.visibility_extensions,
                    m::VISIBILITY_EXTENSIONS,
                    1,
                ),
                Err(e) => {
                    RunnerStats::count(&self.stats.visibility_failures, m::VISIBILITY_FAILURES, 1);
                    tracing::warn!(error = %e, "visibility extension failed; trying again at the next interval");
                }
            }
        }
    }

    /// One `ChangeMessageVisibility` of `msg` to `seconds`, waiting at most `timeout`.
    async fn change_visibility(
        &self,
        msg: &SqsMessage,
        seconds: i32,
        timeout: Duration,
    ) -> Result<(), CallError> {
        let change = self
            .client
            .change_message_visibility()
            .queue_url(&*self.queue_url)
            .receipt_handle(msg.receipt_handle())
            .visibility_timeout(seconds)
            .send();
        call::bounded(timeout, change).await.map(|_| ())
    }

    /// The executor call and what follows from its broker action.
    async fn resolve<T>(&self, msg: &SqsMessage, extending: &Extending) -> Done
    where
        H: Handler<SqsMessage, R::Returns<T>>,
        R::Returns<T>: Send,
        T: Serialize + DeserializeOwned + Send + 'static,
    {
        let step = self
            .execution
            .try_once::<_, T>(msg, &self.lost, self.options.lost_timeouts())
            .await;
        let (result, attempt) = match step {
            Step::Done { result, attempt } => (result, attempt),
            Step::Abandoned { lease_released } => {
                if lease_released {
                    RunnerStats::count(&self.stats.leases_released, m::RELEASED, 1);
                }
                RunnerStats::count(&self.stats.abandoned, m::ABANDONED, 1);
                // Nothing recorded for this call: the message may come back at once.
                let mut extending = extending.lock().await;
                *extending = false;
                self.release(std::slice::from_ref(msg), 0).await;
                return Done::Retried { visibility: 0 };
            }
        };
        match BrokerAction::of(&result) {
            BrokerAction::Ack => {
                let stats = &self.stats;
                match &result {
                    Ok(Outcome::Executed(_)) => RunnerStats::count(&stats.executed, m::EXECUTED, 1),
                    Ok(Outcome::Replayed(_)) => RunnerStats::count(&stats.replayed, m::REPLAYED, 1),
                    _ => RunnerStats::bump(&stats.acked_other),
                }
                tracing::debug!(outcome = outcome_name(&result), "acknowledged: deleting");
                drop(result);
                self.delete(msg).await;
                Done::Resolved
            }
            BrokerAction::DeadLetter { reason, error } => {
                let info = broker::classify(&result, reason, error, attempt);
                drop(result);
                self.dead_letter_until_sent(msg, &info).await;
                self.delete(msg).await;
                Done::Resolved
            }
            BrokerAction::Retry { after } => {
                tracing::debug!(outcome = outcome_name(&result), hint = ?after, "not resolved: received again later");
                Done::Retried {
                    visibility: self.retry(msg, after, extending).await,
                }
            }
            _ => Done::Retried {
                visibility: self
                    .retry(msg, self.options.min_retry_delay, extending)
                    .await,
            },
        }
    }

    async fn delete(&self, msg: &SqsMessage) {
        if let Err(e) = self.deleter.delete(msg.receipt_handle()).await {
            tracing::warn!(error = %e, "delete failed: SQS delivers the message again once its visibility passes, and the store replays it");
        }
    }

    /// Makes `msg` visible again after `after` (clamped to the retry delays, whole seconds),
    /// after any extension in flight and with none after it; returns the seconds set.
    async fn retry(&self, msg: &SqsMessage, after: Duration, extending: &Extending) -> i32 {
        RunnerStats::count(&self.stats.retries, m::RETRIES, 1);
        let secs = self.options.retry_visibility(after);
        let mut extending = extending.lock().await;
        *extending = false;
        let timeout = self.options.call_timeout;
        if let Err(e) = self.change_visibility(msg, secs, timeout).await {
            RunnerStats::count(&self.stats.visibility_failures, m::VISIBILITY_FAILURES, 1);
            tracing::warn!(error = %e, "could not set the retry visibility: the message comes back when its current visibility passes");
        }
        secs
    }

    /// Sends `msg` to the dead-letter queue, trying again every `dead_letter_retry_delay` until
    /// it is accepted (the executor is not called again: for an un-deduplicated message that
    /// would run the handler again). A shutdown that times out drops it unsent: the message is
    /// then received again, and the store gives the same outcome.
    async fn dead_letter_until_sent(&self, msg: &SqsMessage, info: &DeadLetterInfo) {
        let key_id = self.execution.key_id(msg);
        let attempts = self
            .execution
            .dead_letter_attempts(info, key_id.as_deref())
            .await;
        let mut fit = Fit::first(msg.attributes().is_some_and(|a| !a.is_empty()));
        let attributes_for =
            |fit| dead_letter::attributes(msg, info, attempts, key_id.as_deref(), fit);
        let mut attributes = attributes_for(fit);
        loop {
            match self
                .dead_letter
                .send(&self.client, &self.options, msg, attributes.clone())
                .await
            {
                Ok(()) => {
                    RunnerStats::bump(&self.stats.dead_lettered);
                    metrics::counter!(m::DEAD_LETTERED, "reason" => info.reason.as_str())
                        .increment(1);
                    tracing::warn!(
                        reason = info.reason.as_str(),
                        error = %broker::header_text(&info.error),
                        attempts = ?attempts,
                        key = key_id.as_deref().map(broker::header_text).as_deref(),
                        dead_letter_queue = %self.dead_letter.url,
                        "message dead-lettered"
                    );
                    return;
                }
                Err(e) if dead_letter::refused_as_invalid(&e) && fit.smaller().is_some() => {
                    fit = fit.smaller().unwrap_or(fit);
                    if fit == Fit::Compact {
                        tracing::warn!(error = %e, "the dead-letter queue refused the message with the runner's attributes: sending it with the error, the key and the dropped names cut short");
                    } else {
                        tracing::warn!(error = %e, "the dead-letter queue refused the message with its original attributes: sending it with the runner's only, naming the others");
                    }
                    attributes = attributes_for(fit);
                }
                Err(e) => {
                    RunnerStats::count(
                        &self.stats.dead_letter_failures,
                        m::DEAD_LETTER_FAILURES,
                        1,
                    );
                    tracing::error!(error = %e, "dead-letter send failed; trying again");
                    tokio::time::sleep(self.options.dead_letter_retry_delay).await;
                }
            }
        }
    }
}

/// Why [`Common::set_visibility`] changes messages' visibility.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Change {
    /// Given back unprocessed ([`Common::release`]).
    Release,
    /// Kept invisible while they wait in process (messages of a FIFO group waiting for the
    /// messages before them).
    Extend,
}

impl<H, C, R> Common<H, C, R> {
    /// How long an extension waits for its answer: `call_timeout`, but no longer than the
    /// interval, so that the next one comes before the visibility runs out.
    fn extension_timeout(&self) -> Duration {
        self.options.call_timeout.min(self.extend_every)
    }

    /// Makes `messages` visible again after `visibility` seconds, unprocessed (the rest of a FIFO
    /// group behind a retry, the rest of a group at shutdown, or what a receive returned after the
    /// shutdown began).
    pub(crate) async fn release(&self, messages: &[SqsMessage], visibility: i32) {
        self.set_visibility(messages, visibility, Change::Release)
            .await;
    }

    /// Sets the visibility of `messages` to `visibility` seconds, ten per request.
    pub(crate) async fn set_visibility(
        &self,
        messages: &[SqsMessage],
        visibility: i32,
        change: Change,
    ) {
        let stats = &*self.stats;
        let failed_to = match change {
            Change::Release => {
                "could not make messages visible again: they come back when their visibility passes"
            }
            Change::Extend => {
                "could not extend the visibility of messages waiting for their FIFO group; trying again at the next interval"
            }
        };
        for chunk in messages.chunks(MAX_BATCH) {
            let entries: Vec<ChangeMessageVisibilityBatchRequestEntry> = chunk
                .iter()
                .enumerate()
                .map(|(i, msg)| {
                    ChangeMessageVisibilityBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(msg.receipt_handle())
                        .visibility_timeout(visibility)
                        .build()
                        .expect("id and receipt handle are set")
                })
                .collect();
            let request = self
                .client
                .change_message_visibility_batch()
                .queue_url(&*self.queue_url)
                .set_entries(Some(entries))
                .send();
            let timeout = match change {
                Change::Release => self.options.call_timeout,
                Change::Extend => self.extension_timeout(),
            };
            let sent = call::bounded(timeout, request).await;
            match sent {
                Ok(out) => {
                    let done = out.successful().len() as u64;
                    match change {
                        Change::Release => RunnerStats::add(&stats.released, done),
                        Change::Extend => RunnerStats::count(
                            &stats.visibility_extensions,
                            m::VISIBILITY_EXTENSIONS,
                            done,
                        ),
                    }
                    if !out.failed().is_empty() {
                        RunnerStats::count(
                            &stats.visibility_failures,
                            m::VISIBILITY_FAILURES,
                            out.failed().len() as u64,
                        );
                        tracing::warn!(failed = out.failed().len(), "{failed_to}");
                    }
                }
                Err(e) => {
                    RunnerStats::count(
                        &stats.visibility_failures,
                        m::VISIBILITY_FAILURES,
                        chunk.len() as u64,
                    );
                    tracing::warn!(error = %e, "{failed_to}");
                }
            }
        }
    }
}
