//! The connection behind a store (one server or a cluster) and the mapping of driver errors.

use std::fmt;
use std::time::Duration;

use idem_core::Error;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{ErrorKind, RedisError, ScriptInvocation, ServerErrorKind, Value};

use crate::config::RedisConfig;

pub(crate) const STORE: &str = "redis";

/// The error inside [`Error::Unavailable`] when the server did not answer within
/// [`RedisConfig::operation_timeout`].
#[derive(Debug, thiserror::Error)]
#[error("no answer from redis within {after:?}")]
#[non_exhaustive]
pub struct TimedOut {
    /// The bound that passed.
    pub after: Duration,
}

/// One server (auto-reconnecting multiplexed connection) or a Redis Cluster. Both are cheap to
/// clone and pipeline concurrent requests.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Single(_) => f.write_str("Single"),
            Self::Cluster(_) => f.write_str("Cluster"),
        }
    }
}

impl Conn {
    /// Connects to one server.
    pub(crate) async fn single(url: &str, config: &RedisConfig) -> Result<Self, Error> {
        #[cfg(feature = "tls")]
        install_crypto_provider();
        #[cfg(feature = "tls")]
        let client = match &config.tls_root_cert {
            Some(pem) => redis::Client::build_with_tls(url, certificates(pem)),
            None => redis::Client::open(url),
        };
        #[cfg(not(feature = "tls"))]
        let client = redis::Client::open(url);
        let client = client.map_err(|e| invalid_url(url, e))?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.connect_timeout))
            .set_response_timeout(Some(config.response_timeout))
            .set_number_of_retries(config.retries as usize)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(500));
        let connect = ConnectionManager::new_with_config(client, manager_config);
        let manager = bounded(config.operation_timeout, connect)
            .await
            .map_err(|e| config_error(url, e))?;
        Ok(Self::Single(manager))
    }

    /// Connects to a cluster through any of `nodes`.
    pub(crate) async fn cluster(nodes: &[String], config: &RedisConfig) -> Result<Self, Error> {
        #[cfg(feature = "tls")]
        install_crypto_provider();
        if nodes.is_empty() {
            return Err(Error::invalid("url", "a cluster needs at least one node"));
        }
        let builder = ClusterClientBuilder::new(nodes.iter().map(String::as_str));
        #[cfg(feature = "tls")]
        let builder = match &config.tls_root_cert {
            Some(pem) => builder.certs(certificates(pem)),
            None => builder,
        };
        let client = builder
            .connection_timeout(config.connect_timeout)
            .response_timeout(config.response_timeout)
            .overall_response_timeout(Some(config.operation_timeout))
            .retries(config.retries)
            .min_retry_wait(20)
            .max_retry_wait(500)
            .build()
            .map_err(|e| invalid_url(&nodes.join(","), e))?;
        let connect = client.get_async_connection();
        let conn = bounded(config.operation_timeout, connect)
            .await
            .map_err(|e| config_error(&nodes.join(","), e))?;
        Ok(Self::Cluster(conn))
    }

    /// Runs a script (EVALSHA, loading it on NOSCRIPT) within `timeout`.
    pub(crate) async fn invoke(
        &self,
        invocation: &ScriptInvocation<'_>,
        timeout: Duration,
    ) -> Result<Value, Error> {
        match self {
            Self::Single(c) => bounded(timeout, invocation.invoke_async(&mut c.clone())).await,
            Self::Cluster(c) => bounded(timeout, invocation.invoke_async(&mut c.clone())).await,
        }
    }
}

async fn bounded<T>(
    timeout: Duration,
    fut: impl Future<Output = Result<T, RedisError>>,
) -> Result<T, Error> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(result) => result.map_err(map_error),
        Err(_) => Err(Error::unavailable(STORE, TimedOut { after: timeout })),
    }
}

/// A configuration the driver refused only when connecting (such as `#insecure` TLS, which this
/// crate does not enable) is bad input, not a server failure.
fn config_error(url: &str, e: Error) -> Error {
    match e {
        Error::Backend { source, .. }
            if source
                .downcast_ref::<RedisError>()
                .is_some_and(|re| re.kind() == ErrorKind::InvalidClientConfig) =>
        {
            match source.downcast::<RedisError>() {
                Ok(re) => invalid_url(url, *re),
                Err(source) => Error::Backend {
                    store: STORE,
                    source,
                },
            }
        }
        other => other,
    }
}

#[cfg(feature = "tls")]
fn certificates(pem: &[u8]) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(pem.to_vec()),
    }
}

fn invalid_url(url: &str, e: RedisError) -> Error {
    // The URL may hold a password: name only its scheme.
    let scheme = url.split("://").next().unwrap_or("?");
    Error::invalid(
        "url",
        format!(
            "cannot use this {scheme}:// address ({e}); for rediss:// enable the `tls` feature"
        ),
    )
}

/// Maps a driver error: anything that says the server could not be reached or is not serving
/// (I/O, timeouts, refused or dropped connections, cluster down or reconfiguring, loading, read
/// only after a failover) is [`Error::Unavailable`]; everything else is [`Error::Backend`].
pub(crate) fn map_error(e: RedisError) -> Error {
    if is_unavailable(&e) {
        Error::unavailable(STORE, e)
    } else {
        Error::backend(STORE, e)
    }
}

fn is_unavailable(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_cluster_error()
        || matches!(
            e.kind(),
            ErrorKind::ClusterConnectionNotFound
                | ErrorKind::Server(
                    ServerErrorKind::BusyLoading
                        | ServerErrorKind::MasterDown
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::ClusterDown
                        | ServerErrorKind::ReadOnly
                        | ServerErrorKind::Moved
                        | ServerErrorKind::Ask
                )
        )
}

/// rustls needs one process-wide crypto provider; install ring's unless the application chose one.
#[cfg(feature = "tls")]
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race with another installer is fine: some provider is then in place.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_are_unavailable_and_server_errors_are_backend() {
        let refused = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(matches!(
            map_error(refused),
            Error::Unavailable { store: "redis", .. }
        ));
        let timeout = RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert!(matches!(map_error(timeout), Error::Unavailable { .. }));
        let down = RedisError::from((ErrorKind::Server(ServerErrorKind::ClusterDown), "down"));
        assert!(matches!(map_error(down), Error::Unavailable { .. }));
        let script = RedisError::from((ErrorKind::Server(ServerErrorKind::ResponseError), "boom"));
        assert!(matches!(map_error(script), Error::Backend { .. }));
    }

    #[test]
    fn bad_urls_are_invalid_input_without_secrets() {
        let e = invalid_url(
            "nope://user:secret@host",
            RedisError::from((ErrorKind::InvalidClientConfig, "bad")),
        );
        let text = e.to_string();
        assert!(
            matches!(e, Error::InvalidInput { field: "url", .. }),
            "{e:?}"
        );
        assert!(!text.contains("secret"), "{text}");
    }
}
