//! TLS (crate feature `tls`): the store connects over rustls with `sslmode=require`.
#![cfg(feature = "tls")]

mod common;

use std::sync::Arc;

use idem_core::{AcquireOutcome, AcquireRequest, Error, IdempotencyStore, Namespace};
use idem_executor::{ExecutorConfig, Outcome};
use idem_postgres::tokio_postgres::config::SslMode;
use rustls::DigitallySignedStruct;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

/// Test-only verifier: checks handshake signatures but accepts any certificate, because a local
/// test server has a self-signed one (Debian's snakeoil) that no root store trusts.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[tokio::test]
async fn connects_over_tls_when_required() {
    if common::store().await.is_none() {
        return; // no server: skipped (outside CI)
    }
    let admin = common::admin().await;
    let server_ssl: String = admin.query_one("SHOW ssl", &[]).await.unwrap().get(0);

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
        .with_no_client_auth();
    let mut config = common::config(common::run_schema()).with_tls(tls);
    config.pg.ssl_mode(SslMode::Require);
    let store = idem_postgres::PostgresStore::connect(config).await.unwrap();
    let ns = Namespace::new("tls").unwrap();
    let req = AcquireRequest::new(ns.key(format!("k-{}", rand::random::<u64>())).unwrap(), "w");

    if server_ssl != "on" {
        // Without TLS on the server, `sslmode=require` must refuse rather than fall back.
        let r = store.acquire(&req).await;
        assert!(
            matches!(r, Err(Error::Backend { .. } | Error::Unavailable { .. })),
            "{r:?}"
        );
        println!("server has ssl = {server_ssl}: checked that require refuses plaintext");
        return;
    }
    // In-transaction mode on the same encrypted connection.
    let mode = store.in_transaction(ExecutorConfig::new("tls")).unwrap();
    let outcome = mode
        .run_with_key(req.key.id(), None, |tx, _| {
            Box::pin(async move {
                let row = tx
                    .query_one(
                        "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
                        &[],
                    )
                    .await?;
                Ok(row.get::<_, bool>(0))
            })
        })
        .await
        .unwrap();
    assert!(
        matches!(outcome, Outcome::Executed(true)),
        "the connection must be encrypted: {outcome:?}"
    );
    assert!(matches!(
        store.acquire(&req).await.unwrap(),
        AcquireOutcome::Replayed { .. }
    ));
}
