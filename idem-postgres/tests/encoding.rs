//! A database whose encoding is not UTF8 (here `LATIN1`, database `idem_latin1` on the test
//! server, created when missing): a key it cannot hold is refused as invalid input, alone in a
//! batch, and writes nothing; a failure text it cannot hold is refused as invalid input on
//! `error`; a namespace or owner it cannot hold stays a store error (a setup problem, not one
//! message's).

mod common;

use std::time::Duration;

use idem_core::{
    AcquireOutcome, AcquireRequest, Error, FailureKind, IdempotencyStore, Lease, Namespace,
    RecordState,
};
use idem_postgres::{PostgresConfig, PostgresStore};
use tokio::sync::OnceCell;

const DATABASE: &str = "idem_latin1";
const RETENTION: Duration = Duration::from_secs(3600);

/// A migrated store on the `LATIN1` database; `None` as `common::store`.
async fn latin1_store() -> Option<PostgresStore> {
    static CREATED: OnceCell<()> = OnceCell::const_new();
    if !common::server() {
        return None;
    }
    CREATED
        .get_or_init(|| async {
            let admin = common::admin().await;
            let exists = admin
                .query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&DATABASE])
                .await
                .unwrap()
                .is_some();
            if !exists {
                // Another test process may create it at the same moment: it exists either way.
                let _ = admin
                    .batch_execute(&format!(
                        "CREATE DATABASE {DATABASE} ENCODING 'LATIN1' LC_COLLATE 'C' \
                         LC_CTYPE 'C' TEMPLATE template0"
                    ))
                    .await;
            }
        })
        .await;
    let mut pg: tokio_postgres::Config = common::url().parse().unwrap();
    pg.dbname(DATABASE);
    let config = PostgresConfig::from_pg_config(pg).with_schema(common::run_schema());
    let store = PostgresStore::connect(config).await.unwrap();
    store
        .migrate()
        .await
        .expect("migrate on the LATIN1 database");
    Some(store)
}

fn ns() -> Namespace {
    Namespace::new(format!("enc-{}", uuid::Uuid::new_v4().simple())).unwrap()
}

fn request(ns: &Namespace, id: &str, owner: &str) -> AcquireRequest {
    AcquireRequest::new(ns.key(id).unwrap(), owner).with_lease_ttl(Duration::from_secs(30))
}

fn leased(outcome: &idem_core::Result<AcquireOutcome>) -> Lease {
    match outcome {
        Ok(AcquireOutcome::Acquired { lease, .. }) => lease.clone(),
        other => panic!("expected Acquired, got {other:?}"),
    }
}

fn refused_key(outcome: &idem_core::Result<AcquireOutcome>) -> bool {
    matches!(outcome, Err(Error::InvalidInput { field: "key", reason }) if reason.contains("encoding"))
}

