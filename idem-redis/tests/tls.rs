//! `rediss://` connections: with the `tls` feature against a TLS-only redis-server this test
//! starts (self-signed certificate made with the `openssl` command), without it a typed error.

mod common;

use idem_core::Error;
use idem_redis::RedisStore;

#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_round_trip() {
    use std::net::TcpListener;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use idem_core::{AcquireOutcome, AcquireRequest, Bytes, IdempotencyStore, Namespace};
    use idem_redis::RedisConfig;

    if !common::programs("redis (TLS)", &["redis-server", "openssl"]) {
        return;
    }
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap();
    let dir = std::env::temp_dir().join(format!("idem-redis-tls-{port}"));
    std::fs::create_dir_all(&dir).unwrap();
    // A private CA and a server certificate for 127.0.0.1 signed by it.
    let openssl = |args: &[&str]| {
        let status = Command::new("openssl")
            .args(args)
            .current_dir(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("the openssl command (Debian package openssl)");
        assert!(status.success(), "openssl {args:?} failed");
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=idem test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "key.pem",
        "-out",
        "server.csr",
    ]);
    std::fs::write(dir.join("ext.cnf"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "ext.cnf",
        "-out",
        "cert.pem",
    ]);
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let mut server = Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .arg("--tls-cert-file")
        .arg(&cert)
        .arg("--tls-key-file")
        .arg(&key)
        .args([
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(&dir)
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server (scripts/services.sh redis installs it)");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "TLS redis-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }

    let ca = std::fs::read(dir.join("ca.pem")).unwrap();
    let url = format!("rediss://127.0.0.1:{port}");
    let result = async {
        let config = RedisConfig::default().with_tls_root_cert(ca.clone());
        let store = RedisStore::connect_with(&url, config).await?;
        let key = Namespace::new("tls")?.key("k")?;
        let lease = match store
            .acquire(&AcquireRequest::new(key.clone(), "w"))
            .await?
        {
            AcquireOutcome::Acquired { lease, .. } => lease,
            other => panic!("{other:?}"),
        };
        store
            .complete(
                &lease,
                Bytes::from_static(b"over tls"),
                Duration::from_secs(60),
            )
            .await?;
        store.acquire(&AcquireRequest::new(key, "w")).await
    }
    .await;
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        matches!(&result, Ok(AcquireOutcome::Replayed { result }) if result.as_ref() == b"over tls"),
        "{result:?}"
    );
    // Without the private CA the server is not trusted; `#insecure` is not compiled in.
    let untrusted = RedisStore::connect(&url).await;
    assert!(untrusted.is_err(), "{untrusted:?}");
    let insecure = RedisStore::connect(&format!("{url}/#insecure")).await;
    assert!(
        matches!(insecure, Err(Error::InvalidInput { field: "url", .. })),
        "{insecure:?}"
    );
}

#[cfg(not(feature = "tls"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_without_the_feature_is_invalid_input() {
    let r = RedisStore::connect("rediss://127.0.0.1:6380").await;
    assert!(
        matches!(r, Err(Error::InvalidInput { field: "url", .. })),
        "{r:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_scheme_is_invalid_input() {
    let r = RedisStore::connect("memcached://127.0.0.1:1").await;
    assert!(
        matches!(r, Err(Error::InvalidInput { field: "url", .. })),
        "{r:?}"
    );
}
