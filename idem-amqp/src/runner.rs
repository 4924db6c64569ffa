//! The runner: builder, connection loop, delivery tasks, drain.

use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use idem_executor::broker::{
    self, DeadLetterInfo, DrainTimeouts, Execution, Fit, Step, StoreHealth, outcome_name,
};
use idem_executor::{BrokerAction, Codec, Executor, Handler, JsonCodec, Outcome, Plain, Recorder};
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::{Acker, Channel, Connection, ConnectionProperties, Consumer};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::dead_letter;
use crate::error::RunnerError;
use crate::message::AmqpMessage;
use crate::options::RunnerOptions;
use crate::publish::{PublishError, Publisher, Republish, republished};
use crate::stats::{RunnerStats, metric_names as m};
use crate::topology::{QueueTopology, name};

/// The longest a delivery whose retry or dead-letter publication failed is held before it is
/// given back (`basic.nack` with requeue): a delivery unacknowledged past the broker's
/// `consumer_timeout` (30 minutes by default) makes the broker close the channel, and every
/// delivery on it is lost to the runner. So a longer retry delay is cut to this on the retry
/// path, and a dead letter is tried for this long.
pub(crate) const REQUEUE_HOLD_MAX: Duration = Duration::from_secs(60);

/// Pause between two tries of a dead-letter publication that failed.
const DEAD_LETTER_RETRY: Duration = Duration::from_secs(1);
/// Longest wait for a channel or connection to close, or the consumer to be cancelled.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs a handler over a RabbitMQ queue through an [`Executor`], acknowledging each delivery
/// only once its outcome is settled. See the [crate docs](crate) for the exact semantics.
///
/// Build it with [`AmqpRunner::builder`], then [`run`](Self::run) it until a shutdown signal.
/// `R` is the executor's [`Recorder`]: the handler returns `R::Returns<T>` (`T` on a plain
/// executor, a [`Commit`](idem_executor::Commit) on a transactional one).
pub struct AmqpRunner<H, T, C = JsonCodec, R = Plain> {
    uri: String,
    properties: ConnectionProperties,
    common: Arc<Common<H, C, R>>,
    _result: PhantomData<fn() -> T>,
}

impl<H, T, C, R> std::fmt::Debug for AmqpRunner<H, T, C, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpRunner")
            .field("topology", &self.common.topology)
            .field("options", &self.common.options)
            .finish_non_exhaustive()
    }
}

/// Builds an [`AmqpRunner`].
#[must_use]
pub struct AmqpRunnerBuilder<H, T, C = JsonCodec, R = Plain> {
    uri: String,
    properties: ConnectionProperties,
    topology: QueueTopology,
    options: RunnerOptions,
    executor: Executor<C, R>,
    handler: H,
    _result: PhantomData<fn() -> T>,
}

impl<H, T, C, R> std::fmt::Debug for AmqpRunnerBuilder<H, T, C, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpRunnerBuilder")
            .field("topology", &self.topology)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// What every delivery task shares.
struct Common<H, C, R> {
    execution: Execution<H, C, R>,
    topology: QueueTopology,
    queue: Arc<str>,
    options: RunnerOptions,
    stats: Arc<RunnerStats>,
    /// Store errors in a row among the outcomes: while there are some, new deliveries wait.
    store: StoreHealth,
}

