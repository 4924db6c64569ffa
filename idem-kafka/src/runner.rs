//! The runner: builder, poll thread, shutdown.

use std::future::Future;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use idem_executor::{Codec, Executor, Handler, JsonCodec, Plain, Recorder};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::KafkaError;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::runtime::Handle;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::context::{RunnerContext, Shared, Slot, SpawnWorker};
use crate::dead_letter::DeadLetterProducer;
use crate::error::RunnerError;
use crate::flow::Flow;
use crate::message::KafkaMessage;
use crate::options::RunnerOptions;
use crate::stats::RunnerStats;
use crate::worker::{Common, Worker};
use idem_executor::broker::{self, Execution};

/// Consumer properties the runner sets itself, whatever the configuration says.
const FORCED: [(&str, &str); 2] = [
    // Offsets are committed by the runner, only for resolved records.
    ("enable.auto.commit", "false"),
    ("enable.auto.offset.store", "false"),
];

/// Producer properties copied from the consumer configuration when no producer configuration is
/// given (those named so, or starting so): the connection and security settings. A dead-letter
/// producer that connected otherwise than the consumer (without its
/// `enable.ssl.certificate.verification=false`, say) would fail every write, and its partitions
/// would stall on their first dead letter.
const SHARED_PREFIXES: [&str; 15] = [
    "bootstrap.servers",
    "metadata.broker.list",
    "security.protocol",
    "ssl.",
    "sasl.",
    "enable.ssl.",
    "enable.sasl.",
    "https.",
    "client.dns.lookup",
    "client.id",
    "socket.",
    "broker.address.",
    "connections.max.idle.ms",
    "api.version.",
    "broker.version.fallback",
];

/// The dead-letter producer's configuration made of the consumer's: its properties named in (or
/// starting with one of) [`SHARED_PREFIXES`].
fn shared_producer_config(consumer: &ClientConfig) -> ClientConfig {
    let mut config = ClientConfig::new();
    for (k, v) in consumer.config_map() {
        if SHARED_PREFIXES.iter().any(|p| k.starts_with(p)) {
            config.set(k, v);
        }
    }
    config
}

/// Runs a handler over Kafka topics through an [`Executor`], committing offsets only for
/// resolved records. See the [crate docs](crate) for the exact semantics.
///
/// `R` is the executor's [`Recorder`]: [`Plain`] (the default; the handler returns its result
/// `T`) or [`Transactional<S>`](idem_executor::Transactional) for an executor made by
/// [`Executor::transactional`] (the handler returns a [`Commit`](idem_executor::Commit) of its
/// result and the writes committed with it): see the
/// [crate docs](crate#transactional-executors).
///
/// Build it with [`KafkaRunner::builder`], then [`run`](Self::run) it until a shutdown signal.
pub struct KafkaRunner<H, T, C = JsonCodec, R = Plain> {
    consumer_config: ClientConfig,
    topics: Vec<String>,
    common: Common<H, C, R>,
    _result: PhantomData<fn() -> T>,
}

impl<H, T, C, R> std::fmt::Debug for KafkaRunner<H, T, C, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaRunner")
            .field("topics", &self.topics)
            .field("options", &self.common.options)
            .finish_non_exhaustive()
    }
}

/// Builds a [`KafkaRunner`].
#[must_use]
pub struct KafkaRunnerBuilder<H, T, C = JsonCodec, R = Plain> {
    consumer_config: ClientConfig,
    producer_config: Option<ClientConfig>,
    topics: Vec<String>,
    options: RunnerOptions,
    executor: Executor<C, R>,
    handler: H,
    _result: PhantomData<fn() -> T>,
}

impl<H, T, C, R> std::fmt::Debug for KafkaRunnerBuilder<H, T, C, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaRunnerBuilder")
            .field("topics", &self.topics)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<H, T, C, R> KafkaRunner<H, T, C, R>
