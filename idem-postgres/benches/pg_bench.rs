//! Throughput of `acquire` + `complete` through [`PostgresStore`], against `pgbench` running the
//! very same two SQL statements as the baseline.
//!
//! ```text
//! cargo bench -p idem-postgres --bench pg_bench
//! IDEM_POSTGRES_URL=postgres://... IDEM_BENCH_SECS=10 cargo bench -p idem-postgres --bench pg_bench
//! IDEM_BENCH_SYNCHRONOUS_COMMIT=off cargo bench -p idem-postgres --bench pg_bench
//! ```
//!
//! `IDEM_BENCH_SYNCHRONOUS_COMMIT` sets `synchronous_commit` for both sides' sessions; with the
//! server default (`on`) both are usually bound by the commit flush, and `off` shows the client
//! overhead more clearly.
//!
//! For 1 and 16 concurrent clients it measures messages per second through the store (each
//! message: acquire a fresh random key, then complete it), then runs `pgbench -M prepared` with a
//! script holding the store's own statement texts ([`PostgresStore::statement_sql`]), the
//! acquire's `$n` parameters replaced by pgbench variables, a random key per transaction, and the
//! acquire's token passed to the complete with `\gset`. It prints both rates and their ratio.
//!
//! Then, in the same run, the transactional path beside the plain one, each message writing one
//! ledger row as its effect: `acquire` + `complete_with` (the INSERT committed with the
//! completion, one transaction) against `acquire` + the INSERT on its own + `complete` (the
//! effect written outside the completion, as a plain executor does), and the plain `acquire` +
//! `complete` with no effect. Nothing is asserted: the numbers depend on the machine.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Fingerprint, IdempotencyStore, Namespace,
    TransactionalStore,
};
use idem_postgres::{PgWrites, PostgresConfig, PostgresStore, Transition};

const CLIENTS: [usize; 2] = [1, 16];
const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(3600);
const MAX_ATTEMPTS: u32 = 5;
const RESULT: &[u8] = b"ok";

fn fingerprint() -> Fingerprint {
    Fingerprint::of("pg_bench payload")
}

/// How a message's effect (one ledger row) is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Effect {
    /// No effect: acquire + complete.
    None,
    /// acquire + INSERT (its own transaction) + complete.
    Outside,
    /// acquire + complete_with(INSERT): one transaction.
    Transactional,
}

/// Runs acquire+complete on fresh random keys from `clients` tasks for `secs`; returns msgs/s.
async fn store_rate(store: &PostgresStore, ns: &Namespace, clients: usize, secs: Duration) -> f64 {
    effect_rate(store, ns, clients, secs, Effect::None, "").await
}

