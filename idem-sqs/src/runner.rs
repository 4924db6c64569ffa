//! The runner: builder, receive loop, dispatch (FIFO groups in order), drain.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{MessageSystemAttributeName, QueueAttributeName};
use idem_executor::broker::{self, DrainTimeouts, Execution};
use idem_executor::{Codec, Executor, Handler, JsonCodec, Plain, Recorder};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::call;
use crate::dead_letter::DeadLetterQueue;
use crate::deleter::Deleter;
use crate::error::RunnerError;
use crate::message::SqsMessage;
use crate::options::{RunnerOptions, seconds_up};
use crate::stats::{RunnerStats, metric_names as m};
use crate::worker::{self, Common, Done};

/// First pause after a failed `ReceiveMessage`; it doubles up to [`RECEIVE_BACKOFF_MAX`].
const RECEIVE_BACKOFF_MIN: Duration = Duration::from_millis(100);
const RECEIVE_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Runs a handler over an SQS queue through an [`Executor`]: deletes what is resolved, makes
/// retries visible again later, dead-letters with reasons. See the [crate docs](crate) for the
/// exact semantics.
///
/// `R` is the executor's [`Recorder`]: [`Plain`] (the handler returns its result `T`), or
/// [`Transactional<S>`](idem_executor::Transactional) (the handler returns a
/// [`Commit`](idem_executor::Commit) of its result and the writes to commit with it).
///
/// Build it with [`SqsRunner::builder`], then [`run`](Self::run) it until a shutdown signal.
pub struct SqsRunner<H, T, C = JsonCodec, R = Plain> {
    client: Client,
    queue_url: String,
    dead_letter_queue_url: String,
    options: Arc<RunnerOptions>,
    execution: Execution<H, C, R>,
    stats: Arc<RunnerStats>,
    _result: PhantomData<fn() -> T>,
}

impl<H, T, C, R> std::fmt::Debug for SqsRunner<H, T, C, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsRunner")
            .field("queue_url", &self.queue_url)
            .field("dead_letter_queue_url", &self.dead_letter_queue_url)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// Builds an [`SqsRunner`].
#[must_use]
pub struct SqsRunnerBuilder<H, T, C = JsonCodec, R = Plain> {
    client: Client,
    queue_url: String,
    dead_letter_queue_url: Option<String>,
    options: RunnerOptions,
    executor: Executor<C, R>,
    handler: H,
    _result: PhantomData<fn() -> T>,
}

impl<H, T, C, R> std::fmt::Debug for SqsRunnerBuilder<H, T, C, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsRunnerBuilder")
            .field("queue_url", &self.queue_url)
            .field("dead_letter_queue_url", &self.dead_letter_queue_url)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<H, T, C, R> SqsRunner<H, T, C, R>
