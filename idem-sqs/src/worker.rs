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
use crate::error::RunnerError;
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
    /// Raised by a message task that met an error the runner cannot go on with: the receive
    /// loop stops, the runner drains, and [`SqsRunner::run`](crate::SqsRunner::run) returns it.
    pub(crate) fatal: Fatal,
}

/// An error that stops the runner, raised from a message task ([`Common::fatal`]).
#[derive(Debug, Default)]
pub(crate) struct Fatal {
    /// Cancelled once an error is raised.
    raised: CancellationToken,
    /// The first error raised.
    error: std::sync::Mutex<Option<RunnerError>>,
}

impl Fatal {
    /// Raises `error`, unless one was raised before (the first one is kept).
    pub(crate) fn raise(&self, error: RunnerError) {
        let mut first = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if first.is_none() {
            tracing::error!(error = %error, "the runner cannot go on: draining and stopping");
            *first = Some(error);
        }
        self.raised.cancel();
    }

    /// Completes once an error is raised.
    pub(crate) async fn raised(&self) {
        self.raised.cancelled().await;
    }

    /// The first error raised, taken.
    pub(crate) fn take(&self) -> Option<RunnerError> {
        self.error.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// Whether the visibility of a message is still extended: `false` once its final change is made
/// (a retry's or a release's). The lock is held while an extension is in flight, so that the
/// final change waits for it and no extension is sent after it: SQS keeps whichever change
/// reaches it last, and an extension after a retry's would undo the retry delay. (An extension
/// that timed out may still reach SQS later; nothing on the client can rule that out.)
type Extending = tokio::sync::Mutex<bool>;

/// How a dead-letter send ended ([`Common::dead_letter_until_sent`]).
#[derive(Debug)]
enum DeadLettered {
    /// The dead-letter queue took it: the message may be deleted.
    Sent,
    /// The message is no longer this receive's ([`Common::is_gone`]): neither sent nor to be
    /// deleted here; the receive that has it now resolves it.
    Gone,
    /// The dead-letter queue refused it for a reason that trying again cannot heal
    /// ([`CallError::into_fatal`]): not sent, the message not to be deleted.
    Refused(Box<aws_sdk_sqs::Error>),
}

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
        let gone = CancellationToken::new();
        tokio::select! {
            biased;
            done = self.resolve::<T>(msg, &extending, &gone) => done,
            never = self.keep_visible(msg, waited, &extending, &gone) => match never {},
        }
    }

    /// Extends the visibility of `msg` every `extend_every`, for as long as it is polled (the
    /// whole processing of the message: the acquire, the handler under its lease, the
    /// completion, the dead-letter send, the delete), the first one an interval after the
    /// receive answered (SQS started the visibility clock then), or at once when `at_once`. An
    /// extension waits at most half an interval for its answer; a failed one is logged and
    /// counted, and the next one is sent an interval after it, and answered (or abandoned) half
    /// an interval at least before the visibility set before the failure runs out (the interval
    /// is at most a third of the visibility timeout). None once the final change is made
    /// (`extending`).
    ///
    /// Cancels `gone` and extends no more once the message is no longer this receive's: SQS
    /// answered that its receipt handle is invalid, or the message is not in flight or does not
    /// exist ([`CallError::handle_gone`]), or no extension was accepted for a whole visibility
    /// timeout, so that the visibility may have run out (SQS refuses extensions past 12 hours
    /// from the receipt).
    async fn keep_visible(
        &self,
        msg: &SqsMessage,
        at_once: bool,
        extending: &Extending,
        gone: &CancellationToken,
    ) -> Infallible {
        let visibility = self.options.visibility_timeout;
        let seconds = seconds_up(visibility);
        let mut next = first_extension(msg.received_at(), self.extend_every, at_once);
        loop {
            tokio::time::sleep_until(next).await;
            let extending = extending.lock().await;
            if !*extending {
                // Its final change is made: nothing more to do until `resolve` returns.
                drop(extending);
                return std::future::pending().await;
            }
            if msg.may_have_lapsed() {
                drop(extending);
                gone.cancel();
                tracing::warn!(
                    visibility_timeout = ?visibility,
                    "no visibility extension accepted for a whole visibility timeout: the message may be another receive's now; extending it no more"
                );
                return std::future::pending().await;
            }
            let sent_at = Instant::now();
            next = sent_at + self.extend_every;
            let sent = self
                .change_visibility(msg, seconds, self.extension_timeout())
                .await;
            drop(extending);
            match sent {
                Ok(()) => {
                    msg.held(sent_at, visibility);
                    RunnerStats::count(
                        &self.stats.visibility_extensions,
                        m::VISIBILITY_EXTENSIONS,
                        1,
                    );
                }
                Err(e) if e.handle_gone() => {
                    RunnerStats::count(&self.stats.visibility_failures, m::VISIBILITY_FAILURES, 1);
                    gone.cancel();
                    tracing::warn!(error = %e, "the message is no longer this receive's (its receipt handle is refused): extending it no more");
                    return std::future::pending().await;
                }
                Err(e) => {
                    RunnerStats::count(&self.stats.visibility_failures, m::VISIBILITY_FAILURES, 1);
                    tracing::warn!(error = %e, "visibility extension failed; trying again at the next interval");
                }
            }
        }
    }

