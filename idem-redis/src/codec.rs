//! Storage keys, and decoding of script replies.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use idem_core::{
    AcquireOutcome, Error, FailureKind, FencingToken, Fingerprint, IdempotencyKey, Lease, Record,
    RecordState, StateKind,
};
use redis::Value;

/// `{prefix}{namespace}:{id}`. Namespaces hold only `[A-Za-z0-9._-]`, so the first `:` after the
/// prefix always ends the namespace and two different keys never share a storage key.
pub(crate) fn storage_key(prefix: &str, key: &IdempotencyKey) -> Vec<u8> {
    let ns = key.namespace().as_str();
    let id = key.id();
    let mut out = Vec::with_capacity(prefix.len() + ns.len() + 1 + id.len());
    out.extend_from_slice(prefix.as_bytes());
    out.extend_from_slice(ns.as_bytes());
    out.push(b':');
    out.extend_from_slice(id.as_bytes());
    out
}

/// Whole milliseconds of a duration, as the scripts take them (validated durations are >= 1 ms).
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A decoding failure, turned into [`Error::CorruptRecord`] by the caller that knows the key.
#[derive(Debug)]
pub(crate) struct Bad(pub(crate) String);

fn bad(reason: impl Into<String>) -> Bad {
    Bad(reason.into())
}

pub(crate) fn corrupt(store: &'static str, storage_key: &[u8], Bad(reason): Bad) -> Error {
    Error::corrupt(store, String::from_utf8_lossy(storage_key), reason)
}

/// The state codes of the packed record (the low 3 bits of its head byte; see the crate docs).
/// 6 is reserved and 7 is a tombstone, which no script reports as a record.
const IN_PROGRESS: i64 = 0;
const RELEASED: i64 = 1;
const COMPLETED: i64 = 2;
const FAILED_RETRYABLE: i64 = 3;
const FAILED_TERMINAL: i64 = 4;
const FAILED_NOT_STORED: i64 = 5;

/// The state a script reported by its code.
pub(crate) fn state_kind(code: i64) -> Result<StateKind, Bad> {
    Ok(match code {
        IN_PROGRESS => StateKind::InProgress,
        RELEASED => StateKind::Released,
        COMPLETED => StateKind::Completed,
        FAILED_RETRYABLE => StateKind::Failed(FailureKind::Retryable),
        FAILED_TERMINAL => StateKind::Failed(FailureKind::Terminal),
        FAILED_NOT_STORED => StateKind::Failed(FailureKind::ResultNotStored),
        other => return Err(bad(format!("unknown state {other}"))),
    })
}

/// The state code `fail.lua` stores for `kind`; `None` for a kind this version does not know.
pub(crate) fn failed_state(kind: FailureKind) -> Option<i64> {
    match kind {
        FailureKind::Retryable => Some(FAILED_RETRYABLE),
        FailureKind::Terminal => Some(FAILED_TERMINAL),
        FailureKind::ResultNotStored => Some(FAILED_NOT_STORED),
        _ => None,
    }
}

fn failure_kind(code: i64) -> Result<FailureKind, Bad> {
    match state_kind(code)? {
        StateKind::Failed(kind) => Ok(kind),
        other => Err(bad(format!("state {code} ({other}) is not a failure"))),
    }
}

fn int(v: &Value) -> Result<i64, Bad> {
    match v {
        Value::Int(i) => Ok(*i),
        Value::BulkString(b) => parse_int(b),
        Value::SimpleString(s) => parse_int(s.as_bytes()),
        other => Err(bad(format!("expected an integer, got {other:?}"))),
    }
}

fn parse_int(b: &[u8]) -> Result<i64, Bad> {
    std::str::from_utf8(b)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad(format!("not an integer: {:?}", String::from_utf8_lossy(b))))
}

fn uint<T: TryFrom<i64>>(v: &Value, what: &str) -> Result<T, Bad> {
    let i = int(v)?;
    T::try_from(i).map_err(|_| bad(format!("{what} out of range: {i}")))
}

fn bytes(v: &Value) -> Result<Vec<u8>, Bad> {
    match v {
        Value::BulkString(b) => Ok(b.clone()),
        Value::SimpleString(s) => Ok(s.clone().into_bytes()),
        Value::Int(i) => Ok(i.to_string().into_bytes()),
        other => Err(bad(format!("expected a string, got {other:?}"))),
    }
}

fn text(v: &Value, what: &str) -> Result<String, Bad> {
    String::from_utf8(bytes(v)?).map_err(|_| bad(format!("{what} is not UTF-8")))
}

fn array(v: &Value) -> Result<&[Value], Bad> {
    match v {
        Value::Array(items) => Ok(items),
        other => Err(bad(format!("expected an array, got {other:?}"))),
    }
}

