//! Options of a [`DynamoStore`](crate::DynamoStore).

use std::sync::Arc;
use std::time::Duration;

use idem_core::{Clock, Error, Limits, Result, SystemClock};

/// The table name used when none is configured.
pub const DEFAULT_TABLE: &str = "idem";

/// The largest result a [`DynamoStore`](crate::DynamoStore) accepts: 350 KiB (358,400 bytes).
///
/// A DynamoDB item holds at most 400 KB, attribute names included. The rest of an item is at
/// most about 2 KB (key, namespace and id up to 1,152 bytes, owner up to 128 bytes, numbers and
/// names), so 350 KiB leaves a wide margin. Larger results are refused with
/// [`Error::ResultTooLarge`] before any request; store them elsewhere (S3) and keep a reference.
pub const MAX_RESULT_LEN: usize = 350 * 1024;

/// The largest error message a [`DynamoStore`](crate::DynamoStore) accepts: 16 KiB. A failed item
/// holds the error instead of a result, so this is far inside the item limit.
pub const MAX_ERROR_LEN: usize = 16 * 1024;

/// Options of a [`DynamoStore`](crate::DynamoStore): table, endpoint, region, credentials for
/// local use, timeouts, retries, size limits and the clock.
///
/// The defaults bound every operation against an unreachable endpoint to a few seconds
/// (1 s to connect, 2 s per attempt, 3 attempts, 4 s in all), after which it fails with
/// [`Error::Unavailable`].
///
/// ```
/// use std::time::Duration;
/// use idem_dynamo::DynamoConfig;
///
/// let config = DynamoConfig::new("payments-idem")
///     .with_endpoint_url("http://127.0.0.1:8000")
///     .with_region("us-east-1")
///     .with_operation_timeout(Duration::from_secs(2));
/// assert_eq!(config.table, "payments-idem");
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct DynamoConfig {
    /// The table holding one item per key. Default [`DEFAULT_TABLE`] (`idem`).
    pub table: String,
    /// Endpoint override, for DynamoDB Local, LocalStack or a VPC endpoint. Default `None`: the
    /// standard AWS configuration decides (`AWS_ENDPOINT_URL_DYNAMODB`, then `AWS_ENDPOINT_URL`,
    /// then the `endpoint_url` of the profile, then the regional AWS endpoint).
    pub endpoint_url: Option<String>,
    /// Region override. Default `None`: the standard chain decides (`AWS_REGION`, profile,
    /// instance metadata, ...).
    pub region: Option<String>,
    /// Static credentials `(access key id, secret access key)`, for DynamoDB Local and LocalStack
    /// (which accept any). Default `None`: the default credential chain (environment, profile,
    /// web identity, container or instance role).
    pub static_credentials: Option<(String, String)>,
    /// How long opening a connection may take. Default 1 s.
    pub connect_timeout: Duration,
    /// How long one attempt (one HTTP request and its answer) may take. Default 2 s.
    pub attempt_timeout: Duration,
    /// The bound on a whole operation, the SDK's retries and their back-off included. Default 4 s.
    pub operation_timeout: Duration,
    /// Attempts per operation, the first included (the SDK's standard retry mode retries
    /// throttling, 5xx answers, timeouts and transport errors). Default 3.
    pub max_attempts: u32,
    /// The largest result and error message accepted. Default: results up to
    /// [`MAX_RESULT_LEN`] (350 KiB), error texts up to [`idem_core::DEFAULT_MAX_ERROR_LEN`]
    /// (4 KiB); neither can be set above [`MAX_RESULT_LEN`] and [`MAX_ERROR_LEN`] (16 KiB), since
    /// a DynamoDB item holds at most 400 KB.
    pub limits: Limits,
    /// The clock that judges leases and retention. DynamoDB has no server clock, so this is the
    /// client's; see the crate docs for the skew assumption. Default the system clock.
    pub clock: Arc<dyn Clock>,
}

impl Default for DynamoConfig {
    fn default() -> Self {
        Self {
            table: DEFAULT_TABLE.to_owned(),
            endpoint_url: None,
            region: None,
            static_credentials: None,
            connect_timeout: Duration::from_secs(1),
            attempt_timeout: Duration::from_secs(2),
            operation_timeout: Duration::from_secs(4),
            max_attempts: 3,
            limits: Limits::default().with_max_result_len(MAX_RESULT_LEN),
            clock: Arc::new(SystemClock),
        }
    }
}

impl DynamoConfig {
    /// The defaults, on table `table`.
    pub fn new(table: impl Into<String>) -> Self {
        Self::default().with_table(table)
    }

    /// Sets the table (default [`DEFAULT_TABLE`], `idem`).
    pub fn with_table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Sets the endpoint (`http://127.0.0.1:8000` for DynamoDB Local, `http://localhost:4566`
    /// for LocalStack). Default: none, the standard AWS configuration decides.
    pub fn with_endpoint_url(mut self, url: impl Into<String>) -> Self {
        self.endpoint_url = Some(url.into());
        self
    }

    /// Sets the region. Default: none, the standard AWS configuration decides.
    pub fn with_region(mut self, region: impl Into<String>) -> Self {
        self.region = Some(region.into());
        self
    }

    /// Uses fixed credentials instead of the default chain (for DynamoDB Local and LocalStack).
    /// Default: none, the default credential chain.
    pub fn with_static_credentials(
        mut self,
        access_key_id: impl Into<String>,
        secret_access_key: impl Into<String>,
    ) -> Self {
        self.static_credentials = Some((access_key_id.into(), secret_access_key.into()));
        self
    }

    /// Sets the connection timeout (default 1 s).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets the timeout of one attempt (default 2 s).
    pub fn with_attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = timeout;
        self
    }

