//! Shared test support: the server URL, a fresh schema per test run, and a protocol-counting
//! TCP proxy.
//!
//! Every test that needs the server starts with one call here (`server`, `store` or
//! `store_with`): when nothing answers at `IDEM_POSTGRES_URL` it returns `false` (or `None`)
//! and the test returns early, after one "skipped" line for the suite, or, with `CI` set,
//! panics (see `idem_conformance::servers`). `admin` and the rest assume that call was made.
#![allow(dead_code, unreachable_pub)]

pub mod proxy;

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use idem_conformance::servers;
use idem_postgres::{PostgresConfig, PostgresStore};

/// Where the tests find PostgreSQL.
pub const ENV: &str = "IDEM_POSTGRES_URL";
/// The default when the variable is not set.
pub const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
/// Prefix of the per-run schemas; schemas with it older than an hour are dropped by later runs.
const PREFIX: &str = "idem_t";

pub fn url() -> String {
    std::env::var(ENV).unwrap_or_else(|_| DEFAULT_URL.to_owned())
}

/// Whether the server answers; `false` (the test returns early) outside CI when it does not.
pub fn server() -> bool {
    servers::endpoint("postgres", ENV, DEFAULT_URL).is_some()
}

/// A schema name unique to this run: `idem_t<unix seconds>_<random>`.
pub fn fresh_schema() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    format!("{PREFIX}{secs}_{:08x}", rand::random::<u32>())
}

/// The schema shared by every test of this process.
pub fn run_schema() -> &'static str {
    static SCHEMA: OnceLock<String> = OnceLock::new();
    SCHEMA.get_or_init(fresh_schema)
}

/// A direct connection for setup and inspection. Fails the test when the server is not there:
/// call [`server`] (or [`store`]) first.
pub async fn admin() -> tokio_postgres::Client {
    let url = url();
    let connected = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        tokio_postgres::connect(&url, tokio_postgres::NoTls),
    )
    .await;
    let (client, connection) = match connected {
        Ok(Ok(pair)) => pair,
        Ok(Err(e)) => panic!(
            "PostgreSQL is not reachable at {url} ({e}). Set {ENV} to a server, or start the local \
             one with `scripts/services.sh postgres`."
        ),
        Err(_) => panic!(
            "PostgreSQL at {url} did not answer within 10 s. Set {ENV} to a server, or start the \
             local one with `scripts/services.sh postgres`."
        ),
    };
    tokio::spawn(async move {
        let _ = connection.await;
    });
    sweep_old_schemas(&client).await;
    client
}

/// Drops test schemas left by runs that started more than an hour ago (never a running one).
async fn sweep_old_schemas(client: &tokio_postgres::Client) {
    static DONE: AtomicBool = AtomicBool::new(false);
    if DONE.swap(true, Ordering::SeqCst) {
        return;
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let rows = client
        .query(
            "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'idem\\_t%'",
            &[],
        )
        .await
        .unwrap_or_default();
    for row in rows {
        let name: String = row.get(0);
        let Some(secs) = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split('_').next())
            .and_then(|s| s.parse::<u64>().ok())
        else {
            continue;
        };
        if secs + 3600 < now {
            let _ = client
                .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
                .await;
        }
    }
}

/// The configuration for `schema` on the test server.
pub fn config(schema: &str) -> PostgresConfig {
    PostgresConfig::new(&url())
        .expect("IDEM_POSTGRES_URL parses")
        .with_schema(schema)
}

/// A migrated store with `config`; `None` (the test returns early) when the server is missing,
/// outside CI.
pub async fn store_with(config: PostgresConfig) -> Option<PostgresStore> {
    if !server() {
        return None;
    }
    let _ = admin().await; // sweeps old schemas; fails clearly when the server does not answer
    let store = PostgresStore::connect(config)
        .await
        .expect("valid configuration");
    store.migrate().await.expect("migrate");
    Some(store)
}

/// A migrated store in this run's schema (see [`store_with`]).
pub async fn store() -> Option<PostgresStore> {
    store_with(config(run_schema())).await
}

/// A store in this run's schema (migrated) that connects through a fresh counting proxy, and
/// that proxy: the proxy sees this store's traffic and nothing else. `None` as [`store`].
pub async fn proxied_store(
    configure: impl FnOnce(PostgresConfig) -> PostgresConfig,
) -> Option<(PostgresStore, proxy::Proxy)> {
    store().await?;
    let proxy = proxy::Proxy::start(upstream_addr().await).await;
    let store = PostgresStore::connect(configure(config_via(proxy.addr, run_schema())))
        .await
        .expect("valid configuration");
    Some((store, proxy))
}

/// The test server's TCP address (for the proxy).
pub async fn upstream_addr() -> std::net::SocketAddr {
    let base: tokio_postgres::Config = url().parse().expect("IDEM_POSTGRES_URL parses");
    let host = match base.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    let port = base.get_ports().first().copied().unwrap_or(5432);
    tokio::net::lookup_host((host.as_str(), port))
        .await
        .expect("resolve the test server")
        .next()
        .expect("an address for the test server")
}

/// The test configuration, but connecting through `addr` (a proxy).
pub fn config_via(addr: std::net::SocketAddr, schema: &str) -> PostgresConfig {
    let base: tokio_postgres::Config = url().parse().expect("IDEM_POSTGRES_URL parses");
    let mut pg = tokio_postgres::Config::new();
    if let Some(user) = base.get_user() {
        pg.user(user);
    }
    if let Some(password) = base.get_password() {
        pg.password(password);
    }
    if let Some(db) = base.get_dbname() {
        pg.dbname(db);
    }
    pg.host(addr.ip().to_string()).port(addr.port());
    PostgresConfig::from_pg_config(pg).with_schema(schema)
}
