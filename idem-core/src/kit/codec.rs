//! The kit's record encoding: compact, versioned, and strict when decoding.
//!
//! Format 1, every integer unsigned LEB128 ("varint") unless said otherwise:
//!
//! | bytes | what |
//! |---|---|
//! | 1 | format: `1` |
//! | 1 | state: 0 in progress, 1 released, 2 completed, 3 failed retryable, 4 failed terminal, 5 failed with the result not stored, 127 tombstone |
//! | 8 | fencing token, big-endian |
//!
//! A tombstone ends there (10 bytes). A record goes on with:
//!
//! | bytes | what |
//! |---|---|
//! | 1 | flags: 1 fingerprint, 2 lease end, 4 retention deadline (other bits must be 0) |
//! | varint | attempts |
//! | zigzag varint | `created_at`, microseconds since the Unix epoch |
//! | zigzag varint | `updated_at`, the same |
//! | zigzag varint | lease end, the same; with flag 2, set exactly while in progress |
//! | zigzag varint | retention deadline, the same; with flag 4, set exactly when completed or failed |
//! | 32 | fingerprint; with flag 1 |
//! | varint + bytes | owner, UTF-8 |
//! | varint + bytes | the result (completed) or error text (failed, UTF-8); empty in other states |
//!
//! Nothing may follow. Times keep whole microseconds (anything finer is dropped on write).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, Namespace};
use crate::record::{FailureKind, FencingToken, Record, RecordState};

const FORMAT: u8 = 1;
const TOMBSTONE: u8 = 127;
const FLAG_FINGERPRINT: u8 = 1;
const FLAG_LEASE: u8 = 2;
const FLAG_RETENTION: u8 = 4;

/// What a key holds: a record, or the tombstone `delete` left.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
#[allow(clippy::large_enum_variant)] // short-lived; boxing would cost an allocation per call
pub enum Stored {
    /// A record (possibly past retention: [`Record::is_expired`]).
    Record(Record),
    /// A deleted record's token: read as no record, kept so that tokens keep rising.
    Tombstone(FencingToken),
}

impl Stored {
    /// The token the key holds, which the next acquisition must exceed.
    pub fn token(&self) -> FencingToken {
        match self {
            Self::Record(r) => r.token,
            Self::Tombstone(t) => *t,
        }
    }

    /// The record, if this is one (past retention or not).
    pub fn record(&self) -> Option<&Record> {
        match self {
            Self::Record(r) => Some(r),
            Self::Tombstone(_) => None,
        }
    }
}

/// The backend key of an idempotency key: `namespace:id` as UTF-8. Unambiguous, since a
/// namespace never holds `:`; the keys of one namespace share the prefix `namespace:`.
pub fn storage_key(key: &IdempotencyKey) -> Vec<u8> {
    let mut out = Vec::with_capacity(key.namespace().as_str().len() + 1 + key.id().len());
    out.extend_from_slice(key.namespace().as_str().as_bytes());
    out.push(b':');
    out.extend_from_slice(key.id().as_bytes());
    out
}

/// The prefix every backend key of `namespace` starts with.
pub(crate) fn namespace_prefix(namespace: &Namespace) -> Vec<u8> {
    let mut out = namespace.as_str().as_bytes().to_vec();
    out.push(b':');
    out
}

/// The idempotency key of a backend key ([`storage_key`]'s inverse).
pub(crate) fn parse_storage_key(store: &'static str, raw: &[u8]) -> Result<IdempotencyKey> {
    let corrupt = |why: &str| Error::corrupt(store, String::from_utf8_lossy(raw), why);
    let text = std::str::from_utf8(raw).map_err(|_| corrupt("key is not UTF-8"))?;
    let (ns, id) = text
        .split_once(':')
        .ok_or_else(|| corrupt("key has no namespace"))?;
    let ns = Namespace::new(ns).map_err(|e| corrupt(&e.to_string()))?;
    IdempotencyKey::new(ns, id).map_err(|e| corrupt(&e.to_string()))
}

