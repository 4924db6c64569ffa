//! The item layout: attribute names, time encoding, and decoding an item into a [`Record`].

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use bytes::Bytes;
use idem_core::{
    Error, FencingToken, Fingerprint, IdempotencyKey, Record, RecordState, Result, StateKind,
};

use crate::STORE;

/// A DynamoDB item as the SDK returns it.
pub(crate) type Item = HashMap<String, AttributeValue>;

/// Attribute names. Expressions refer to them through `#name` placeholders only, so none of
/// them clashes with DynamoDB's reserved words.
pub(crate) mod attr {
    /// Partition key: `{namespace}:{id}`.
    pub(crate) const PK: &str = "pk";
    // The next two are written through the `#namespace` and `#id` placeholders only.
    #[allow(dead_code)]
    pub(crate) const NAMESPACE: &str = "namespace";
    #[allow(dead_code)]
    pub(crate) const ID: &str = "id";
    pub(crate) const STATE: &str = "state";
    pub(crate) const TOKEN: &str = "token";
    pub(crate) const OWNER: &str = "owner";
    /// Attempts while the record can be acquired again (in progress, released, failed retryable).
    pub(crate) const ATTEMPTS: &str = "attempts";
    /// `created_at` in microseconds, same lifetime as `attempts`.
    pub(crate) const CREATED: &str = "created_us";
    /// Fingerprint (B, 32 bytes) or NULL when the caller opted out; same lifetime as `attempts`.
    pub(crate) const FINGERPRINT: &str = "fingerprint";
    /// The three above, moved here once the record is final (completed, or failed terminally or
    /// with its result not stored).
    pub(crate) const FINAL_ATTEMPTS: &str = "final_attempts";
    pub(crate) const FINAL_CREATED: &str = "final_created_us";
    pub(crate) const FINAL_FINGERPRINT: &str = "final_fingerprint";
    pub(crate) const LEASE: &str = "lease_expires_us";
    pub(crate) const UPDATED: &str = "updated_us";
    /// Retention deadline in microseconds (logical expiry, checked by every operation).
    pub(crate) const EXPIRES: &str = "expires_us";
    /// Retention deadline in epoch seconds, the table's TTL attribute.
    pub(crate) const TTL: &str = "ttl";
    pub(crate) const RESULT: &str = "result";
    pub(crate) const ERROR: &str = "error";
    /// Random id of the acquire call that wrote the current acquisition, so that call can tell
    /// its own earlier write from another's when the SDK retried it.
    pub(crate) const ACQ_ID: &str = "acq_id";
    /// The state the item had before that acquisition (`absent` for none), to report `takeover`
    /// for a retried acquire.
    pub(crate) const ACQ_PREV: &str = "acq_prev";
}

/// Values of the `state` attribute: [`StateKind::name`], which carries the
/// [`FailureKind`](idem_core::FailureKind) of a failed record (`failed_retryable`,
/// `failed_terminal`, `failed_result_not_stored`). The expressions need the few below as
/// constants; the failed states are written as `StateKind::Failed(kind).name()`.
pub(crate) mod state {
    pub(crate) const IN_PROGRESS: &str = "in_progress";
    pub(crate) const RELEASED: &str = "released";
    pub(crate) const COMPLETED: &str = "completed";
    pub(crate) const FAILED_RETRYABLE: &str = "failed_retryable";
    /// Not a state: the value of `acq_prev` when the item had no state (absent or tombstone).
    pub(crate) const ABSENT: &str = "absent";
}

/// The partition key of `key`. Namespaces cannot contain `:`, so the first `:` separates the
/// namespace from the id and no two keys share a partition key.
pub(crate) fn partition_key(key: &IdempotencyKey) -> String {
    format!("{}:{}", key.namespace(), key.id())
}