impl<H, T, C, R> AmqpRunner<H, T, C, R>
where
    H: Handler<AmqpMessage, R::Returns<T>>,
    T: Serialize + DeserializeOwned + Send + 'static,
    R::Returns<T>: Send + 'static,
    C: Codec,
    R: Recorder,
{
    /// A builder over the broker's URI (`amqp://user:password@host:5672/vhost`, `%2f` for the
    /// default vhost `/`), the queue topology, the executor and the handler.
    pub fn builder(
        uri: impl Into<String>,
        topology: QueueTopology,
        executor: Executor<C, R>,
        handler: H,
    ) -> AmqpRunnerBuilder<H, T, C, R> {
        AmqpRunnerBuilder {
            uri: uri.into(),
            properties: ConnectionProperties::default(),
            topology,
            options: RunnerOptions::default(),
            executor,
            handler,
            _result: PhantomData,
        }
    }

    /// The live counters, to watch the runner while it runs.
    pub fn stats(&self) -> Arc<RunnerStats> {
        Arc::clone(&self.common.stats)
    }

    /// The options in force.
    pub fn options(&self) -> &RunnerOptions {
        &self.common.options
    }

    /// The topology in force.
    pub fn topology(&self) -> &QueueTopology {
        &self.common.topology
    }

    /// Connects, declares the topology (or checks the work queue), consumes until `shutdown`
    /// completes, then drains: `basic.cancel` (no new delivery), the deliveries in process finish
    /// (up to [`drain_timeout`](RunnerOptions::drain_timeout), then they are treated as lost),
    /// deliveries that arrive meanwhile are given back (`basic.nack` with requeue), and the
    /// channels and the connection are closed (the broker requeues whatever is unacknowledged).
    ///
    /// A connection or channel lost while running is opened again, with a delay from
    /// [`min_reconnect_delay`](RunnerOptions::min_reconnect_delay) doubling up to
    /// [`max_reconnect_delay`](RunnerOptions::max_reconnect_delay), until it works or `shutdown`
    /// completes; the deliveries of the lost channel are handled as the crate docs say
    /// ([lost deliveries](crate#lost-deliveries)).
    ///
    /// Before it returns, it also waits for the deliveries of lost connections still in
    /// process: their handlers are let finish as the lost deliveries are (half the
    /// [`orphan_timeout`](RunnerOptions::orphan_timeout) from the loss, then signalled), and their
    /// tasks are aborted one orphan timeout after the loss at the latest.
    ///
    /// Must be called within a Tokio runtime. Dropping the returned future drops the connection
    /// without a drain (the deliveries of lost connections go on by themselves, within the same
    /// bounds).
    ///
    /// # Errors
    /// [`RunnerError::Amqp`] when the *first* connection, the declarations or `basic.consume`
    /// fail (a wrong URI, credentials, a queue declared with other arguments), and
    /// [`RunnerError::TimedOut`] when they do not finish within
    /// [`connect_timeout`](RunnerOptions::connect_timeout): later failures are retried.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), RunnerError> {
        let stop = CancellationToken::new();
        let mut shutdown = std::pin::pin!(shutdown);
        let mut main = std::pin::pin!(self.consume_until(stop.clone()));
        tokio::select! {
            result = &mut main => return result,
            () = &mut shutdown => {
                tracing::info!(queue = %self.common.queue, "shutdown requested: draining");
                stop.cancel();
            }
        }
        let result = main.await;
        tracing::info!(queue = %self.common.queue, "amqp runner stopped");
        result
    }

    /// Consumes, reconnecting, until `stop`; then waits for the deliveries of lost sessions.
    async fn consume_until(&self, stop: CancellationToken) -> Result<(), RunnerError> {
        let mut orphans = Orphans::default();
        let result = self.reconnecting(&stop, &mut orphans).await;
        orphans.wait(&self.common.queue).await;
        result
    }

    /// Connects and consumes, again after each loss, until `stop` (or a failed first
    /// connection); the tasks of each lost session go to `orphans`.
    async fn reconnecting(
        &self,
        stop: &CancellationToken,
        orphans: &mut Orphans,
    ) -> Result<(), RunnerError> {
        let mut failures = 0u32;
        let mut connected = false;
        loop {
            let opened = tokio::select! {
                biased;
                () = stop.cancelled() => return Ok(()),
                opened = tokio::time::timeout(self.common.options.connect_timeout, self.open()) => {
                    opened.unwrap_or(Err(RunnerError::TimedOut {
                        context: "connecting and declaring",
                        after: self.common.options.connect_timeout,
                    }))
                }
            };
            match opened {
                Ok(session) => {
                    failures = 0;
                    connected = true;
                    tracing::info!(queue = %self.common.queue, "amqp runner consuming");
                    match self.consume(session, stop, orphans).await {
                        None => return Ok(()),
                        Some(why) => {
                            RunnerStats::count(&self.common.stats.reconnects, m::RECONNECTS);
                            tracing::warn!(queue = %self.common.queue, %why, "connection or channel lost: reconnecting");
                        }
                    }
                }
                Err(e) if !connected => return Err(e),
                Err(e) => {
                    failures = failures.saturating_add(1);
                    tracing::warn!(queue = %self.common.queue, error = %e, failures, "reconnection failed");
                }
            }
            let delay = self.common.options.reconnect_delay(failures);
            tokio::select! {
                biased;
                () = stop.cancelled() => return Ok(()),
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// A connection, its topology declared, a consuming channel and a publishing channel.
    async fn open(&self) -> Result<Session, RunnerError> {
        let common = &self.common;
        let connection = Arc::new(
            Connection::connect(&self.uri, self.properties.clone())
                .await
                .map_err(|e| RunnerError::amqp("connecting", e))?,
        );
        // Declarations on a channel of their own: a refused one closes its channel.
        let declare = connection
            .create_channel()
            .await
            .map_err(|e| RunnerError::amqp("opening a channel", e))?;
        common.topology.declare_on(&declare).await?;
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, declare.close(200, "declared".into())).await;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| RunnerError::amqp("opening the consuming channel", e))?;
        channel
            .basic_qos(common.options.prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| RunnerError::amqp("setting the prefetch (basic.qos)", e))?;
        let consumer = channel
            .basic_consume(
                name(&common.topology.queue),
                ShortString::from(common.options.consumer_tag.as_str()),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                RunnerError::amqp(format!("consuming from {}", common.topology.queue), e)
            })?;
        let publisher = Arc::new(Publisher::new(
            &self.uri,
            self.properties.clone(),
            common.options.publish_timeout,
        ));
        Ok(Session {
            connection,
            channel,
            consumer,
            publisher,
            lost: CancellationToken::new(),
            unsettled: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Consumes on `session` until it is lost (`Some(why)`, its tasks handed to `orphans`) or
    /// `stop` (`None`, after the drain).
    async fn consume(
        &self,
        mut session: Session,
        stop: &CancellationToken,
        orphans: &mut Orphans,
    ) -> Option<String> {
        let mut tasks = JoinSet::new();
        let max_batch = self
            .common
            .options
            .max_batch
            .min(self.common.execution.max_batch())
            .max(1);
        // While the store fails (the last outcomes were store errors), new deliveries wait
        // (at most the prefetch of them, then the broker sends no more): each one taken into
        // the outage would go to the retry queue, every `retry_delay`, a publication and a
        // store call that cannot succeed. The wait after each group grows with the failures in
        // a row, as the reconnect delay does; one outcome the store answered ends it.
        let mut resume: Option<tokio::time::Instant> = None;
        let lost = loop {
            let paused = resume.is_some();
            tokio::select! {
                biased;
                () = stop.cancelled() => break None,
                Some(joined) = tasks.join_next(), if !tasks.is_empty() => report(joined),
                Some(joined) = orphans.tasks.join_next(), if !orphans.tasks.is_empty() => report(joined),
                () = tokio::time::sleep_until(resume.unwrap_or_else(tokio::time::Instant::now)), if paused => {
                    resume = None;
                }
                next = session.consumer.next(), if !paused => {
                    // The deliveries at hand with this one form its group.
                    let mut group = Vec::new();
                    let mut next = Some(next);
                    let mut ended = None;
                    while let Some(item) = next.take() {
                        match item {
                            Some(Ok(delivery)) => {
                                RunnerStats::bump(&self.common.stats.received);
                                group.push(delivery);
                                if group.len() < max_batch {
                                    if group.len() == 1 {
                                        // One yield lets the connection's reader hand over
                                        // the deliveries it already received: those that
                                        // arrived together form one group.
                                        tokio::task::yield_now().await;
                                    }
                                    next = session.consumer.next().now_or_never();
                                }
                            }
                            Some(Err(e)) => ended = Some(e.to_string()),
                            None => ended = Some(CANCELLED.to_owned()),
                        }
                    }
                    if !group.is_empty() {
                        let options = &self.common.options;
                        if let Some(pause) = self
                            .common
                            .store
                            .pause(options.min_reconnect_delay, options.max_reconnect_delay)
                        {
                            RunnerStats::count(&self.common.stats.store_pauses, m::STORE_PAUSES);
                            tracing::debug!(failures = self.common.store.failures(), ?pause, "the store is failing: holding new deliveries back");
                            resume = Some(tokio::time::Instant::now() + pause);
                        }
                        session.unsettled.fetch_add(group.len(), Ordering::Relaxed);
                        tasks.spawn(deliver(
                            Arc::clone(&self.common),
                            Arc::clone(&session.publisher),
                            group,
                            session.lost.clone(),
                            Arc::clone(&session.unsettled),
                        ));
                    }
                    if let Some(why) = ended {
                        break Some(why);
                    }
                }
            }
        };
        match lost {
            Some(why) => {
                // The in-flight deliveries cannot be acknowledged any more: the broker requeues
                // them. Their tasks go on as lost deliveries (see `Execution::try_batch`), kept
                // so that the shutdown waits for them.
                session.lost.cancel();
                orphans.adopt(
                    tasks,
                    Arc::clone(&session.unsettled),
                    Arc::clone(&self.common.stats),
                    self.common.options.orphan_timeout,
                );
                let connection = Arc::clone(&session.connection);
                let publisher = Arc::clone(&session.publisher);
                tokio::spawn(async move {
                    // Its publications end with the session's deliveries, which can no longer
                    // be acknowledged.
                    publisher.close().await;
                    let _ = tokio::time::timeout(
                        CLOSE_TIMEOUT,
                        connection.close(200, "channel lost".into()),
                    )
                    .await;
                });
                Some(why)
            }
            None => {
                self.drain(&mut session, tasks).await;
                None
            }
        }
    }

    async fn drain(&self, session: &mut Session, mut tasks: JoinSet<()>) {
        let options = &self.common.options;
        let tag = session.consumer.tag();
        if let Err(e) = tokio::time::timeout(
            CLOSE_TIMEOUT,
            session
                .channel
                .basic_cancel(tag, BasicCancelOptions::default()),
        )
        .await
        .unwrap_or_else(|_| {
            Err(lapin::ErrorKind::InvalidChannelState(
                lapin::ChannelState::Closing,
                "basic.cancel timed out",
            )
            .into())
        }) {
            tracing::warn!(error = %e, "basic.cancel failed; closing the channel gives the deliveries back");
        }
        let stats = &self.common.stats;
        let consumer = &mut session.consumer;
        // What arrives after the cancel is given back at once.
        let give_back = async move {
            while let Some(Ok(delivery)) = consumer.next().await {
                let nack = delivery.acker.nack(BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                });
                if !matches!(nack.await, Ok(true)) {
                    RunnerStats::count(&stats.ack_failures, m::ACK_FAILURES);
                }
            }
        };
        let timeouts = DrainTimeouts {
            drain: options.drain_timeout,
            orphan: options.orphan_timeout,
        };
        let drained = broker::drain(&mut tasks, &session.lost, timeouts, report, give_back).await;
        if drained.aborted > 0 {
            // The deliveries the aborted groups had not settled yet (a group is one task).
            let left = session.unsettled.swap(0, Ordering::Relaxed);
            RunnerStats::add(&stats.abandoned, m::ABANDONED, left);
        }
        session.publisher.close().await;
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, session.channel.close(200, "shutdown".into()))
            .await;
        let _ = tokio::time::timeout(
            CLOSE_TIMEOUT,
            session.connection.close(200, "shutdown".into()),
        )
        .await;
    }
}

