//! `TransactionalStore::complete_with` on PostgreSQL: the fenced completion and the handler's
//! statements in one transaction, pipelined.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::proxy::Proxy;
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Error, IdempotencyStore, Lease, LostLease, Namespace,
    RecordState, StateKind, TransactionalStore,
};
use idem_postgres::{MAX_WRITES, PgWrites, PostgresStore, param};

const RETENTION: Duration = Duration::from_secs(3600);

fn ns() -> Namespace {
    Namespace::new(format!("cw-{:08x}", rand::random::<u32>())).unwrap()
}

/// Business tables of their own in this run's schema: `ledger (entry text PRIMARY KEY, amount
/// bigint CHECK (amount <> 0), account text REFERENCES accounts)`, `accounts (id text PRIMARY
/// KEY, balance bigint)` holding `alice` with 100, and `events (token bigint)`, deliberately
/// without any constraint, so that a statement run twice shows instead of being refused.
struct Tables {
    ledger: String,
    accounts: String,
    events: String,
}

async fn tables(admin: &tokio_postgres::Client) -> Tables {
    let suffix = format!("{:08x}", rand::random::<u32>());
    let schema = common::run_schema();
    let accounts = format!("\"{schema}\".\"accounts_{suffix}\"");
    let ledger = format!("\"{schema}\".\"ledger_{suffix}\"");
    let events = format!("\"{schema}\".\"events_{suffix}\"");
    admin
        .batch_execute(&format!(
            "CREATE TABLE {accounts} (id text PRIMARY KEY, balance bigint NOT NULL);
             INSERT INTO {accounts} VALUES ('alice', 100);
             CREATE TABLE {ledger} (entry text PRIMARY KEY, amount bigint NOT NULL \
                CHECK (amount <> 0), account text REFERENCES {accounts} (id), token bigint);
             CREATE TABLE {events} (token bigint);"
        ))
        .await
        .unwrap();
    Tables {
        ledger,
        accounts,
        events,
    }
}

impl Tables {
    fn insert(&self) -> String {
        format!(
            "INSERT INTO {} (entry, amount, account, token) VALUES ($1, $2, $3, $4)",
            self.ledger
        )
    }

    /// An unconditional append to `events`.
    fn event(&self, token: i64) -> PgWrites {
        PgWrites::new().execute(
            format!("INSERT INTO {} (token) VALUES ($1)", self.events),
            [token],
        )
    }

    async fn events(&self, admin: &tokio_postgres::Client) -> i64 {
        admin
            .query_one(&format!("SELECT count(*) FROM {}", self.events), &[])
            .await
            .unwrap()
            .get(0)
    }

    fn debit(&self) -> String {
        format!(
            "UPDATE {} SET balance = balance - $1 WHERE id = $2 AND balance >= $1",
            self.accounts
        )
    }

