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

    /// The durable consumer was deleted while the runner ran: the server said it does not exist
    /// at three checks in a row, or the consumer found under its name is a new one (created
    /// after the runner started, from a position the runner cannot know). The runner never
    /// creates it again while it runs: created anew, a consumer delivers the stream from its
    /// first message, and every message whose record the store no longer keeps (past its
    /// retention) would run its handler again. It drained the messages it held (their handlers
    /// finished and their results are recorded; their acks could not reach the deleted
    /// consumer) and stopped.
    ///
    /// The operator recreates the consumer from the first message not yet processed
    /// (`DeliverPolicy::ByStartSequence`; `ack_floor` is a lower bound), then starts the
    /// runners again. See [Streams and consumers](crate#streams-and-consumers).
    #[error(
        "consumer {consumer} of stream {stream} was deleted while the runner ran; it must be \
         recreated by the operator from the first message not yet processed (every message up \
         to stream sequence {ack_floor} was acknowledged when the runner last looked; later ones \
         may have been too), e.g. with DeliverPolicy::ByStartSequence, then the runner started \
         again: the runner does not recreate it, which would deliver the stream from its start \
         and run again every message whose record the store no longer keeps"
    )]
    ConsumerDeleted {
        /// The stream.
        stream: String,
        /// The durable consumer's name.
        consumer: String,
        /// The consumer's ack floor (a stream sequence) when the runner last read the
        /// consumer's info (at the start, or at its last check after a failed pull): every
        /// message up to it was acknowledged; messages after it may have been too.
        ack_floor: u64,
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
