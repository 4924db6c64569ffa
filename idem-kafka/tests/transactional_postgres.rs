//! The runner with a transactional PostgreSQL executor (`Executor::transactional` over a
//! `PostgresStore`): the handler returns a `Commit` of its receipt and the `PgWrites` of the
//! payment (a ledger row and a debit), which commit in the same transaction as the key's
//! completion.
//!
//! Needs a Kafka-protocol broker (`IDEM_KAFKA_BROKERS`, default `127.0.0.1:9092`) and PostgreSQL
//! (`IDEM_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`); start them with
//! `scripts/services.sh kafka postgres`. Without them the test returns after one "skipped" line;
//! with `CI=true` it fails.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use idem_conformance::servers;
use idem_core::{FailureKind, IdempotencyStore, Namespace, RecordState};
use idem_executor::{Commit, Executor, ExecutorConfig, HandlerContext, HandlerError};
use idem_kafka::{HEADER_KEY, HEADER_REASON, KafkaMessage, KafkaRunner, RunnerOptions};
use idem_postgres::{PgWrites, PostgresConfig, PostgresStore, tokio_postgres};
use tokio::sync::oneshot;

const POSTGRES_VAR: &str = "IDEM_POSTGRES_URL";
const DEFAULT_POSTGRES_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
const NAMESPACE: &str = "payments";
const OPENING_BALANCE: i64 = 10_000;
/// Payments `p0..p11`, each produced once; `p0..p5` produced again on the other partition.
const PAYMENTS: i64 = 12;
const DUPLICATED: i64 = 6;

#[derive(serde::Deserialize)]
struct Payment {
    amount: i64,
    #[serde(default)]
    decline: bool,
}

fn amount(i: i64) -> i64 {
    100 + i
}