    async fn entries(&self, admin: &tokio_postgres::Client) -> Vec<String> {
        admin
            .query(
                &format!("SELECT entry FROM {} ORDER BY entry", self.ledger),
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    async fn balance(&self, admin: &tokio_postgres::Client) -> i64 {
        admin
            .query_one(
                &format!("SELECT balance FROM {} WHERE id = 'alice'", self.accounts),
                &[],
            )
            .await
            .unwrap()
            .get(0)
    }
}

async fn acquire(store: &PostgresStore, req: &AcquireRequest) -> Lease {
    match store.acquire(req).await.unwrap() {
        AcquireOutcome::Acquired { lease, .. } => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

async fn in_progress(store: &PostgresStore, lease: &Lease) {
    let record = store.get(&lease.key).await.unwrap().unwrap();
    assert_eq!(
        (record.state, record.token),
        (RecordState::InProgress, lease.token),
        "the record must still be the lease's, in progress"
    );
}

/// The writes of a debit of `amount` from alice with its ledger entry.
fn debit(t: &Tables, entry: &str, amount: i64, token: i64) -> PgWrites {
    PgWrites::new()
        .execute(t.debit(), (amount, "alice"))
        .expect_rows(1)
        .execute(t.insert(), (entry.to_owned(), -amount, "alice", token))
}

#[tokio::test]
async fn statements_commit_with_the_completion_and_a_resend_applies_nothing_again() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let t = tables(&admin).await;
    let lease = acquire(&store, &AcquireRequest::new(ns().key("pay").unwrap(), "w")).await;
    let token = lease.token.get() as i64;
    let writes = t
        .event(token)
        .execute(t.insert(), ("e1", 10i64, "alice", token))
        .execute(
            t.insert(),
            vec![param("e2"), param(20i64), param("alice"), param(token)],
        );
    store
        .complete_with(&lease, Bytes::from_static(b"ok"), RETENTION, writes.clone())
        .await
        .unwrap();
    assert_eq!(t.entries(&admin).await, ["e1", "e2"]);
    let record = store.get(&lease.key).await.unwrap().unwrap();
    assert_eq!(
        record.state,
        RecordState::Completed {
            result: Bytes::from_static(b"ok")
        }
    );

    assert_eq!(t.events(&admin).await, 1);

    // The same completion re-sent (a lost reply): Ok, and the statements do not run again.
    store
        .complete_with(&lease, Bytes::from_static(b"ok"), RETENTION, t.event(token))
        .await
        .unwrap();
    assert_eq!(t.events(&admin).await, 1);
    store
        .complete_with(&lease, Bytes::from_static(b"ok"), RETENTION, writes.clone())
        .await
        .unwrap();
    assert_eq!(t.entries(&admin).await, ["e1", "e2"]);
    assert_eq!(t.events(&admin).await, 1);

    // Other result bytes: refused, and still nothing run.
    let r = store
        .complete_with(
            &lease,
            Bytes::from_static(b"other"),
            RETENTION,
            t.event(token),
        )
        .await;
    assert!(
        matches!(
            r,
            Err(Error::LeaseLost {
                why: LostLease::NotInProgress {
                    state: StateKind::Completed
                },
                ..
            })
        ),
        "{r:?}"
    );
    assert_eq!(t.entries(&admin).await, ["e1", "e2"]);
    assert_eq!(t.events(&admin).await, 1);
}

#[tokio::test]
async fn a_zombie_writes_nothing() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let t = tables(&admin).await;
    let key = ns().key("zombie").unwrap();
    let zombie = acquire(
        &store,
        &AcquireRequest::new(key.clone(), "a").with_lease_ttl(Duration::from_millis(50)),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(80)).await;
    let holder = acquire(&store, &AcquireRequest::new(key, "b")).await;
    // Unconditional writes (their COMMIT is pipelined) and conditional ones (COMMIT after the
    // counts are read): refused either way.
    for writes in [
        t.event(zombie.token.get() as i64),
        debit(&t, "zombie", 10, zombie.token.get() as i64),
    ] {
        let r = store
            .complete_with(&zombie, Bytes::from_static(b"z"), RETENTION, writes)
            .await;
        assert!(
            matches!(&r, Err(Error::LeaseLost { why: LostLease::Superseded { current }, .. }) if *current == holder.token),
            "{r:?}"
        );
    }
    assert_eq!(t.events(&admin).await, 0);
    assert_eq!(t.entries(&admin).await, Vec::<String>::new());
    assert_eq!(t.balance(&admin).await, 100);
    in_progress(&store, &holder).await;
}

/// A statement the database refuses (constraints, data) or whose row count is not the expected
/// one: `EffectRefused` with its index, nothing written, the record still in progress.
#[tokio::test]
async fn refused_statements_roll_everything_back() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let t = tables(&admin).await;
    admin
        .batch_execute(&format!(
            "INSERT INTO {} (entry, amount, account) VALUES ('taken', 1, 'alice')",
            t.ledger
        ))
        .await
        .unwrap();
    let lease = acquire(&store, &AcquireRequest::new(ns().key("r").unwrap(), "w")).await;
    let first = || PgWrites::new().execute(t.insert(), ("new", 5i64, "alice", 0i64));
    // Over the most a btree index row holds, even compressed: class 54, program limit.
    let huge_entry: String = (0..300)
        .map(|_| uuid::Uuid::new_v4().simple().to_string())
        .collect();
    let cases: Vec<(&str, PgWrites, usize, &str)> = vec![
        (
            "program limit",
            first().execute(t.insert(), (huge_entry, 5i64, "alice", 0i64)),
            1,
            "54000",
        ),
        (
            "unique",
            first().execute(t.insert(), ("taken", 5i64, "alice", 0i64)),
            1,
            "23505",
        ),
        (
            "check",
            first().execute(t.insert(), ("zero", 0i64, "alice", 0i64)),
            1,
            "23514",
        ),
        (
            "foreign key",
            first().execute(t.insert(), ("fk", 5i64, "nobody", 0i64)),
            1,
            "23503",
        ),
        (
            "data",
            first().execute(
                format!("UPDATE {} SET balance = balance * $1", t.accounts),
                [i64::MAX],
            ),
            1,
            "22003",
        ),
        (
            "expect_rows",
            first()
                .execute(t.debit(), (1_000i64, "alice"))
                .expect_rows(1),
            1,
            "expect_rows",
        ),
        (
            "expect_rows on the first",
            debit(&t, "x", 1_000, 0),
            0,
            "affected 0",
        ),
    ];
    for (name, writes, index, says) in cases {
        let r = store
            .complete_with(&lease, Bytes::from_static(b"x"), RETENTION, writes)
            .await;
        match &r {
            Err(Error::EffectRefused {
                index: i, reason, ..
            }) => {
                assert_eq!(*i, index, "{name}: {r:?}");
                assert!(reason.contains(says), "{name}: {reason}");
            }
            other => panic!("{name}: expected EffectRefused, got {other:?}"),
        }
        assert_eq!(t.entries(&admin).await, ["taken"], "{name}");
        assert_eq!(t.balance(&admin).await, 100, "{name}");
        in_progress(&store, &lease).await;
    }

    // The lease is still held: a good completion goes through.
    store
        .complete_with(
            &lease,
            Bytes::from_static(b"paid"),
            RETENTION,
            debit(&t, "paid", 30, lease.token.get() as i64),
        )
        .await
        .unwrap();
    assert_eq!(t.entries(&admin).await, ["paid", "taken"]);
    assert_eq!(t.balance(&admin).await, 70);
}

/// A deferred constraint is checked at COMMIT: refused with the index `len()`.
#[tokio::test]
async fn a_deferred_constraint_is_refused_at_commit() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let table = format!(
        "\"{}\".\"deferred_{:08x}\"",
        common::run_schema(),
        rand::random::<u32>()
    );
    admin
        .batch_execute(&format!(
            "CREATE TABLE {table} (id text, CONSTRAINT one UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)"
        ))
        .await
        .unwrap();
    let lease = acquire(&store, &AcquireRequest::new(ns().key("d").unwrap(), "w")).await;
    let insert = format!("INSERT INTO {table} (id) VALUES ($1)");
    let writes = PgWrites::new()
        .execute(insert.clone(), ["a"])
        .execute(insert, ["a"]);
    let r = store
        .complete_with(&lease, Bytes::from_static(b"x"), RETENTION, writes)
        .await;
    assert!(
        matches!(&r, Err(Error::EffectRefused { index: 2, reason, .. }) if reason.starts_with("at COMMIT") && reason.contains("23505")),
        "{r:?}"
    );
    let rows: i64 = admin
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0);
    in_progress(&store, &lease).await;
}

