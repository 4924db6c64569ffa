//! Errors of the runner.

/// Why an [`SqsRunner`](crate::SqsRunner) could not be built or stopped running.
///
/// Per-message results are never errors: they end in a delete, a visibility change or the
/// dead-letter queue.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunnerError {
    /// An option is not usable.
    #[error("invalid runner configuration: {field}: {reason}")]
    Config {
        /// The option at fault.
        field: &'static str,
        /// Why.
        reason: String,
    },

    /// SQS refused an operation the runner cannot do without: reading a queue's attributes at
    /// start (the queue or the dead-letter queue does not exist, or the credentials may not read
    /// it), or, for a reason that trying again cannot heal (the queue deleted, access or its KMS
    /// key denied), receiving from the queue or sending a dead letter to the dead-letter queue
    /// while it ran (`context` names the queue). Throttling, server errors and timeouts are
    /// retried instead.
    #[error("sqs error while {context}: {source}")]
    Sqs {
        /// What the runner was doing.
        context: String,
        /// The SDK's error.
        #[source]
        source: Box<aws_sdk_sqs::Error>,
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

    pub(crate) fn sqs(context: impl Into<String>, source: impl Into<aws_sdk_sqs::Error>) -> Self {
        Self::Sqs {
            context: context.into(),
            source: Box::new(source.into()),
        }
    }
}
