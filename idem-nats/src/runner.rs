//! The runner: builder, pull loop, message tasks, progress acks, drain.

use std::future::Future;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::{AckKind, Acker};
use futures::{FutureExt, StreamExt};
use idem_executor::broker::{
    self, DeadLetterInfo, DrainTimeouts, Execution, Fit, Step, StoreHealth, outcome_name,
};
use idem_executor::{BrokerAction, Codec, Executor, Handler, JsonCodec, Outcome, Plain, Recorder};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::dead_letter::{self, DeadLetterReason, HEADER_REASON};
use crate::error::RunnerError;
use crate::message::NatsMessage;
use crate::options::{RunnerOptions, check_found_consumer};
use crate::stats::{RunnerStats, metric_names as m};
use crate::subject::{self, Consumed};

/// Longest wait for the server's confirmation of a double ack (as `async-nats`'s JetStream
/// context waits by default), and for an ack not confirmed (a nak, a progress ack) to be handed
/// to the connection, whose buffer may be full while it is disconnected: an ack lost so fails
/// after it, and the server redelivers the message after its ack deadline.
const ACK_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause between two tries of a dead-letter publication that failed.
const DEAD_LETTER_RETRY: Duration = Duration::from_secs(1);

/// Runs a handler over a JetStream durable pull consumer through an [`Executor`], settling each
/// message (ack, nak with a delay, or dead letter and term) only once its outcome is known, and
/// holding its ack deadline with progress acks meanwhile. See the [crate docs](crate).
///
/// Build it with [`NatsRunner::builder`], then [`run`](Self::run) it until a shutdown signal.
/// `R` is the executor's [`Recorder`]: the handler returns `R::Returns<T>` (`T` on a plain
/// executor, a [`Commit`](idem_executor::Commit) on a transactional one).
pub struct NatsRunner<H, T, C = JsonCodec, R = Plain> {
    common: Arc<Common<H, C, R>>,
    _result: PhantomData<fn() -> T>,
}

impl<H, T, C, R> std::fmt::Debug for NatsRunner<H, T, C, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsRunner")
            .field("stream", &self.common.stream)
            .field("consumer", &self.common.consumer)
            .field("options", &self.common.options)
            .finish_non_exhaustive()
    }
}

/// Builds a [`NatsRunner`].
#[must_use]
pub struct NatsRunnerBuilder<H, T, C = JsonCodec, R = Plain> {
    client: async_nats::Client,
    stream: String,
    consumer: String,
    options: RunnerOptions,
    executor: Executor<C, R>,
    handler: H,
    _result: PhantomData<fn() -> T>,
}

impl<H, T, C, R> std::fmt::Debug for NatsRunnerBuilder<H, T, C, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsRunnerBuilder")
            .field("stream", &self.stream)
            .field("consumer", &self.consumer)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// What every message task shares.
struct Common<H, C, R> {
    execution: Execution<H, C, R>,
    /// The connection: confirmed acks go through its shared request inbox.
    client: async_nats::Client,
    jetstream: async_nats::jetstream::Context,
    stream: String,
    /// The durable consumer's name.
    consumer: String,
    options: RunnerOptions,
    stats: Arc<RunnerStats>,
    /// The executor's heartbeat interval: the pace of progress acks.
    heartbeat: Duration,
    max_attempts: u32,
    /// The longest subject a dead letter can be published to (the server's protocol line).
    max_subject: usize,
    /// The subjects the consumer receives, as last read from the server.
    consumed: Mutex<Consumed>,
    /// Store errors in a row among the outcomes: while there are some, each pull waits first.
    store: StoreHealth,
}

impl<H, C, R> Common<H, C, R> {
    /// The subjects the consumer receives, as the server has them now (as last read, when the
    /// server cannot be asked).
    async fn consumed_now(&self) -> Consumed {
        let fresh = async {
            let stream = self.jetstream.get_stream(&self.stream).await.ok()?;
            let info = stream.consumer_info(&self.consumer).await.ok()?;
            Some(Consumed::new(
                &stream.cached_info().config.subjects,
                &info.config.filter_subject,
            ))
        };
        let fresh = fresh.await;
        let mut last = self
            .consumed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(fresh) = fresh {
            *last = fresh;
        }
        last.clone()
    }
}

/// How [`NatsRunner::consumer`] gets the durable consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Get {
    /// At the start: created when missing, if
    /// [`create_consumer`](RunnerOptions::create_consumer) allows it.
    Start,
    /// While running: never created (a consumer created anew delivers the stream from its first
    /// message).
    Again,
}

/// What the server said does not exist.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Missing {
    Stream,
    Consumer,
}