/// Writes the store cannot take: `InvalidInput` on `writes`; those the client can judge alone
/// are refused before anything is sent, those that need the statement's shape after preparing
/// it, before the transaction begins. Nothing written, the record still in progress.
#[tokio::test]
async fn bad_writes_are_invalid_input_and_write_nothing() {
    let Some((store, proxy)) = common::proxied_store(|c| c.with_pool_size(1)).await else {
        return;
    };
    let admin = common::admin().await;
    let t = tables(&admin).await;
    let lease = acquire(&store, &AcquireRequest::new(ns().key("bad").unwrap(), "w")).await;
    let ok = || PgWrites::new().execute(t.insert(), ("e", 5i64, "alice", 0i64));
    let too_many = (0..MAX_WRITES).fold(ok(), |w, i| {
        w.execute(t.insert(), (format!("e{i}"), 5i64, "alice", 0i64))
    });
    let unsent: Vec<(&str, PgWrites)> = vec![
        ("too many", too_many),
        ("COMMIT", ok().execute("COMMIT", ())),
        (
            "ROLLBACK after a comment",
            ok().execute("/* undo */ rollback", ()),
        ),
        ("empty", ok().execute("  ", ())),
        ("only empty statements", ok().execute(" ; ;", ())),
        // PostgreSQL drops the empty statement: this one is a COMMIT, and the writes after it
        // would run outside the fenced transaction.
        (
            "COMMIT after an empty statement",
            ok().execute(";COMMIT", ())
                .execute(t.insert(), ("after", 5i64, "alice", 0i64)),
        ),
        (
            "ROLLBACK after empty statements",
            ok().execute("/*x*/;;ROLLBACK", ()),
        ),
        // Session state would stay on the pooled connection for every later call.
        (
            "session setting",
            ok().execute("SET default_transaction_read_only = on", ()),
        ),
        ("DEALLOCATE", ok().execute("DEALLOCATE ALL", ())),
        ("PREPARE", ok().execute("PREPARE q AS SELECT 1", ())),
        ("NUL", ok().execute("SELECT '\0'", ())),
        ("expect_rows first", PgWrites::new().expect_rows(1)),
    ];
    for (name, writes) in unsent {
        let before = proxy.counts();
        let r = store
            .complete_with(&lease, Bytes::from_static(b"x"), RETENTION, writes)
            .await;
        assert!(
            matches!(
                r,
                Err(Error::InvalidInput {
                    field: "writes",
                    ..
                })
            ),
            "{name}: {r:?}"
        );
        assert_eq!(
            proxy.counts(),
            before,
            "{name}: refused before anything is sent"
        );
    }
    let prepared: Vec<(&str, PgWrites, &str)> = vec![
        (
            "parameter count",
            ok().execute(t.insert(), ("e", 5i64)),
            "takes 4 parameters, 2 given",
        ),
        (
            "parameter type",
            ok().execute(t.insert(), ("e", "five", "alice", 0i64)),
            "parameter $2",
        ),
        (
            "syntax",
            ok().execute("INSERT INTO nowhere VALUE ($1)", [1i64]),
            "42601",
        ),
        // (An unknown table or schema is `NotSetUp`: see the next test.)
        (
            "unknown column",
            ok().execute(format!("UPDATE {} SET no_such_column = 1", t.ledger), ()),
            "42703",
        ),
        (
            "unknown function",
            ok().execute("SELECT no_such_function_here()", ()),
            "42883",
        ),
        (
            "two statements in one text",
            ok().execute("SELECT 1; COMMIT", ()),
            "does not prepare",
        ),
    ];
    for (name, writes, says) in prepared {
        let r = store
            .complete_with(&lease, Bytes::from_static(b"x"), RETENTION, writes)
            .await;
        assert!(
            matches!(&r, Err(Error::InvalidInput { field: "writes", reason }) if reason.contains(says)),
            "{name}: {r:?}"
        );
    }
    // The core's `complete` checks come first.
    let r = store
        .complete_with(
            &lease,
            Bytes::from(vec![0u8; store.limits().max_result_len + 1]),
            RETENTION,
            ok(),
        )
        .await;
    assert!(matches!(r, Err(Error::ResultTooLarge { .. })), "{r:?}");
    assert_eq!(t.entries(&admin).await, Vec::<String>::new());
    in_progress(&store, &lease).await;
    // And the connection is still good for a real completion.
    store
        .complete_with(&lease, Bytes::from_static(b"x"), RETENTION, ok())
        .await
        .unwrap();
    assert_eq!(t.entries(&admin).await, ["e"]);
}

