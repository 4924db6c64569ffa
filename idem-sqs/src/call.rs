//! SQS calls with a bound on their wait: the AWS SDK puts none on a call unless the client's
//! config sets one, and a call that never answers would hold whatever waits on it.

use std::future::Future;
use std::time::Duration;

/// Why an SQS call failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    /// SQS (or the connection to it) answered with an error.
    #[error(transparent)]
    Sqs(Box<aws_sdk_sqs::Error>),
    /// No answer within the runner's [`call_timeout`](crate::RunnerOptions::call_timeout) (and
    /// the receive's wait time, for a receive). The call may still have taken effect.
    #[error("SQS did not answer within {0:?}")]
    TimedOut(Duration),
}

impl CallError {
    /// SQS's error, when it answered with one.
    pub(crate) fn sqs(&self) -> Option<&aws_sdk_sqs::Error> {
        match self {
            Self::Sqs(e) => Some(e),
            Self::TimedOut(_) => None,
        }
    }
}

/// `call` (an SDK request's `send()`), failed with [`CallError::TimedOut`] when it has not
/// answered within `timeout`. The call's future is boxed: the SDK's are large, and the tasks
/// that await them would carry their size.
pub(crate) fn bounded<O, E>(
    timeout: Duration,
    call: impl Future<Output = Result<O, E>> + Send,
) -> impl Future<Output = Result<O, CallError>> + Send
where
    E: Into<aws_sdk_sqs::Error>,
{
    let call = tokio::time::timeout(timeout, Box::pin(call));
    async move {
        match call.await {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(e)) => Err(CallError::Sqs(Box::new(e.into()))),
            Err(_) => Err(CallError::TimedOut(timeout)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_call_that_never_answers_times_out_and_an_answer_passes() {
        let timeout = Duration::from_millis(20);
        let hung = std::future::pending::<Result<(), aws_sdk_sqs::Error>>();
        let err = bounded(timeout, hung).await.unwrap_err();
        assert!(
            matches!(err, CallError::TimedOut(t) if t == timeout),
            "{err:?}"
        );
        assert!(err.sqs().is_none());
        let answered = async { Ok::<_, aws_sdk_sqs::Error>(7) };
        assert_eq!(bounded(timeout, answered).await.unwrap(), 7);
    }
}
