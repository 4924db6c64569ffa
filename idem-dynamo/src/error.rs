//! Mapping SDK errors onto [`idem_core::Error`].

use std::fmt;

use aws_sdk_dynamodb::config::http::HttpResponse;
use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::operation::RequestId;
use idem_core::{BoxError, Error};

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

/// A request to DynamoDB that failed: the `source` of the [`Error::Unavailable`] and
/// [`Error::Backend`] this crate returns.
///
/// Its `Display` says what happened, so that a log line of the [`Error`] alone does:
///
/// - DynamoDB answered with an error: the operation, the error code, DynamoDB's message, the
///   HTTP status and the request id, for instance `UpdateItem: ValidationException: One or
///   more parameter values were invalid (HTTP 400, request id 5d2a...)`;
/// - no answer (a transport failure, a timeout, an unreadable answer): the operation and what
///   the SDK reports (`GetItem: dispatch failure`), and its causes follow through
///   [`source`](std::error::Error::source) (`io error: Connection refused`).
///
/// The SDK's own error is kept whole: [`SdkFailure::sdk_error`] returns it, to downcast to
/// `SdkError<UpdateItemError, HttpResponse>` (or the error type of the operation named).
#[derive(Debug)]
pub struct SdkFailure {
    operation: &'static str,
    /// Set when DynamoDB answered with an error.
    answer: Option<Answer>,
    sdk: BoxError,
}

/// What DynamoDB answered.
#[derive(Debug)]
struct Answer {
    code: Option<String>,
    message: Option<String>,
    /// The operation error's own text, for an answer without code or message.
    text: String,
    status: u16,
    request_id: Option<String>,
}

impl SdkFailure {
    pub(crate) fn new<E>(operation: &'static str, err: SdkError<E, HttpResponse>) -> Self
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let answer = match &err {
            SdkError::ServiceError(ctx) => Some(Answer {
                code: ctx.err().code().map(str::to_owned),
                message: ctx.err().message().map(str::to_owned),
                text: ctx.err().to_string(),
                status: ctx.raw().status().as_u16(),
                request_id: err.request_id().map(str::to_owned),
            }),
            _ => None,
        };
        Self {
            operation,
            answer,
            sdk: Box::new(err),
        }
    }

    /// The DynamoDB operation that failed (`UpdateItem`, `GetItem`, `CreateTable`, ...).
    pub fn operation(&self) -> &'static str {
        self.operation
    }

    /// The error code DynamoDB answered (`ValidationException`, ...); `None` when no answer
    /// came or it had no code.
    pub fn code(&self) -> Option<&str> {
        self.answer.as_ref()?.code.as_deref()
    }

    /// The message DynamoDB answered; `None` when no answer came or it had no message.
    pub fn message(&self) -> Option<&str> {
        self.answer.as_ref()?.message.as_deref()
    }

    /// The SDK's error, whole: an `aws_sdk_dynamodb::error::SdkError<E, HttpResponse>` where
    /// `E` is the error type of [`operation`](Self::operation) (for instance `UpdateItemError`).
    pub fn sdk_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.sdk
    }
}

impl fmt::Display for SdkFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.operation)?;
        let Some(answer) = &self.answer else {
            // The SDK's text ("dispatch failure", "request has timed out"); `source` goes on.
            return write!(f, "{}", self.sdk);
        };
        match (&answer.code, &answer.message) {
            (Some(code), Some(message)) => write!(f, "{code}: {message}")?,
            (Some(code), None) => f.write_str(code)?,
            (None, Some(message)) => f.write_str(message)?,
            (None, None) => f.write_str(&answer.text)?,
        }
        write!(f, " (HTTP {}", answer.status)?;
        if let Some(id) = &answer.request_id {
            write!(f, ", request id {id}")?;
        }
        f.write_str(")")
    }
}

impl std::error::Error for SdkFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self.answer {
            // The answer's code and message are the whole story.
            Some(_) => None,
            // The transport's or the timeout's causes.
            None => self.sdk.source(),
        }
    }
}

/// The `fix` of [`Error::NotSetUp`] for a missing table.
fn create_table_hint(table: &str) -> String {
    format!(
        "create it with `DynamoStore::create_table_if_missing()` (tests and development) or in \
         your infrastructure code (see \"The table\" in the idem-dynamo docs); with the AWS CLI: \
         `aws dynamodb create-table --table-name {table} --attribute-definitions \
         AttributeName=pk,AttributeType=S --key-schema AttributeName=pk,KeyType=HASH \
         --billing-mode PAY_PER_REQUEST` then `aws dynamodb update-time-to-live --table-name \
         {table} --time-to-live-specification Enabled=true,AttributeName=ttl`"
    )
}