where
    H: Handler<SqsMessage, R::Returns<T>>,
    R::Returns<T>: Send,
    T: Serialize + DeserializeOwned + Send + 'static,
    C: Codec,
    R: Recorder,
{
    /// A builder over an SQS client, the URL of the queue to consume, the executor and the
    /// handler. A [dead-letter queue](SqsRunnerBuilder::dead_letter_queue) is required.
    ///
    /// The client's read (or operation attempt) timeout, if it sets one, must be longer than
    /// [`wait_time`](RunnerOptions::wait_time): a long poll waits that long for messages. The
    /// runner bounds its calls itself ([`call_timeout`](RunnerOptions::call_timeout)).
    pub fn builder(
        client: Client,
        queue_url: impl Into<String>,
        executor: Executor<C, R>,
        handler: H,
    ) -> SqsRunnerBuilder<H, T, C, R> {
        SqsRunnerBuilder {
            client,
            queue_url: queue_url.into(),
            dead_letter_queue_url: None,
            options: RunnerOptions::default(),
            executor,
            handler,
            _result: PhantomData,
        }
    }

    /// The live counters, to watch the runner while it runs.
    pub fn stats(&self) -> Arc<RunnerStats> {
        Arc::clone(&self.stats)
    }

    /// The options in force.
    pub fn options(&self) -> &RunnerOptions {
        &self.options
    }

    /// The interval at which the visibility of a message in process is extended: the
    /// [option](RunnerOptions::visibility_extend_interval), or the executor's heartbeat interval
    /// or a third of the visibility timeout, whichever is shorter.
    pub fn visibility_extend_interval(&self) -> Duration {
        self.options
            .extend_interval(self.execution.executor().heartbeat_interval())
    }

    /// Receives and processes messages until `shutdown` completes (or a queue can no longer be
    /// used: see Errors), then drains: no message is received any more (what a receive in
    /// flight still returns is made visible again at once, unprocessed), the messages in
    /// process finish (up to
    /// [`drain_timeout`](RunnerOptions::drain_timeout), after which they are given up and made
    /// visible again, at once or, for a handler signalled at half the
    /// [`orphan_timeout`](RunnerOptions::orphan_timeout), after the retry delay, their started
    /// handlers' leases left to expire), and the pending deletes are sent. See the crate docs'
    /// "Shutdown" for how long that takes at worst.
    ///
    /// First reads the attributes of the queue and of the dead-letter queue (whether each is
    /// FIFO). Must be called within a Tokio runtime: the message tasks are spawned on it.
    ///
    /// # Errors
    /// [`RunnerError::Sqs`] when a queue's attributes cannot be read at start (the queue does not
    /// exist, or the credentials may not read it), or, after the drain, when SQS refuses for a
    /// reason that trying again cannot heal (the queue deleted, access or its KMS key denied) a
    /// receive from the queue, or a dead-letter send (the error's context names the
    /// dead-letter queue; the message is not deleted, but made visible again).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), RunnerError> {
        let fifo = is_fifo(&self.client, &self.queue_url).await?;
        let dead_letter = DeadLetterQueue {
            fifo: is_fifo(&self.client, &self.dead_letter_queue_url).await?,
            url: self.dead_letter_queue_url.clone(),
        };
        let options = Arc::clone(&self.options);
        let (deleter, deleter_task) = Deleter::start(
            self.client.clone(),
            self.queue_url.clone(),
            options.max_delete_calls,
            options.call_timeout,
            Arc::clone(&self.stats),
        );
        let common = Arc::new(Common {
            extend_every: self.visibility_extend_interval(),
            execution: self.execution,
            client: self.client.clone(),
            queue_url: self.queue_url.clone().into(),
            dead_letter,
            options: Arc::clone(&options),
            stats: Arc::clone(&self.stats),
            deleter,
            drain: CancellationToken::new(),
            lost: CancellationToken::new(),
            fatal: worker::Fatal::default(),
        });
        tracing::info!(queue_url = %self.queue_url, fifo, dead_letter_queue_url = %common.dead_letter.url, "sqs runner started");
        let mut receiver = Receiver {
            common: Arc::clone(&common),
            fifo,
            permits: Arc::new(Semaphore::new(options.max_in_flight)),
            tasks: JoinSet::new(),
            groups: HashMap::new(),
        };
        // A message task's fatal error (the dead-letter queue refusing for good) stops the
        // receive loop as the shutdown does.
        let fatal = Arc::clone(&common);
        let stop = async move {
            tokio::select! {
                () = shutdown => {}
                () = fatal.fatal.raised() => {}
            }
        };
        let result = receiver.receive_until(stop).await;
        receiver.drain().await;
        drop(receiver);
        let raised = common.fatal.take();
        // The last handle to the deleter goes with `common`: its loop sends what is left, then ends.
        drop(common);
        let _ = deleter_task.await;
        tracing::info!(queue_url = %self.queue_url, "sqs runner stopped");
        result.and(raised.map_or(Ok(()), Err))
    }
}

