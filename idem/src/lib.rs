#![doc = include_str!("../../README.md")]

pub use idem_core::*;

/// The executor: the middleware a consumer wraps its message handler with.
pub use idem_executor as executor;
pub use idem_executor::{
    BrokerAction, Commit, CommitRefusal, ConfigError, DeadLetterReason, EffectRefusedPolicy,
    Executor, ExecutorBuilder, ExecutorConfig, ExecutorError, Handler, HandlerContext,
    HandlerError, KeySource, Message, Outcome, RawMessage, TransactionalExecutor,
};

/// The Redis store: one Lua script per transition, standalone and Redis Cluster.
#[cfg(feature = "redis")]
pub use idem_redis as redis;

/// The DynamoDB store: one conditional write per transition.
#[cfg(feature = "dynamo")]
pub use idem_dynamo as dynamo;

/// The PostgreSQL store: single-statement transitions and a transactional mode.
#[cfg(feature = "postgres")]
pub use idem_postgres as postgres;

/// The Kafka consumer runner: outcomes mapped to in-order offset commits, pauses and a
/// dead-letter topic.
#[cfg(feature = "kafka")]
pub use idem_kafka as kafka;

/// The Amazon SQS consumer runner: long-polled batches, batched deletes, visibility kept in step
/// with the lease, a dead-letter queue with reason attributes, FIFO group order.
#[cfg(feature = "sqs")]
pub use idem_sqs as sqs;

/// The RabbitMQ consumer runner: manual acks under a prefetch bound, delayed retries through a
/// TTL queue, a dead-letter exchange with reason headers, reconnects that release the leases of
/// deliveries whose handler had not started.
#[cfg(feature = "amqp")]
pub use idem_amqp as amqp;

/// The NATS JetStream consumer runner: double acks, delayed naks, progress acks in step with the
/// lease heartbeat, a dead-letter subject with reason headers.
#[cfg(feature = "nats")]
pub use idem_nats as nats;

/// The SQLite store: durable records in one file, for a single consumer host; built on the
/// custom-store kit.
#[cfg(feature = "sqlite")]
pub use idem_sqlite as sqlite;
