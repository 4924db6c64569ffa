//! A server that may evict keys is named at connect: a `tracing` warning when its
//! `maxmemory-policy` is not `noeviction` (an evicted record is a forgotten completion), none
//! when it is. On private servers, so that the policy is this test's own.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use common::PrivateRedis;
use idem_redis::RedisStore;

/// What the `tracing` events of the calls made with it installed said, as text.
#[derive(Clone, Default)]
struct Said(Arc<Mutex<Vec<u8>>>);

impl Write for Said {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Connects to a private server started with `args` and returns what was logged meanwhile.
async fn connect_logged(args: &[&str]) -> Option<String> {
    let server = PrivateRedis::start_with(args)?;
    let said = Said::default();
    let writer = said.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    RedisStore::connect(&server.url()).await.unwrap();
    let text = String::from_utf8(said.0.lock().unwrap().clone()).unwrap();
    Some(text)
}

#[tokio::test]
async fn a_server_that_may_evict_keys_is_named_at_connect() {
    let Some(said) =
        connect_logged(&["--appendonly", "no", "--maxmemory-policy", "allkeys-lru"]).await
    else {
        return;
    };
    assert!(
        said.contains("WARN") && said.contains("maxmemory-policy allkeys-lru"),
        "no warning: {said:?}"
    );
    let Some(said) =
        connect_logged(&["--appendonly", "no", "--maxmemory-policy", "noeviction"]).await
    else {
        return;
    };
    assert!(
        !said.contains("maxmemory"),
        "a warning for noeviction: {said:?}"
    );
}