/// A statement naming a table or schema that does not exist (a consumer deployed before the
/// migration that creates its table) is `NotSetUp`, not invalid input: nothing is written, the
/// record stays in progress, and the same writes go through once the table exists.
#[tokio::test]
async fn a_missing_table_or_schema_is_not_set_up_and_writes_nothing() {
    let Some(store) =
        common::store_with(common::config(common::run_schema()).with_pool_size(1)).await
    else {
        return;
    };
    let admin = common::admin().await;
    let t = tables(&admin).await;
    let lease = acquire(
        &store,
        &AcquireRequest::new(ns().key("later").unwrap(), "w"),
    )
    .await;
    let suffix = format!("{:08x}", rand::random::<u32>());
    let schema = common::run_schema();
    let later = format!("later_{suffix}");
    let missing_schema = format!("no_schema_{suffix}");
    let ok = || PgWrites::new().execute(t.insert(), ("e", 5i64, "alice", 0i64));
    let into_later = format!("INSERT INTO \"{schema}\".\"{later}\" (token) VALUES ($1)");
    let cases: Vec<(&str, PgWrites, &str, &str)> = vec![
        (
            "missing table",
            ok().execute(into_later.clone(), [1i64]),
            &later,
            "42P01",
        ),
        // PostgreSQL answers 42P01 for a table in a missing schema too.
        (
            "missing schema",
            ok().execute(
                format!("INSERT INTO \"{missing_schema}\".\"ledger\" (token) VALUES ($1)"),
                [1i64],
            ),
            &missing_schema,
            "42P01",
        ),
        (
            "function in a missing schema",
            ok().execute(format!("SELECT \"{missing_schema}\".f($1)"), [1i64]),
            &missing_schema,
            "3F000",
        ),
    ];
    for (name, writes, names, code) in cases {
        let r = store
            .complete_with(&lease, Bytes::from_static(b"x"), RETENTION, writes)
            .await;
        match &r {
            Err(e @ Error::NotSetUp { missing, .. }) => {
                assert!(missing.contains(names), "{name}: {e}");
                assert!(missing.contains("statement 1"), "{name}: {e}");
                assert!(missing.contains(code), "{name}: {e}");
            }
            other => panic!("{name}: expected NotSetUp, got {other:?}"),
        }
        assert_eq!(t.entries(&admin).await, Vec::<String>::new(), "{name}");
        in_progress(&store, &lease).await;
    }
    // The migration runs: the same writes now commit with the completion.
    admin
        .batch_execute(&format!(
            "CREATE TABLE \"{schema}\".\"{later}\" (token bigint)"
        ))
        .await
        .unwrap();
    store
        .complete_with(
            &lease,
            Bytes::from_static(b"x"),
            RETENTION,
            ok().execute(into_later, [1i64]),
        )
        .await
        .unwrap();
    assert_eq!(t.entries(&admin).await, ["e"]);
    let rows: i64 = admin
        .query_one(
            &format!("SELECT count(*) FROM \"{schema}\".\"{later}\""),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1);
}

