//! A custom store built on the kit: an in-memory map with compare-and-swap, and the store the
//! kit makes of it. The worked example of `docs/custom-store.md`; `idem-sqlite`'s tests run the
//! whole conformance suite on it.
//!
//! Run it with `cargo run -p idem --example kit_memory`.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use idem::kit::{Cas, CasBackend, KitStore, Scanned, Versioned};
use idem::{AcquireOutcome, AcquireRequest, Bytes, IdempotencyStore, Namespace, Result};

/// Values and their versions in a sorted map. Every method holds the lock for its whole
/// compare-and-swap, which is what makes it atomic.
#[derive(Debug, Default)]
pub struct MapBackend {
    map: Mutex<BTreeMap<Vec<u8>, (Bytes, u64)>>,
    /// Versions come from one counter, so a version is never reused, even after a delete.
    versions: AtomicU64,
}

impl MapBackend {
    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<Vec<u8>, (Bytes, u64)>> {
        self.map
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[async_trait]
impl CasBackend for MapBackend {
    type Version = u64;

    fn name(&self) -> &'static str {
        "kit-memory"
    }

    async fn load(&self, key: &[u8]) -> Result<Option<Versioned<u64>>> {
        let map = self.map();
        Ok(map
            .get(key)
            .map(|(value, v)| Versioned::new(value.clone(), *v)))
    }

    async fn store(&self, key: &[u8], value: Bytes, expected: Option<&u64>) -> Result<Cas> {
        let mut map = self.map();
        if map.get(key).map(|(_, v)| v) != expected {
            return Ok(Cas::Conflict);
        }
        let version = self.versions.fetch_add(1, Ordering::Relaxed) + 1;
        map.insert(key.to_vec(), (value, version));
        Ok(Cas::Written)
    }

    async fn delete(&self, key: &[u8], expected: &u64) -> Result<Cas> {
        let mut map = self.map();
        if map.get(key).map(|(_, v)| v) != Some(expected) {
            return Ok(Cas::Conflict);
        }
        map.remove(key);
        Ok(Cas::Written)
    }

    // No `now`: the kit uses the client's clock, which is this process's.

    async fn scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<Scanned<u64>>> {
        let start = match after {
            Some(after) if after >= prefix => Bound::Excluded(after.to_vec()),
            _ => Bound::Included(prefix.to_vec()),
        };
        let map = self.map();
        let found = map
            .range((start, Bound::Unbounded))
            .take_while(|(key, _)| key.starts_with(prefix))
            .take(limit)
            .map(|(key, (value, v))| Scanned::new(key.clone(), Versioned::new(value.clone(), *v)))
            .collect();
        Ok(found)
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let store = KitStore::new(MapBackend::default());
    let key = Namespace::new("payments")?.key("charge-1001")?;
    let request = AcquireRequest::new(key, "worker-1");
    let retention = Duration::from_secs(3600);

    let AcquireOutcome::Acquired { lease, .. } = store.acquire(&request).await? else {
        unreachable!("a fresh key is acquired");
    };
    println!("acquired with token {}", lease.token);
    store
        .complete(&lease, Bytes::from_static(b"receipt-7"), retention)
        .await?;
    // A completion re-sent after a lost reply answers Ok and changes nothing.
    store
        .complete(&lease, Bytes::from_static(b"receipt-7"), retention)
        .await?;

    match store.acquire(&request).await? {
        AcquireOutcome::Replayed { result } => println!("duplicate: replayed {result:?}"),
        other => panic!("expected a replay, got {other:?}"),
    }
    Ok(())
}
