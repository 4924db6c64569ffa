//! Errors of the runner.

/// Why a [`NatsRunner`](crate::NatsRunner) could not be built or stopped running.
///
/// Per-message results are never errors: they end in an ack, a delayed nak or a dead letter. A
/// connection lost while running is not an error either: the client reconnects.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunnerError {
    /// An option, or the consumer's configuration on the server, is not usable.
    #[error("invalid runner configuration: {field}: {reason}")]
    Config {
        /// The option (or consumer setting) at fault.
        field: &'static str,
        /// Why.
        reason: String,
    },

    /// Getting the stream, or getting or creating the consumer, failed.
    #[error("nats error while {context}: {source}")]
    Nats {
        /// What the runner was doing.
        context: String,
        /// The client's error.
        #[source]
        source: async_nats::Error,
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

    pub(crate) fn nats(context: impl Into<String>, source: impl Into<async_nats::Error>) -> Self {
        Self::Nats {
            context: context.into(),
            source: source.into(),
        }
    }
}