impl<H, T, C, R> SqsRunnerBuilder<H, T, C, R>
where
    H: Handler<SqsMessage, R::Returns<T>>,
    R::Returns<T>: Send,
    T: Serialize + DeserializeOwned + Send + 'static,
    C: Codec,
    R: Recorder,
{
    /// The queue that dead-lettered messages are sent to (required), with their reason
    /// attributes (see [Dead-letter messages](crate#dead-letter-messages)). The runner never
    /// creates queues.
    pub fn dead_letter_queue(mut self, url: impl Into<String>) -> Self {
        self.dead_letter_queue_url = Some(url.into());
        self
    }

    /// Replaces the options.
    pub fn options(mut self, options: RunnerOptions) -> Self {
        self.options = options;
        self
    }

    /// Changes the options in place, e.g. `.configure(|o| o.with_max_in_flight(32))`.
    pub fn configure(mut self, f: impl FnOnce(RunnerOptions) -> RunnerOptions) -> Self {
        self.options = f(self.options);
        self
    }

    /// Validates the options (against the executor's heartbeat interval too).
    ///
    /// # Errors
    /// [`RunnerError::Config`] naming the bad option (no dead-letter queue, a dead-letter queue
    /// that is the source queue, a batch over 10, ...).
    pub fn build(self) -> Result<SqsRunner<H, T, C, R>, RunnerError> {
        self.options.validate(self.executor.heartbeat_interval())?;
        if self.queue_url.is_empty() {
            return Err(RunnerError::config("queue_url", "is empty"));
        }
        let Some(dead_letter_queue_url) = self.dead_letter_queue_url.filter(|u| !u.is_empty())
        else {
            return Err(RunnerError::config(
                "dead_letter_queue",
                "is not set: conflicts and poison messages need a dead-letter queue",
            ));
        };
        if dead_letter_queue_url == self.queue_url {
            return Err(RunnerError::config(
                "dead_letter_queue",
                "is the source queue: dead letters would be received again",
            ));
        }
        Ok(SqsRunner {
            client: self.client,
            queue_url: self.queue_url,
            dead_letter_queue_url,
            options: Arc::new(self.options),
            execution: Execution::new(self.executor, self.handler),
            stats: Arc::new(RunnerStats::default()),
            _result: PhantomData,
        })
    }
}

/// Whether the queue is FIFO, from its `FifoQueue` attribute.
async fn is_fifo(client: &Client, url: &str) -> Result<bool, RunnerError> {
    let out = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::FifoQueue)
        .send()
        .await
        .map_err(|e| RunnerError::sqs(format!("reading the attributes of {url}"), e))?;
    Ok(out
        .attributes()
        .and_then(|a| a.get(&QueueAttributeName::FifoQueue))
        .is_some_and(|v| v == "true"))
}

/// A received message and its place among the messages in process.
type Item = (SqsMessage, Option<OwnedSemaphorePermit>);

/// The receive loop's state.
struct Receiver<H, C, R> {
    common: Arc<Common<H, C, R>>,
    fifo: bool,
    /// One permit per message in process.
    permits: Arc<Semaphore>,
    tasks: JoinSet<()>,
    /// Per FIFO group, the "finished" signal of the last task dispatched for it: the next one
    /// waits for it, so a group's messages run one at a time, in the order received.
    groups: HashMap<String, CancellationToken>,
}