/// How many records the namespace holds, counted by the server.
async fn records(store: &PostgresStore, ns: &Namespace) -> i64 {
    let client = store.pool().get().await.unwrap();
    let sql = format!(
        "SELECT count(*) FROM {} WHERE namespace = $1",
        store.qualified_table()
    );
    client
        .query_one(&sql, &[&ns.as_str()])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn a_key_the_database_cannot_hold_is_invalid_input_alone() {
    let Some(store) = latin1_store().await else {
        return;
    };
    let ns = ns();
    // `é` is in LATIN1, `支` is not.
    let single = store.acquire(&request(&ns, "支付-1", "worker")).await;
    assert!(refused_key(&single), "{single:?}");
    assert_eq!(records(&store, &ns).await, 0, "nothing written");

    let batch = store
        .acquire_many(&[
            request(&ns, "café-1", "worker"),
            request(&ns, "支付-2", "worker"),
            request(&ns, "plain-3", "worker"),
        ])
        .await
        .expect("the batch is answered item by item");
    leased(&batch[0]);
    assert!(refused_key(&batch[1]), "{:?}", batch[1]);
    leased(&batch[2]);
    assert_eq!(records(&store, &ns).await, 2);
}

#[tokio::test]
async fn an_owner_the_database_cannot_hold_is_not_blamed_on_the_key() {
    let Some(store) = latin1_store().await else {
        return;
    };
    let ns = ns();
    for id in ["plain-1", "支付-1"] {
        let r = store.acquire(&request(&ns, id, "工人-1")).await;
        assert!(
            matches!(&r, Err(Error::Backend { .. })),
            "{id}: every acquire of this owner fails, so it is no one key's fault: {r:?}"
        );
    }
    // A non-ASCII owner the database holds is found innocent, and the key is refused.
    let r = store.acquire(&request(&ns, "支付-2", "ouvrière-1")).await;
    assert!(refused_key(&r), "{r:?}");
    assert_eq!(records(&store, &ns).await, 0);
}

#[tokio::test]
async fn a_failure_text_the_database_cannot_hold_is_invalid_input() {
    let Some(store) = latin1_store().await else {
        return;
    };
    let ns = ns();
    let lease = leased(&store.acquire(&request(&ns, "café-2", "worker")).await);
    let r = store
        .fail(&lease, "支払い失敗", FailureKind::Terminal, RETENTION)
        .await;
    assert!(
        matches!(&r, Err(Error::InvalidInput { field: "error", .. })),
        "{r:?}"
    );
    let other = leased(&store.acquire(&request(&ns, "café-3", "worker")).await);
    let batch = store
        .fail_many(
            &[
                idem_core::Failure::new(lease.clone(), "支払い失敗", FailureKind::Terminal),
                idem_core::Failure::new(other.clone(), "refusé", FailureKind::Terminal),
            ],
            RETENTION,
        )
        .await
        .expect("the batch is answered item by item");
    assert!(
        matches!(&batch[0], Err(Error::InvalidInput { field: "error", .. })),
        "{:?}",
        batch[0]
    );
    batch[1].as_ref().expect("a text LATIN1 holds is stored");
    let record = store.get(&lease.key).await.unwrap().unwrap();
    assert_eq!(
        record.state,
        RecordState::InProgress,
        "refused: nothing written"
    );
    // The same failure in ASCII is stored (the executor writes it so).
    store
        .fail(
            &lease,
            "\\u{652f}\\u{6255}",
            FailureKind::Terminal,
            RETENTION,
        )
        .await
        .unwrap();
}

/// The in-transaction mode answers as the executor does: a key the database cannot hold is an
/// invalid key (dead-lettered, the handler not run), and a failure text it cannot hold is
/// recorded in ASCII, its attempt counted.
#[tokio::test]
async fn the_in_transaction_mode_refuses_the_key_and_records_the_failure_in_ascii() {
    use idem_executor::{
        BrokerAction, DeadLetterReason, ExecutorConfig, ExecutorError, HandlerError, Outcome,
        RawMessage,
    };
    let Some(store) = latin1_store().await else {
        return;
    };
    let ns = ns();
    let mode = store
        .in_transaction(ExecutorConfig::new(ns.as_str()))
        .unwrap();
    let msg = |id: &str| RawMessage::new("{}").with_header("idempotency-key", id.to_owned());

    let refused = mode
        .run::<_, String, _>(&msg("支付-1"), |_, _| {
            Box::pin(async { panic!("the handler must not run for a key the store refused") })
        })
        .await;
    let Err(e @ ExecutorError::InvalidKey(_)) = &refused else {
        panic!("{refused:?}");
    };
    assert!(
        matches!(
            e.action(),
            BrokerAction::DeadLetter {
                reason: DeadLetterReason::InvalidKey,
                ..
            }
        ),
        "{e:?}"
    );

    let failed = mode
        .run::<_, String, _>(&msg("café-4"), |_, _| {
            Box::pin(async { Err(HandlerError::terminal("支払い失敗")) })
        })
        .await;
    let escaped = "\\u{652f}\\u{6255}\\u{3044}\\u{5931}\\u{6557}";
    assert!(
        matches!(&failed, Ok(Outcome::Failed { error }) if error == escaped),
        "{failed:?}"
    );
    let record = store
        .get(&ns.key("café-4").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(&record.state, RecordState::Failed { error, .. } if error == escaped),
        "{:?}",
        record.state
    );
    assert_eq!(record.attempts, 1, "the attempt is counted");
    assert_eq!(records(&store, &ns).await, 1);
}