where
    H: Handler<KafkaMessage, R::Returns<T>>,
    T: Serialize + DeserializeOwned + Send + 'static,
    R::Returns<T>: Send,
    C: Codec,
    R: Recorder,
{
    /// A builder over a consumer configuration (`bootstrap.servers` and `group.id` at least; the
    /// runner creates the consumer with its own context), the executor and the handler.
    pub fn builder(
        consumer_config: ClientConfig,
        executor: Executor<C, R>,
        handler: H,
    ) -> KafkaRunnerBuilder<H, T, C, R> {
        KafkaRunnerBuilder {
            consumer_config,
            producer_config: None,
            topics: Vec::new(),
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

    /// Subscribes and processes records until `shutdown` completes (or the consumer reports a
    /// fatal error, or a partition's worker dies), then drains: the records in process finish (up
    /// to [`drain_timeout`](RunnerOptions::drain_timeout), after which they are revoked as on a
    /// rebalance), the resolved offsets are committed synchronously, and the consumer leaves the
    /// group.
    ///
    /// Must be called within a Tokio runtime (either flavour): the partition workers are spawned
    /// on it. The Kafka client itself is polled on a dedicated thread. Dropping the returned
    /// future starts the same shutdown without waiting for it.
    ///
    /// # Errors
    /// [`RunnerError::Kafka`] when the consumer cannot be created or subscribed,
    /// [`RunnerError::Fatal`] after a fatal consumer error, [`RunnerError::WorkerDied`] when a
    /// partition's worker task panicked (the runner drained first, in both cases): restart the
    /// process (or call `run` again) to go on. [`RunnerError::PollThread`] when the thread that
    /// polls the Kafka client could not be started or panicked.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), RunnerError> {
        let handle = Handle::current();
        let spawner = Spawner {
            handle,
            common: self.common.clone(),
            _result: PhantomData::<fn() -> T>,
        };
        let shared = Arc::new(Shared::new(
            Box::new(spawner),
            Arc::clone(&self.common.options),
            Arc::clone(&self.common.stats),
        ));
        let mut config = self.consumer_config.clone();
        for (k, v) in FORCED {
            config.set(k, v);
        }
        let consumer: BaseConsumer<RunnerContext> = config
            .create_with_context(RunnerContext {
                shared: Arc::clone(&shared),
            })
            .map_err(|source| RunnerError::Kafka {
                context: "creating the consumer",
                source,
            })?;
        let topics: Vec<&str> = self.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&topics)
            .map_err(|source| RunnerError::Kafka {
                context: "subscribing",
                source,
            })?;
        let stop = CancellationToken::new();
        let _stop_on_drop = stop.clone().drop_guard();
        let (done_tx, done_rx) = oneshot::channel();
        let poll_stop = stop.clone();
        let drain = self.common.drain.clone();
        std::thread::Builder::new()
            .name("idem-kafka-poll".into())
            .spawn(move || {
                let result = poll_loop(&consumer, &shared, &poll_stop, &drain);
                // Leave the group (the revocation finds no worker left) before reporting.
                drop(consumer);
                let _ = done_tx.send(result);
            })
            .map_err(|e| RunnerError::PollThread(e.to_string()))?;
        tracing::info!(topics = ?self.topics, "kafka runner started");
        let mut done_rx = done_rx;
        tokio::select! {
            () = shutdown => {
                tracing::info!("shutdown requested: draining");
                stop.cancel();
            }
            result = &mut done_rx => {
                return result.unwrap_or_else(|_| Err(RunnerError::PollThread("the poll thread panicked".into())));
            }
        }
        let result = done_rx
            .await
            .unwrap_or_else(|_| Err(RunnerError::PollThread("the poll thread panicked".into())));
        tracing::info!("kafka runner stopped");
        result
    }
}