/// Transaction characteristics the writes cannot set: the completion's statement runs first in
/// the transaction, and PostgreSQL takes an isolation level, `[NOT] DEFERRABLE` or a snapshot
/// only before a transaction's first query (`25001` after it). Refused before anything is sent;
/// nothing written, the record still in progress. `READ WRITE` (a no-op: the completion wrote)
/// and `READ ONLY` (the statements after it may not write) do run.
#[tokio::test]
async fn transaction_characteristics_the_completion_precedes_are_refused_before_sending() {
    let Some((store, proxy)) = common::proxied_store(|c| c.with_pool_size(1)).await else {
        return;
    };
    let admin = common::admin().await;
    let t = tables(&admin).await;
    let lease = acquire(&store, &AcquireRequest::new(ns().key("iso").unwrap(), "w")).await;
    let ok = || PgWrites::new().execute(t.insert(), ("e", 5i64, "alice", 0i64));
    for (sql, says) in [
        (
            "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
            "ISOLATION LEVEL",
        ),
        // Even the level in force: the server takes that one as a no-op, but which level is in
        // force depends on the server's `default_transaction_isolation`.
        (
            "set transaction isolation level read committed",
            "ISOLATION LEVEL",
        ),
        (
            "/* c */ SET TRANSACTION READ ONLY, ISOLATION LEVEL REPEATABLE READ",
            "ISOLATION LEVEL",
        ),
        ("SET TRANSACTION READ ONLY DEFERRABLE", "DEFERRABLE"),
        ("SET TRANSACTION NOT DEFERRABLE", "DEFERRABLE"),
        ("SET TRANSACTION SNAPSHOT '00000003-0000001B-1'", "SNAPSHOT"),
        (
            "SET LOCAL TRANSACTION ISOLATION LEVEL SERIALIZABLE",
            "ISOLATION LEVEL",
        ),
        (
            "SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE",
            "ISOLATION LEVEL",
        ),
        (
            "SET LOCAL transaction_isolation = 'serializable'",
            "transaction_isolation",
        ),
        (
            "set local transaction_deferrable to on",
            "transaction_deferrable",
        ),
        // The session's defaults: refused as any session setting.
        (
            "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE",
            "changes the session",
        ),
    ] {
        let before = proxy.counts();
        let r = store
            .complete_with(
                &lease,
                Bytes::from_static(b"x"),
                RETENTION,
                ok().execute(sql, ()),
            )
            .await;
        match &r {
            Err(Error::InvalidInput {
                field: "writes",
                reason,
            }) => {
                assert!(reason.contains(says), "{sql}: {reason}");
                assert!(reason.contains("statement 1"), "{sql}: {reason}");
            }
            other => panic!("{sql}: expected InvalidInput on writes, got {other:?}"),
        }
        assert_eq!(
            proxy.counts(),
            before,
            "{sql}: refused before anything is sent"
        );
    }
    assert_eq!(t.entries(&admin).await, Vec::<String>::new());
    in_progress(&store, &lease).await;

    // What can be set after the completion runs: READ WRITE (the transaction already wrote) and
    // READ ONLY (for the statements after it).
    store
        .complete_with(
            &lease,
            Bytes::from_static(b"x"),
            RETENTION,
            ok().execute("SET TRANSACTION READ WRITE", ())
                .execute("SET TRANSACTION READ ONLY", ())
                .execute(format!("SELECT count(*) FROM {}", t.ledger), ()),
        )
        .await
        .unwrap();
    assert_eq!(t.entries(&admin).await, ["e"]);
}

