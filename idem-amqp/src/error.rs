//! Errors of the runner.

/// Why an [`AmqpRunner`](crate::AmqpRunner) could not be built or stopped running.
///
/// Per-delivery results are never errors: they end in an ack, a delayed retry or a dead letter.
/// A connection lost while running is not an error either: the runner reconnects.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunnerError {
    /// An option or name is not usable.
    #[error("invalid runner configuration: {field}: {reason}")]
    Config {
        /// The option at fault.
        field: &'static str,
        /// Why.
        reason: String,
    },

    /// The first connection, or what the runner does on it before consuming (channels, the
    /// declarations of [`QueueTopology`](crate::QueueTopology), `basic.consume`), failed. Later
    /// connection losses are retried instead.
    #[error("amqp error while {context}: {source}")]
    Amqp {
        /// What the runner was doing.
        context: String,
        /// lapin's error.
        #[source]
        source: lapin::Error,
    },

    /// The first connection, and what the runner does on it before consuming, did not finish
    /// within [`connect_timeout`](crate::RunnerOptions::connect_timeout).
    #[error("amqp: {context} did not finish within {after:?}")]
    TimedOut {
        /// What the runner was doing.
        context: &'static str,
        /// The timeout.
        after: std::time::Duration,
    },
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

    pub(crate) fn amqp(context: impl Into<String>, source: lapin::Error) -> Self {
        Self::Amqp {
            context: context.into(),
            source,
        }
    }
}
