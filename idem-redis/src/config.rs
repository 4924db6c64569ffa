//! Options of a [`RedisStore`](crate::RedisStore).

use std::time::Duration;

use idem_core::Limits;

/// The key prefix used when none is configured.
pub const DEFAULT_PREFIX: &str = "idem:";

/// Options of a [`RedisStore`](crate::RedisStore): key prefix, timeouts and size limits.
///
/// The defaults bound every operation against an unreachable or stalled server to about three
/// seconds, after which it fails with [`Error::Unavailable`](idem_core::Error::Unavailable).
///
/// ```
/// use std::time::Duration;
/// use idem_redis::RedisConfig;
///
/// let config = RedisConfig::default()
///     .with_prefix("payments:idem:")
///     .with_response_timeout(Duration::from_millis(500));
/// assert_eq!(config.prefix, "payments:idem:");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisConfig {
    /// Prepended to every storage key: a record lives under `{prefix}{namespace}:{id}`.
    /// Default [`DEFAULT_PREFIX`] (`idem:`). A prefix holding a hash tag (`{idem}:`) puts every
    /// record into one Redis Cluster slot, whatever tags the ids carry (Redis hashes a key by its
    /// first tag): only do that on purpose. Under such a prefix
    /// [`RedisStore::effect_key`](crate::RedisStore::effect_key) refuses to build keys, since
    /// they would be shared by every record.
    pub prefix: String,
    /// How long one attempt to open a TCP (or TLS) connection may take. Default 1 s.
    pub connect_timeout: Duration,
    /// How long the server may take to answer one command. Default 2 s.
    pub response_timeout: Duration,
    /// The bound on a whole store operation, reconnects and cluster redirects included; past it
    /// the operation fails with [`Error::Unavailable`](idem_core::Error::Unavailable). Default 3 s.
    pub operation_timeout: Duration,
    /// How many times a request refused without running is sent again, within
    /// [`operation_timeout`](Self::operation_timeout): a refused connection, `LOADING`, `BUSY`,
    /// `OOM`, `READONLY`, ... and on a cluster `MOVED`, `ASK`, `TRYAGAIN`, `CLUSTERDOWN`. On one
    /// server it is also how many times each reconnection is attempted. A request that may have
    /// run (a response timeout, a dropped connection) is never re-sent. Default 2.
    pub retries: u32,
    /// The largest result and error message accepted. Default [`Limits::default`].
    pub limits: Limits,
    /// PEM root certificates to trust for `rediss://` instead of the system's store (a private
    /// CA). Feature `tls`. Default `None` (the system's store).
    #[cfg(feature = "tls")]
    pub tls_root_cert: Option<Vec<u8>>,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_owned(),
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(2),
            operation_timeout: Duration::from_secs(3),
            retries: 2,
            limits: Limits::default(),
            #[cfg(feature = "tls")]
            tls_root_cert: None,
        }
    }
}

impl RedisConfig {
    /// Sets the key prefix.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets the connection timeout.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets the per-command response timeout.
    pub fn with_response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Sets the bound on a whole operation.
    pub fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// Sets [`retries`](Self::retries).
    pub fn with_retries(mut self, retries: u32) -> Self {
        self.retries = retries;
        self
    }

    /// Sets the size limits.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Trusts these PEM root certificates for `rediss://` instead of the system's store.
    #[cfg(feature = "tls")]
    pub fn with_tls_root_cert(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_root_cert = Some(pem.into());
        self
    }
}