/// A statement that cannot run inside the writes' transaction, in a way the text does not show
/// (`25001`: a transaction setting changed by a function, `VACUUM`), is `InvalidInput` on
/// `writes` from the server's answer; a write after the writes made the transaction read-only
/// (`25006`) is `Backend` naming the statement. Nothing written, the record still in progress.
#[tokio::test]
async fn statements_that_cannot_run_in_the_transaction_write_nothing() {
    let Some(store) =
        common::store_with(common::config(common::run_schema()).with_pool_size(1)).await
    else {
        return;
    };
    let admin = common::admin().await;
    let t = tables(&admin).await;
    let lease = acquire(&store, &AcquireRequest::new(ns().key("tx").unwrap(), "w")).await;
    let ok = || PgWrites::new().execute(t.insert(), ("e", 5i64, "alice", 0i64));
    for (name, writes) in [
        (
            "isolation level by a function",
            ok().execute(
                // A level other than the one in force (the same one is a no-op).
                "SELECT set_config('transaction_isolation', \
                 CASE current_setting('transaction_isolation') \
                 WHEN 'serializable' THEN 'repeatable read' ELSE 'serializable' END, true)",
                (),
            ),
        ),
        ("VACUUM", ok().execute(format!("VACUUM {}", t.events), ())),
    ] {
        let r = store
            .complete_with(&lease, Bytes::from_static(b"x"), RETENTION, writes)
            .await;
        assert!(
            matches!(&r, Err(Error::InvalidInput { field: "writes", reason }) if reason.contains("statement 1") && reason.contains("25001")),
            "{name}: {r:?}"
        );
        assert_eq!(t.entries(&admin).await, Vec::<String>::new(), "{name}");
        in_progress(&store, &lease).await;
    }
    let r = store
        .complete_with(
            &lease,
            Bytes::from_static(b"x"),
            RETENTION,
            ok().execute("SET TRANSACTION READ ONLY", ())
                .execute(t.insert(), ("ro", 5i64, "alice", 0i64)),
        )
        .await;
    assert!(
        matches!(&r, Err(e @ Error::Backend { .. }) if e.to_string().contains("statement 2") && e.to_string().contains("25006")),
        "{r:?}"
    );
    assert_eq!(t.entries(&admin).await, Vec::<String>::new());
    in_progress(&store, &lease).await;
}

/// The store's role lacks a privilege a statement needs: `Backend` naming the statement and the
/// server's `42501`, whether PostgreSQL checks it when the statement is prepared (`USAGE` on a
/// schema) or when it runs in the transaction (`INSERT` on a table). Nothing written, the record
/// still in progress; once granted, the same writes commit.
#[tokio::test]
async fn a_missing_privilege_is_backend_and_writes_nothing() {
    let Some(_) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let t = tables(&admin).await;
    let schema = common::run_schema();
    let role = format!("idem_t_role_{:08x}", rand::random::<u32>());
    let private = common::fresh_schema();
    admin
        .batch_execute(&format!(
            "CREATE ROLE \"{role}\" NOLOGIN;
             GRANT USAGE ON SCHEMA \"{schema}\" TO \"{role}\";
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA \"{schema}\" TO \"{role}\";
             GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA \"{schema}\" TO \"{role}\";
             REVOKE INSERT ON {ledger} FROM \"{role}\";
             CREATE SCHEMA \"{private}\";
             CREATE TABLE \"{private}\".\"audit\" (token bigint);",
            ledger = t.ledger
        ))
        .await
        .unwrap();
    // The store's connections act as that role (`SET ROLE` at connect).
    let mut pg: idem_postgres::tokio_postgres::Config = common::url().parse().unwrap();
    pg.options(format!("-c role={role}"));
    let store = PostgresStore::connect(
        idem_postgres::PostgresConfig::from_pg_config(pg)
            .with_schema(schema)
            .with_pool_size(1),
    )
    .await
    .unwrap();
    let lease = acquire(&store, &AcquireRequest::new(ns().key("p").unwrap(), "w")).await;
    let ok = || t.event(1);
    let into_audit = format!("INSERT INTO \"{private}\".\"audit\" (token) VALUES ($1)");
    for (name, writes, says) in [
        (
            "USAGE on a schema, checked at prepare",
            ok().execute(into_audit.clone(), [1i64]),
            "permission denied for schema",
        ),
        (
            "INSERT on a table, checked in the transaction",
            ok().execute(t.insert(), ("e", 5i64, "alice", 0i64)),
            "permission denied for table",
        ),
    ] {
        let r = store
            .complete_with(&lease, Bytes::from_static(b"x"), RETENTION, writes)
            .await;
        match &r {
            Err(e @ Error::Backend { .. }) => {
                let text = e.to_string();
                assert!(text.contains("statement 1"), "{name}: {text}");
                assert!(text.contains("42501"), "{name}: {text}");
                assert!(text.contains(says), "{name}: {text}");
            }
            other => panic!("{name}: expected Backend, got {other:?}"),
        }
        assert_eq!(t.events(&admin).await, 0, "{name}");
        assert_eq!(t.entries(&admin).await, Vec::<String>::new(), "{name}");
        in_progress(&store, &lease).await;
    }
    // Granted: the same writes commit with the completion.
    admin
        .batch_execute(&format!(
            "GRANT INSERT ON {} TO \"{role}\"; GRANT USAGE ON SCHEMA \"{private}\" TO \"{role}\";
             GRANT INSERT ON \"{private}\".\"audit\" TO \"{role}\";",
            t.ledger
        ))
        .await
        .unwrap();
    store
        .complete_with(
            &lease,
            Bytes::from_static(b"x"),
            RETENTION,
            ok().execute(t.insert(), ("e", 5i64, "alice", 0i64))
                .execute(into_audit, [1i64]),
        )
        .await
        .unwrap();
    assert_eq!(t.entries(&admin).await, ["e"]);
    drop(store);
    admin
        .batch_execute(&format!(
            "DROP SCHEMA \"{private}\" CASCADE; DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\";"
        ))
        .await
        .unwrap();
}

