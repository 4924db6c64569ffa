//! TLS through rustls (crate feature `tls`).

use std::sync::Arc;

/// A rustls client configuration trusting the Mozilla root certificates of `webpki-roots`, on
/// the `ring` provider (named explicitly, so it does not depend on which rustls provider other
/// crates of the build enable).
pub(crate) fn webpki_client_config() -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("the ring provider supports the default TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth()
}

#[cfg(test)]
mod tests {
    #[test]
    fn builds_a_client_config() {
        let config = super::webpki_client_config();
        assert!(config.alpn_protocols.is_empty());
    }
}
