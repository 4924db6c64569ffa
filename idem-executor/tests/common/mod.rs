//! A `MemoryStore` with two faults a test can arm, shared by the executor's test files.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Error, FailureKind, IdempotencyKey, IdempotencyStore,
    Lease, MemoryStore, MemoryWrites, Record, Result, TransactionalStore,
};

/// A `MemoryStore` whose `complete` answers only `complete_reply_delay` after it took effect (a
/// slow reply), and whose transactional completions are refused as `NotSetUp` (a table the
/// handler's writes name is missing; nothing written) while `missing_table` is set.
#[derive(Debug, Default)]
pub(crate) struct Hooked {
    pub(crate) inner: MemoryStore,
    pub(crate) complete_reply_delay: Duration,
    pub(crate) missing_table: AtomicBool,
}

#[async_trait::async_trait]
impl IdempotencyStore for Hooked {
    fn name(&self) -> &'static str {
        "hooked"
    }
    async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome> {
        self.inner.acquire(req).await
    }
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        self.inner.extend(lease, ttl).await
    }
    async fn complete(&self, lease: &Lease, result: Bytes, retention: Duration) -> Result<()> {
        let done = self.inner.complete(lease, result, retention).await;
        tokio::time::sleep(self.complete_reply_delay).await;
        done
    }
    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        self.inner.fail(lease, error, kind, retention).await
    }
    async fn release(&self, lease: &Lease) -> Result<()> {
        self.inner.release(lease).await
    }
    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        self.inner.get(key).await
    }
    async fn delete(&self, key: &IdempotencyKey) -> Result<bool> {
        self.inner.delete(key).await
    }
    async fn purge_expired(&self, limit: usize) -> Result<u64> {
        self.inner.purge_expired(limit).await
    }
}

#[async_trait::async_trait]
impl TransactionalStore for Hooked {
    type Writes = MemoryWrites;
    async fn complete_with(
        &self,
        lease: &Lease,
        result: Bytes,
        retention: Duration,
        writes: MemoryWrites,
    ) -> Result<()> {
        if self.missing_table.load(Ordering::SeqCst) {
            return Err(Error::not_set_up("hooked", "table \"ledger\"", "create it"));
        }
        self.inner
            .complete_with(lease, result, retention, writes)
            .await
    }
}