impl<H, T, C, R> NatsRunner<H, T, C, R>
where
    H: Handler<NatsMessage, R::Returns<T>>,
    T: Serialize + DeserializeOwned + Send + 'static,
    R::Returns<T>: Send + 'static,
    C: Codec,
    R: Recorder,
{
    /// A builder over a connected client, the stream, the durable consumer's name, the executor
    /// and the handler.
    pub fn builder(
        client: async_nats::Client,
        stream: impl Into<String>,
        consumer: impl Into<String>,
        executor: Executor<C, R>,
        handler: H,
    ) -> NatsRunnerBuilder<H, T, C, R> {
        NatsRunnerBuilder {
            client,
            stream: stream.into(),
            consumer: consumer.into(),
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

    /// Gets (or, at the start, creates) the consumer, checks its configuration, pulls and processes messages
    /// until `shutdown` completes, then drains: no new pull; the pull in flight is read to its
    /// end (at most [`pull_expiry`](RunnerOptions::pull_expiry)) and what it brings is nak'ed
    /// for an immediate redelivery (a message on its last allowed delivery is run instead); the
    /// messages in process finish and are settled (up to
    /// [`drain_timeout`](RunnerOptions::drain_timeout); then a handler that had not started
    /// releases its lease and its message is nak'ed, or dead-lettered on its last allowed
    /// delivery, and running ones are signalled half-way through the orphan timeout, which
    /// drops them unless they return at once).
    ///
    /// A pull request that fails is sent again with a bounded delay, after getting the
    /// consumer again (never created again while running). The client reconnects to the server
    /// by itself; an ack that does not reach the server meanwhile leaves its message to be
    /// redelivered after its ack deadline, and the store replays it.
    ///
    /// # Errors
    /// - [`RunnerError::ConsumerDeleted`] when the consumer was deleted while the runner ran
    ///   (missing at three checks in a row, or a new consumer under its name), after draining
    ///   the messages in process; the operator recreates it from the right position;
    /// - [`RunnerError::Nats`] when the stream or the consumer cannot be had at the start (the
    ///   consumer missing with [`create_consumer`](RunnerOptions::create_consumer) off, say), or
    ///   the stream is gone while running (three checks in a row);
    /// - [`RunnerError::Config`] when the consumer on the server is not usable (not explicit
    ///   acks, `headers_only`, `ack_wait` or a `backoff` entry not above the heartbeat interval,
    ///   `max_deliver` not above `max_attempts`, a `max_batch` under
    ///   [`max_in_flight`](RunnerOptions::max_in_flight) or a `max_expires` under
    ///   [`pull_expiry`](RunnerOptions::pull_expiry), which would make the server refuse the
    ///   runner's pulls), or when it would receive its own dead letters (the stream captures the
    ///   [`dead_letter_subject`](RunnerOptions::dead_letter_subject) and the filter lets it
    ///   through).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), RunnerError> {
        let stop = CancellationToken::new();
        let mut shutdown = std::pin::pin!(shutdown);
        let mut main = std::pin::pin!(self.consume_until(stop.clone()));
        tokio::select! {
            result = &mut main => return result,
            () = &mut shutdown => {
                tracing::info!(stream = %self.common.stream, consumer = %self.common.consumer, "shutdown requested: draining");
                stop.cancel();
            }
        }
        let result = main.await;
        tracing::info!(stream = %self.common.stream, consumer = %self.common.consumer, "nats runner stopped");
        result
    }

    /// The durable pull consumer, its settings checked; at the start ([`Get::Start`]) created
    /// when missing, if allowed. Also refuses dead-letter subjects the consumer would receive.
    async fn consumer(&self, get: Get) -> Result<(PullConsumer, i64), RunnerError> {
        let common = &self.common;
        let options = &common.options;
        let name = &common.consumer;
        let stream = common
            .jetstream
            .get_stream(&common.stream)
            .await
            .map_err(|e| RunnerError::nats(format!("getting stream {}", common.stream), e))?;
        let consumer: PullConsumer = match stream.get_consumer(name).await {
            Ok(consumer) => consumer,
            Err(e) => {
                let e = RunnerError::nats(format!("getting consumer {name}"), e);
                if get != Get::Start
                    || !options.create_consumer
                    || missing(&e) != Some(Missing::Consumer)
                {
                    return Err(e);
                }
                let config = PullConfig {
                    durable_name: Some(name.clone()),
                    deliver_policy: DeliverPolicy::All,
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: options.ack_wait,
                    max_deliver: options.max_deliver.unwrap_or(-1),
                    filter_subject: options.filter_subject.clone().unwrap_or_default(),
                    ..PullConfig::default()
                };
                // (Another runner may create it at the same moment: the server answers both.)
                let created = stream
                    .get_or_create_consumer(name, config)
                    .await
                    .map_err(|e| {
                        RunnerError::nats(format!("getting or creating consumer {name}"), e)
                    })?;
                tracing::warn!(stream = %common.stream, consumer = %name, "created the durable consumer, which was missing: it delivers the stream from its first message (see create_consumer)");
                created
            }
        };
        let config = &consumer.cached_info().config;
        check_found_consumer(name, config, options, common.heartbeat, common.max_attempts)?;
        let consumed = Consumed::new(
            &stream.cached_info().config.subjects,
            &config.filter_subject,
        );
        if let Some(why) = consumed.loop_through(&options.dead_letter_subject) {
            return Err(RunnerError::config(
                "dead_letter_subject",
                format!(
                    "{:?}: stream {} (subjects {:?}) and consumer {name} (filter {:?}): {why}: \
                     every dead letter would come back and be dead-lettered again, without end; \
                     publish dead letters to subjects the source stream does not capture, or \
                     that the consumer's filter keeps out",
                    options.dead_letter_subject, common.stream, consumed.stream, consumed.filters,
                ),
            ));
        }
        *common
            .consumed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = consumed;
        let max_deliver = config.max_deliver;
        Ok((consumer, max_deliver))
    }

    /// After `failures` failed pulls in a row: waits the reconnect delay, then gets the consumer
    /// again ([`recover`](Self::recover)). `Ok(false)` when `stop` came first.
    async fn after_failure(
        &self,
        stop: &CancellationToken,
        failures: u32,
        consumer: &mut PullConsumer,
        max_deliver: &mut i64,
        gone: &mut u32,
    ) -> Result<bool, RunnerError> {
        tokio::select! {
            biased;
            () = stop.cancelled() => return Ok(false),
            () = tokio::time::sleep(self.common.options.reconnect_delay(failures)) => {}
        }
        self.recover(consumer, max_deliver, gone).await?;
        Ok(true)
    }

    /// After a failed pull: gets the consumer again and checks it, as [`consumer`](Self::consumer)
    /// does at the start, but never creates it. `Err` when the runner cannot go on: the consumer
    /// is not usable; it was deleted ([`RunnerError::ConsumerDeleted`]: the server said it does
    /// not exist at [`GONE_CHECKS`] checks in a row, once could be a server still recovering
    /// its streams, or the consumer under its name is a new one); or the stream is gone (the
    /// server's answer, at [`GONE_CHECKS`] checks in a row). Any other failure (the server
    /// unreachable) leaves the consumer as it was, to pull again.
    async fn recover(
        &self,
        consumer: &mut PullConsumer,
        max_deliver: &mut i64,
        gone: &mut u32,
    ) -> Result<(), RunnerError> {
        match self.consumer(Get::Again).await {
            Ok((again, deliver)) => {
                if again.cached_info().created != consumer.cached_info().created {
                    tracing::error!(consumer = %self.common.consumer, "the consumer was deleted and created again while the runner ran, from a position it cannot know: stopping");
                    return Err(self.deleted(consumer));
                }
                *gone = 0;
                *consumer = again;
                *max_deliver = deliver;
                Ok(())
            }
            Err(e @ RunnerError::Config { .. }) => Err(e),
            Err(e) => match missing(&e) {
                Some(what) => {
                    *gone += 1;
                    tracing::warn!(error = %e, checks = *gone, "the stream or the consumer is not on the server");
                    if *gone < GONE_CHECKS {
                        Ok(())
                    } else if what == Missing::Consumer {
                        tracing::error!(consumer = %self.common.consumer, "the consumer was deleted while the runner ran: stopping (the runner does not create it again, which would deliver the stream from its start)");
                        Err(self.deleted(consumer))
                    } else {
                        Err(e)
                    }
                }
                None => {
                    *gone = 0;
                    tracing::warn!(error = %e, "getting the consumer again failed");
                    Ok(())
                }
            },
        }
    }

    /// [`RunnerError::ConsumerDeleted`], with the ack floor `consumer` last showed.
    fn deleted(&self, consumer: &PullConsumer) -> RunnerError {
        RunnerError::ConsumerDeleted {
            stream: self.common.stream.clone(),
            consumer: self.common.consumer.clone(),
            ack_floor: consumer.cached_info().ack_floor.stream_sequence,
        }
    }

    async fn consume_until(&self, stop: CancellationToken) -> Result<(), RunnerError> {
        let common = &self.common;
        let options = &common.options;
        let (mut consumer, mut max_deliver) = self.consumer(Get::Start).await?;
        // Checks in a row that found the stream or the consumer gone.
        let mut gone = 0;
        tracing::info!(stream = %common.stream, consumer = %self.common.consumer, max_deliver, "nats runner consuming");
        let permits = Arc::new(Semaphore::new(options.max_in_flight));
        let lost = CancellationToken::new();
        let mut tasks = JoinSet::new();
        // Failed pulls in a row, reset only by a message: until one comes, every pull is followed
        // by the pause and a check of the consumer (the pulls of a deleted consumer end silently
        // at their expiry, and only that check finds it gone).
        let mut failures = 0u32;
        // Whether the last pull brought messages.
        let mut busy = false;
        let half = u32::try_from(options.max_in_flight.div_ceil(2)).unwrap_or(u32::MAX);
        'pulls: while !stop.is_cancelled() {
            // While the store fails (the last outcomes were store errors), wait before pulling:
            // every message pulled into an outage is nak'ed, and every nak is a delivery that
            // counts towards `max_deliver` and a store call that cannot succeed. The wait grows
            // with the failures in a row, as the reconnect delay does; one outcome the store
            // answered ends it.
            if let Some(pause) = common
                .store
                .pause(options.min_reconnect_delay, options.max_reconnect_delay)
            {
                RunnerStats::count(&common.stats.store_pauses, m::STORE_PAUSES);
                let resume = tokio::time::Instant::now() + pause;
                tracing::debug!(
                    failures = common.store.failures(),
                    ?pause,
                    "the store is failing: pausing pulls"
                );
                loop {
                    tokio::select! {
                        biased;
                        () = stop.cancelled() => break 'pulls,
                        Some(joined) = tasks.join_next(), if !tasks.is_empty() => report(joined),
                        () = tokio::time::sleep_until(resume) => break,
                    }
                }
            }
            // Pull as many messages as there are free slots, once at least half of them are
            // free (fewer, larger pulls; the other half keeps working meanwhile): nothing waits
            // in a client buffer with its ack deadline running.
            let first = tokio::select! {
                biased;
                () = stop.cancelled() => break,
                Some(joined) = tasks.join_next(), if !tasks.is_empty() => {
                    report(joined);
                    continue;
                }
                p = Arc::clone(&permits).acquire_many_owned(half) => p.expect("the semaphore is never closed"),
            };
            let mut group = first;
            let mut slots = Vec::with_capacity(options.max_in_flight);
            while group.num_permits() > 1 {
                slots.push(group.split(1).expect("more than one permit"));
            }
            slots.push(group);
            while slots.len() < options.max_in_flight {
                match Arc::clone(&permits).try_acquire_owned() {
                    Ok(p) => slots.push(p),
                    Err(_) => break,
                }
            }
            // While messages keep coming, a pull takes what the stream holds now and returns
            // at once (no wait), so that its messages form one group; once a pull brought
            // nothing, the next one waits for messages (up to the pull expiry).
            let fetching = busy;
            let batch = if fetching {
                consumer
                    .fetch()
                    .max_messages(slots.len())
                    .expires(options.pull_expiry)
                    .messages()
                    .await
            } else {
                consumer
                    .batch()
                    .max_messages(slots.len())
                    .expires(options.pull_expiry)
                    .messages()
                    .await
            };
            busy = false;
            let mut batch = match batch {
                Ok(batch) => batch,
                Err(e) => {
                    RunnerStats::count(&common.stats.stream_errors, m::STREAM_ERRORS);
                    failures = failures.saturating_add(1);
                    tracing::warn!(error = %e, failures, "pull request failed");
                    drop(slots);
                    match self
                        .after_failure(&stop, failures, &mut consumer, &mut max_deliver, &mut gone)
                        .await
                    {
                        Ok(true) => continue,
                        Ok(false) => break,
                        Err(e) => {
                            self.drain(tasks, &lost).await;
                            return Err(e);
                        }
                    }
                }
            };
            // Read the pull to its end (all its messages, or its expiry), even when stopping:
            // what arrives after the stop is nak'ed for an immediate redelivery. The messages of
            // a no-wait pull, or those of a waiting pull that are at hand together, go through
            // one executor batch (up to `max_batch`).
            let mut ended = false;
            while !ended {
                let mut next = tokio::select! {
                    biased;
                    Some(joined) = tasks.join_next(), if !tasks.is_empty() => {
                        report(joined);
                        continue;
                    }
                    next = batch.next() => next,
                };
                let mut group = Vec::new();
                loop {
                    match next {
                        Some(Ok(message)) => {
                            failures = 0;
                            busy = true;
                            if let Some(taken) =
                                self.take(message, &stop, &mut slots, max_deliver).await
                            {
                                group.push(taken);
                            }
                        }
                        Some(Err(e)) => {
                            RunnerStats::count(&common.stats.stream_errors, m::STREAM_ERRORS);
                            failures = failures.saturating_add(1);
                            tracing::warn!(error = %e, failures, "pull error");
                            ended = true;
                            break;
                        }
                        None => {
                            ended = true;
                            break;
                        }
                    }
                    if group.len() >= options.max_batch {
                        break;
                    }
                    if fetching {
                        // The rest of a no-wait pull is on its way: it joins the group.
                        next = batch.next().await;
                        continue;
                    }
                    // What a waiting pull has already brought joins the group; nothing more is
                    // waited for.
                    match batch.next().now_or_never() {
                        Some(more) => next = more,
                        None => break,
                    }
                }
                if !group.is_empty() {
                    tasks.spawn(deliver(
                        Arc::clone(common),
                        group,
                        lost.clone(),
                        max_deliver,
                    ));
                }
            }
            if failures > 0 {
                drop(slots);
                match self
                    .after_failure(&stop, failures, &mut consumer, &mut max_deliver, &mut gone)
                    .await
                {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => {
                        self.drain(tasks, &lost).await;
                        return Err(e);
                    }
                }
            }
        }
        self.drain(tasks, &lost).await;
        Ok(())
    }

    /// A message of a pull, with the slot it takes; `None` (the message nak'ed for an
    /// immediate redelivery) when stopping or when the pull brought more than was asked for.
    /// A message on its last allowed delivery (`max_deliver`) is never nak'ed, which would
    /// make the server drop it: it is taken then too, without a slot (a stop still drains it).
    async fn take(
        &self,
        message: async_nats::jetstream::Message,
        stop: &CancellationToken,
        slots: &mut Vec<OwnedSemaphorePermit>,
        max_deliver: i64,
    ) -> Option<(async_nats::jetstream::Message, Option<OwnedSemaphorePermit>)> {
        let stats = &self.common.stats;
        if !stop.is_cancelled() {
            RunnerStats::bump(&stats.received);
            if let Some(slot) = slots.pop() {
                return Some((message, Some(slot)));
            }
        }
        let delivered = message.info().map_or(1, |i| i.delivered);
        if is_last_delivery(delivered, max_deliver) {
            if stop.is_cancelled() {
                RunnerStats::bump(&stats.received);
            }
            return Some((message, None));
        }
        if within(message.ack_with(AckKind::Nak(None))).await.is_err() {
            RunnerStats::count(&stats.ack_failures, m::ACK_FAILURES);
        }
        None
    }

    async fn drain(&self, mut tasks: JoinSet<()>, lost: &CancellationToken) {
        let options = &self.common.options;
        let timeouts = DrainTimeouts {
            drain: options.drain_timeout,
            orphan: options.orphan_timeout,
        };
        let drained = broker::drain(&mut tasks, lost, timeouts, report, async {}).await;
        if drained.aborted > 0 {
            // Their messages come back after their ack deadline.
            RunnerStats::add(&self.common.stats.abandoned, m::ABANDONED, drained.aborted);
        }
    }
}

