//! [`PostgresStore::drop_namespace`]: removes every record of a namespace.

use deadpool_postgres::Object;
use idem_core::{Error, Namespace, Result};

use crate::error::{STORE, is_connection_error, map_store_pg};
use crate::store::PostgresStore;

/// Rows one statement of [`PostgresStore::drop_namespace`] deletes.
const DROP_BATCH: i64 = 10_000;

impl PostgresStore {
    /// Removes every record of `namespace` and returns how many it removed: a clean slate for a
    /// throwaway namespace (tests, demos, a replay environment). The SQL equivalent of
    /// `DELETE FROM <table> WHERE namespace = $1`, run in batches of 10,000 rows (each its own
    /// statement, within [`statement_timeout`](crate::PostgresConfig::statement_timeout)), the
    /// namespace bound as a parameter.
    ///
    /// **Not for a namespace in use.** Everything the store knew about its keys goes: stored
    /// results (a duplicate delivered afterwards runs the handler again), attempt counts and
    /// exhausted or terminally failed keys (a poison message runs again), and leases (a worker
    /// holding one gets [`LeaseLost`](idem_core::Error::LeaseLost) with the record gone when it
    /// finishes). Fencing tokens stay strictly increasing: they come from the table's sequence,
    /// which is left as it is. A key held by an open [in-transaction](crate::transactional)
    /// handler is waited for (its row is locked), up to the statement timeout.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_postgres::PostgresStore) -> idem_core::Result<()> {
    /// use idem_core::Namespace;
    ///
    /// let removed = store.drop_namespace(&Namespace::new("demo-payments")?).await?;
    /// println!("{removed} records removed");
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As the other operations ([`Error::Unavailable`], [`Error::NotSetUp`], ...). Batches
    /// already deleted stay deleted; calling again removes the rest.
    pub async fn drop_namespace(&self, namespace: &Namespace) -> Result<u64> {
        let sql = format!(
            "DELETE FROM {t} t WHERE t.ctid IN (\
                SELECT d.ctid FROM {t} d WHERE d.namespace = $1::text LIMIT $2::bigint)",
            t = self.qualified_table()
        );
        let timeout = self.inner.op_timeout;
        let mut removed = 0;
        loop {
            let client = self.conn().await?;
            let run = async {
                let prepared = client.prepare_cached(&sql).await?;
                client
                    .execute(&prepared, &[&namespace.as_str(), &DROP_BATCH])
                    .await
            };
            let deleted = match tokio::time::timeout(timeout, run).await {
                Ok(Ok(n)) => n,
                Ok(Err(e)) => {
                    if is_connection_error(&e) {
                        drop(Object::take(client));
                    }
                    return Err(map_store_pg(e, &self.inner.names));
                }
                Err(_) => {
                    drop(Object::take(client));
                    return Err(Error::timed_out(STORE, timeout));
                }
            };
            removed += deleted;
            if deleted < DROP_BATCH as u64 {
                return Ok(removed);
            }
        }
    }
}
