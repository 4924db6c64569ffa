//! [`SqliteStore`]: the kit's store over [`SqliteBackend`].

use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::kit::KitStore;
use idem_core::{
    AcquireOutcome, AcquireRequest, Completion, Error, Failure, FailureKind, IdempotencyKey,
    IdempotencyStore, Lease, Limits, ListQuery, Page, Record, Result,
};

use crate::backend::{NAME, SqliteBackend};
use crate::options::SqliteOptions;

/// A durable embedded [`IdempotencyStore`] on one SQLite file: the custom-store kit
/// ([`KitStore`]) over [`SqliteBackend`]. See the [crate docs](crate) for costs, clock,
/// errors and durability.
///
/// Cloning is cheap and shares the connections. Needs a tokio runtime: statements run in place
/// on the calling worker thread ([`Offload::InPlace`](crate::Offload::InPlace), the default, on
/// a multi-thread runtime) or on its blocking pool
/// ([`Offload::BlockingPool`](crate::Offload::BlockingPool)), as [`SqliteOptions::offload`]
/// says.
#[derive(Clone, Debug)]
pub struct SqliteStore {
    kit: KitStore<SqliteBackend>,
}

impl SqliteStore {
    /// Opens the database at `path` with the default [`SqliteOptions`]: the file and the table
    /// are created when missing, and the file is put in WAL mode (for good: the mode is kept in
    /// the file, for every program that opens it).
    ///
    /// A relative `path` is made absolute against the working directory at the time of the
    /// call: every connection of the store (read connections are opened later, on demand) opens
    /// that file, wherever the process moves afterwards.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] (field `path`) for an empty path, `:memory:` or a SQLite URI
    /// (`file:...`): each connection to an empty path or `:memory:` gets a private database
    /// of its own, where the store's connections must share one file.
    /// [`Error::Unavailable`] when the file cannot be opened or created (its directory is
    /// missing, no permission), can only be read, or stays locked past the busy timeout;
    /// [`Error::Backend`] when it is not a database, or SQLite leaves it out of WAL mode.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path, SqliteOptions::default()).await
    }

    /// Opens the database at `path` with `options`.
    ///
    /// # Errors
    /// As [`open`](Self::open); and [`Error::NotSetUp`] when the table is missing and
    /// [`SqliteOptions::create`] is off.
    pub async fn open_with(path: impl AsRef<Path>, options: SqliteOptions) -> Result<Self> {
        let path = path.as_ref().to_owned();
        let kit_options = options.kit.clone();
        let backend =
            tokio::task::spawn_blocking(move || SqliteBackend::open_blocking(&path, options))
                .await
                .map_err(|e| Error::unavailable(NAME, e))??;
        Ok(Self {
            kit: KitStore::with_options(backend, kit_options),
        })
    }

    /// The backend: the database file, the statement count.
    pub fn backend(&self) -> &SqliteBackend {
        self.kit.backend()
    }

    /// The kit store this wraps.
    pub fn kit(&self) -> &KitStore<SqliteBackend> {
        &self.kit
    }
}

#[async_trait]
impl IdempotencyStore for SqliteStore {
    /// `sqlite`.
    fn name(&self) -> &'static str {
        self.kit.name()
    }
    fn limits(&self) -> Limits {
        self.kit.limits()
    }
    /// One `SELECT`, plus one `INSERT` or `UPDATE` when it changes the record.
    async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome> {
        self.kit.acquire(req).await
    }
    /// One `SELECT` and one `UPDATE`.
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        self.kit.extend(lease, ttl).await
    }
    /// One `SELECT` and one `UPDATE`; a replay or a refusal is the `SELECT` alone.
    async fn complete(&self, lease: &Lease, result: Bytes, retention: Duration) -> Result<()> {
        self.kit.complete(lease, result, retention).await
    }
    /// One `SELECT` and one `UPDATE`; a replay or a refusal is the `SELECT` alone.
    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        self.kit.fail(lease, error, kind, retention).await
    }
    /// One `SELECT` and one `UPDATE`; a replay or a refusal is the `SELECT` alone.
    async fn release(&self, lease: &Lease) -> Result<()> {
        self.kit.release(lease).await
    }
    async fn acquire_many(&self, reqs: &[AcquireRequest]) -> Result<Vec<Result<AcquireOutcome>>> {
        self.kit.acquire_many(reqs).await
    }
    async fn complete_many(
        &self,
        items: &[Completion],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        self.kit.complete_many(items, retention).await
    }
    async fn fail_many(&self, items: &[Failure], retention: Duration) -> Result<Vec<Result<()>>> {
        self.kit.fail_many(items, retention).await
    }
    async fn release_many(&self, leases: &[Lease]) -> Result<Vec<Result<()>>> {
        self.kit.release_many(leases).await
    }
    /// One `SELECT`.
    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        self.kit.get(key).await
    }
    /// One `SELECT` and one `UPDATE` (the record becomes a tombstone).
    async fn delete(&self, key: &IdempotencyKey) -> Result<bool> {
        self.kit.delete(key).await
    }
    /// One range query on the primary key over the namespace, `limit` rows long.
    async fn list(&self, query: &ListQuery) -> Result<Page> {
        self.kit.list(query).await
    }
    /// Range queries over the whole table, 256 rows each, and one statement per record
    /// purged.
    async fn purge_expired(&self, limit: usize) -> Result<u64> {
        self.kit.purge_expired(limit).await
    }
}