/// Encodes what a key holds (format 1).
pub fn encode(stored: &Stored) -> Bytes {
    let record = match stored {
        Stored::Tombstone(token) => {
            let mut out = BytesMut::with_capacity(10);
            out.put_u8(FORMAT);
            out.put_u8(TOMBSTONE);
            out.put_u64(token.get());
            return out.freeze();
        }
        Stored::Record(r) => r,
    };
    let (state, payload): (u8, &[u8]) = match &record.state {
        RecordState::InProgress => (0, &[]),
        RecordState::Released => (1, &[]),
        RecordState::Completed { result } => (2, result),
        RecordState::Failed { error, kind } => (
            match kind {
                FailureKind::Retryable => 3,
                FailureKind::Terminal => 4,
                FailureKind::ResultNotStored => 5,
            },
            error.as_bytes(),
        ),
    };
    let mut flags = 0;
    if record.fingerprint.is_some() {
        flags |= FLAG_FINGERPRINT;
    }
    if record.lease_expires_at.is_some() {
        flags |= FLAG_LEASE;
    }
    if record.expires_at.is_some() {
        flags |= FLAG_RETENTION;
    }
    let mut out = BytesMut::with_capacity(64 + record.owner.len() + payload.len());
    out.put_u8(FORMAT);
    out.put_u8(state);
    out.put_u64(record.token.get());
    out.put_u8(flags);
    put_varint(&mut out, u64::from(record.attempts));
    put_time(&mut out, record.created_at);
    put_time(&mut out, record.updated_at);
    if let Some(at) = record.lease_expires_at {
        put_time(&mut out, at);
    }
    if let Some(at) = record.expires_at {
        put_time(&mut out, at);
    }
    if let Some(fp) = &record.fingerprint {
        out.put_slice(fp.as_bytes());
    }
    put_varint(&mut out, record.owner.len() as u64);
    out.put_slice(record.owner.as_bytes());
    put_varint(&mut out, payload.len() as u64);
    out.put_slice(payload);
    out.freeze()
}

/// Decodes what `key` holds. `store` names the backend in errors.
///
/// # Errors
/// [`Error::CorruptRecord`] for anything that is not a value [`encode`] makes: another format,
/// an unknown state or flag, a value cut short or too long, text that is not UTF-8, fields that
/// contradict the state. Never panics.
pub fn decode(store: &'static str, key: &IdempotencyKey, value: &[u8]) -> Result<Stored> {
    let corrupt = |why: String| Error::corrupt(store, key.to_string(), why);
    let mut r = Reader { buf: value };
    let format = r.u8().map_err(&corrupt)?;
    if format != FORMAT {
        return Err(corrupt(format!(
            "unknown record format {format} (this version reads format {FORMAT})"
        )));
    }
    let state = r.u8().map_err(&corrupt)?;
    let token = FencingToken::new(r.u64().map_err(&corrupt)?);
    if state == TOMBSTONE {
        if !r.buf.is_empty() {
            return Err(corrupt(format!("{} bytes after a tombstone", r.buf.len())));
        }
        return Ok(Stored::Tombstone(token));
    }
    let body = (|| {
        let flags = r.u8()?;
        if flags & !(FLAG_FINGERPRINT | FLAG_LEASE | FLAG_RETENTION) != 0 {
            return Err(format!("unknown flags {flags:#04x}"));
        }
        let attempts = u32::try_from(r.varint()?).map_err(|_| "attempts over 2^32".to_owned())?;
        let created_at = r.time()?;
        let updated_at = r.time()?;
        let lease_expires_at = (flags & FLAG_LEASE != 0).then(|| r.time()).transpose()?;
        let expires_at = (flags & FLAG_RETENTION != 0)
            .then(|| r.time())
            .transpose()?;
        let fingerprint = if flags & FLAG_FINGERPRINT != 0 {
            let raw: [u8; 32] = r
                .take(32)?
                .try_into()
                .map_err(|_| "short fingerprint".to_owned())?;
            Some(Fingerprint::from_bytes(raw))
        } else {
            None
        };
        let owner = r.text("owner")?;
        let payload = r.bytes()?;
        if !r.buf.is_empty() {
            return Err(format!("{} bytes after the record", r.buf.len()));
        }
        let text = |what: &str| {
            String::from_utf8(payload.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
        };
        let (state, in_progress, finished) = match state {
            0 => (RecordState::InProgress, true, false),
            1 => (RecordState::Released, false, false),
            2 => (
                RecordState::Completed {
                    result: Bytes::copy_from_slice(payload),
                },
                false,
                true,
            ),
            3..=5 => (
                RecordState::Failed {
                    error: text("error")?,
                    kind: FailureKind::ALL[usize::from(state - 3)],
                },
                false,
                true,
            ),
            other => return Err(format!("unknown state {other}")),
        };
        if lease_expires_at.is_some() != in_progress {
            return Err(format!(
                "a {} record {} a lease end",
                state.name(),
                if in_progress { "without" } else { "with" }
            ));
        }
        if expires_at.is_some() != finished {
            return Err(format!(
                "a {} record {} a retention deadline",
                state.name(),
                if finished { "without" } else { "with" }
            ));
        }
        if !finished && !payload.is_empty() {
            return Err(format!("a {} record with a payload", state.name()));
        }
        Ok(Record {
            key: key.clone(),
            state,
            fingerprint,
            token,
            owner,
            attempts,
            lease_expires_at,
            created_at,
            updated_at,
            expires_at,
        })
    })();
    body.map(Stored::Record).map_err(corrupt)
}

fn put_varint(out: &mut BytesMut, mut n: u64) {
    while n >= 0x80 {
        out.put_u8((n as u8) | 0x80);
        n >>= 7;
    }
    out.put_u8(n as u8);
}

/// Microseconds since the Unix epoch, negative before it, zigzag-encoded.
fn put_time(out: &mut BytesMut, t: SystemTime) {
    let micros: i64 = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
        Err(e) => i64::try_from(e.duration().as_micros()).map_or(i64::MIN, |m| -m),
    };
    put_varint(out, ((micros << 1) ^ (micros >> 63)) as u64);
}

