//! `backend::check_backend` passes a correct kit backend and fails each deliberately broken one,
//! naming the rule: the two bugs the store-level scenarios let through (a version reused after a
//! delete, a delete that does not compare), a capped `scan`, and a compare-and-swap that is
//! not atomic.

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use idem_conformance::backend::check_backend;
use idem_core::Result;
use idem_core::kit::{Cas, CasBackend, Scanned, Versioned};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bug {
    None,
    /// Versions count per key and start again at 1 once the key is deleted.
    ReusedVersions,
    /// `delete` removes the key whatever version it holds.
    BlindDelete,
    /// `scan` returns at most 10 keys.
    CappedScan,
    /// `store` compares, lets other tasks run, then writes.
    NotAtomic,
}

#[derive(Debug)]
struct Map {
    bug: Bug,
    map: Mutex<BTreeMap<Vec<u8>, (Bytes, u64)>>,
    /// Per-key counters, for `ReusedVersions`.
    per_key: Mutex<HashMap<Vec<u8>, u64>>,
    versions: AtomicU64,
}

impl Map {
    fn new(bug: Bug) -> Self {
        Self {
            bug,
            map: Mutex::default(),
            per_key: Mutex::default(),
            versions: AtomicU64::new(0),
        }
    }

    fn version_of(&self, map: &BTreeMap<Vec<u8>, (Bytes, u64)>, key: &[u8]) -> Option<u64> {
        map.get(key).map(|(_, v)| *v)
    }

    fn next_version(&self, key: &[u8]) -> u64 {
        if self.bug == Bug::ReusedVersions {
            let mut per_key = self.per_key.lock().unwrap();
            let n = per_key.entry(key.to_vec()).or_default();
            *n += 1;
            *n
        } else {
            self.versions.fetch_add(1, Ordering::Relaxed) + 1
        }
    }
}

#[async_trait]
impl CasBackend for Map {
    type Version = u64;

    fn name(&self) -> &'static str {
        "broken-map"
    }

    async fn load(&self, key: &[u8]) -> Result<Option<Versioned<u64>>> {
        let map = self.map.lock().unwrap();
        Ok(map.get(key).map(|(v, n)| Versioned::new(v.clone(), *n)))
    }

    async fn store(&self, key: &[u8], value: Bytes, expected: Option<&u64>) -> Result<Cas> {
        if self.bug == Bug::NotAtomic {
            let current = self.version_of(&self.map.lock().unwrap(), key);
            if current.as_ref() != expected {
                return Ok(Cas::Conflict);
            }
            tokio::task::yield_now().await;
        }
        let mut map = self.map.lock().unwrap();
        if self.bug != Bug::NotAtomic && self.version_of(&map, key).as_ref() != expected {
            return Ok(Cas::Conflict);
        }
        let version = self.next_version(key);
        map.insert(key.to_vec(), (value, version));
        Ok(Cas::Written)
    }

    async fn delete(&self, key: &[u8], expected: &u64) -> Result<Cas> {
        let mut map = self.map.lock().unwrap();
        let current = self.version_of(&map, key);
        let matches = match self.bug {
            Bug::BlindDelete => current.is_some(),
            _ => current == Some(*expected),
        };
        if !matches {
            return Ok(Cas::Conflict);
        }
        map.remove(key);
        if self.bug == Bug::ReusedVersions {
            self.per_key.lock().unwrap().remove(key);
        }
        Ok(Cas::Written)
    }

    async fn scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<Scanned<u64>>> {
        let limit = if self.bug == Bug::CappedScan {
            limit.min(10)
        } else {
            limit
        };
        let start = match after {
            Some(after) if after >= prefix => Bound::Excluded(after.to_vec()),
            _ => Bound::Included(prefix.to_vec()),
        };
        let map = self.map.lock().unwrap();
        Ok(map
            .range((start, Bound::Unbounded))
            .take_while(|(k, _)| k.starts_with(prefix))
            .take(limit)
            .map(|(k, (v, n))| Scanned::new(k.clone(), Versioned::new(v.clone(), *n)))
            .collect())
    }
}

/// The panic message of `check_backend` on a backend with `bug`, or `None` when it passed.
async fn broken_rule(bug: Bug) -> Option<String> {
    let outcome = tokio::spawn(async move { check_backend(&Map::new(bug), "broken").await }).await;
    match outcome {
        Ok(()) => None,
        Err(e) => {
            let panic = e.into_panic();
            Some(
                panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default(),
            )
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_correct_backend_passes_and_each_broken_one_fails_on_its_rule() {
    assert_eq!(broken_rule(Bug::None).await, None, "the correct map passes");
    for (bug, rule) in [
        (Bug::ReusedVersions, "a version must never be reused"),
        (
            Bug::BlindDelete,
            "delete at a version the key no longer holds",
        ),
        (Bug::CappedScan, "must return them all"),
        (Bug::NotAtomic, "racing"),
    ] {
        let failed = broken_rule(bug).await;
        assert!(
            failed.as_deref().is_some_and(|m| m.contains(rule)),
            "{bug:?} must fail on \"{rule}\": {failed:?}"
        );
    }
}
