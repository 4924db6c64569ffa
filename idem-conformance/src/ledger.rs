//! A fenced ledger for the chaos scenario (C19).

use std::collections::HashMap;
use std::sync::Mutex;

use idem_core::FencingToken;

/// A downstream system that fences its writes: per key it keeps the highest token it has seen and
/// refuses any write with a lower one, the way a handler's database or API should.
///
/// It records every write it accepts and every one it refuses, so a scenario can check that the
/// effect that stands for each key is the one written by the acquisition that completed.
#[derive(Debug, Default)]
pub struct Ledger {
    entries: Mutex<HashMap<String, Entry>>,
}

/// What the ledger holds for one key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    /// The token of the write that stands.
    pub token: Option<FencingToken>,
    /// The value written by it.
    pub value: Vec<u8>,
    /// Writes accepted.
    pub accepted: u32,
    /// Writes refused as stale.
    pub refused: u32,
}

impl Ledger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes `value` for `key` if `token` is not lower than any token already seen for it;
    /// returns whether the write was accepted.
    pub fn write(&self, key: &str, token: FencingToken, value: &[u8]) -> bool {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let entry = entries.entry(key.to_owned()).or_default();
        if entry.token.is_some_and(|seen| token < seen) {
            entry.refused += 1;
            return false;
        }
        entry.token = Some(token);
        entry.value = value.to_vec();
        entry.accepted += 1;
        true
    }

    /// What the ledger holds for `key`.
    pub fn entry(&self, key: &str) -> Option<Entry> {
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .cloned()
    }

    /// Total refused writes.
    pub fn refused(&self) -> u32 {
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|e| e.refused)
            .sum()
    }
}