/// Microseconds since the Unix epoch (0 for a clock set before 1970).
pub(crate) fn micros(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The inverse of [`micros`].
pub(crate) fn from_micros(us: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_micros(us)
}

/// Epoch seconds for the TTL attribute, rounded up so DynamoDB never deletes before the deadline.
pub(crate) fn ttl_seconds(expires_us: u64) -> u64 {
    expires_us.div_ceil(1_000_000)
}

pub(crate) fn n(v: u64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

pub(crate) fn s(v: impl Into<String>) -> AttributeValue {
    AttributeValue::S(v.into())
}

pub(crate) fn b(v: impl Into<Vec<u8>>) -> AttributeValue {
    AttributeValue::B(Blob::new(v))
}

pub(crate) fn null() -> AttributeValue {
    AttributeValue::Null(true)
}

/// The stored form of an optional fingerprint.
pub(crate) fn fingerprint_value(fp: Option<&Fingerprint>) -> AttributeValue {
    fp.map_or_else(null, |fp| b(fp.as_bytes().to_vec()))
}

/// Whether `item` is a tombstone left by `delete` (no `state`): every operation treats it as
/// absent.
pub(crate) fn is_tombstone(item: &Item) -> bool {
    matches!(item.get(attr::STATE), None | Some(AttributeValue::Null(_)))
}

/// Reads items for one key, naming the key in every error.
pub(crate) struct Decoder<'a> {
    item: &'a Item,
    key: &'a IdempotencyKey,
}

impl<'a> Decoder<'a> {
    pub(crate) fn new(item: &'a Item, key: &'a IdempotencyKey) -> Self {
        Self { item, key }
    }

    fn corrupt(&self, reason: impl Into<String>) -> Error {
        Error::corrupt(STORE, partition_key(self.key), reason)
    }

    fn get(&self, name: &str) -> Option<&'a AttributeValue> {
        self.item.get(name)
    }

    pub(crate) fn opt_u64(&self, name: &str) -> Result<Option<u64>> {
        match self.get(name) {
            None | Some(AttributeValue::Null(_)) => Ok(None),
            Some(AttributeValue::N(v)) => v
                .parse()
                .map(Some)
                .map_err(|_| self.corrupt(format!("{name} is {v:?}, not an unsigned integer"))),
            Some(other) => Err(self.corrupt(format!("{name} is not a number: {other:?}"))),
        }
    }

    pub(crate) fn u64(&self, name: &str) -> Result<u64> {
        self.opt_u64(name)?
            .ok_or_else(|| self.corrupt(format!("{name} is missing")))
    }

    /// The first of `names` that is present.
    fn u64_of(&self, names: [&str; 2]) -> Result<u64> {
        for name in names {
            if let Some(v) = self.opt_u64(name)? {
                return Ok(v);
            }
        }
        Err(self.corrupt(format!("{} is missing", names[0])))
    }

    pub(crate) fn opt_string(&self, name: &str) -> Result<Option<String>> {
        match self.get(name) {
            None | Some(AttributeValue::Null(_)) => Ok(None),
            Some(AttributeValue::S(v)) => Ok(Some(v.clone())),
            Some(other) => Err(self.corrupt(format!("{name} is not a string: {other:?}"))),
        }
    }

    pub(crate) fn string(&self, name: &str) -> Result<String> {
        self.opt_string(name)?
            .ok_or_else(|| self.corrupt(format!("{name} is missing")))
    }

    fn fingerprint(&self) -> Result<Option<Fingerprint>> {
        let value = self
            .get(attr::FINGERPRINT)
            .or_else(|| self.get(attr::FINAL_FINGERPRINT));
        match value {
            None | Some(AttributeValue::Null(_)) => Ok(None),
            Some(AttributeValue::B(blob)) => Fingerprint::try_from(blob.as_ref())
                .map(Some)
                .map_err(|e| self.corrupt(e.to_string())),
            Some(other) => Err(self.corrupt(format!("fingerprint is not binary: {other:?}"))),
        }
    }

    fn state(&self) -> Result<RecordState> {
        let name = self.string(attr::STATE)?;
        let Some(kind) = StateKind::from_name(&name) else {
            return Err(self.corrupt(format!("unknown state {name:?}")));
        };
        Ok(match kind {
            StateKind::InProgress => RecordState::InProgress,
            StateKind::Released => RecordState::Released,
            StateKind::Completed => match self.get(attr::RESULT) {
                Some(AttributeValue::B(blob)) => RecordState::Completed {
                    result: Bytes::copy_from_slice(blob.as_ref()),
                },
                _ => return Err(self.corrupt("completed without a binary result")),
            },
            StateKind::Failed(kind) => RecordState::Failed {
                error: self.string(attr::ERROR)?,
                kind,
            },
            other => return Err(self.corrupt(format!("state {other} is not handled"))),
        })
    }

    /// The whole record, whether or not it is past retention.
    pub(crate) fn record(&self) -> Result<Record> {
        let state = self.state()?;
        let lease_expires_at = match state {
            RecordState::InProgress => Some(from_micros(self.u64(attr::LEASE)?)),
            _ => None,
        };
        let attempts = self.u64_of([attr::ATTEMPTS, attr::FINAL_ATTEMPTS])?;
        Ok(Record {
            key: self.key.clone(),
            state,
            fingerprint: self.fingerprint()?,
            token: FencingToken::new(self.u64(attr::TOKEN)?),
            owner: self.string(attr::OWNER)?,
            attempts: u32::try_from(attempts)
                .map_err(|_| self.corrupt(format!("attempts {attempts} is out of range")))?,
            lease_expires_at,
            created_at: from_micros(self.u64_of([attr::CREATED, attr::FINAL_CREATED])?),
            updated_at: from_micros(self.u64(attr::UPDATED)?),
            expires_at: self.opt_u64(attr::EXPIRES)?.map(from_micros),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::Namespace;

    fn key() -> IdempotencyKey {
        Namespace::new("ns").unwrap().key("a:b c").unwrap()
    }

    #[test]
    fn partition_key_splits_at_first_colon() {
        assert_eq!(partition_key(&key()), "ns:a:b c");
    }

    #[test]
    fn time_round_trips_in_microseconds() {
        let t = from_micros(1_700_000_000_123_456);
        assert_eq!(micros(t), 1_700_000_000_123_456);
        assert_eq!(ttl_seconds(1_700_000_000_000_000), 1_700_000_000);
        assert_eq!(ttl_seconds(1_700_000_000_000_001), 1_700_000_001);
        assert_eq!(micros(UNIX_EPOCH - Duration::from_secs(1)), 0);
    }

    fn live_item() -> Item {
        HashMap::from([
            (attr::STATE.to_owned(), s(state::IN_PROGRESS)),
            (attr::TOKEN.to_owned(), n(7)),
            (attr::OWNER.to_owned(), s("w1")),
            (attr::ATTEMPTS.to_owned(), n(2)),
            (attr::CREATED.to_owned(), n(10)),
            (attr::UPDATED.to_owned(), n(20)),
            (attr::LEASE.to_owned(), n(30)),
            (attr::FINGERPRINT.to_owned(), null()),
        ])
    }

    #[test]
    fn decodes_live_and_final_records() {
        let k = key();
        let record = Decoder::new(&live_item(), &k).record().unwrap();
        assert_eq!(record.state, RecordState::InProgress);
        assert_eq!(record.token, FencingToken::new(7));
        assert_eq!(record.attempts, 2);
        assert_eq!(record.fingerprint, None);
        assert_eq!(record.lease_expires_at, Some(from_micros(30)));
        assert_eq!(record.expires_at, None);

        let fp = Fingerprint::of("x");
        let done = HashMap::from([
            (attr::STATE.to_owned(), s(state::COMPLETED)),
            (attr::RESULT.to_owned(), b(b"ok".to_vec())),
            (attr::TOKEN.to_owned(), n(7)),
            (attr::OWNER.to_owned(), s("w1")),
            (attr::FINAL_ATTEMPTS.to_owned(), n(3)),
            (attr::FINAL_CREATED.to_owned(), n(10)),
            (
                attr::FINAL_FINGERPRINT.to_owned(),
                fingerprint_value(Some(&fp)),
            ),
            (attr::UPDATED.to_owned(), n(20)),
            (attr::EXPIRES.to_owned(), n(40)),
        ]);
        let record = Decoder::new(&done, &k).record().unwrap();
        assert_eq!(
            record.state,
            RecordState::Completed {
                result: Bytes::from_static(b"ok")
            }
        );
        assert_eq!(record.attempts, 3);
        assert_eq!(record.fingerprint, Some(fp));
        assert_eq!(record.lease_expires_at, None);
        assert_eq!(record.expires_at, Some(from_micros(40)));
    }

    #[test]
    fn state_names_are_the_core_names() {
        assert_eq!(state::IN_PROGRESS, StateKind::InProgress.name());
        assert_eq!(state::RELEASED, StateKind::Released.name());
        assert_eq!(state::COMPLETED, StateKind::Completed.name());
        assert_eq!(
            state::FAILED_RETRYABLE,
            StateKind::Failed(idem_core::FailureKind::Retryable).name()
        );
        assert!(StateKind::from_name(state::ABSENT).is_none());
    }

    #[test]
    fn every_failure_kind_decodes_as_stored() {
        let k = key();
        for kind in idem_core::FailureKind::ALL {
            let mut item = live_item();
            item.remove(attr::LEASE);
            item.insert(attr::STATE.to_owned(), s(StateKind::Failed(kind).name()));
            item.insert(attr::ERROR.to_owned(), s("déclined\n"));
            let record = Decoder::new(&item, &k).record().unwrap();
            assert_eq!(
                record.state,
                RecordState::Failed {
                    error: "déclined\n".to_owned(),
                    kind
                }
            );
            item.remove(attr::ERROR);
            let r = Decoder::new(&item, &k).record();
            assert!(matches!(r, Err(Error::CorruptRecord { .. })), "{r:?}");
        }
    }

    #[test]
    fn bad_items_are_corrupt_records() {
        let k = key();
        let mut item = live_item();
        item.insert(attr::STATE.to_owned(), s("sleeping"));
        let r = Decoder::new(&item, &k).record();
        assert!(matches!(r, Err(Error::CorruptRecord { .. })), "{r:?}");

        let mut item = live_item();
        item.insert(attr::TOKEN.to_owned(), s("7"));
        let r = Decoder::new(&item, &k).record();
        assert!(matches!(r, Err(Error::CorruptRecord { .. })), "{r:?}");

        let mut item = live_item();
        item.insert(attr::FINGERPRINT.to_owned(), b(vec![1, 2, 3]));
        let r = Decoder::new(&item, &k).record();
        assert!(matches!(r, Err(Error::CorruptRecord { .. })), "{r:?}");

        let mut item = live_item();
        item.remove(attr::LEASE);
        let r = Decoder::new(&item, &k).record();
        assert!(matches!(r, Err(Error::CorruptRecord { .. })), "{r:?}");
    }
}
