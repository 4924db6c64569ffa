//! The shared conformance suite (C01-C24 and C26) against PostgreSQL.
//!
//! The store under test connects through its own counting proxy (`common::proxy`), so C23 counts
//! the round trips of this store instance only: every extended-protocol `Sync` and every simple
//! `Query` it sent, re-sends included.

mod common;

use std::sync::Arc;
use std::time::Duration;

use idem_conformance::{Config, Harness};
use idem_core::DynStore;
use idem_postgres::{PostgresConfig, PostgresStore};

async fn harness() -> Option<Harness> {
    let (store, proxy) = common::proxied_store(|config| config).await?;
    let counters = proxy.counters.clone();
    Some(
        Harness::new(Arc::new(store), Config::real_time())
            .with_round_trips(move || counters.requests())
            .with_unreachable(|| async {
                // Nothing listens on port 1.
                let config = PostgresConfig::new("postgres://postgres@127.0.0.1:1/test")?
                    .with_connect_timeout(Duration::from_secs(1))
                    .with_pool_wait_timeout(Duration::from_secs(1));
                Ok(Arc::new(PostgresStore::connect(config).await?) as DynStore)
            })
            .with_silent(|addr| async move {
                // The default timeouts, as a user gets them.
                let config = PostgresConfig::new(&format!("postgres://postgres@{addr}/test"))?;
                Ok(Arc::new(PostgresStore::connect(config).await?) as DynStore)
            }),
    )
}

idem_conformance::conformance_tests!(harness);

/// C25 (transactional effects) on `complete_with` with `PgWrites`.
mod transactional {
    use async_trait::async_trait;
    use idem_conformance::effects::{EffectProbe, c25_transactional_effects};
    use idem_postgres::{MAX_WRITES, PgWrites};

    use super::*;

    /// Effects are rows of a table of their own: `(name text PRIMARY KEY, value bytea)`.
    struct Probe {
        table: String,
        admin: tokio_postgres::Client,
    }

    impl Probe {
        async fn new() -> Self {
            let admin = common::admin().await;
            let table = format!(
                "\"{}\".\"c25_{:08x}\"",
                common::run_schema(),
                rand::random::<u32>()
            );
            admin
                .batch_execute(&format!(
                    "CREATE TABLE {table} (name text PRIMARY KEY, value bytea NOT NULL)"
                ))
                .await
                .unwrap();
            Self { table, admin }
        }

        fn upsert(&self) -> String {
            format!(
                "INSERT INTO {} (name, value) VALUES ($1, $2) \
                 ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                self.table
            )
        }
    }

    #[async_trait]
    impl EffectProbe<PostgresStore> for Probe {
        fn set(&self, name: &str, value: &[u8]) -> PgWrites {
            PgWrites::new().execute(self.upsert(), (name.to_owned(), value.to_vec()))
        }

        fn refused(&self, name: &str) -> Option<PgWrites> {
            // The effect, then a condition that fails: a row that was never written must be
            // updated exactly once.
            Some(
                self.set(name, b"refused")
                    .execute(
                        format!("UPDATE {} SET value = value WHERE name = $1", self.table),
                        [format!("{name}:never-written")],
                    )
                    .expect_rows(1),
            )
        }

        fn too_many(&self, name: &str) -> Option<PgWrites> {
            let writes = (0..MAX_WRITES).fold(PgWrites::new(), |w, i| {
                w.execute(self.upsert(), (format!("{name}:{i}"), Vec::<u8>::new()))
            });
            Some(writes.execute(self.upsert(), (name.to_owned(), b"too many".to_vec())))
        }

        async fn read(&self, name: &str) -> Option<Vec<u8>> {
            self.admin
                .query_opt(
                    &format!("SELECT value FROM {} WHERE name = $1", self.table),
                    &[&name],
                )
                .await
                .unwrap()
                .map(|row| row.get(0))
        }
    }

    #[tokio::test]
    async fn c25_transactional_effects_system_clock() {
        let Some(store) = common::store().await else {
            return;
        };
        let h = Harness::new(Arc::new(store.clone()), Config::real_time());
        c25_transactional_effects(&h, &store, &Probe::new().await).await;
    }
}