/// Logs a message task that panicked (its message is redelivered after its ack deadline).
fn report(joined: Result<(), tokio::task::JoinError>) {
    if let Err(e) = joined
        && e.is_panic()
    {
        tracing::error!(error = %e, "a message task panicked; the message is redelivered after its ack deadline");
    }
}

impl<H, T, C, R> NatsRunnerBuilder<H, T, C, R>
where
    H: Handler<NatsMessage, R::Returns<T>>,
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

    /// Changes the options in place, e.g. `.configure(|o| o.with_max_in_flight(4))`.
    pub fn configure(mut self, f: impl FnOnce(RunnerOptions) -> RunnerOptions) -> Self {
        self.options = f(self.options);
        self
    }

    /// Validates the options against the executor's heartbeat interval and maximum attempts.
    ///
    /// # Errors
    /// [`RunnerError::Config`] naming the bad option.
    pub fn build(self) -> Result<NatsRunner<H, T, C, R>, RunnerError> {
        let heartbeat = self.executor.heartbeat_interval();
        let max_attempts = self.executor.config().max_attempts;
        let store_max_batch = self.executor.store().limits().max_batch;
        // A JetStream publication's reply subject is one of the client's inboxes.
        let max_subject = subject::max_publish_subject(self.client.new_inbox().len());
        self.options
            .validate(heartbeat, max_attempts, store_max_batch, max_subject)?;
        if self.stream.is_empty() {
            return Err(RunnerError::config("stream", "is empty"));
        }
        if self.consumer.is_empty() {
            return Err(RunnerError::config("consumer", "is empty"));
        }
        Ok(NatsRunner {
            common: Arc::new(Common {
                execution: Execution::new(self.executor, self.handler),
                jetstream: async_nats::jetstream::new(self.client.clone()),
                client: self.client,
                stream: self.stream,
                consumer: self.consumer,
                options: self.options,
                stats: Arc::new(RunnerStats::default()),
                heartbeat,
                max_attempts,
                max_subject,
                consumed: Mutex::new(Consumed::default()),
                store: StoreHealth::default(),
            }),
            _result: PhantomData,
        })
    }
}

