//! The store-outage fault test (`idem_conformance::outage`) on a private redis-server with AOF:
//! 10,000 keys x 3 deliveries, workers that crash and stall past their lease, and the server
//! killed with `SIGKILL` and restarted twice mid-run, once with the effect committed through
//! `complete_with` and once written outside the store. The transactional path must lose no
//! key, duplicate no effect and accept no zombie write; the outside path prints its duplicates.
//!
//! The server runs with `appendonly yes` and `appendfsync always`: Redis then writes and fsyncs
//! the AOF before it answers, so every completion a worker saw acknowledged survives the kill.
//! (With `everysec` a `kill -9` loses nothing the kernel already has, but Redis may postpone the
//! write itself while a slow fsync runs, and then answer first: an acknowledged completion could
//! vanish and the run would count a lost key that is the configuration's, not the store's.) A
//! script is logged as one `MULTI`/`EXEC` block, which Redis drops whole if the AOF ends inside
//! it, so the effect and the completion also survive or vanish together.
//!
//! `IDEM_OUTAGE_KEYS` and `IDEM_OUTAGE_SEED` change the key count and the seed.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use common::PrivateRedis;
use idem_conformance::outage::{Effects, Outage, OutagePlan, run_both};
use idem_core::{Error, FencingToken, IdempotencyKey, Result};
use idem_redis::{RedisConfig, RedisStore, RedisWrites};
use redis::aio::ConnectionManager;

/// Kills and restarts the private server.
#[derive(Clone)]
struct Server(Arc<Mutex<PrivateRedis>>);

impl Server {
    fn with<T>(&self, f: impl FnOnce(&mut PrivateRedis) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

#[async_trait]
impl Outage for Server {
    async fn kill(&self) {
        let server = self.clone();
        tokio::task::spawn_blocking(move || server.with(PrivateRedis::stop))
            .await
            .unwrap();
    }

    async fn restart(&self) {
        let server = self.clone();
        let url = tokio::task::spawn_blocking(move || {
            server.with(|s| {
                s.restart();
                s.url()
            })
        })
        .await
        .unwrap();
        // It accepts connections; it answers once it has loaded the AOF (LOADING until then).
        let client = redis::Client::open(url).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ping = async {
                let mut conn = client.get_multiplexed_async_connection().await?;
                redis::cmd("PING").query_async::<String>(&mut conn).await
            };
            match ping.await {
                Ok(_) => return,
                Err(e) => assert!(
                    Instant::now() < deadline,
                    "the restarted server does not answer: {e}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The effect of a key: its applying tokens appended to a list under the record's hash tag.
struct Appended {
    store: RedisStore,
    admin: ConnectionManager,
}

impl Appended {
    fn list(&self, key: &IdempotencyKey) -> String {
        self.store
            .effect_key(key, ":effects")
            .expect("the driver's ids hold no braces")
    }
}

#[async_trait]
impl Effects<RedisStore> for Appended {
    fn apply(&self, key: &IdempotencyKey, token: FencingToken) -> RedisWrites {
        RedisWrites::new().rpush(self.list(key), token.get().to_string())
    }

    async fn applied(&self, key: &IdempotencyKey) -> Result<Vec<FencingToken>> {
        let tokens: Vec<u64> = redis::cmd("LRANGE")
            .arg(self.list(key))
            .arg(0)
            .arg(-1)
            .query_async(&mut self.admin.clone())
            .await
            .map_err(|e| Error::unavailable("redis", e))?;
        Ok(tokens.into_iter().map(FencingToken::new).collect())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn store_kills_duplicate_nothing_on_the_transactional_path() {
    let Some(server) =
        PrivateRedis::start_with(&["--appendonly", "yes", "--appendfsync", "always"])
    else {
        return;
    };
    let url = server.url();
    let server = Server(Arc::new(Mutex::new(server)));
    let store = RedisStore::connect_with(&url, RedisConfig::default())
        .await
        .expect("the private server answers");
    let admin = redis::Client::open(url.as_str())
        .unwrap()
        .get_connection_manager()
        .await
        .unwrap();
    let effects = Arc::new(Appended {
        store: store.clone(),
        admin,
    });
    // 64 workers and 300 ms leases (the driver's defaults are 16 and 500 ms): the same faults,
    // in about 15 s per path instead of 45 on a 2-core machine, where most of a run is workers
    // waiting out leases of crashed and stalled deliveries.
    let plan = OutagePlan::default()
        .with_workers(64)
        .with_lease_ttl(Duration::from_millis(300));
    let started = Instant::now();
    let (tx, outside) = run_both(
        "redis (private server, AOF appendfsync always, kill -9)",
        &plan,
        Arc::new(store),
        // The driver drops its handle after the last kill: this test keeps its own, so the server
        // lives until the end.
        Arc::new(server.clone()),
        effects,
    )
    .await;
    drop(server);
    println!("both runs took {:.1} s", started.elapsed().as_secs_f64());
    // `run_both` checked the transactional path (0 lost, 0 duplicate, 0 zombie) and the kills.
    assert_eq!(tx.kills, 2);
    assert_eq!(outside.lost_keys, 0);
}