/// Like [`store_rate`], each message also writing one row of `ledger` as `effect` says.
async fn effect_rate(
    store: &PostgresStore,
    ns: &Namespace,
    clients: usize,
    secs: Duration,
    effect: Effect,
    ledger: &str,
) -> f64 {
    let insert = format!("INSERT INTO {ledger} (id, token) VALUES ($1, $2)");
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (store, ns, stop, done) = (store.clone(), ns.clone(), stop.clone(), done.clone());
            let insert = insert.clone();
            tokio::spawn(async move {
                let owner = format!("bench-{c}");
                while !stop.load(Ordering::Relaxed) {
                    let id = rand::random_range(1..i64::MAX).to_string();
                    let req = AcquireRequest::new(ns.key(&id).unwrap(), owner.clone())
                        .with_fingerprint(fingerprint())
                        .with_lease_ttl(LEASE)
                        .with_max_attempts(MAX_ATTEMPTS);
                    match store.acquire(&req).await.expect("acquire") {
                        AcquireOutcome::Acquired { lease, .. } => {
                            let token = lease.token.get() as i64;
                            let result = Bytes::from_static(RESULT);
                            match effect {
                                Effect::None => store.complete(&lease, result, RETENTION).await,
                                Effect::Outside => {
                                    let client = store.pool().get().await.expect("a connection");
                                    client
                                        .execute(insert.as_str(), &[&id, &token])
                                        .await
                                        .expect("the effect");
                                    drop(client);
                                    store.complete(&lease, result, RETENTION).await
                                }
                                Effect::Transactional => {
                                    let writes = PgWrites::new()
                                        .execute(insert.clone(), (id.clone(), token));
                                    store.complete_with(&lease, result, RETENTION, writes).await
                                }
                            }
                            .expect("complete");
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                        other => panic!("a fresh random key gave {other:?}"),
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(secs).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

/// The pgbench script: the store's two statements, `$n` replaced by pgbench variables.
fn pgbench_script(store: &PostgresStore) -> String {
    let mut acquire = store.statement_sql(Transition::Acquire).to_owned();
    for (n, var) in [
        (7, ":lock_timeout"),
        (6, ":max_attempts"),
        (5, ":lease_us"),
        (4, ":owner"),
        (3, ":fp"),
        (2, ":id"),
        (1, ":ns"),
    ] {
        acquire = acquire.replace(&format!("${n}"), var);
    }
    let mut complete = store.statement_sql(Transition::Complete).to_owned();
    for (n, var) in [
        (5, ":retention_us"),
        (4, ":result"),
        (3, ":p_new_token"),
        (2, ":id"),
        (1, ":ns"),
    ] {
        complete = complete.replace(&format!("${n}"), var);
    }
    format!("\\set id random(1, 9223372036854775806)\n{acquire} \\gset p_\n{complete};\n")
}

/// Runs pgbench with `clients` clients for `secs`; returns transactions (messages) per second.
fn pgbench_rate(url: &str, script: &PathBuf, ns: &str, clients: usize, secs: Duration) -> f64 {
    let lock_timeout = PostgresConfig::new(url)
        .unwrap()
        .lock_timeout
        .as_millis()
        .to_string();
    let mut command = Command::new("pgbench");
    if let Some(sc) = synchronous_commit() {
        command.env("PGOPTIONS", format!("-c synchronous_commit={sc}"));
    }
    let out = command
        .args(["-n", "-M", "prepared"])
        .args(["-c", &clients.to_string()])
        .args(["-j", &clients.min(2).to_string()])
        .args(["-T", &secs.as_secs().max(1).to_string()])
        .arg("-f")
        .arg(script)
        .args(["-D", &format!("ns={ns}")])
        .args(["-D", "owner=pgbench"])
        .args(["-D", &format!("fp=\\x{}", fingerprint().to_hex())])
        .args(["-D", &format!("lease_us={}", LEASE.as_micros())])
        .args(["-D", &format!("max_attempts={MAX_ATTEMPTS}")])
        .args(["-D", &format!("lock_timeout={lock_timeout}")])
        .args(["-D", &format!("retention_us={}", RETENTION.as_micros())])
        .args(["-D", &format!("result={}", String::from_utf8_lossy(RESULT))])
        .arg(url)
        .output()
        .expect("run pgbench (install postgresql-client; scripts/services.sh postgres does)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "pgbench failed:\n{stdout}\n{stderr}");
    let failed = stdout
        .lines()
        .find(|l| l.starts_with("number of failed transactions"))
        .unwrap_or("");
    if !failed.is_empty() && !failed.contains(": 0 ") {
        eprintln!("pgbench: {failed}");
    }
    stdout
        .lines()
        .find_map(|l| {
            let rest = l.strip_prefix("tps = ")?;
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .unwrap_or_else(|| panic!("no tps line in pgbench output:\n{stdout}\n{stderr}"))
}

/// `IDEM_BENCH_SYNCHRONOUS_COMMIT`, checked to be a plain word.
fn synchronous_commit() -> Option<String> {
    let value = std::env::var("IDEM_BENCH_SYNCHRONOUS_COMMIT").ok()?;
    assert!(
        value.chars().all(|c| c.is_ascii_alphabetic() || c == '_'),
        "IDEM_BENCH_SYNCHRONOUS_COMMIT must be a setting like on, off or local"
    );
    Some(value)
}

fn main() {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let secs = Duration::from_secs(
        std::env::var("IDEM_BENCH_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(10),
    );
    let stamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let schema = format!(
        "idem_bench_{stamp}_{:06x}",
        rand::random::<u32>() & 0xff_ffff
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();

    let store = runtime.block_on(async {
        let mut config = PostgresConfig::new(&url)
            .expect("IDEM_POSTGRES_URL parses")
            .with_schema(&schema)
            .with_pool_size(CLIENTS.into_iter().max().unwrap());
        if let Some(sc) = synchronous_commit() {
            config.pg.options(format!("-c synchronous_commit={sc}"));
        }
        let store = PostgresStore::connect(config).await.expect("connect");
        store.migrate().await.unwrap_or_else(|e| {
            panic!(
                "PostgreSQL at {url} is not usable ({e}); set IDEM_POSTGRES_URL or run \
                 scripts/services.sh postgres"
            )
        });
        store
    });

    println!(
        "idem-postgres: acquire + complete per message, {secs:?} per measurement, schema {schema}, \
         synchronous_commit {}",
        synchronous_commit().unwrap_or_else(|| "(server default)".into())
    );
    let mut store_rates = Vec::new();
    for clients in CLIENTS {
        let ns = Namespace::new(format!("store-{clients}")).unwrap();
        let rate = runtime.block_on(async {
            // Warm up: connections open, statements prepared.
            store_rate(&store, &ns, clients, Duration::from_secs(1)).await;
            store_rate(&store, &ns, clients, secs).await
        });
        println!("  store    {clients:>2} tasks:   {rate:>9.0} msgs/s");
        store_rates.push(rate);
    }

    let script = std::env::temp_dir().join(format!("{schema}.pgbench"));
    std::fs::write(&script, pgbench_script(&store)).unwrap();
    let mut pgbench_rates = Vec::new();
    for clients in CLIENTS {
        let ns = format!("pgbench-{clients}");
        pgbench_rate(&url, &script, &ns, clients, Duration::from_secs(1));
        let rate = pgbench_rate(&url, &script, &ns, clients, secs);
        println!("  pgbench  {clients:>2} clients: {rate:>9.0} msgs/s");
        pgbench_rates.push(rate);
    }

    // Sanity check: pgbench really ran both statements (every key it acquired is completed).
    runtime.block_on(async {
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(conn);
        for ns in ["store-16", "pgbench-16"] {
            let row = client
                .query_one(
                    &format!(
                        "SELECT count(*), count(*) FILTER (WHERE state = 'completed') FROM {} \
                         WHERE namespace = $1",
                        store.qualified_table()
                    ),
                    &[&ns],
                )
                .await
                .unwrap();
            let (all, completed): (i64, i64) = (row.get(0), row.get(1));
            println!("  check {ns:>10}: {completed} of {all} records completed");
        }
    });

    println!();
    println!("  clients   store msgs/s   pgbench msgs/s   store/pgbench");
    for (i, clients) in CLIENTS.into_iter().enumerate() {
        println!(
            "  {clients:>7}   {:>12.0}   {:>14.0}   {:>13.2}",
            store_rates[i],
            pgbench_rates[i],
            store_rates[i] / pgbench_rates[i]
        );
    }
    let last = CLIENTS.len() - 1;
    let ratio = store_rates[last] / pgbench_rates[last];
    println!(
        "  target: >= 0.80 of pgbench at {} clients: {} ({ratio:.2})",
        CLIENTS[last],
        if ratio >= 0.8 { "met" } else { "NOT met" }
    );

    // The transactional path beside the plain one, same run, same store.
    let ledger = format!("\"{schema}\".\"ledger\"");
    runtime.block_on(async {
        let client = store.pool().get().await.expect("a connection");
        client
            .batch_execute(&format!(
                "CREATE TABLE {ledger} (id text NOT NULL, token bigint NOT NULL)"
            ))
            .await
            .expect("the ledger table");
    });
    println!();
    println!("  one ledger row per message (msgs/s):");
    println!("  clients   no effect   effect outside   transactional   transactional/outside");
    for clients in CLIENTS {
        let mut rates = Vec::new();
        for effect in [Effect::None, Effect::Outside, Effect::Transactional] {
            let ns = Namespace::new(format!("{effect:?}-{clients}").to_lowercase()).unwrap();
            rates.push(runtime.block_on(async {
                effect_rate(
                    &store,
                    &ns,
                    clients,
                    Duration::from_secs(1),
                    effect,
                    &ledger,
                )
                .await;
                effect_rate(&store, &ns, clients, secs, effect, &ledger).await
            }));
        }
        println!(
            "  {clients:>7}   {:>9.0}   {:>14.0}   {:>13.0}   {:>21.2}",
            rates[0],
            rates[1],
            rates[2],
            rates[2] / rates[1]
        );
    }

    let _ = std::fs::remove_file(&script);
    runtime.block_on(async {
        if let Ok((client, conn)) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
            tokio::spawn(conn);
            let _ = client
                .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
                .await;
        }
    });
}