/// How many checks in a row must find the stream or the consumer gone before the runner stops.
const GONE_CHECKS: u32 = 3;

/// What the server answered does not exist, if that is what `e` says: the stream or the
/// consumer.
fn missing(e: &RunnerError) -> Option<Missing> {
    use async_nats::jetstream::ErrorCode;
    use async_nats::jetstream::context::{
        ConsumerInfoError, ConsumerInfoErrorKind, GetStreamError, GetStreamErrorKind,
    };
    use async_nats::jetstream::stream::{ConsumerError, ConsumerErrorKind};
    let code = |e: &async_nats::jetstream::Error| match e.error_code() {
        ErrorCode::STREAM_NOT_FOUND => Some(Missing::Stream),
        ErrorCode::CONSUMER_NOT_FOUND => Some(Missing::Consumer),
        _ => None,
    };
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(e) = cause {
        let found = if let Some(e) = e.downcast_ref::<GetStreamError>() {
            match e.kind() {
                GetStreamErrorKind::JetStream(j) => code(&j),
                _ => None,
            }
        } else if let Some(e) = e.downcast_ref::<ConsumerInfoError>() {
            match e.kind() {
                ConsumerInfoErrorKind::NotFound => Some(Missing::Consumer),
                ConsumerInfoErrorKind::StreamNotFound => Some(Missing::Stream),
                ConsumerInfoErrorKind::JetStream(j) => code(&j),
                _ => None,
            }
        } else if let Some(e) = e.downcast_ref::<ConsumerError>() {
            match e.kind() {
                ConsumerErrorKind::JetStream(j) => code(&j),
                _ => None,
            }
        } else if let Some(e) = e.downcast_ref::<async_nats::jetstream::Error>() {
            code(e)
        } else {
            None
        };
        if found.is_some() {
            return found;
        }
        cause = e.source();
    }
    None
}