/// Logs a group's task that panicked (its deliveries not settled yet stay unacknowledged, and
/// hold their prefetch slots, until the channel closes).
fn report(joined: Result<(), tokio::task::JoinError>) {
    if let Err(e) = joined
        && e.is_panic()
    {
        tracing::error!(error = %e, "a delivery group's task panicked; its deliveries not settled yet stay unacknowledged until the channel closes");
    }
}

/// The delivery tasks of lost sessions (their channel or connection closed), kept so that the
/// shutdown waits for them as it does for the current session's: one task per lost session,
/// which waits for that session's tasks.
///
/// Those tasks end by themselves: a handler still running is signalled at half the orphan
/// timeout from the loss, and the executor call dropped at 90% of it
/// ([`Execution::try_batch`]). What is still there one orphan timeout after the loss (a store
/// or broker call hanging) is aborted, as [`broker::drain`] does at shutdown. Dropped (the `run`
/// future dropped), they are detached, not aborted: they go on within the same bounds.
#[derive(Default)]
struct Orphans {
    tasks: JoinSet<()>,
}

impl Orphans {
    /// Takes the tasks of a session lost now (`unsettled` counts its deliveries not settled
    /// yet).
    fn adopt(
        &mut self,
        mut tasks: JoinSet<()>,
        unsettled: Arc<AtomicUsize>,
        stats: Arc<RunnerStats>,
        orphan_timeout: Duration,
    ) {
        if tasks.is_empty() {
            return;
        }
        self.tasks.spawn(async move {
            let deadline = tokio::time::sleep(orphan_timeout);
            tokio::pin!(deadline);
            loop {
                tokio::select! {
                    biased;
                    joined = tasks.join_next() => match joined {
                        Some(joined) => report(joined),
                        None => return,
                    },
                    () = &mut deadline => {
                        tracing::error!(
                            left = tasks.len(),
                            "delivery tasks of a lost connection did not end within the orphan timeout: aborted"
                        );
                        let left = unsettled.swap(0, Ordering::Relaxed);
                        RunnerStats::add(&stats.abandoned, m::ABANDONED, left);
                        tasks.abort_all();
                        return;
                    }
                }
            }
        });
    }

