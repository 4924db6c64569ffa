//! The store-outage fault test of issue 12 on PostgreSQL: 10,000 keys × 3 deliveries
//! (`IDEM_OUTAGE_KEYS` to change), workers that crash and stall past their lease, and the store
//! killed twice per run: every connection of the store terminated (`pg_terminate_backend` from a
//! separate admin connection, for every backend with this test's own `application_name`), and
//! kept terminated for the whole outage (every connection the pool opens meanwhile is terminated
//! too), once with the effect committed by `complete_with` in the completion's transaction and
//! once written outside the store. The shared driver (`idem_conformance::outage`) prints the
//! table and asserts 0 lost keys, 0 duplicate effects and 0 zombie writes for the transactional
//! path.
//!
//! Only this test's connections are touched: the server is the shared one, but every backend it
//! terminates carries the store's own, random `application_name`.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idem_conformance::outage::{Effects, Outage, OutagePlan, run_both};
use idem_core::{Error, FencingToken, IdempotencyKey, Result};
use idem_postgres::{PgWrites, PostgresStore};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

/// Ends every connection of the store: once at `kill`, then every 20 ms until `restart`.
struct Terminate {
    admin: Arc<tokio_postgres::Client>,
    application_name: String,
    down: Arc<AtomicBool>,
    terminated: Arc<AtomicU64>,
    keeper: Mutex<Option<JoinHandle<()>>>,
}

/// Terminates every backend of `application_name`; returns how many.
async fn terminate(admin: &tokio_postgres::Client, application_name: &str) -> u64 {
    admin
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = $1 AND pid <> pg_backend_pid()",
            &[&application_name],
        )
        .await
        .map(|row| row.get::<_, i64>(0) as u64)
        .expect("the admin connection terminates the store's backends")
}

#[async_trait]
impl Outage for Terminate {
    async fn kill(&self) {
        self.down.store(true, Ordering::SeqCst);
        let killed = terminate(&self.admin, &self.application_name).await;
        self.terminated.fetch_add(killed, Ordering::SeqCst);
        let (admin, name, down, terminated) = (
            self.admin.clone(),
            self.application_name.clone(),
            self.down.clone(),
            self.terminated.clone(),
        );
        *self.keeper.lock().await = Some(tokio::spawn(async move {
            while down.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(20)).await;
                terminated.fetch_add(terminate(&admin, &name).await, Ordering::SeqCst);
            }
        }));
    }

    async fn restart(&self) {
        self.down.store(false, Ordering::SeqCst);
        if let Some(keeper) = self.keeper.lock().await.take() {
            keeper.await.expect("the keeper");
        }
        // Back once a fresh connection works.
        loop {
            if let Ok((client, connection)) =
                tokio_postgres::connect(&common::url(), tokio_postgres::NoTls).await
            {
                tokio::spawn(connection);
                if client.simple_query("SELECT 1").await.is_ok() {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Each key's effect: a row `(key, token)` per application, in a table without constraints.
///
/// The driver reads the effects back only once the run is over (when they no longer change),
/// key after key: the first read loads the whole table in one query and the others are answered
/// from it, instead of 10,000 round trips.
struct Appended {
    table: String,
    admin: Arc<tokio_postgres::Client>,
    loaded: tokio::sync::OnceCell<HashMap<String, Vec<FencingToken>>>,
}

#[async_trait]
impl Effects<PostgresStore> for Appended {
    fn apply(&self, key: &IdempotencyKey, token: FencingToken) -> PgWrites {
        PgWrites::new().execute(
            format!("INSERT INTO {} (key, token) VALUES ($1, $2)", self.table),
            (key.to_string(), token.get() as i64),
        )
    }

    async fn applied(&self, key: &IdempotencyKey) -> Result<Vec<FencingToken>> {
        let all = self
            .loaded
            .get_or_try_init(|| async {
                let rows = self
                    .admin
                    .query(&format!("SELECT key, token FROM {}", self.table), &[])
                    .await
                    .map_err(|e| Error::unavailable("postgres", e))?;
                let mut all: HashMap<String, Vec<FencingToken>> = HashMap::new();
                for row in rows {
                    all.entry(row.get(0))
                        .or_default()
                        .push(FencingToken::new(row.get::<_, i64>(1) as u64));
                }
                Ok::<_, Error>(all)
            })
            .await?;
        Ok(all.get(&key.to_string()).cloned().unwrap_or_default())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminating_every_connection_duplicates_nothing_on_the_transactional_path() {
    let plan = OutagePlan::default().with_workers(48);
    let application_name = format!("idem-outage-{:08x}", rand::random::<u32>());
    let Some(store) = common::store_with(
        common::config(common::run_schema())
            .with_application_name(application_name.clone())
            .with_pool_size(plan.workers + 4)
            .with_connect_timeout(Duration::from_secs(1)),
    )
    .await
    else {
        return;
    };
    let admin = Arc::new(common::admin().await);
    let table = format!(
        "\"{}\".\"outage_effects_{:08x}\"",
        common::run_schema(),
        rand::random::<u32>()
    );
    admin
        .batch_execute(&format!(
            "CREATE TABLE {table} (key text NOT NULL, token bigint NOT NULL)"
        ))
        .await
        .unwrap();
    let terminated = Arc::new(AtomicU64::new(0));
    let outage = Arc::new(Terminate {
        admin: admin.clone(),
        application_name,
        down: Arc::new(AtomicBool::new(false)),
        terminated: terminated.clone(),
        keeper: Mutex::new(None),
    });
    let started = Instant::now();
    let (tx, outside) = run_both(
        "postgres (every connection of the store terminated, pg_terminate_backend)",
        &plan,
        Arc::new(store),
        outage,
        Arc::new(Appended {
            table,
            admin,
            loaded: tokio::sync::OnceCell::new(),
        }),
    )
    .await;
    println!(
        "both runs in {:.1} s; {} backends terminated; duplicate effects outside the store: {}",
        started.elapsed().as_secs_f64(),
        terminated.load(Ordering::SeqCst),
        outside.duplicate_effects
    );
    assert_eq!(tx.deliveries, plan.keys * plan.deliveries);
    assert!(
        terminated.load(Ordering::SeqCst) > 0,
        "no connection was terminated"
    );
}