/// A direct connection for setup and inspection.
async fn admin(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "PostgreSQL is not reachable at {url} ({e}); set {POSTGRES_VAR} or start it with \
                 scripts/services.sh postgres"
            )
        });
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_postgres_executor_commits_one_ledger_row_per_key_with_its_completion() {
    if !kafka_only() {
        return;
    }
    let Some(url) = servers::endpoint("kafka", POSTGRES_VAR, DEFAULT_POSTGRES_URL) else {
        return;
    };
    init_tracing();

    // The store and the business tables, in a schema of this run.
    let schema = format!(
        "idem_kafka_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let admin = admin(&url).await;
    let store = Arc::new(
        PostgresStore::connect(
            PostgresConfig::new(&url)
                .expect("postgres url")
                .with_schema(&schema),
        )
        .await
        .expect("connect"),
    );
    store.migrate().await.expect("migrate");
    // No unique constraint on the ledger: a second row for a payment would show, not fail.
    admin
        .batch_execute(&format!(
            "CREATE TABLE {schema}.accounts (id text PRIMARY KEY, balance bigint NOT NULL);
             CREATE TABLE {schema}.ledger (
                 id bigserial PRIMARY KEY, payment text NOT NULL, account text NOT NULL,
                 amount bigint NOT NULL, fence bigint NOT NULL);"
        ))
        .await
        .expect("business tables");
    admin
        .execute(
            &format!("INSERT INTO {schema}.accounts (id, balance) VALUES ($1, $2)"),
            &[&"alice", &OPENING_BALANCE],
        )
        .await
        .expect("opening balance");

    // Records: every payment once, six of them again on the other partition (so a duplicate can
    // arrive while its original runs), one payment the balance cannot cover (its debit is refused
    // in the transaction, after its ledger row was written), and one the handler declines.
    let topic = unique("tx-pg");
    let group = unique("g");
    create_topic(&topic, 2).await;
    create_topic(&format!("{topic}.dlq"), 1).await;
    let payment = |i: i64| format!("{{\"amount\":{}}}", amount(i));
    let mut recs = Vec::new();
    for i in 0..PAYMENTS {
        recs.push(Rec::keyed((i % 2) as i32, &format!("p{i}"), payment(i)));
    }
    recs.push(Rec::keyed(0, "p-over", "{\"amount\":1000000}"));
    recs.push(Rec::keyed(
        1,
        "p-declined",
        "{\"amount\":50,\"decline\":true}",
    ));
    for i in 0..DUPLICATED {
        recs.push(Rec::keyed(
            ((i + 1) % 2) as i32,
            &format!("p{i}"),
            payment(i),
        ));
    }
    let total = recs.len() as u64;
    let ends = ends(&produce(&topic, &recs).await);

    let executor = Executor::transactional(
        Arc::clone(&store),
        ExecutorConfig::new(NAMESPACE)
            .with_max_attempts(2)
            .with_retry_delay(Duration::from_millis(50)),
    )
    .expect("executor config");
    let insert_ledger = format!(
        "INSERT INTO {schema}.ledger (payment, account, amount, fence) VALUES ($1, $2, $3, $4)"
    );
    let debit = format!(
        "UPDATE {schema}.accounts SET balance = balance - $1 WHERE id = $2 AND balance >= $1"
    );
    let calls: Arc<Mutex<BTreeMap<String, u32>>> = Arc::default();
    let seen = Arc::clone(&calls);
    let handler = move |msg: KafkaMessage, ctx: HandlerContext| {
        let (insert_ledger, debit, seen) =
            (insert_ledger.clone(), debit.clone(), Arc::clone(&seen));
        async move {
            let key = ctx.key().expect("a deduplicated record").id().to_owned();
            *seen.lock().unwrap().entry(key.clone()).or_default() += 1;
            let payment: Payment =
                serde_json::from_slice(msg.payload()).map_err(HandlerError::terminal)?;
            if payment.decline {
                return Err(HandlerError::terminal(std::io::Error::other(
                    "card declined",
                )));
            }
            let token = ctx.token().expect("a leased record").get();
            let fence = i64::try_from(token).map_err(HandlerError::terminal)?;
            // The ledger row first, so that a refused debit has a written row to roll back.
            let writes = PgWrites::new()
                .execute(insert_ledger, (key.clone(), "alice", payment.amount, fence))
                .execute(debit, (payment.amount, "alice"))
                .expect_rows(1);
            Ok(Commit::new(
                format!("{key}: {} paid with token {token}", payment.amount),
                writes,
            ))
        }
    };
    let runner = KafkaRunner::builder(consumer_config(&group), executor, handler)
        .topic(&topic)
        .options(
            RunnerOptions::default()
                .with_commit_interval(Duration::from_millis(100))
                .with_retry_delays(Duration::from_millis(20), Duration::from_millis(500)),
        )
        .build()
        .expect("runner");
    let stats = runner.stats();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let task = tokio::spawn(runner.run(async {
        let _ = stop_rx.await;
    }));
    let resolved = wait_for(Duration::from_secs(90), || {
        let stats = Arc::clone(&stats);
        async move { stats.resolved() >= total }
    })
    .await;
    assert!(
        resolved,
        "resolved {} of {total}: {stats:?}",
        stats.resolved()
    );
    stop_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the runner stops within 30 s")
        .unwrap()
        .expect("the runner ends cleanly");

    // Each payment ran once (duplicates replayed); the refused one ran on both attempts.
    let mut expected_calls: BTreeMap<String, u32> =
        (0..PAYMENTS).map(|i| (format!("p{i}"), 1)).collect();
    expected_calls.insert("p-over".into(), 2);
    expected_calls.insert("p-declined".into(), 1);
    assert_eq!(*calls.lock().unwrap(), expected_calls);
    assert_eq!(
        (stats.executed(), stats.replayed(), stats.dead_lettered()),
        (PAYMENTS as u64, DUPLICATED as u64, 2)
    );

    // Exactly one ledger row per payment, fenced with the token of the completion that committed
    // it; none for the refused or the declined payment.
    let ns = Namespace::new(NAMESPACE).unwrap();
    let rows = admin
        .query(
            &format!(
                "SELECT payment, count(*), sum(amount)::bigint, min(fence), max(fence)
                 FROM {schema}.ledger GROUP BY payment"
            ),
            &[],
        )
        .await
        .expect("ledger");
    let ledger: HashMap<String, (i64, i64, i64, i64)> = rows
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3), r.get(4))))
        .collect();
    assert_eq!(
        ledger.keys().cloned().collect::<BTreeSet<_>>(),
        (0..PAYMENTS)
            .map(|i| format!("p{i}"))
            .collect::<BTreeSet<_>>(),
        "ledger rows exactly for the paid keys"
    );
    for i in 0..PAYMENTS {
        let key = format!("p{i}");
        let record = store
            .get(&ns.key(&key).unwrap())
            .await
            .unwrap()
            .expect("a record");
        let token = i64::try_from(record.token.get()).unwrap();
        assert_eq!(ledger[&key], (1, amount(i), token, token), "{key}");
        let RecordState::Completed { result } = &record.state else {
            panic!("{key}: {:?}", record.state);
        };
        let receipt: String = serde_json::from_slice(result).unwrap();
        assert_eq!(
            receipt,
            format!("{key}: {} paid with token {token}", amount(i))
        );
    }
    let balance: i64 = admin
        .query_one(
            &format!("SELECT balance FROM {schema}.accounts WHERE id = $1"),
            &[&"alice"],
        )
        .await
        .unwrap()
        .get(0);
    let paid: i64 = (0..PAYMENTS).map(amount).sum();
    assert_eq!(balance, OPENING_BALANCE - paid);

    // The refused payment used its two attempts; the declined one failed for good.
    let over = store
        .get(&ns.key("p-over").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(&over.state, RecordState::Failed { kind: FailureKind::Retryable, error } if error.contains("refused")),
        "{:?}",
        over.state
    );
    assert_eq!(over.attempts, 2);
    let declined = store
        .get(&ns.key("p-declined").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(&declined.state, RecordState::Failed { kind: FailureKind::Terminal, error } if error.contains("card declined")),
        "{:?}",
        declined.state
    );

    // Both went to the dead-letter topic; every offset was committed.
    let dead = read_topic(&format!("{topic}.dlq"), 2, Duration::from_secs(20)).await;
    let dead: BTreeMap<String, String> = dead
        .iter()
        .map(|m| {
            (
                header(m, HEADER_KEY).expect("key header"),
                header(m, HEADER_REASON).expect("reason header"),
            )
        })
        .collect();
    assert_eq!(
        dead,
        BTreeMap::from([
            ("p-declined".to_owned(), "failed".to_owned()),
            ("p-over".to_owned(), "exhausted".to_owned()),
        ])
    );
    assert_eq!(committed(&group, &topic, 2), ends);

    admin
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .expect("drop the schema");
}