    /// Waits for every lost session's tasks to end (each within one orphan timeout from its
    /// loss).
    async fn wait(&mut self, queue: &str) {
        if self.tasks.is_empty() {
            return;
        }
        tracing::info!(
            queue,
            lost_sessions = self.tasks.len(),
            "waiting for the deliveries of lost connections still in process"
        );
        while let Some(joined) = self.tasks.join_next().await {
            report(joined);
        }
    }
}

impl Drop for Orphans {
    fn drop(&mut self) {
        self.tasks.detach_all();
    }
}

/// One connection and what the runner opened on it.
struct Session {
    connection: Arc<Connection>,
    channel: Channel,
    consumer: Consumer,
    publisher: Arc<Publisher>,
    /// Cancelled when the session is lost (or the drain timed out).
    lost: CancellationToken,
    /// Deliveries handed to a group's task and not settled yet.
    unsettled: Arc<AtomicUsize>,
}

impl<H, T, C, R> AmqpRunnerBuilder<H, T, C, R>
where
    H: Handler<AmqpMessage, R::Returns<T>>,
    T: Serialize + DeserializeOwned + Send + 'static,
    R::Returns<T>: Send + 'static,
    C: Codec,
    R: Recorder,
{
    /// Replaces the options.
    pub fn options(mut self, options: RunnerOptions) -> Self {
        self.options = options;
        self
    }

    /// Changes the options in place, e.g. `.configure(|o| o.with_prefetch(4))`.
    pub fn configure(mut self, f: impl FnOnce(RunnerOptions) -> RunnerOptions) -> Self {
        self.options = f(self.options);
        self
    }

    /// lapin's connection properties (connection name, client properties, authentication
    /// provider). The runner reconnects by itself: leave lapin's own recovery off.
    pub fn connection_properties(mut self, properties: ConnectionProperties) -> Self {
        self.properties = properties;
        self
    }

    /// Validates the options and the topology.
    ///
    /// # Errors
    /// [`RunnerError::Config`] naming the bad option or name.
    pub fn build(self) -> Result<AmqpRunner<H, T, C, R>, RunnerError> {
        self.options.validate()?;
        self.topology.validate()?;
        if self.uri.is_empty() {
            return Err(RunnerError::config("uri", "is empty"));
        }
        let queue: Arc<str> = Arc::from(self.topology.queue.as_str());
        Ok(AmqpRunner {
            uri: self.uri,
            properties: self.properties,
            common: Arc::new(Common {
                execution: Execution::new(self.executor, self.handler),
                topology: self.topology,
                queue,
                options: self.options,
                stats: Arc::new(RunnerStats::default()),
                store: StoreHealth::default(),
            }),
            _result: PhantomData,
        })
    }
}

