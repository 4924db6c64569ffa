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

    /// SQS's error when it refused the call for a reason that trying again cannot heal, so that
    /// the runner must stop rather than retry; otherwise the error back. Such are: the queue
    /// does not exist (deleted), the credentials may not use it (`AccessDenied`), its KMS key
    /// refuses (`KMS.AccessDeniedException`, disabled, not found, in an invalid state, of the
    /// wrong usage, or the region not opted in), or the request's transport is refused
    /// (`InvalidSecurity`). Throttling (SQS's or KMS's), server errors, connection failures and
    /// timeouts are not.
    pub(crate) fn into_fatal(self) -> Result<Box<aws_sdk_sqs::Error>, Self> {
        match self {
            Self::Sqs(e) if is_fatal(&e) => Ok(e),
            other => Err(other),
        }
    }

    /// Whether SQS answered that the receipt handle no longer designates a message in flight
    /// for this receive: the handle is invalid (`ReceiptHandleIsInvalid`), the message is not in
    /// flight (`MessageNotInflight`), or it does not exist any more (`InvalidParameterValue` on
    /// the `ReceiptHandle` parameter: "Message does not exist or is not available for visibility
    /// timeout change", as SQS and LocalStack answer for a deleted or purged message). The
    /// message is then another receive's, or deleted: nothing this receive does to it counts.
    pub(crate) fn handle_gone(&self) -> bool {
        use aws_sdk_sqs::Error as E;
        use aws_sdk_sqs::error::ProvideErrorMetadata;
        let Some(error) = self.sqs() else {
            return false;
        };
        #[allow(deprecated)]
        let typed = matches!(
            error,
            E::ReceiptHandleIsInvalid(_) | E::MessageNotInflight(_) | E::InvalidIdFormat(_)
        );
        typed
            || match error.code() {
                Some("ReceiptHandleIsInvalid" | "AWS.SimpleQueueService.MessageNotInflight") => {
                    true
                }
                Some(code) if code.starts_with("InvalidParameterValue") => error
                    .message()
                    .is_some_and(|m| m.contains("parameter ReceiptHandle is invalid")),
                _ => false,
            }
    }
}

/// Whether SQS's answer is a refusal that trying again cannot heal ([`CallError::into_fatal`]).
fn is_fatal(error: &aws_sdk_sqs::Error) -> bool {
    use aws_sdk_sqs::Error as E;
    use aws_sdk_sqs::error::ProvideErrorMetadata;
    match error {
        E::QueueDoesNotExist(_)
        | E::KmsAccessDenied(_)
        | E::KmsDisabled(_)
        | E::KmsInvalidKeyUsage(_)
        | E::KmsInvalidState(_)
        | E::KmsNotFound(_)
        | E::KmsOptInRequired(_)
        | E::InvalidSecurity(_) => true,
        // Codes the SDK does not type for every operation (`AccessDenied` for none), or spelled
        // as the JSON protocol's type when the query-compatible code is missing.
        other => other.code().is_some_and(|code| FATAL_CODES.contains(&code)),
    }
}

/// Error codes of a refusal that trying again cannot heal ([`CallError::into_fatal`]), besides the
/// SDK's typed ones.
const FATAL_CODES: &[&str] = &[
    "AccessDenied",
    "AccessDeniedException",
    "AWS.SimpleQueueService.NonExistentQueue",
    "QueueDoesNotExist",
    "KMS.AccessDeniedException",
    "KMS.DisabledException",
    "KMS.InvalidKeyUsageException",
    "KMS.InvalidStateException",
    "KMS.NotFoundException",
    "KMS.OptInRequired",
];

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
    use aws_sdk_sqs::error::ErrorMetadata;
    use aws_sdk_sqs::operation::change_message_visibility::ChangeMessageVisibilityError;
    use aws_sdk_sqs::operation::send_message::SendMessageError;
    use aws_sdk_sqs::types::error::{
        KmsAccessDenied, KmsDisabled, KmsInvalidState, KmsNotFound, KmsThrottled,
        MessageNotInflight, QueueDoesNotExist, ReceiptHandleIsInvalid, RequestThrottled,
    };

    use super::*;

    /// A `SendMessage` refusal with `code` and `message`, as the SDK gives a code it does not
    /// type.
    fn refused(code: &str, message: &str) -> CallError {
        let meta = ErrorMetadata::builder().code(code).message(message).build();
        CallError::Sqs(Box::new(SendMessageError::generic(meta).into()))
    }

    fn typed(e: impl Into<aws_sdk_sqs::Error>) -> CallError {
        CallError::Sqs(Box::new(e.into()))
    }

    #[test]
    fn a_refusal_that_cannot_heal_is_fatal_and_throttling_is_not() {
        let fatal = [
            typed(SendMessageError::QueueDoesNotExist(
                QueueDoesNotExist::builder().build(),
            )),
            typed(SendMessageError::KmsAccessDenied(
                KmsAccessDenied::builder().build(),
            )),
            typed(SendMessageError::KmsDisabled(
                KmsDisabled::builder().build(),
            )),
            typed(SendMessageError::KmsNotFound(
                KmsNotFound::builder().build(),
            )),
            typed(SendMessageError::KmsInvalidState(
                KmsInvalidState::builder().build(),
            )),
            refused("AccessDenied", "not authorized to perform: sqs:sendmessage"),
            refused("AccessDeniedException", "not authorized"),
            refused("KMS.AccessDeniedException", "kms:GenerateDataKey denied"),
        ];
        for e in fatal {
            let text = e.to_string();
            assert!(e.into_fatal().is_ok(), "fatal: {text}");
        }
        let passing = [
            typed(SendMessageError::RequestThrottled(
                RequestThrottled::builder().build(),
            )),
            typed(SendMessageError::KmsThrottled(
                KmsThrottled::builder().build(),
            )),
            refused("InternalError", "we encountered an internal error"),
            refused("ServiceUnavailable", "try again"),
            refused("ThrottlingException", "rate exceeded"),
            refused("InvalidParameterValue", "message too long"),
            CallError::TimedOut(Duration::from_secs(1)),
        ];
        for e in passing {
            let text = e.to_string();
            assert!(e.into_fatal().is_err(), "tried again: {text}");
        }
    }

    #[test]
    fn a_refused_receipt_handle_means_the_message_is_gone() {
        let gone = [
            typed(ChangeMessageVisibilityError::ReceiptHandleIsInvalid(
                ReceiptHandleIsInvalid::builder().build(),
            )),
            typed(ChangeMessageVisibilityError::MessageNotInflight(
                MessageNotInflight::builder().build(),
            )),
            // What SQS and LocalStack answer for a message deleted or purged.
            refused(
                "InvalidParameterValue",
                "Value ZGU4 for parameter ReceiptHandle is invalid. Reason: Message does not \
                 exist or is not available for visibility timeout change.",
            ),
        ];
        for e in gone {
            assert!(e.handle_gone(), "{e}");
        }
        let kept = [
            // Past 12 hours from the receipt: refused, but the visibility set before still runs.
            refused(
                "InvalidParameterValue",
                "Value 30 for parameter VisibilityTimeout is invalid. Reason: Total \
                 VisibilityTimeout for the message is beyond the limit [43200 seconds]",
            ),
            typed(ChangeMessageVisibilityError::RequestThrottled(
                RequestThrottled::builder().build(),
            )),
            CallError::TimedOut(Duration::from_secs(1)),
        ];
        for e in kept {
            assert!(!e.handle_gone(), "{e}");
        }
    }

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