/// An ack the server does not confirm (a nak, a progress ack), given at most [`ACK_TIMEOUT`] to
/// be handed to the connection (whose buffer may be full while it is disconnected).
async fn within(
    ack: impl Future<Output = Result<(), async_nats::Error>>,
) -> Result<(), async_nats::Error> {
    tokio::time::timeout(ACK_TIMEOUT, ack)
        .await
        .unwrap_or_else(|_| Err("not handed to the connection within 5 s".into()))
}

/// Whether a message delivered `delivered` times is on the consumer's last allowed delivery
/// (`max_deliver`; 0 or less: unlimited), when a nak would make the server stop delivering it.
fn is_last_delivery(delivered: i64, max_deliver: i64) -> bool {
    max_deliver > 0 && delivered >= max_deliver
}

/// Whether a publication was refused for its size: over the server's `max_payload` (refused by
/// the client before it is sent) or over the stream's `max_msg_size` (refused by the stream).
fn too_large(error: &async_nats::jetstream::context::PublishError) -> bool {
    use async_nats::jetstream::ErrorCode;
    error.kind() == PublishErrorKind::MaxPayloadExceeded
        || std::error::Error::source(error)
            .and_then(|source| source.downcast_ref::<async_nats::jetstream::Error>())
            .is_some_and(|e| e.error_code() == ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM)
}