    /// Sets the bound on a whole operation, retries included (default 4 s).
    pub fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// Sets the attempts per operation (default 3; 1 disables the SDK's retries).
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// Sets the size limits (default: results up to [`MAX_RESULT_LEN`], error texts up to
    /// [`idem_core::DEFAULT_MAX_ERROR_LEN`]).
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Sets the clock (default the system clock; tests use a
    /// [`ManualClock`](idem_core::ManualClock) to expire leases and retention without sleeping).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Checks the options.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] naming the field: a table name DynamoDB would refuse (3 to 255 of
    /// `[A-Za-z0-9_.-]`), an endpoint that is not an `http://` or `https://` URL with a host
    /// (`127.0.0.1:8000` without its scheme), a zero timeout or attempt count, or limits above
    /// [`MAX_RESULT_LEN`] / [`MAX_ERROR_LEN`].
    pub fn validate(&self) -> Result<()> {
        let table_ok = (3..=255).contains(&self.table.len())
            && self
                .table
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
        if !table_ok {
            return Err(Error::invalid(
                "table",
                format!(
                    "{:?} is not a DynamoDB table name (3 to 255 of A-Z a-z 0-9 _ . -)",
                    self.table
                ),
            ));
        }
        if let Some(url) = &self.endpoint_url {
            // The SDK takes any text here and fails every call at dispatch: a store that
            // connects, then answers `Unavailable` to everything, as if DynamoDB were down.
            let uri = url.parse::<http::Uri>().ok();
            let usable = uri.as_ref().is_some_and(|uri| {
                matches!(uri.scheme_str(), Some("http" | "https")) && uri.host().is_some()
            });
            if !usable {
                return Err(Error::invalid(
                    "endpoint_url",
                    format!("{url:?} is not an http:// or https:// URL with a host"),
                ));
            }
        }
        for (field, timeout) in [
            ("connect_timeout", self.connect_timeout),
            ("attempt_timeout", self.attempt_timeout),
            ("operation_timeout", self.operation_timeout),
        ] {
            if timeout.is_zero() {
                return Err(Error::invalid(field, "must be above zero"));
            }
        }
        if self.max_attempts == 0 {
            return Err(Error::invalid("max_attempts", "must be at least 1"));
        }
        if self.limits.max_result_len > MAX_RESULT_LEN {
            return Err(Error::invalid(
                "limits",
                format!(
                    "max_result_len {} is over the DynamoDB cap of {MAX_RESULT_LEN} bytes",
                    self.limits.max_result_len
                ),
            ));
        }
        if self.limits.max_error_len > MAX_ERROR_LEN {
            return Err(Error::invalid(
                "limits",
                format!(
                    "max_error_len {} is over the cap of {MAX_ERROR_LEN} bytes",
                    self.limits.max_error_len
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_must_be_an_http_url_with_a_host() {
        for good in [
            "http://127.0.0.1:8000",
            "https://dynamodb.eu-west-1.amazonaws.com",
            "http://localhost:4566/",
        ] {
            DynamoConfig::default()
                .with_endpoint_url(good)
                .validate()
                .unwrap();
        }
        for bad in [
            "127.0.0.1:8000",
            "localhost",
            "ftp://host",
            "http://",
            "",
            "http//x:1",
        ] {
            let err = DynamoConfig::default()
                .with_endpoint_url(bad)
                .validate()
                .unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::InvalidInput {
                        field: "endpoint_url",
                        ..
                    }
                ),
                "{bad:?}: {err:?}"
            );
        }
    }

    #[test]
    fn defaults_are_valid_and_bounded() {
        let config = DynamoConfig::default();
        config.validate().unwrap();
        // The defaults the field docs state.
        assert_eq!(config.table, DEFAULT_TABLE);
        assert_eq!(config.endpoint_url, None);
        assert_eq!(config.region, None);
        assert_eq!(config.static_credentials, None);
        assert_eq!(config.connect_timeout, Duration::from_secs(1));
        assert_eq!(config.attempt_timeout, Duration::from_secs(2));
        assert_eq!(config.operation_timeout, Duration::from_secs(4));
        assert_eq!(config.max_attempts, 3);
        assert_eq!(config.limits.max_result_len, MAX_RESULT_LEN);
        assert_eq!(
            config.limits.max_error_len,
            idem_core::DEFAULT_MAX_ERROR_LEN
        );
    }

    #[test]
    fn bad_options_are_rejected() {
        let cases = [
            ("table", DynamoConfig::new("ab")),
            ("table", DynamoConfig::new("has space")),
            ("max_attempts", DynamoConfig::default().with_max_attempts(0)),
            (
                "operation_timeout",
                DynamoConfig::default().with_operation_timeout(Duration::ZERO),
            ),
            (
                "limits",
                DynamoConfig::default()
                    .with_limits(Limits::default().with_max_result_len(MAX_RESULT_LEN + 1)),
            ),
            (
                "limits",
                DynamoConfig::default()
                    .with_limits(Limits::default().with_max_error_len(MAX_ERROR_LEN + 1)),
            ),
        ];
        for (field, config) in cases {
            let r = config.validate();
            assert!(
                matches!(&r, Err(Error::InvalidInput { field: f, .. }) if *f == field),
                "{field}: {r:?}"
            );
        }
    }
}