/// Why the consumer ended when the broker cancelled it.
const CANCELLED: &str = "the broker cancelled the consumer (queue deleted?)";

/// Processes a group of deliveries to their ends: one executor batch, each delivery's ack,
/// delayed retry or dead letter sent as soon as its outcome is recorded.
async fn deliver<H, T, C, R>(
    common: Arc<Common<H, C, R>>,
    publisher: Arc<Publisher>,
    group: Vec<lapin::message::Delivery>,
    lost: CancellationToken,
    unsettled: Arc<AtomicUsize>,
) where
    H: Handler<AmqpMessage, R::Returns<T>>,
    T: Serialize + DeserializeOwned + Send + 'static,
    R::Returns<T>: Send + 'static,
    C: Codec,
    R: Recorder,
{
    let (msgs, ackers): (Vec<AmqpMessage>, Vec<Acker>) = group
        .into_iter()
        .map(|mut delivery| {
            let msg = AmqpMessage::from_delivery(&mut delivery, Arc::clone(&common.queue));
            (msg, delivery.acker)
        })
        .unzip();
    let span = tracing::debug_span!(
        "idem_amqp_group",
        queue = %common.queue,
        deliveries = msgs.len(),
        first_delivery_tag = msgs[0].delivery_tag(),
    );
    // Each delivery is settled as soon as its step is known (its completion recorded), not once
    // the whole group's are: a slow handler holds back only its own delivery.
    let mut ackers: Vec<Option<Acker>> = ackers.into_iter().map(Some).collect();
    common
        .execution
        .try_batch_settling(
            &msgs,
            &lost,
            common.options.lost_timeouts(),
            |index, step| {
                let acker = ackers[index]
                    .take()
                    .expect("try_batch_each gives one step per delivery");
                settle_one::<H, T, C, R>(
                    &common,
                    &publisher,
                    &lost,
                    &unsettled,
                    &msgs[index],
                    acker,
                    step,
                )
            },
        )
        .instrument(span)
        .await;
}