/// Lock and statement timeouts (and, the same way, serialization failures and deadlocks) are
/// retryable, and roll everything back.
#[tokio::test]
async fn a_call_its_caller_gives_up_on_leaves_no_transaction_open_in_the_pool() {
    // One pooled connection, so the next calls get the one the abandoned call used.
    let Some(store) =
        common::store_with(common::config(common::run_schema()).with_pool_size(1)).await
    else {
        return;
    };
    let observer = common::store_with(common::config(common::run_schema()))
        .await
        .expect("a second store");
    let admin = common::admin().await;
    let t = tables(&admin).await;
    let ns = ns();
    let a = acquire(&store, &AcquireRequest::new(ns.key("a").unwrap(), "w")).await;
    let b = acquire(&store, &AcquireRequest::new(ns.key("b").unwrap(), "w")).await;

    // A condition makes the call wait for the counts with its transaction open (COMMIT goes
    // only once they are read); the caller gives up while it waits.
    let writes = PgWrites::new()
        .execute(t.insert(), ("given-up", 1i64, "alice", 0i64))
        .expect_rows(5)
        .execute("SELECT pg_sleep(1)", ());
    let call = store.complete_with(&a, Bytes::from_static(b"a"), RETENTION, writes);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), call)
            .await
            .is_err(),
        "the call was to be given up on"
    );

    // The next call on the pool's connection commits on its own, as another connection sees.
    store
        .complete(&b, Bytes::from_static(b"b"), RETENTION)
        .await
        .unwrap();
    let seen = observer.get(&b.key).await.unwrap().unwrap();
    assert!(
        matches!(seen.state, RecordState::Completed { .. }),
        "a completion that answered Ok is not committed: {:?}",
        seen.state
    );
    let seen = observer.get(&a.key).await.unwrap().unwrap();
    assert_eq!(
        seen.state,
        RecordState::InProgress,
        "the given-up call wrote"
    );
    let entries: i64 = admin
        .query_one(
            &format!("SELECT count(*) FROM {} WHERE entry = 'given-up'", t.ledger),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(entries, 0, "the refused condition's write was committed");
}

#[tokio::test]
async fn timeouts_are_unavailable_and_roll_back() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let t = tables(&admin).await;
    let lease = acquire(&store, &AcquireRequest::new(ns().key("t").unwrap(), "w")).await;

    // The accounts row is locked by another transaction: the debit waits 100 ms, then 55P03.
    let mut other = tokio_postgres::connect(&common::url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(other.1);
    let locker = other.0.transaction().await.unwrap();
    locker
        .execute(
            &format!("SELECT 1 FROM {} WHERE id = 'alice' FOR UPDATE", t.accounts),
            &[],
        )
        .await
        .unwrap();
    // (The insert's foreign key check waits on that lock too.)
    let writes = PgWrites::new()
        .execute("SELECT set_config('lock_timeout', '100', true)", ())
        .execute(t.insert(), ("locked", 5i64, "alice", 0i64))
        .execute(t.debit(), (5i64, "alice"));
    let r = store
        .complete_with(&lease, Bytes::from_static(b"x"), RETENTION, writes)
        .await;
    assert!(
        matches!(&r, Err(e @ Error::Unavailable { .. }) if e.to_string().contains("lock timeout")),
        "{r:?}"
    );
    locker.rollback().await.unwrap();

    let writes = PgWrites::new()
        .execute(t.insert(), ("slow", 5i64, "alice", 0i64))
        .execute("SELECT set_config('statement_timeout', '50', true)", ())
        .execute("SELECT pg_sleep(1)", ());
    let r = store
        .complete_with(&lease, Bytes::from_static(b"x"), RETENTION, writes)
        .await;
    assert!(
        matches!(&r, Err(e @ Error::Unavailable { .. }) if e.to_string().contains("statement timeout")),
        "{r:?}"
    );
    assert_eq!(t.entries(&admin).await, Vec::<String>::new());
    in_progress(&store, &lease).await;
    drop(other.0);
}