/// The dead letter of a message on its last allowed delivery that has no final outcome: reason
/// `undelivered` (not `exhausted`, which says the key is poison: this one's handler may never
/// have run).
fn last_delivery_info(msg: &NatsMessage, why: &str) -> DeadLetterInfo {
    DeadLetterInfo {
        reason: DeadLetterReason::Undelivered,
        error: format!(
            "delivered {} times, the consumer's max_deliver, without a final outcome ({why})",
            msg.delivered()
        ),
        attempts: None,
    }
}

/// Processes a group of messages to their end: one executor batch, each message settled as soon
/// as its outcome is known; a progress ack for every message not yet settled at each heartbeat
/// interval meanwhile.
async fn deliver<H, T, C, R>(
    common: Arc<Common<H, C, R>>,
    group: Vec<(async_nats::jetstream::Message, Option<OwnedSemaphorePermit>)>,
    lost: CancellationToken,
    max_deliver: i64,
) where
    H: Handler<NatsMessage, R::Returns<T>>,
    T: Serialize + DeserializeOwned + Send + 'static,
    R::Returns<T>: Send + 'static,
    C: Codec,
    R: Recorder,
{
    let mut msgs = Vec::with_capacity(group.len());
    let mut settles = Vec::with_capacity(group.len());
    for (message, permit) in group {
        let (sequence, delivered) = message
            .info()
            .map_or((0, 1), |i| (i.stream_sequence, i.delivered));
        let reply = message.reply.clone();
        let (message, acker) = message.split();
        let msg = NatsMessage::from_parts(message, &common.stream, sequence, delivered);
        let span = tracing::debug_span!(
            "idem_nats_message",
            stream = %common.stream,
            subject = msg.subject(),
            sequence,
            delivered,
            outcome = tracing::field::Empty,
        );
        settles.push(Settle {
            common: &common,
            acker,
            reply,
            lost: &lost,
            max_deliver,
            span,
            settled: AtomicBool::new(false),
            slot: Mutex::new(permit),
        });
        msgs.push(msg);
    }
    let settles = &settles;
    let msgs = &msgs;
    let work = async {
        let timeouts = common.options.lost_timeouts();
        // Each message is settled as soon as its step is known (its completion recorded), not
        // once the whole group's are: a slow handler holds back only its own message.
        common
            .execution
            .try_batch_settling::<_, T, _, _>(msgs, &lost, timeouts, |index, step| {
                settle_one::<H, T, C, R>(&settles[index], &msgs[index], step)
            })
            .instrument(tracing::debug_span!("idem_nats_batch", stream = %common.stream, messages = msgs.len()))
            .await;
    };
    tokio::select! {
        biased;
        () = work => {}
        () = keep_alive(&common, settles) => {}
    }
}

