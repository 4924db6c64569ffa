//! Mapping SDK errors onto [`idem_core::Error`].

use aws_sdk_dynamodb::config::http::HttpResponse;
use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use idem_core::Error;

use crate::STORE;

/// Error codes DynamoDB (and the AWS front end) answers when the request may succeed if sent
/// again later: throttling, request limits, server-side trouble, transient conflicts.
const RETRYABLE_CODES: &[&str] = &[
    "ProvisionedThroughputExceededException",
    "ThrottlingException",
    "Throttling",
    "ThrottledException",
    "TooManyRequestsException",
    "RequestThrottled",
    "RequestThrottledException",
    "RequestLimitExceeded",
    "LimitExceededException",
    "TransactionConflictException",
    "TransactionInProgressException",
    "ReplicatedWriteConflictException",
    "InternalServerError",
    "InternalFailure",
    "ServiceUnavailable",
    "ServiceUnavailableException",
    "RequestTimeout",
    "RequestTimeoutException",
    "PriorRequestNotComplete",
];

/// Whether a service error code is transient.
pub(crate) fn is_retryable_code(code: Option<&str>) -> bool {
    code.is_some_and(|code| RETRYABLE_CODES.contains(&code))
}

/// Maps an SDK error: timeouts, transport (dispatch) failures, unreadable responses, throttling,
/// request limits and 5xx answers are [`Error::Unavailable`] (retryable); everything else
/// (validation errors, a missing table, access denied, a request that could not be built) is
/// [`Error::Backend`]. The SDK error is kept whole as the `source`.
pub(crate) fn map_sdk_error<E>(err: SdkError<E, HttpResponse>) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let transient = match &err {
        SdkError::TimeoutError(_) | SdkError::DispatchFailure(_) | SdkError::ResponseError(_) => {
            true
        }
        SdkError::ServiceError(ctx) => {
            is_retryable_code(ctx.err().code()) || ctx.raw().status().is_server_error()
        }
        _ => false,
    };
    if transient {
        Error::unavailable(STORE, err)
    } else {
        Error::backend(STORE, err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_dynamodb::error::{ConnectorError, ErrorMetadata};
    use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
    use aws_sdk_dynamodb::types::error::{
        ProvisionedThroughputExceededException, RequestLimitExceeded, ResourceNotFoundException,
    };
    use aws_smithy_runtime_api::http::StatusCode;
    use aws_smithy_types::body::SdkBody;

    /// Error metadata as the SDK's deserializer fills it from an answer.
    fn code(code: &str) -> ErrorMetadata {
        ErrorMetadata::builder().code(code).build()
    }

    fn response(status: u16) -> HttpResponse {
        HttpResponse::new(StatusCode::try_from(status).unwrap(), SdkBody::empty())
    }

    fn service(err: UpdateItemError, status: u16) -> Error {
        map_sdk_error(SdkError::service_error(err, response(status)))
    }

    #[test]
    fn sdk_errors_map_to_unavailable_or_backend() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let cases: Vec<(Error, bool)> = vec![
            (
                map_sdk_error::<UpdateItemError>(SdkError::timeout_error("slow")),
                true,
            ),
            (
                map_sdk_error::<UpdateItemError>(SdkError::dispatch_failure(ConnectorError::io(
                    io.into(),
                ))),
                true,
            ),
            (
                map_sdk_error::<UpdateItemError>(SdkError::response_error(
                    "garbled",
                    response(200),
                )),
                true,
            ),
            (
                service(
                    UpdateItemError::ProvisionedThroughputExceededException(
                        ProvisionedThroughputExceededException::builder()
                            .meta(code("ProvisionedThroughputExceededException"))
                            .build(),
                    ),
                    400,
                ),
                true,
            ),
            (
                service(
                    UpdateItemError::RequestLimitExceeded(
                        RequestLimitExceeded::builder()
                            .meta(code("RequestLimitExceeded"))
                            .build(),
                    ),
                    400,
                ),
                true,
            ),
            (
                service(UpdateItemError::unhandled("gateway trouble"), 503),
                true,
            ),
            (
                service(
                    UpdateItemError::ResourceNotFoundException(
                        ResourceNotFoundException::builder()
                            .meta(code("ResourceNotFoundException"))
                            .build(),
                    ),
                    400,
                ),
                false,
            ),
            (
                map_sdk_error::<UpdateItemError>(SdkError::construction_failure("bad request")),
                false,
            ),
        ];
        for (err, retryable) in cases {
            assert_eq!(err.is_retryable(), retryable, "{err:?}");
            if !retryable {
                assert!(
                    matches!(err, Error::Backend { store: STORE, .. }),
                    "{err:?}"
                );
            }
        }
    }

    #[test]
    fn throttling_and_limits_are_retryable() {
        for code in [
            "ProvisionedThroughputExceededException",
            "ThrottlingException",
            "RequestLimitExceeded",
            "InternalServerError",
        ] {
            assert!(is_retryable_code(Some(code)), "{code}");
        }
        for code in [
            "ValidationException",
            "ResourceNotFoundException",
            "AccessDeniedException",
        ] {
            assert!(!is_retryable_code(Some(code)), "{code}");
        }
        assert!(!is_retryable_code(None));
    }
}