/// Maps an SDK error of `operation` on `table`: a missing table (`ResourceNotFoundException`)
/// is [`Error::NotSetUp`] naming it and saying how to create it; timeouts, transport
/// (dispatch) failures, unreadable responses, throttling, request limits and 5xx answers are
/// [`Error::Unavailable`] (retryable); everything else (validation errors, access denied, a
/// request that could not be built) is [`Error::Backend`]. The source of the last two is an
/// [`SdkFailure`] holding the SDK error whole.
pub(crate) fn map_sdk_error<E>(
    operation: &'static str,
    table: &str,
    region: Option<&str>,
    err: SdkError<E, HttpResponse>,
) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let transient = match &err {
        SdkError::TimeoutError(_) | SdkError::DispatchFailure(_) | SdkError::ResponseError(_) => {
            true
        }
        SdkError::ServiceError(ctx) => {
            if ctx.err().code() == Some("ResourceNotFoundException") {
                let at = region.map_or_else(String::new, |r| format!(" in region {r}"));
                let said = ctx.err().message().unwrap_or("ResourceNotFoundException");
                return Error::not_set_up(
                    STORE,
                    format!("table {table:?}{at} ({operation} answered: {said})"),
                    create_table_hint(table),
                );
            }
            is_retryable_code(ctx.err().code()) || ctx.raw().status().is_server_error()
        }
        _ => false,
    };
    let failure = SdkFailure::new(operation, err);
    if transient {
        Error::unavailable(STORE, failure)
    } else {
        Error::backend(STORE, failure)
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

    fn map(err: SdkError<UpdateItemError, HttpResponse>) -> Error {
        map_sdk_error("UpdateItem", "idem", Some("us-east-1"), err)
    }

    fn service(err: UpdateItemError, status: u16) -> Error {
        map(SdkError::service_error(err, response(status)))
    }

    #[test]
    fn sdk_errors_map_to_unavailable_or_backend() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let cases: Vec<(Error, bool)> = vec![
            (map(SdkError::timeout_error("slow")), true),
            (
                map(SdkError::dispatch_failure(ConnectorError::io(io.into()))),
                true,
            ),
            (
                map(SdkError::response_error("garbled", response(200))),
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
                service(UpdateItemError::generic(code("ValidationException")), 400),
                false,
            ),
            (map(SdkError::construction_failure("bad request")), false),
        ];
        for (err, retryable) in cases {
            assert_eq!(err.is_retryable(), retryable, "{err:?}");
            let source = match &err {
                Error::Unavailable { store, source } | Error::Backend { store, source } => {
                    assert_eq!(*store, STORE);
                    source
                }
                other => panic!("expected Unavailable or Backend, got {other:?}"),
            };
            assert!(
                !retryable || matches!(err, Error::Unavailable { .. }),
                "{err:?}"
            );
            let failure = source
                .downcast_ref::<SdkFailure>()
                .unwrap_or_else(|| panic!("the source is an SdkFailure: {err:?}"));
            assert_eq!(failure.operation(), "UpdateItem");
            assert!(
                failure
                    .sdk_error()
                    .downcast_ref::<SdkError<UpdateItemError, HttpResponse>>()
                    .is_some(),
                "the SDK error is kept whole: {failure:?}"
            );
        }
    }

    #[test]
    fn a_missing_table_is_not_set_up_and_says_how_to_create_it() {
        let err = service(
            UpdateItemError::ResourceNotFoundException(
                ResourceNotFoundException::builder()
                    .message("Cannot do operations on a non-existent table")
                    .meta(
                        ErrorMetadata::builder()
                            .code("ResourceNotFoundException")
                            .message("Cannot do operations on a non-existent table")
                            .build(),
                    )
                    .build(),
            ),
            400,
        );
        let Error::NotSetUp {
            store,
            missing,
            fix,
        } = &err
        else {
            panic!("expected NotSetUp, got {err:?}");
        };
        assert_eq!(*store, STORE);
        assert!(
            missing.contains("\"idem\"") && missing.contains("us-east-1"),
            "{missing}"
        );
        assert!(missing.contains("non-existent table"), "{missing}");
        assert!(fix.contains("create_table_if_missing"), "{fix}");
        assert!(
            fix.contains("aws dynamodb create-table --table-name idem"),
            "{fix}"
        );
        assert!(!err.is_retryable());
    }

    #[test]
    fn display_says_what_dynamodb_answered() {
        let meta = ErrorMetadata::builder()
            .code("ValidationException")
            .message("One or more parameter values were invalid")
            .build();
        let err = service(UpdateItemError::generic(meta), 400);
        assert_eq!(
            err.to_string(),
            "dynamo store error: UpdateItem: ValidationException: One or more parameter values \
             were invalid (HTTP 400)"
        );

        // No answer: the SDK's words, then the transport's causes.
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
        let err = map(SdkError::dispatch_failure(ConnectorError::io(io.into())));
        let text = err.to_string();
        assert!(
            text.starts_with("dynamo store unavailable: UpdateItem: dispatch failure: ")
                && text.ends_with("connection refused"),
            "{text}"
        );

        // An answer with neither code nor message shows the operation error's own text.
        let err = service(UpdateItemError::unhandled("gateway trouble"), 502);
        assert_eq!(
            err.to_string(),
            "dynamo store unavailable: UpdateItem: unhandled error (HTTP 502)"
        );
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