/// Concurrent re-sends of one completion (a client retrying while its first send still runs):
/// one applies, the others wait on the record's row lock and are answered `Ok` by the replay
/// rule; the statements run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_resends_apply_once() {
    let Some(store) = common::store().await else {
        return;
    };
    let admin = common::admin().await;
    let t = tables(&admin).await;
    let lease = acquire(&store, &AcquireRequest::new(ns().key("c").unwrap(), "w")).await;
    let writes = t.event(lease.token.get() as i64);
    let store = Arc::new(store);
    let sends: Vec<_> = (0..8)
        .map(|_| {
            let (store, lease, writes) = (store.clone(), lease.clone(), writes.clone());
            tokio::spawn(async move {
                store
                    .complete_with(&lease, Bytes::from_static(b"done"), RETENTION, writes)
                    .await
            })
        })
        .collect();
    for s in sends {
        s.await.unwrap().unwrap();
    }
    assert_eq!(t.events(&admin).await, 1);
}

/// Sends one `complete_with` of `writes` on a fresh key; returns the requests and flights it
/// cost.
async fn cost(
    store: &PostgresStore,
    proxy: &Proxy,
    key: idem_core::IdempotencyKey,
    writes: impl FnOnce(i64) -> PgWrites,
) -> (u64, u64) {
    let lease = acquire(store, &AcquireRequest::new(key, "w")).await;
    let (requests, flights) = (proxy.counters.requests(), proxy.flights());
    store
        .complete_with(
            &lease,
            Bytes::from_static(b"ok"),
            RETENTION,
            writes(lease.token.get() as i64),
        )
        .await
        .unwrap();
    (
        proxy.counters.requests() - requests,
        proxy.flights() - flights,
    )
}

/// What a transactional completion costs on the wire, counted by the proxy: requests (each
/// `Sync` or simple `Query`, what the server answers) and flights (network round trips).
#[tokio::test]
async fn one_round_trip_counted_on_the_wire() {
    let Some((store, proxy)) = common::proxied_store(|c| c.with_pool_size(1)).await else {
        return;
    };
    let admin = common::admin().await;
    let t = tables(&admin).await;
    let ns = ns();
    let key = |k: &str| ns.key(k).unwrap();
    let two = |token: i64| {
        PgWrites::new()
            .execute(t.insert(), (format!("a{token}"), 1i64, "alice", token))
            .execute(t.insert(), (format!("b{token}"), 1i64, "alice", token))
    };
    let conditional = |token: i64| debit(&t, &format!("c{token}"), 1, token);

    // First time on the connection: the texts are prepared first (one flight for all of them).
    let first = cost(&store, &proxy, key("k1"), two).await;
    // Prepared: BEGIN, completion, guard, 2 statements, COMMIT = 6 requests in one flight.
    let steady = cost(&store, &proxy, key("k2"), two).await;
    // A row-count condition: COMMIT waits for the counts, a second flight.
    let _ = cost(&store, &proxy, key("k3"), conditional).await;
    let with_condition = cost(&store, &proxy, key("k4"), conditional).await;
    // With no statements it is a plain `complete`: one request, one flight (once prepared).
    let _ = cost(&store, &proxy, key("k5"), |_| PgWrites::new()).await;
    let none = cost(&store, &proxy, key("k6"), |_| PgWrites::new()).await;
    println!(
        "complete_with on the wire (requests, flights): first use {first:?}, two statements \
         {steady:?}, with expect_rows {with_condition:?}, no statements {none:?}"
    );
    assert_eq!(steady, (6, 1));
    assert_eq!(first.1, 2);
    assert_eq!(with_condition, (6, 2));
    assert_eq!(none, (1, 1));
}