impl<H, C, R> Receiver<H, C, R>
where
    C: Codec,
    R: Recorder,
{
    /// Receives and dispatches until `shutdown` completes, or the queue is gone.
    async fn receive_until<T>(
        &mut self,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), RunnerError>
    where
        H: Handler<SqsMessage, R::Returns<T>>,
        R::Returns<T>: Send,
        T: Serialize + DeserializeOwned + Send + 'static,
    {
        let common = Arc::clone(&self.common);
        let options = &common.options;
        let mut shutdown = std::pin::pin!(shutdown);
        let mut backoff = RECEIVE_BACKOFF_MIN;
        loop {
            // Room for one message at least, and as many more as a batch takes.
            let first = tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                permit = Arc::clone(&self.permits).acquire_owned() => permit.expect("never closed"),
            };
            let mut held = vec![first];
            while held.len() < options.batch_size {
                match Arc::clone(&self.permits).try_acquire_owned() {
                    Ok(permit) => held.push(permit),
                    Err(_) => break,
                }
            }
            self.reap();
            let receive = common
                .client
                .receive_message()
                .queue_url(&*common.queue_url)
                .max_number_of_messages(held.len() as i32)
                .wait_time_seconds(seconds_up(options.wait_time))
                .visibility_timeout(seconds_up(options.visibility_timeout))
                .message_attribute_names("All")
                .message_system_attribute_names(MessageSystemAttributeName::All)
                .send();
            let receive = call::bounded(
                options.wait_time.saturating_add(options.call_timeout),
                receive,
            );
            let mut receive = std::pin::pin!(receive);
            let mut stopping = false;
            let received = tokio::select! {
                biased;
                received = &mut receive => received,
                () = &mut shutdown => {
                    // Let the long poll return rather than drop what it may have taken.
                    stopping = true;
                    receive.await
                }
            };
            match received {
                Ok(out) => {
                    backoff = RECEIVE_BACKOFF_MIN;
                    RunnerStats::bump(&common.stats.receives);
                    let messages: Vec<SqsMessage> = out
                        .messages
                        .unwrap_or_default()
                        .into_iter()
                        .map(|msg| {
                            SqsMessage::received(
                                msg,
                                Arc::clone(&common.queue_url),
                                options.visibility_timeout,
                            )
                        })
                        .collect();
                    RunnerStats::count(&common.stats.received, m::RECEIVED, messages.len() as u64);
                    if stopping {
                        common.release(&messages, 0).await;
                        return Ok(());
                    }
                    self.dispatch::<T>(messages, held);
                }
                Err(e) => {
                    let e = match e.into_fatal() {
                        Ok(source) => {
                            tracing::error!(error = %source, "the queue refuses receives for good (deleted, or access denied): draining and stopping");
                            return Err(RunnerError::Sqs {
                                context: format!("receiving messages from {}", common.queue_url),
                                source,
                            });
                        }
                        Err(e) => e,
                    };
                    RunnerStats::count(&common.stats.receive_errors, m::RECEIVE_ERRORS, 1);
                    tracing::warn!(error = %e, retry_in = ?backoff, "ReceiveMessage failed");
                    if stopping {
                        return Ok(());
                    }
                    drop(held);
                    tokio::select! {
                        biased;
                        () = &mut shutdown => return Ok(()),
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(RECEIVE_BACKOFF_MAX);
                }
            }
        }
    }

    /// Spawns the tasks of a received batch, one permit each (the permits left over go back).
    fn dispatch<T>(&mut self, messages: Vec<SqsMessage>, held: Vec<OwnedSemaphorePermit>)
    where
        H: Handler<SqsMessage, R::Returns<T>>,
        R::Returns<T>: Send,
        T: Serialize + DeserializeOwned + Send + 'static,
    {
        let mut permits = held.into_iter();
        if !self.fifo {
            for msg in messages {
                let permit = permits.next();
                let common = Arc::clone(&self.common);
                self.tasks.spawn(async move {
                    let _permit = permit;
                    let span = message_span(&msg);
                    common.process::<T>(&msg, false).instrument(span).await;
                });
            }
            return;
        }
        // FIFO: the batch's messages by group, each group in the order received.
        let mut groups: Vec<(String, Vec<Item>)> = Vec::new();
        for msg in messages {
            let group = msg.message_group_id().unwrap_or_default().to_owned();
            let item = (msg, permits.next());
            match groups.iter_mut().find(|(g, _)| *g == group) {
                Some((_, items)) => items.push(item),
                None => groups.push((group, vec![item])),
            }
        }
        if self.groups.len() > 4 * self.common.options.max_in_flight {
            self.groups.retain(|_, done| !done.is_cancelled());
        }
        for (group, items) in groups {
            let finished = CancellationToken::new();
            let before = self.groups.insert(group, finished.clone());
            let common = Arc::clone(&self.common);
            self.tasks.spawn(async move {
                // Signals the next task of the group however this one ends (even aborted).
                let _finished = finished.drop_guard();
                let (msgs, permits): (Vec<SqsMessage>, Vec<_>) = items.into_iter().unzip();
                // The first of `msgs` not started yet: those from it on wait in memory, kept
                // invisible meanwhile (the one in process keeps itself invisible). `extending`
                // is held while an extension is in flight: a release or a start waits for it,
                // so that no extension lands after them.
                let next = AtomicUsize::new(0);
                let extending = tokio::sync::Mutex::new(());
                let waiting = Waiting {
                    msgs: &msgs,
                    next: &next,
                    extending: &extending,
                };
                let work = async {
                    let waited = before.is_some();
                    if let Some(before) = before {
                        before.cancelled().await;
                    }
                    common.process_group::<T>(&waiting, permits, waited).await;
                };
                tokio::select! {
                    biased;
                    () = work => {}
                    never = common.keep_waiting_visible(&waiting) => match never {},
                }
            });
        }
    }

    /// Drops the results of the tasks that ended, logging the ones that panicked.
    fn reap(&mut self) {
        while let Some(ended) = self.tasks.try_join_next() {
            log_panic(ended);
        }
    }

    /// Waits for the tasks in process, up to the drain timeout; then they are lost (a handler
    /// not started releases its lease, a running one gets the orphan timeout), and what is
    /// still there after that is dropped.
    async fn drain(&mut self) {
        let common = &self.common;
        common.drain.cancel();
        let timeouts = DrainTimeouts {
            drain: common.options.drain_timeout,
            orphan: common.options.orphan_timeout,
        };
        let drained =
            broker::drain(&mut self.tasks, &common.lost, timeouts, log_panic, async {}).await;
        if drained.aborted > 0 {
            // Each aborted task held one message at least (a FIFO group's may hold more).
            RunnerStats::count(
                &common.stats.abandoned,
                m::ABANDONED,
                drained.aborted as u64,
            );
        }
    }
}