fn at(items: &[Value], i: usize) -> Result<&Value, Bad> {
    items.get(i).ok_or_else(|| {
        bad(format!(
            "reply has {} elements, wanted index {i}",
            items.len()
        ))
    })
}

/// Milliseconds since the Unix epoch as a time.
fn time(ms: i64) -> Result<SystemTime, Bad> {
    u64::try_from(ms)
        .map(|ms| UNIX_EPOCH + Duration::from_millis(ms))
        .map_err(|_| bad(format!("time before the epoch: {ms} ms")))
}

/// Decodes the reply of `acquire.lua` (see the reply table at the top of that script).
pub(crate) fn acquire_outcome(
    reply: &Value,
    key: &IdempotencyKey,
    owner: &str,
) -> Result<AcquireOutcome, Bad> {
    let items = array(reply)?;
    Ok(match int(at(items, 0)?)? {
        0 => AcquireOutcome::Acquired {
            lease: Lease {
                key: key.clone(),
                owner: owner.to_owned(),
                token: FencingToken::new(uint(at(items, 1)?, "token")?),
                attempt: uint(at(items, 2)?, "attempt")?,
                expires_at: time(int(at(items, 3)?)?)?,
            },
            takeover: int(at(items, 4)?)? == 1,
        },
        1 => AcquireOutcome::InProgress {
            owner: text(at(items, 1)?, "owner")?,
            retry_after: Duration::from_millis(uint(at(items, 2)?, "retry_after")?),
        },
        2 => AcquireOutcome::Replayed {
            result: Bytes::from(bytes(at(items, 1)?)?),
        },
        3 => AcquireOutcome::Conflict,
        4 => AcquireOutcome::Exhausted {
            attempts: uint(at(items, 1)?, "attempts")?,
            last_error: match int(at(items, 2)?)? {
                1 => Some(text(at(items, 3)?, "error")?),
                _ => None,
            },
        },
        5 => match failure_kind(int(at(items, 2)?)?)? {
            FailureKind::Retryable => return Err(bad("a retryable failure replayed as terminal")),
            kind => AcquireOutcome::Failed {
                error: text(at(items, 1)?, "error")?,
                kind,
            },
        },
        kind => return Err(bad(format!("unknown acquire reply kind {kind}"))),
    })
}

/// Decodes the compact reply of an acquire that a batch's fast path made (`lua/acquire_fast.lua`,
/// the reply forms in `lua/batch.lua`): the token alone, of a first attempt with no takeover,
/// whose lease ends `lease_ms` (what the item sent) after the token's base, `floor(token / 1000)`
/// milliseconds since the epoch. The same outcome as `acquire_outcome` of the body's
/// `{0, token, 1, lease end, 0}`.
pub(crate) fn fast_acquired(
    token: i64,
    key: &IdempotencyKey,
    owner: &str,
    lease_ms: u64,
) -> Result<AcquireOutcome, Bad> {
    let token = u64::try_from(token).map_err(|_| bad(format!("token out of range: {token}")))?;
    let expires_at = (token / 1000)
        .checked_add(lease_ms)
        .and_then(|ms| i64::try_from(ms).ok())
        .ok_or_else(|| {
            bad(format!(
                "lease end out of range: token {token}, lease {lease_ms} ms"
            ))
        })?;
    Ok(AcquireOutcome::Acquired {
        lease: Lease {
            key: key.clone(),
            owner: owner.to_owned(),
            token: FencingToken::new(token),
            attempt: 1,
            expires_at: time(expires_at)?,
        },
        takeover: false,
    })
}

/// What a fenced script (`extend`, `complete`, `fail`, `release`) answered.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Fenced {
    /// The transition was applied; `extend` also returns the new lease end (ms).
    Applied(Option<i64>),
    /// The lease is not current: the token and state of the record found instead, or `None`
    /// when there is none (absent, a tombstone or past retention).
    Lost(Option<(FencingToken, StateKind)>),
    /// `complete_with` only: the handler's write `index` (from 0) cannot apply, for `reason`;
    /// nothing was written.
    Refused { index: usize, reason: String },
}

