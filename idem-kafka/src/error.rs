//! Errors of the runner.

use rdkafka::error::KafkaError;

/// Why a [`KafkaRunner`](crate::KafkaRunner) could not be built or stopped running.
///
/// Per-record results are never errors: they end in a commit, a retry or the dead-letter topic.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunnerError {
    /// An option or the consumer configuration is not usable.
    #[error("invalid runner configuration: {field}: {reason}")]
    Config {
        /// The option or consumer property at fault.
        field: &'static str,
        /// Why.
        reason: String,
    },

    /// rdkafka refused an operation the runner cannot do without.
    #[error("kafka error while {context}: {source}")]
    Kafka {
        /// What the runner was doing.
        context: &'static str,
        /// rdkafka's error.
        #[source]
        source: KafkaError,
    },

    /// The consumer reported a fatal error: the runner drained and stopped.
    #[error("fatal consumer error: {0}")]
    Fatal(#[source] KafkaError),

    /// A partition's worker task ended unexpectedly (it panicked): the runner drained the other
    /// partitions, committed what was resolved and stopped, rather than leave the partition
    /// stuck. Its unresolved records are redelivered when the process (or another group member)
    /// consumes the partition again.
    #[error("the worker of partition {topic}/{partition} died (panicked)")]
    WorkerDied {
        /// The partition's topic.
        topic: String,
        /// The partition.
        partition: i32,
    },

    /// The poll thread could not be started or died unexpectedly.
    #[error("the runner's poll thread failed: {0}")]
    PollThread(String),
}

impl From<idem_executor::broker::OptionError> for RunnerError {
    fn from(e: idem_executor::broker::OptionError) -> Self {
        Self::Config {
            field: e.field,
            reason: e.reason,
        }
    }
}

impl RunnerError {
    pub(crate) fn config(field: &'static str, reason: impl Into<String>) -> Self {
        Self::Config {
            field,
            reason: reason.into(),
        }
    }
}