impl<H, C, R> Common<H, C, R>
where
    C: Codec,
    R: Recorder,
{
    /// A FIFO group's messages of one batch, one at a time, in order.
    ///
    /// After a retry, the rest of the batch's messages of the group get the same visibility as
    /// the retried one (set just after it), so they become visible again just after it, never
    /// before: SQS gives a group's messages out in order once they are visible, and no other
    /// while one of them is in flight. (Making them visible at once would do on SQS, whose group
    /// stays blocked while the retried message is invisible; LocalStack's does not.) At
    /// shutdown, the messages not started are made visible again at once.
    ///
    /// `waiting.next` is kept at the index of the first message not started yet (`msgs.len()`
    /// once none waits any more), for [`keep_waiting_visible`](Self::keep_waiting_visible);
    /// `waited`: the first message waited for an earlier task of its group.
    async fn process_group<T>(
        &self,
        waiting: &Waiting<'_>,
        permits: Vec<Option<OwnedSemaphorePermit>>,
        waited: bool,
    ) where
        H: Handler<SqsMessage, R::Returns<T>>,
        R::Returns<T>: Send,
        T: Serialize + DeserializeOwned + Send + 'static,
    {
        let msgs = waiting.msgs;
        for ((at, msg), permit) in msgs.iter().enumerate().zip(permits) {
            let (rest, visibility) = if self.drain.is_cancelled() {
                (&msgs[at..], 0)
            } else {
                waiting.stop_at(at + 1).await;
                let span = message_span(msg);
                let done = self
                    .process::<T>(msg, waited || at > 0)
                    .instrument(span)
                    .await;
                drop(permit);
                match done {
                    Done::Resolved => continue,
                    Done::Retried { visibility } => (&msgs[at + 1..], visibility),
                }
            };
            // No more extensions: they would undo the release.
            waiting.stop_at(msgs.len()).await;
            if !rest.is_empty() {
                self.release(rest, visibility).await;
            }
            return;
        }
    }

    /// Keeps the waiting messages invisible, every `extend_every` from their receive, while
    /// they wait for the messages of their group before them (the earlier tasks' and this
    /// task's).
    async fn keep_waiting_visible(&self, group: &Waiting<'_>) -> Infallible {
        let visibility = seconds_up(self.options.visibility_timeout);
        let Some(first) = group.msgs.first() else {
            return std::future::pending().await;
        };
        let mut at = worker::first_extension(first.received_at(), self.extend_every, false);
        loop {
            tokio::time::sleep_until(at).await;
            at = tokio::time::Instant::now() + self.extend_every;
            let _extending = group.extending.lock().await;
            let waiting = &group.msgs[group.next.load(Ordering::SeqCst).min(group.msgs.len())..];
            if !waiting.is_empty() {
                self.set_visibility(waiting, visibility, worker::Change::Extend)
                    .await;
            }
        }
    }
}

/// The messages of one FIFO group task and which of them still wait in memory.
struct Waiting<'a> {
    msgs: &'a [SqsMessage],
    /// The first of `msgs` not started yet.
    next: &'a AtomicUsize,
    /// Held while an extension of the waiting messages is in flight.
    extending: &'a tokio::sync::Mutex<()>,
}

impl Waiting<'_> {
    /// From now on only the messages from `next` on wait; returns once no extension that
    /// could still include the others is in flight.
    async fn stop_at(&self, next: usize) {
        self.next.store(next, Ordering::SeqCst);
        drop(self.extending.lock().await);
    }
}

fn message_span(msg: &SqsMessage) -> tracing::Span {
    tracing::debug_span!(
        "idem_sqs_message",
        message_id = msg.message_id(),
        group = msg.message_group_id(),
        receive_count = msg.receive_count()
    )
}

fn log_panic(ended: Result<(), tokio::task::JoinError>) {
    if let Err(e) = ended
        && e.is_panic()
    {
        tracing::error!(error = %e, "a message task panicked (outside the handler, whose panics the executor catches): its message comes back once its visibility passes");
    }
}