impl<H, T, C, R> KafkaRunnerBuilder<H, T, C, R>
where
    H: Handler<KafkaMessage, R::Returns<T>>,
    T: Serialize + DeserializeOwned + Send + 'static,
    R::Returns<T>: Send,
    C: Codec,
    R: Recorder,
{
    /// Adds a topic to subscribe to (at least one is required). Regex subscriptions (`^...`)
    /// work as in rdkafka.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topics.push(topic.into());
        self
    }

    /// Adds several topics.
    pub fn topics<I, S>(mut self, topics: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.topics.extend(topics.into_iter().map(Into::into));
        self
    }

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

    /// The configuration of the dead-letter producer. By default it is made of the consumer
    /// configuration's connection and security properties: `bootstrap.servers`,
    /// `metadata.broker.list`, `security.protocol`, `ssl.*`, `sasl.*`, `enable.ssl.*` (such as
    /// `enable.ssl.certificate.verification`), `enable.sasl.*`, `https.*`, `client.dns.lookup`,
    /// `client.id`, `socket.*`, `broker.address.*`, `connections.max.idle.ms`, `api.version.*`
    /// and `broker.version.fallback`. Give a configuration here when the producer needs anything
    /// else (it then takes nothing from the consumer's). Unless it sets `message.max.bytes`, that
    /// is raised to librdkafka's maximum (1,000,000,000), so that the broker's limit for the
    /// dead-letter topic decides: librdkafka's default (1,000,000 bytes, headers included)
    /// would refuse every time a record the source topic took, and stall its partition.
    pub fn producer_config(mut self, config: ClientConfig) -> Self {
        self.producer_config = Some(config);
        self
    }

    /// Validates the options and the consumer configuration, and creates the dead-letter
    /// producer.
    ///
    /// # Errors
    /// [`RunnerError::Config`] naming the bad option or property (no topic, no `group.id`, ...),
    /// [`RunnerError::Kafka`] when the producer cannot be created.
    pub fn build(self) -> Result<KafkaRunner<H, T, C, R>, RunnerError> {
        self.options
            .validate(self.executor.store().limits().max_batch)?;
        if self.topics.is_empty() || self.topics.iter().any(String::is_empty) {
            return Err(RunnerError::config(
                "topics",
                "subscribe to at least one topic, and no empty name",
            ));
        }
        if self
            .consumer_config
            .get("group.id")
            .is_none_or(str::is_empty)
        {
            return Err(RunnerError::config(
                "group.id",
                "the consumer configuration needs a group.id: offsets are committed for a group",
            ));
        }
        for (key, _) in FORCED {
            match self.consumer_config.get(key) {
                Some(v) if v != "false" => tracing::warn!(
                    property = key,
                    value = v,
                    "overridden to false: the runner commits offsets itself"
                ),
                _ => {}
            }
        }
        let producer_config = self
            .producer_config
            .unwrap_or_else(|| shared_producer_config(&self.consumer_config));
        let dead_letter = DeadLetterProducer::new(
            &producer_config,
            self.options.dead_letter_topic.clone(),
            self.options.dead_letter_timeout,
        )?;
        let options = Arc::new(self.options);
        Ok(KafkaRunner {
            consumer_config: self.consumer_config,
            topics: self.topics,
            common: Common {
                execution: Execution::new(self.executor, self.handler),
                dead_letter: Arc::new(dead_letter),
                in_flight: Arc::new(Semaphore::new(options.max_in_flight)),
                stats: Arc::new(RunnerStats::default()),
                drain: CancellationToken::new(),
                options,
            },
            _result: PhantomData,
        })
    }
}

struct Spawner<H, T, C, R> {
    handle: Handle,
    common: Common<H, C, R>,
    _result: PhantomData<fn() -> T>,
}

impl<H, T, C, R> SpawnWorker for Spawner<H, T, C, R>
where
    H: Handler<KafkaMessage, R::Returns<T>>,
    T: Serialize + DeserializeOwned + Send + 'static,
    R::Returns<T>: Send,
    C: Codec,
    R: Recorder,
{
    fn spawn(&self, topic: &str, partition: i32) -> Slot {
        let flow = Arc::new(Mutex::new(Flow::new(
            self.common.options.max_buffered_per_partition,
            self.common.options.max_buffered_bytes_per_partition,
        )));
        let (records_tx, records_rx) = mpsc::unbounded_channel::<KafkaMessage>();
        let (exited_tx, exited_rx) = std::sync::mpsc::channel();
        let revoke = CancellationToken::new();
        let worker = Worker::<H, T, C, R> {
            common: self.common.clone(),
            flow: Arc::clone(&flow),
            records: records_rx,
            revoke: revoke.clone(),
            _exited: exited_tx,
            _result: PhantomData,
        };
        tracing::debug!(topic, partition, "partition worker started");
        self.handle.spawn(worker.run());
        Slot {
            flow,
            records: records_tx,
            revoke,
            exited: exited_rx,
        }
    }
}

