//! The state machine as pure functions over one record.
//!
//! [`MemoryStore`](crate::MemoryStore) runs these under a lock. A backend on any store that offers
//! an atomic read-modify-write of one item (a compare-and-swap key-value store, a transaction)
//! can run them too and inherit the exact semantics of the contract; backends that must express
//! the rules in their own language (Lua, SQL, DynamoDB conditions) mirror them and are held to
//! the same behaviour by the conformance suite.

use std::time::{Duration, SystemTime};

use crate::error::{Error, Result};
use crate::record::{AcquireOutcome, AcquireRequest, FencingToken, Lease, Record, RecordState};

/// What an acquire decided.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
#[allow(clippy::large_enum_variant)] // a short-lived return value; boxing would cost an allocation
pub enum AcquireDecision {
    /// Store this record (new or replacing the old one) and return the outcome.
    Write(Record, AcquireOutcome),
    /// Leave the stored record as it is and return the outcome.
    Keep(AcquireOutcome),
}

impl AcquireDecision {
    /// The outcome to return to the caller.
    pub fn outcome(&self) -> &AcquireOutcome {
        match self {
            Self::Write(_, outcome) | Self::Keep(outcome) => outcome,
        }
    }
}

/// Decides an acquire. `existing` is the stored record (records past retention count as absent);
/// `next_token` is called only when a new token is issued and must return a token higher than
/// every token the key ever had.
pub fn acquire(
    existing: Option<&Record>,
    req: &AcquireRequest,
    now: SystemTime,
    next_token: impl FnOnce() -> FencingToken,
) -> AcquireDecision {
    let existing = existing.filter(|r| !r.is_expired(now));
    let Some(record) = existing else {
        let lease = new_lease(req, next_token(), 1, now);
        let record = Record {
            key: req.key.clone(),
            state: RecordState::InProgress,
            fingerprint: req.fingerprint,
            token: lease.token,
            owner: req.owner.clone(),
            attempts: 1,
            lease_expires_at: Some(lease.expires_at),
            created_at: now,
            updated_at: now,
            expires_at: None,
        };
        return AcquireDecision::Write(
            record,
            AcquireOutcome::Acquired {
                lease,
                takeover: false,
            },
        );
    };
    if let (Some(stored), Some(asked)) = (record.fingerprint, req.fingerprint)
        && stored != asked
    {
        return AcquireDecision::Keep(AcquireOutcome::Conflict);
    }
    let reacquire = |takeover: bool| {
        let lease = new_lease(req, next_token(), record.attempts + 1, now);
        let mut next = record.clone();
        next.state = RecordState::InProgress;
        next.token = lease.token;
        next.owner = req.owner.clone();
        next.attempts = lease.attempt;
        next.lease_expires_at = Some(lease.expires_at);
        next.updated_at = now;
        next.expires_at = None;
        AcquireDecision::Write(next, AcquireOutcome::Acquired { lease, takeover })
    };
    let exhausted = |last_error: Option<String>| {
        AcquireDecision::Keep(AcquireOutcome::Exhausted {
            attempts: record.attempts,
            last_error,
        })
    };
    match &record.state {
        RecordState::InProgress => {
            let lease_end = record.lease_expires_at.unwrap_or(now);
            if lease_end > now {
                AcquireDecision::Keep(AcquireOutcome::InProgress {
                    owner: record.owner.clone(),
                    retry_after: lease_end.duration_since(now).unwrap_or(Duration::ZERO),
                })
            } else if record.attempts < req.max_attempts {
                reacquire(true)
            } else {
                exhausted(None)
            }
        }
        RecordState::Released if record.attempts < req.max_attempts => reacquire(false),
        RecordState::Released => exhausted(None),
        RecordState::Completed { result } => AcquireDecision::Keep(AcquireOutcome::Replayed {
            result: result.clone(),
        }),
        RecordState::Failed {
            retryable: true,
            error,
        } => {
            if record.attempts < req.max_attempts {
                reacquire(false)
            } else {
                exhausted(Some(error.clone()))
            }
        }
        RecordState::Failed {
            retryable: false,
            error,
        } => AcquireDecision::Keep(AcquireOutcome::Failed {
            error: error.clone(),
        }),
    }
}

fn new_lease(req: &AcquireRequest, token: FencingToken, attempt: u32, now: SystemTime) -> Lease {
    Lease {
        key: req.key.clone(),
        owner: req.owner.clone(),
        token,
        attempt,
        expires_at: now + req.lease_ttl,
    }
}

/// Checks that `lease` is the current holder of `existing`: the record exists, is not past
/// retention, is in progress and carries the lease's token.
///
/// # Errors
/// [`Error::LeaseLost`] otherwise.
pub fn check_fence<'r>(
    existing: Option<&'r mut Record>,
    lease: &Lease,
    now: SystemTime,
) -> Result<&'r mut Record> {
    match existing {
        Some(record)
            if !record.is_expired(now)
                && record.token == lease.token
                && record.state == RecordState::InProgress =>
        {
            Ok(record)
        }
        other => Err(Error::LeaseLost {
            key: lease.key.clone(),
            presented: lease.token,
            current: other.filter(|r| !r.is_expired(now)).map(|r| r.token),
        }),
    }
}

/// Applies a heartbeat to a record that passed [`check_fence`]; returns the extended lease.
pub fn extend(record: &mut Record, lease: &Lease, ttl: Duration, now: SystemTime) -> Lease {
    let expires_at = now + ttl;
    record.lease_expires_at = Some(expires_at);
    record.updated_at = now;
    Lease {
        expires_at,
        ..lease.clone()
    }
}

/// Applies a completion to a record that passed [`check_fence`].
pub fn complete(record: &mut Record, result: bytes::Bytes, retention: Duration, now: SystemTime) {
    record.state = RecordState::Completed { result };
    finish(record, retention, now);
}

/// Applies a failure to a record that passed [`check_fence`].
pub fn fail(
    record: &mut Record,
    error: &str,
    retryable: bool,
    retention: Duration,
    now: SystemTime,
) {
    record.state = RecordState::Failed {
        error: error.to_owned(),
        retryable,
    };
    finish(record, retention, now);
}

fn finish(record: &mut Record, retention: Duration, now: SystemTime) {
    record.lease_expires_at = None;
    record.updated_at = now;
    record.expires_at = Some(now + retention);
}

/// Applies a release to a record that passed [`check_fence`]: the attempt is not counted.
pub fn release(record: &mut Record, now: SystemTime) {
    record.state = RecordState::Released;
    record.attempts = record.attempts.saturating_sub(1);
    record.lease_expires_at = None;
    record.updated_at = now;
}