/// Settles one delivery of a group with its step, in its span.
async fn settle_one<H, T, C, R>(
    common: &Common<H, C, R>,
    publisher: &Publisher,
    lost: &CancellationToken,
    unsettled: &AtomicUsize,
    msg: &AmqpMessage,
    acker: Acker,
    step: Step<T>,
) where
    H: Handler<AmqpMessage, R::Returns<T>>,
    T: Serialize + DeserializeOwned + Send + 'static,
    R::Returns<T>: Send + 'static,
    C: Codec,
    R: Recorder,
{
    let span = tracing::debug_span!(
        "idem_amqp_delivery",
        queue = %common.queue,
        delivery_tag = msg.delivery_tag(),
        redelivered = msg.redelivered(),
        outcome = tracing::field::Empty,
    );
    let delivery = Delivery {
        common,
        publisher,
        acker,
        lost,
    };
    async move {
        delivery.settle::<T>(msg, step).await;
        unsettled.fetch_sub(1, Ordering::Relaxed);
    }
    .instrument(span)
    .await;
}

struct Delivery<'a, H, C, R> {
    common: &'a Common<H, C, R>,
    publisher: &'a Publisher,
    acker: Acker,
    lost: &'a CancellationToken,
}

impl<H, C, R> Delivery<'_, H, C, R>
where
    C: Codec,
    R: Recorder,
{
    /// Settles the delivery by the step its executor call gave.
    async fn settle<T>(&self, msg: &AmqpMessage, step: Step<T>)
    where
        T: Serialize + DeserializeOwned + Send + 'static,
    {
        let common = self.common;
        let options = &common.options;
        let (result, attempt) = match step {
            Step::Abandoned { lease_released } => {
                if lease_released {
                    RunnerStats::count(&common.stats.released, m::RELEASED);
                }
                return self.abandoned("lost before its outcome");
            }
            Step::Done { result, attempt } => (result, attempt),
        };
        common.store.note(&result);
        let outcome = outcome_name(&result);
        tracing::Span::current().record("outcome", outcome);
        if self.lost.is_cancelled() {
            // The outcome is recorded (or not) in the store; the redelivery replays it.
            return self.abandoned(outcome);
        }
        match BrokerAction::of(&result) {
            BrokerAction::Ack => {
                let stats = &common.stats;
                match &result {
                    Ok(Outcome::Executed(_)) => RunnerStats::count(&stats.executed, m::EXECUTED),
                    Ok(Outcome::Replayed(_)) => RunnerStats::count(&stats.replayed, m::REPLAYED),
                    _ => RunnerStats::bump(&stats.acked_other),
                }
                self.ack().await;
                tracing::debug!(outcome, "acknowledged");
            }
            BrokerAction::DeadLetter { reason, error } => {
                let info = broker::classify(&result, reason, error, attempt);
                drop(result);
                // The outcome is final: only the publication is tried again, never the
                // executor call (which, for an un-deduplicated message, would run the handler
                // again).
                self.dead_letter_until_published(msg, &info).await;
            }
            BrokerAction::Retry { after } => {
                drop(result);
                self.retry(msg, options.retry_delay(after), outcome).await;
            }
            _ => {
                drop(result);
                self.retry(msg, options.min_retry_delay, outcome).await;
            }
        }
    }

    fn abandoned(&self, outcome: &str) {
        RunnerStats::count(&self.common.stats.abandoned, m::ABANDONED);
        tracing::debug!(
            outcome,
            "delivery lost (channel closed or drain timed out): left to the broker's redelivery"
        );
    }

    async fn ack(&self) {
        match self.acker.ack(BasicAckOptions::default()).await {
            Ok(true) => {}
            Ok(false) => {
                RunnerStats::count(&self.common.stats.ack_failures, m::ACK_FAILURES);
                tracing::warn!(
                    "basic.ack not sent: the channel is closed; the broker redelivers the message and the store replays it"
                );
            }
            Err(e) => {
                RunnerStats::count(&self.common.stats.ack_failures, m::ACK_FAILURES);
                tracing::warn!(error = %e, "basic.ack failed; the broker redelivers the message and the store replays it");
            }
        }
    }

    /// Declares the topology again when `error` says a part of it is gone (deleted while the
    /// runner runs) and the runner declares it; the failed publication is then tried again.
    async fn redeclare_if_missing(&self, error: &PublishError) {
        let topology = &self.common.topology;
        if !topology.declare || !error.topology_missing() {
            return;
        }
        match self.publisher.redeclare(topology).await {
            Ok(()) => tracing::warn!(
                dead_letter_exchange = %topology.dead_letter_exchange,
                retry_queue = %topology.retry_queue,
                "a part of the topology was gone: declared it again"
            ),
            Err(e) => tracing::error!(error = %e, "declaring the topology again failed"),
        }
    }

    /// Publishes a copy to the retry queue, expiring after `delay` (then the broker moves it back
    /// to the work queue), and acknowledges the delivery. When the publication fails, waits
    /// `delay` (at most [`REQUEUE_HOLD_MAX`]) and gives the delivery back with `basic.nack`
    /// (requeue).
    async fn retry(&self, msg: &AmqpMessage, delay: Duration, outcome: &str) {
        let common = self.common;
        let expiration = ShortString::from(delay.as_millis().to_string());
        let properties = republished(msg, Republish::Retry { expiration });
        let published = self
            .publisher
            .publish("", &common.topology.retry_queue, msg.body(), properties)
            .await;
        match published {
            Ok(()) => {
                RunnerStats::count(&common.stats.retries, m::RETRIES);
                tracing::debug!(outcome, ?delay, "published to the retry queue");
                self.ack().await;
            }
            Err(e) => {
                RunnerStats::count(&common.stats.publish_failures, m::PUBLISH_FAILURES);
                tracing::warn!(outcome, error = %e, retry_queue = %common.topology.retry_queue, "retry publication failed: requeueing after the delay instead");
                self.redeclare_if_missing(&e).await;
                tokio::select! {
                    biased;
                    () = self.lost.cancelled() => return self.abandoned(outcome),
                    () = tokio::time::sleep(delay.min(REQUEUE_HOLD_MAX)) => {}
                }
                self.requeue().await;
            }
        }
    }

    /// Gives the delivery back (`basic.nack` with requeue): the broker delivers it again.
    async fn requeue(&self) {
        let nack = self.acker.nack(BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        });
        if matches!(nack.await, Ok(true)) {
            RunnerStats::count(&self.common.stats.requeued, m::REQUEUED);
        } else {
            RunnerStats::count(&self.common.stats.ack_failures, m::ACK_FAILURES);
        }
    }

    /// Publishes to the dead-letter exchange until it is confirmed, then acknowledges.
    ///
    /// A dead letter refused as too large for a frame is sent again at once in the next smaller
    /// [`Fit`]: without the original headers, then compact (the error, the key and the dropped
    /// names cut to [`COMPACT_TEXT`](broker::COMPACT_TEXT) bytes). Any other failure is tried
    /// again every [`DEAD_LETTER_RETRY`]. The delivery is held at most [`REQUEUE_HOLD_MAX`]
    /// (past the broker's `consumer_timeout` the whole channel would be lost): then it is given
    /// back with `basic.nack` and requeue, and its redelivery, answered from the store (the
    /// handler does not run again), is dead-lettered again. A dead letter too large even in the
    /// compact form (which AMQP's limits on property sizes rule out at any frame size the broker
    /// accepts) is not tried again: it is held until then. Stops (leaving the delivery to the
    /// broker) when the delivery is lost.
    async fn dead_letter_until_published(&self, msg: &AmqpMessage, info: &DeadLetterInfo) {
        let common = self.common;
        let held_until = tokio::time::Instant::now() + REQUEUE_HOLD_MAX;
        let key_id = common.execution.key_id(msg);
        let attempts = common
            .execution
            .dead_letter_attempts(info, key_id.as_deref())
            .await;
        let topology = &common.topology;
        let mut fit = Fit::first(msg.headers().is_some_and(|h| !h.inner().is_empty()));
        loop {
            let headers = dead_letter::headers(msg, info, attempts, key_id.as_deref(), fit);
            let published = self
                .publisher
                .publish(
                    &topology.dead_letter_exchange,
                    &topology.dead_letter_routing_key,
                    msg.body(),
                    republished(msg, Republish::DeadLetter { headers }),
                )
                .await;
            let e = match published {
                Ok(()) => {
                    RunnerStats::bump(&common.stats.dead_lettered);
                    metrics::counter!(m::DEAD_LETTERED, "reason" => info.reason.as_str())
                        .increment(1);
                    tracing::warn!(
                        reason = info.reason.as_str(),
                        error = %broker::header_text(&info.error),
                        attempts = ?attempts,
                        key = key_id.as_deref().map(broker::header_text).as_deref(),
                        dead_letter_exchange = %topology.dead_letter_exchange,
                        "message dead-lettered"
                    );
                    return self.ack().await;
                }
                Err(e) => e,
            };
            if self.lost.is_cancelled() {
                return self.abandoned("dead_letter_pending");
            }
            let too_large = matches!(e, PublishError::TooLarge { .. });
            if too_large && let Some(smaller) = fit.smaller() {
                if smaller == Fit::Compact {
                    tracing::warn!(error = %e, "the dead letter does not fit in a frame with the runner's headers: publishing it with the error, the key and the dropped header names cut short");
                } else {
                    tracing::warn!(error = %e, "the dead letter does not fit in a frame with the original headers: publishing it with the runner's headers only, naming the original ones");
                }
                fit = smaller;
                continue;
            }
            RunnerStats::count(&common.stats.publish_failures, m::PUBLISH_FAILURES);
            let next_try = if too_large {
                // No try will fit: hold the delivery until it is given back, not retry it
                // every second.
                tracing::error!(error = %e, reason = info.reason.as_str(), held = ?REQUEUE_HOLD_MAX, "the dead letter does not fit in a frame even in its compact form: holding the delivery, then giving it back");
                held_until
            } else {
                tracing::error!(error = %e, dead_letter_exchange = %topology.dead_letter_exchange, "dead-letter publication failed; trying again");
                self.redeclare_if_missing(&e).await;
                (tokio::time::Instant::now() + DEAD_LETTER_RETRY).min(held_until)
            };
            tokio::select! {
                biased;
                () = self.lost.cancelled() => return self.abandoned("dead_letter_pending"),
                () = tokio::time::sleep_until(next_try) => {}
            }
            if tokio::time::Instant::now() >= held_until {
                tracing::error!(
                    reason = info.reason.as_str(),
                    held = ?REQUEUE_HOLD_MAX,
                    dead_letter_exchange = %topology.dead_letter_exchange,
                    "the dead letter was not published in time: giving the delivery back (basic.nack with requeue); its redelivery is dead-lettered again"
                );
                return self.requeue().await;
            }
        }
    }
}