/// Decodes the reply of a fenced script: `{1}` or `{1, lease_end_ms}` when applied (or replayed),
/// `{0}` when refused with no record, `{0, token, state}` when refused with a record, and (from
/// `complete_with`) `{2, i, reason}` when write `i` (from 1) cannot apply.
pub(crate) fn fenced(reply: &Value) -> Result<Fenced, Bad> {
    let items = array(reply)?;
    match int(at(items, 0)?)? {
        1 => Ok(Fenced::Applied(items.get(1).map(int).transpose()?)),
        0 if items.len() == 1 => Ok(Fenced::Lost(None)),
        0 => Ok(Fenced::Lost(Some((
            FencingToken::new(uint(at(items, 1)?, "token")?),
            state_kind(int(at(items, 2)?)?)?,
        )))),
        2 => {
            let index: usize = uint(at(items, 1)?, "write index")?;
            Ok(Fenced::Refused {
                index: index
                    .checked_sub(1)
                    .ok_or_else(|| bad("write index 0 (they count from 1)"))?,
                reason: String::from_utf8_lossy(&bytes(at(items, 2)?)?).into_owned(),
            })
        }
        kind => Err(bad(format!("unknown transition reply kind {kind}"))),
    }
}

/// Lease end in ms from an applied `extend`.
pub(crate) fn lease_end(ms: Option<i64>) -> Result<SystemTime, Bad> {
    time(ms.ok_or_else(|| bad("extend reply without the lease end"))?)
}