/// `t` as a record keeps it ([`put_time`]): whole microseconds, cut towards the epoch. A time a
/// call returns (a lease's end) is given this way, so that it is the one the store holds.
pub(crate) fn stored_time(t: SystemTime) -> SystemTime {
    let whole = |d: Duration| Duration::new(d.as_secs(), d.subsec_micros() * 1000);
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => UNIX_EPOCH + whole(d),
        Err(e) => UNIX_EPOCH - whole(e.duration()),
    }
}

/// Microseconds since the Unix epoch of `t` (0 before it): the time term of new tokens.
pub(crate) fn micros(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.buf.len() < n {
            return Err(format!(
                "cut short: {n} bytes wanted, {} left",
                self.buf.len()
            ));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u64(&mut self) -> Result<u64, String> {
        let raw: [u8; 8] = self
            .take(8)?
            .try_into()
            .map_err(|_| "short integer".to_owned())?;
        Ok(u64::from_be_bytes(raw))
    }

    fn varint(&mut self) -> Result<u64, String> {
        let mut n: u64 = 0;
        for i in 0..10 {
            let b = self.u8()?;
            let bits = u64::from(b & 0x7f);
            if i == 9 && bits > 1 {
                return Err("varint over 64 bits".to_owned());
            }
            n |= bits << (7 * i);
            if b & 0x80 == 0 {
                return Ok(n);
            }
        }
        Err("varint over 10 bytes".to_owned())
    }

    fn time(&mut self) -> Result<SystemTime, String> {
        let z = self.varint()?;
        let micros = ((z >> 1) as i64) ^ -((z & 1) as i64);
        let d = Duration::from_micros(micros.unsigned_abs());
        let t = if micros >= 0 {
            UNIX_EPOCH.checked_add(d)
        } else {
            UNIX_EPOCH.checked_sub(d)
        };
        t.ok_or_else(|| format!("time {micros} µs is out of range"))
    }

    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let len = usize::try_from(self.varint()?).map_err(|_| "length too large".to_owned())?;
        self.take(len)
    }

    fn text(&mut self, what: &str) -> Result<String, String> {
        let raw = self.bytes()?;
        String::from_utf8(raw.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> IdempotencyKey {
        Namespace::new("n").unwrap().key("k").unwrap()
    }

    fn at(micros: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_micros(micros)
    }

    fn record(state: RecordState) -> Record {
        let finished = matches!(
            state,
            RecordState::Completed { .. } | RecordState::Failed { .. }
        );
        Record {
            key: key(),
            lease_expires_at: (state == RecordState::InProgress).then(|| at(1_700_000_030_000_000)),
            expires_at: finished.then(|| at(1_700_000_090_000_000)),
            state,
            fingerprint: Some(Fingerprint::of("payload")),
            token: FencingToken::new(1_700_000_000_000_123),
            owner: "worker-é€𝄞".into(),
            attempts: 3,
            created_at: at(1_600_000_000_000_000),
            updated_at: at(1_700_000_000_000_001),
        }
    }

    fn every_state() -> Vec<Stored> {
        let mut all = vec![
            Stored::Record(record(RecordState::InProgress)),
            Stored::Record(record(RecordState::Released)),
            Stored::Record(record(RecordState::Completed {
                result: Bytes::from((0..=255u8).collect::<Vec<_>>()),
            })),
            Stored::Record(record(RecordState::Completed {
                result: Bytes::new(),
            })),
            Stored::Tombstone(FencingToken::new(u64::MAX)),
        ];
        for kind in FailureKind::ALL {
            all.push(Stored::Record(record(RecordState::Failed {
                error: "declined \u{1}\u{10ffff}".into(),
                kind,
            })));
        }
        let mut bare = record(RecordState::Released);
        bare.fingerprint = None;
        bare.created_at = UNIX_EPOCH - Duration::from_micros(5);
        all.push(Stored::Record(bare));
        all
    }

    #[test]
    fn every_state_round_trips() {
        for stored in every_state() {
            let bytes = encode(&stored);
            assert_eq!(bytes[0], FORMAT);
            assert_eq!(decode("t", &key(), &bytes).unwrap(), stored, "{bytes:?}");
        }
    }

    #[test]
    fn records_are_compact() {
        let mut r = record(RecordState::Completed {
            result: Bytes::new(),
        });
        r.fingerprint = None;
        r.owner = "w".into();
        // format, state, token, flags, attempts, 3 times, owner, empty payload.
        assert!(encode(&Stored::Record(r)).len() <= 1 + 1 + 8 + 1 + 1 + 3 * 8 + 2 + 1);
        assert_eq!(encode(&Stored::Tombstone(FencingToken::new(7))).len(), 10);
    }

    #[test]
    fn foreign_values_are_corrupt_records() {
        let good = encode(&every_state()[2]);
        let mut cases: Vec<Vec<u8>> = vec![
            vec![],
            b"{\"state\":\"completed\"}".to_vec(),
            vec![2; 40],
            vec![FORMAT, 9, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0],
            vec![FORMAT, TOMBSTONE, 0, 0, 0, 0, 0, 0, 0, 1, 0],
        ];
        // Every cut of a good value, and the value with a byte more.
        for cut in 0..good.len() {
            cases.push(good[..cut].to_vec());
        }
        let mut longer = good.to_vec();
        longer.push(0);
        cases.push(longer);
        // Unknown flag bit.
        let mut flagged = good.to_vec();
        flagged[10] |= 0x80;
        cases.push(flagged);
        for case in cases {
            let r = decode("t", &key(), &case);
            assert!(
                matches!(r, Err(Error::CorruptRecord { store: "t", .. })),
                "{case:?}: {r:?}"
            );
        }
    }

    #[test]
    fn contradictory_fields_are_corrupt() {
        let mut no_lease = record(RecordState::InProgress);
        no_lease.lease_expires_at = None;
        let mut lease_when_done = record(RecordState::Completed {
            result: Bytes::new(),
        });
        lease_when_done.lease_expires_at = Some(at(1));
        let mut kept_released = record(RecordState::Released);
        kept_released.expires_at = Some(at(1));
        for r in [no_lease, lease_when_done, kept_released] {
            let bytes = encode(&Stored::Record(r));
            assert!(matches!(
                decode("t", &key(), &bytes),
                Err(Error::CorruptRecord { .. })
            ));
        }
        // Invalid UTF-8 in the owner.
        let mut bytes = encode(&every_state()[1]).to_vec();
        let owner_at = bytes.len() - 1 - "worker-é€𝄞".len();
        bytes[owner_at] = 0xff;
        assert!(matches!(
            decode("t", &key(), &bytes),
            Err(Error::CorruptRecord { .. })
        ));
    }

    #[test]
    fn storage_keys_round_trip() {
        let key = Namespace::new("a.b-c_1").unwrap().key("x:y\n€").unwrap();
        let raw = storage_key(&key);
        assert_eq!(raw, "a.b-c_1:x:y\n€".as_bytes());
        assert_eq!(parse_storage_key("t", &raw).unwrap(), key);
        assert!(raw.starts_with(&namespace_prefix(key.namespace())));
        for bad in [&b"no-colon"[..], b":id", b"ns:", b"n s:x", b"\xff:x"] {
            assert!(matches!(
                parse_storage_key("t", bad),
                Err(Error::CorruptRecord { .. })
            ));
        }
    }
}