/// Settles one message of a group with its step, in its span, and marks it settled.
async fn settle_one<H, T, C, R>(settle: &Settle<'_, H, C, R>, msg: &NatsMessage, step: Step<T>)
where
    H: Handler<NatsMessage, R::Returns<T>>,
    T: Serialize + DeserializeOwned + Send + 'static,
    R::Returns<T>: Send + 'static,
    C: Codec,
    R: Recorder,
{
    let span = settle.span.clone();
    async {
        settle.settle::<T>(msg, step).await;
        settle.settled.store(true, Ordering::Relaxed);
    }
    .instrument(span)
    .await;
}

/// Sends a progress ack for every message of `settles` not yet settled at every heartbeat
/// interval, forever (the caller drops it once the group is settled): no ack deadline passes
/// while a message is held.
async fn keep_alive<H, C, R>(common: &Common<H, C, R>, settles: &[Settle<'_, H, C, R>]) {
    let mut ticks = tokio::time::interval(common.heartbeat);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let held = settles
            .iter()
            .filter(|s| !s.settled.load(Ordering::Relaxed))
            .map(|s| async move {
                match within(s.acker.ack_with(AckKind::Progress)).await {
                    Ok(()) => RunnerStats::count(&common.stats.progress, m::PROGRESS),
                    Err(e) => {
                        let _in = s.span.enter();
                        tracing::warn!(error = %e, "progress ack failed; the ack deadline may pass");
                    }
                }
            });
        futures::future::join_all(held).await;
    }
}

/// How one message of a group is settled.
struct Settle<'a, H, C, R> {
    common: &'a Common<H, C, R>,
    acker: Acker,
    /// The message's reply subject, where acks go.
    reply: Option<async_nats::Subject>,
    lost: &'a CancellationToken,
    max_deliver: i64,
    /// The message's span.
    span: tracing::Span,
    /// Whether it is settled (no more progress acks): set as its final ack, nak or term is
    /// sent.
    settled: AtomicBool,
    /// The message's slot (none for a message taken on its last delivery without one), given
    /// back as its final ack, nak or term is sent: the next pull need not wait for the server's
    /// confirmation.
    slot: Mutex<Option<OwnedSemaphorePermit>>,
}