/// Decodes the reply of `get.lua`: nil, or `{state, token, attempts, created, updated, lease
/// end or -1, fingerprint or '', owner, result or error, expires_at or -1}` (times in ms since the
/// Unix epoch). The script unpacks the stored record; this only types the fields.
pub(crate) fn record(reply: &Value, key: &IdempotencyKey) -> Result<Option<Record>, Bad> {
    let items = match reply {
        Value::Nil => return Ok(None),
        other => array(other)?,
    };
    if items.len() != 10 {
        return Err(bad(format!(
            "get reply has {} elements, not 10",
            items.len()
        )));
    }
    let payload = bytes(&items[8])?;
    let state = match state_kind(int(&items[0])?)? {
        StateKind::InProgress => RecordState::InProgress,
        StateKind::Released => RecordState::Released,
        StateKind::Completed => RecordState::Completed {
            result: Bytes::from(payload),
        },
        StateKind::Failed(kind) => RecordState::Failed {
            error: String::from_utf8(payload).map_err(|_| bad("error is not UTF-8"))?,
            kind,
        },
        other => return Err(bad(format!("unexpected state {other}"))),
    };
    let fingerprint = match bytes(&items[6])? {
        fp if fp.is_empty() => None,
        fp => Some(Fingerprint::try_from(&fp[..]).map_err(|e| bad(e.to_string()))?),
    };
    let optional_time = |v: &Value| match int(v)? {
        ms if ms >= 0 => time(ms).map(Some),
        _ => Ok(None),
    };
    Ok(Some(Record {
        key: key.clone(),
        state,
        fingerprint,
        token: FencingToken::new(uint(&items[1], "token")?),
        owner: text(&items[7], "owner")?,
        attempts: uint(&items[2], "attempts")?,
        lease_expires_at: optional_time(&items[5])?,
        created_at: time(int(&items[3])?)?,
        updated_at: time(int(&items[4])?)?,
        expires_at: optional_time(&items[9])?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::Namespace;

    fn key() -> IdempotencyKey {
        Namespace::new("ns").unwrap().key("it's {a}:b").unwrap()
    }

    fn s(v: &str) -> Value {
        Value::BulkString(v.as_bytes().to_vec())
    }

    #[test]
    fn storage_key_is_prefix_namespace_colon_id() {
        assert_eq!(storage_key("idem:", &key()), b"idem:ns:it's {a}:b".to_vec());
    }

    #[test]
    fn decodes_a_get_reply() {
        let token = 1_700_000_000_123_456u64;
        let fp = Fingerprint::of("payload");
        let reply = Value::Array(vec![
            Value::Int(2),
            Value::Int(i64::try_from(token).unwrap()),
            Value::Int(2),
            Value::Int(1_700_000_000_100),
            Value::Int(1_700_000_000_130),
            Value::Int(-1),
            Value::BulkString(fp.as_bytes().to_vec()),
            s("w1"),
            s(""),
            Value::Int(1_700_000_100_000),
        ]);
        let r = record(&reply, &key()).unwrap().unwrap();
        let at = |ms: u64| UNIX_EPOCH + Duration::from_millis(ms);
        assert_eq!(r.token, FencingToken::new(token));
        assert_eq!(r.attempts, 2);
        assert_eq!(
            r.state,
            RecordState::Completed {
                result: Bytes::new()
            }
        );
        assert_eq!(r.fingerprint, Some(fp));
        assert_eq!(r.owner, "w1");
        assert_eq!(r.created_at, at(1_700_000_000_100));
        assert_eq!(r.updated_at, at(1_700_000_000_130));
        assert_eq!(r.lease_expires_at, None);
        assert_eq!(r.expires_at, Some(at(1_700_000_100_000)));
    }

    #[test]
    fn malformed_get_replies_are_corrupt() {
        let short = Value::Array(vec![Value::Int(0), Value::Int(12345)]);
        assert!(record(&short, &key()).is_err());
        let mut items = vec![
            Value::Int(7),
            Value::Int(12345),
            Value::Int(1),
            Value::Int(1),
            Value::Int(1),
            Value::Int(-1),
            s(""),
            s("w"),
            s(""),
            Value::Int(-1),
        ];
        assert!(
            record(&Value::Array(items.clone()), &key()).is_err(),
            "state 7"
        );
        items[0] = Value::Int(0);
        items[6] = s("not 32 bytes");
        assert!(record(&Value::Array(items), &key()).is_err(), "fingerprint");
        assert_eq!(record(&Value::Nil, &key()).unwrap(), None);
    }

    #[test]
    fn decodes_acquire_replies() {
        let k = key();
        let acquired = Value::Array(vec![
            Value::Int(0),
            Value::Int(42),
            Value::Int(3),
            Value::Int(5_000),
            Value::Int(1),
        ]);
        match acquire_outcome(&acquired, &k, "me").unwrap() {
            AcquireOutcome::Acquired { lease, takeover } => {
                assert!(takeover);
                assert_eq!(lease.token, FencingToken::new(42));
                assert_eq!(lease.attempt, 3);
                assert_eq!(lease.owner, "me");
                assert_eq!(lease.expires_at, UNIX_EPOCH + Duration::from_secs(5));
            }
            other => panic!("{other:?}"),
        }
        let exhausted = Value::Array(vec![Value::Int(4), Value::Int(5), Value::Int(0), s("")]);
        assert_eq!(
            acquire_outcome(&exhausted, &k, "me").unwrap(),
            AcquireOutcome::Exhausted {
                attempts: 5,
                last_error: None
            }
        );
        assert!(acquire_outcome(&Value::Array(vec![Value::Int(9)]), &k, "me").is_err());
        assert_eq!(
            acquire_outcome(
                &Value::Array(vec![Value::Int(5), s("why"), Value::Int(5)]),
                &k,
                "me"
            )
            .unwrap(),
            AcquireOutcome::Failed {
                error: "why".into(),
                kind: FailureKind::ResultNotStored
            }
        );
        assert_eq!(
            acquire_outcome(
                &Value::Array(vec![Value::Int(5), s("why"), Value::Int(4)]),
                &k,
                "me"
            )
            .unwrap(),
            AcquireOutcome::Failed {
                error: "why".into(),
                kind: FailureKind::Terminal
            }
        );
        for not_terminal in [0, 2, 3, 6] {
            let reply = Value::Array(vec![Value::Int(5), s("why"), Value::Int(not_terminal)]);
            assert!(acquire_outcome(&reply, &k, "me").is_err(), "{not_terminal}");
        }
    }

    #[test]
    fn decodes_fenced_replies() {
        assert_eq!(
            fenced(&Value::Array(vec![Value::Int(0)])).unwrap(),
            Fenced::Lost(None)
        );
        assert_eq!(
            fenced(&Value::Array(vec![
                Value::Int(0),
                Value::Int(42),
                Value::Int(5)
            ]))
            .unwrap(),
            Fenced::Lost(Some((
                FencingToken::new(42),
                StateKind::Failed(FailureKind::ResultNotStored)
            )))
        );
        assert_eq!(
            fenced(&Value::Array(vec![Value::Int(1), Value::Int(7)])).unwrap(),
            Fenced::Applied(Some(7))
        );
        assert_eq!(
            fenced(&Value::Array(vec![Value::Int(2), Value::Int(3), s("why")])).unwrap(),
            Fenced::Refused {
                index: 2,
                reason: "why".into()
            }
        );
        assert!(fenced(&Value::Array(vec![Value::Int(2), Value::Int(0), s("why")])).is_err());
        assert!(fenced(&Value::Array(vec![Value::Int(0), Value::Int(42)])).is_err());
        assert!(
            fenced(&Value::Array(vec![
                Value::Int(0),
                Value::Int(42),
                Value::Int(7)
            ]))
            .is_err()
        );
    }

    #[test]
    fn state_codes_cover_every_state_kind_once() {
        let mut seen = Vec::new();
        for code in 0..8 {
            if let Ok(kind) = state_kind(code) {
                assert!(!seen.contains(&kind), "{kind} twice");
                seen.push(kind);
            }
        }
        assert_eq!(seen, StateKind::ALL.to_vec());
        for kind in FailureKind::ALL {
            let code = failed_state(kind).unwrap();
            assert_eq!(state_kind(code).unwrap(), StateKind::Failed(kind));
        }
    }
}