/// The poll thread: polls, dispatches, applies pauses, commits; then drains and commits.
fn poll_loop(
    consumer: &BaseConsumer<RunnerContext>,
    shared: &Shared,
    stop: &CancellationToken,
    drain: &CancellationToken,
) -> Result<(), RunnerError> {
    let options = Arc::clone(&shared.options);
    let mut last_commit = Instant::now();
    let mut fatal = None;
    while !stop.is_cancelled() {
        match consumer.poll(options.poll_interval) {
            Some(Ok(msg)) => shared.dispatch(consumer, KafkaMessage::new(msg.detach())),
            Some(Err(KafkaError::MessageConsumptionFatal(code))) => {
                tracing::error!(error = %code, "fatal consumer error: draining");
                fatal = Some(RunnerError::Fatal(KafkaError::MessageConsumptionFatal(
                    code,
                )));
                break;
            }
            Some(Err(KafkaError::PartitionEOF(_))) | None => {}
            Some(Err(e)) => tracing::warn!(error = %e, "consumer error"),
        }
        if let Some((topic, partition)) = shared.dead_worker() {
            tracing::error!(
                topic,
                partition,
                "a partition's worker died (panicked): draining and stopping the runner rather than leave the partition stuck"
            );
            fatal = Some(RunnerError::WorkerDied { topic, partition });
            break;
        }
        shared.apply_pauses(consumer);
        if last_commit.elapsed() >= options.commit_interval {
            shared.commit(consumer, CommitMode::Async);
            last_commit = Instant::now();
        }
    }

    // Drain: no new record starts; the ones in process finish, or are cancelled at the deadline.
    shared.start_draining(consumer);
    drain.cancel();
    let deadline = broker::instant_after(options.drain_timeout);
    let mut cancelled_at = None;
    while !shared.all_exited() {
        let now = Instant::now();
        match cancelled_at {
            None if now >= deadline => {
                tracing::warn!(
                    "drain timeout: revoking the records still in process (handlers not started release their leases; running ones are signalled, then dropped with their leases left to expire)"
                );
                shared.revoke_all();
                cancelled_at = Some(now);
            }
            Some(at) if now.duration_since(at) >= options.revoke_timeout => {
                tracing::warn!("workers did not stop after cancellation; closing anyway");
                break;
            }
            _ => {}
        }
        // Keep serving the group (heartbeats, rebalances) while draining; records are dropped.
        let _ = consumer.poll(options.poll_interval);
        if last_commit.elapsed() >= options.commit_interval {
            shared.commit(consumer, CommitMode::Async);
            last_commit = Instant::now();
        }
    }
    let slots = shared.take_all();
    shared.stop(consumer, slots, true);
    consumer.unsubscribe();
    match fatal {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dead_letter_producer_connects_as_the_consumer_does() {
        let mut consumer = ClientConfig::new();
        let shared = [
            ("bootstrap.servers", "kafka:9093"),
            ("security.protocol", "SASL_SSL"),
            ("ssl.ca.location", "/etc/ca.pem"),
            ("ssl.endpoint.identification.algorithm", "none"),
            ("enable.ssl.certificate.verification", "false"),
            ("sasl.mechanism", "PLAIN"),
            ("sasl.username", "payments"),
            ("enable.sasl.oauthbearer.unsecure.jwt", "true"),
            ("client.id", "payments-consumer"),
            ("client.dns.lookup", "use_all_dns_ips"),
            ("socket.timeout.ms", "30000"),
            ("socket.keepalive.enable", "true"),
            ("broker.address.family", "v4"),
            ("api.version.request", "true"),
        ];
        for (k, v) in shared {
            consumer.set(k, v);
        }
        for (k, v) in [
            ("group.id", "payments"),
            ("auto.offset.reset", "earliest"),
            ("session.timeout.ms", "2000"),
            ("enable.auto.commit", "false"),
        ] {
            consumer.set(k, v);
        }
        let producer = shared_producer_config(&consumer);
        let mut got: Vec<(&str, &str)> = producer
            .config_map()
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        got.sort_unstable();
        let mut want = shared.to_vec();
        want.sort_unstable();
        assert_eq!(
            got, want,
            "the connection and security properties, and nothing else"
        );
    }
}