impl<H, C, R> Settle<'_, H, C, R>
where
    C: Codec,
    R: Recorder,
{
    /// Acts on what the executor batch came to for `msg`: ack, nak with a delay, or dead letter
    /// then term.
    async fn settle<T>(&self, msg: &NatsMessage, step: Step<T>)
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
                RunnerStats::count(&common.stats.abandoned, m::ABANDONED);
                if is_last_delivery(msg.delivered(), self.max_deliver) {
                    // A nak would make the server drop it: dead-letter it instead.
                    let info = last_delivery_info(msg, "abandoned by the drain");
                    return self.dead_letter_until_published(msg, &info).await;
                }
                // Redelivered at once elsewhere (a lease left to expire makes it wait there).
                self.send(AckKind::Nak(None), false).await;
                return;
            }
            Step::Done { result, attempt } => (result, attempt),
        };
        common.store.note(&result);
        let outcome = outcome_name(&result);
        tracing::Span::current().record("outcome", outcome);
        match BrokerAction::of(&result) {
            BrokerAction::Ack => {
                match &result {
                    Ok(Outcome::Executed(_)) => {
                        RunnerStats::count(&common.stats.executed, m::EXECUTED)
                    }
                    Ok(Outcome::Replayed(_)) => {
                        RunnerStats::count(&common.stats.replayed, m::REPLAYED)
                    }
                    _ => RunnerStats::bump(&common.stats.acked_other),
                }
                self.send(AckKind::Ack, true).await;
                tracing::debug!(outcome, "acknowledged");
            }
            BrokerAction::DeadLetter { reason, error } => {
                let info = broker::classify(&result, reason, error, attempt);
                drop(result);
                self.dead_letter_until_published(msg, &info).await;
            }
            action => {
                drop(result);
                let hint = match action {
                    BrokerAction::Retry { after } => after,
                    _ => options.min_retry_delay,
                };
                if is_last_delivery(msg.delivered(), self.max_deliver) {
                    // A nak now would make the server drop the message: dead-letter it instead.
                    let info = last_delivery_info(msg, &format!("last: {outcome}"));
                    return self.dead_letter_until_published(msg, &info).await;
                }
                let delay = options.retry_delay(hint);
                RunnerStats::count(&common.stats.naks, m::NAKS);
                tracing::debug!(outcome, ?delay, "nak with a delay");
                self.send(AckKind::Nak(Some(delay)), false).await;
            }
        }
    }

    /// Sends an ack of `kind`; `confirmed`: waits for the server's confirmation (double ack).
    async fn send(&self, kind: AckKind, confirmed: bool) {
        // No progress ack after the final one (it would restart the ack deadline of a nak'ed
        // message, putting off its redelivery).
        self.settled.store(true, Ordering::Relaxed);
        self.free_slot();
        let sent = if confirmed {
            self.confirmed(kind).await
        } else {
            within(self.acker.ack_with(kind)).await
        };
        if let Err(e) = sent {
            RunnerStats::count(&self.common.stats.ack_failures, m::ACK_FAILURES);
            tracing::warn!(error = %e, "ack failed; the server redelivers the message after its ack deadline and the store replays it");
        }
    }

    /// Gives the message's slot back (once; later calls do nothing).
    fn free_slot(&self) {
        let slot = self
            .slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        drop(slot);
    }

    /// A double ack: `kind` sent as a request to the message's reply subject, then the server's
    /// answer awaited (at most 5 s). The request
    /// goes through the client's shared response inbox (one subscription for the connection),
    /// where `Acker::double_ack_with` subscribes and unsubscribes an inbox of its own per ack:
    /// the same confirmation, two protocol operations and a server-side interest change fewer.
    async fn confirmed(&self, kind: AckKind) -> Result<(), async_nats::Error> {
        let Some(reply) = self.reply.clone() else {
            return Err("no reply subject: not a JetStream message".into());
        };
        let request = async_nats::Request::new()
            .payload(kind.into())
            .timeout(Some(ACK_TIMEOUT));
        self.common.client.send_request(reply, request).await?;
        Ok(())
    }

    /// Whether `msg` is itself a dead letter (it carries [`HEADER_REASON`]) that dead-lettering
    /// to `subject` would send back to this consumer: `subject` is its own, or one the consumer
    /// receives (the stream's subjects and the consumer's filter, as the server has them now).
    async fn comes_back(&self, msg: &NatsMessage, subject: &str) -> bool {
        let is_dead_letter = msg
            .headers()
            .is_some_and(|h| h.get(HEADER_REASON).is_some());
        is_dead_letter
            && (subject == msg.subject() || self.common.consumed_now().await.takes(subject))
    }

    /// Publishes to the dead-letter subject (cut short when too long for the server's protocol
    /// line) until a stream acknowledges it, then terminates the message; stops (nak'ing the
    /// message) when the drain timed out. A dead letter that came back to the consumer is
    /// terminated instead ([`comes_back`](Self::comes_back)).
    async fn dead_letter_until_published(&self, msg: &NatsMessage, info: &DeadLetterInfo) {
        let common = self.common;
        let (subject, cut) = common
            .options
            .dead_letter_subject
            .for_subject_within(msg.subject(), common.max_subject);
        if cut {
            tracing::warn!(
                subject_len = msg.subject().len(),
                dead_letter_subject = %subject,
                "subject too long: the dead-letter subject (the prefix and the message's subject) would make the publication longer than the server's protocol line (4,096 bytes; the server would close the connection), so it goes to the subject cut short; the original subject is in idem-dlq-source-subject"
            );
        }
        if self.comes_back(msg, &subject).await {
            RunnerStats::count(&common.stats.dead_letter_loops, m::DEAD_LETTER_LOOPS);
            tracing::error!(
                reason = info.reason.as_str(),
                error = %broker::header_text(&info.error),
                dead_letter_subject = %subject,
                "a dead letter came back to the consumer (the source stream captures the dead-letter subject): terminated, not dead-lettered again, which would loop without end; it stays in the stream it was published to. Publish dead letters to subjects the source stream does not capture"
            );
            return self.send(AckKind::Term, true).await;
        }
        let key_id = common.execution.key_id(msg);
        // Once the delivery is lost (the drain timed out) the time left is short: no store read
        // for the attempt count (the header is left out), the publication first.
        let attempts = if self.lost.is_cancelled() {
            info.attempts
        } else {
            common
                .execution
                .dead_letter_attempts(info, key_id.as_deref())
                .await
        };
        let mut fit = Fit::first(msg.headers().is_some_and(|h| !h.is_empty()));
        let headers_for = |fit| {
            dead_letter::headers(
                msg,
                &common.consumer,
                info,
                attempts,
                key_id.as_deref(),
                fit,
            )
        };
        let mut headers = headers_for(fit);
        loop {
            let publish = async {
                common
                    .jetstream
                    .publish_with_headers(subject.clone(), headers.clone(), msg.payload().clone())
                    .await?
                    .await
            };
            let published = tokio::time::timeout(common.options.publish_timeout, publish).await;
            match published {
                Ok(Ok(ack)) => {
                    RunnerStats::bump(&common.stats.dead_lettered);
                    metrics::counter!(m::DEAD_LETTERED, "reason" => info.reason.as_str())
                        .increment(1);
                    tracing::warn!(
                        reason = info.reason.as_str(),
                        error = %broker::header_text(&info.error),
                        attempts = ?attempts,
                        key = key_id.as_deref().map(broker::header_text).as_deref(),
                        dead_letter_subject = %subject,
                        dead_letter_stream = %ack.stream,
                        duplicate = ack.duplicate,
                        "message dead-lettered"
                    );
                    return self.send(AckKind::Term, true).await;
                }
                Ok(Err(e)) if too_large(&e) && fit.smaller().is_some() => {
                    fit = fit.smaller().unwrap_or(fit);
                    if fit == Fit::Compact {
                        tracing::warn!(error = %e, "the dead letter is over the server's or the stream's size limit with the runner's headers: publishing it with the error and the key cut short");
                    } else {
                        tracing::warn!(error = %e, "the dead letter is over the server's or the stream's size limit with the original headers: publishing it with the runner's only, naming the others");
                    }
                    headers = headers_for(fit);
                    continue;
                }
                Ok(Err(e)) => {
                    RunnerStats::count(&common.stats.publish_failures, m::PUBLISH_FAILURES);
                    tracing::error!(error = %e, dead_letter_subject = %subject, "dead-letter publication failed (does a stream capture the subject?); trying again");
                }
                Err(_) => {
                    RunnerStats::count(&common.stats.publish_failures, m::PUBLISH_FAILURES);
                    tracing::error!(dead_letter_subject = %subject, "dead-letter publication not acknowledged in time; trying again");
                }
            }
            tokio::select! {
                biased;
                () = self.lost.cancelled() => {
                    RunnerStats::count(&common.stats.abandoned, m::ABANDONED);
                    return self.send(AckKind::Nak(None), false).await;
                }
                () = tokio::time::sleep(DEAD_LETTER_RETRY) => {}
            }
        }
    }
}