    /// Whether `msg` is no longer this receive's: an extension found it so (`gone`), or its
    /// visibility may have run out.
    fn is_gone(msg: &SqsMessage, gone: &CancellationToken) -> bool {
        gone.is_cancelled() || msg.may_have_lapsed()
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
    async fn resolve<T>(
        &self,
        msg: &SqsMessage,
        extending: &Extending,
        gone: &CancellationToken,
    ) -> Done
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
                match self.dead_letter_until_sent(msg, &info, gone).await {
                    DeadLettered::Sent => {
                        self.delete(msg).await;
                        Done::Resolved
                    }
                    DeadLettered::Gone => {
                        tracing::warn!(
                            "the message is no longer this receive's: not dead-lettered nor deleted here (the receive that has it now gets the same outcome from the store)"
                        );
                        // On a FIFO queue the rest of its group goes back with it.
                        Done::Retried { visibility: 0 }
                    }
                    DeadLettered::Refused(source) => {
                        self.fatal.raise(RunnerError::Sqs {
                            context: format!(
                                "sending a dead letter to the dead-letter queue {}",
                                self.dead_letter.url
                            ),
                            source,
                        });
                        // Not dead-lettered: kept, and visible again at once (this runner
                        // receives no more).
                        let mut extending = extending.lock().await;
                        *extending = false;
                        self.release(std::slice::from_ref(msg), 0).await;
                        Done::Retried { visibility: 0 }
                    }
                }
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
    /// would run the handler again), the dead-letter queue refuses it for a reason that trying
    /// again cannot heal ([`CallError::into_fatal`]: the queue deleted, access or its KMS key
    /// denied), or the message is no longer this receive's ([`is_gone`](Self::is_gone)). A
    /// shutdown that times out drops it unsent: the message is then received again, and the
    /// store gives the same outcome.
    async fn dead_letter_until_sent(
        &self,
        msg: &SqsMessage,
        info: &DeadLetterInfo,
        gone: &CancellationToken,
    ) -> DeadLettered {
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
            if Self::is_gone(msg, gone) {
                return DeadLettered::Gone;
            }
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
                    return DeadLettered::Sent;
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
                    let e = match e.into_fatal() {
                        Ok(source) => {
                            tracing::error!(error = %source, dead_letter_queue = %self.dead_letter.url, "the dead-letter queue refuses the message for good: not dead-lettered, kept in the queue");
                            return DeadLettered::Refused(source);
                        }
                        Err(e) => e,
                    };
                    tracing::error!(error = %e, "dead-letter send failed; trying again");
                    tokio::select! {
                        () = tokio::time::sleep(self.options.dead_letter_retry_delay) => {}
                        () = gone.cancelled() => {}
                    }
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
    /// How long an extension waits for its answer: `call_timeout`, but no longer than half the
    /// interval ([`RunnerOptions::extension_timeout`]).
    fn extension_timeout(&self) -> Duration {
        self.options.extension_timeout(self.extend_every)
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
            let sent_at = Instant::now();
            let sent = call::bounded(timeout, request).await;
            match sent {
                Ok(out) => {
                    let done = out.successful().len() as u64;
                    if change == Change::Extend {
                        let set = Duration::from_secs(u64::try_from(visibility).unwrap_or(0));
                        for ok in out.successful() {
                            if let Some(msg) =
                                ok.id().parse::<usize>().ok().and_then(|i| chunk.get(i))
                            {
                                msg.held(sent_at, set);
                            }
                        }
                    }
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

/// When the first extension of a message received at `received_at` is due: one interval after
/// the receive answered (SQS started the visibility clock then, not when the message's task
/// started), or at once for a message that waited in memory (`at_once`: its last extension, a
/// waiting one, may be up to an interval old). Already past when the task starts late: then at
/// once too.
pub(crate) fn first_extension(received_at: Instant, interval: Duration, at_once: bool) -> Instant {
    if at_once {
        Instant::now()
    } else {
        received_at + interval
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The visibility clock starts at the receive, not when the message's task starts: a task
    /// that starts late extends at the receive's interval (at once when that has passed).
    #[test]
    fn the_first_extension_is_due_an_interval_after_the_receive() {
        let interval = Duration::from_secs(10);
        let received_at = Instant::now();
        assert_eq!(
            first_extension(received_at, interval, false),
            received_at + interval
        );
        let before = Instant::now();
        let waited = first_extension(received_at, interval, true);
        assert!(waited >= before && waited <= Instant::now(), "at once");
        if let Some(long_ago) = Instant::now().checked_sub(2 * interval) {
            assert!(first_extension(long_ago, interval, false) <= Instant::now());
        }
    }
}
