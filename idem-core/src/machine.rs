//! The state machine as pure functions over one record.
//!
//! [`MemoryStore`](crate::MemoryStore) runs these under a lock. A backend on any store that offers
//! an atomic read-modify-write of one item (a compare-and-swap key-value store, a transaction)
//! can run them too and inherit the exact semantics of the contract; backends that must express
//! the rules in their own language (Lua, SQL, DynamoDB conditions) mirror them and are held to
//! the same behaviour by the conformance suite.

use std::time::{Duration, SystemTime};

use crate::error::{Error, Result};
use crate::record::{
    AcquireOutcome, AcquireRequest, FailureKind, FencingToken, Lease, Record, RecordState,
};

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
            kind: FailureKind::Retryable,
            error,
        } => {
            if record.attempts < req.max_attempts {
                reacquire(false)
            } else {
                exhausted(Some(error.clone()))
            }
        }
        RecordState::Failed { error, kind } => AcquireDecision::Keep(AcquireOutcome::Failed {
            error: error.clone(),
            kind: *kind,
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
/// [`Error::LeaseLost`] otherwise, saying what was found ([`lost`]).
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
        other => Err(lost(other.map(|r| &*r), lease, now)),
    }
}

/// The [`Error::LeaseLost`] for a refused transition of `lease`, given the stored record
/// (records past retention count as absent).
pub fn lost(existing: Option<&Record>, lease: &Lease, now: SystemTime) -> Error {
    let found = existing
        .filter(|r| !r.is_expired(now))
        .map(|r| (r.token, r.state.kind()));
    Error::lease_lost(lease, found)
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

/// A fenced transition that finishes an acquisition, with its arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Finish<'a> {
    /// `complete(lease, result, retention)`.
    Complete {
        /// The result to store.
        result: &'a bytes::Bytes,
        /// How long to keep the record.
        retention: Duration,
    },
    /// `fail(lease, error, kind, retention)`.
    Fail {
        /// The error text to store.
        error: &'a str,
        /// How the attempt failed.
        kind: FailureKind,
        /// How long to keep the record.
        retention: Duration,
    },
    /// `release(lease)`.
    Release,
}

impl Finish<'_> {
    /// Whether `record`, carrying the caller's token, is exactly what this transition leaves
    /// behind: the same result bytes, the same error and kind, or released. A transition
    /// re-sent after it took effect (a lost reply) then answers `Ok` and changes nothing.
    pub fn is_done_in(&self, record: &Record) -> bool {
        match (self, &record.state) {
            (Self::Complete { result, .. }, RecordState::Completed { result: stored }) => {
                stored == *result
            }
            (
                Self::Fail { error, kind, .. },
                RecordState::Failed {
                    error: stored,
                    kind: stored_kind,
                },
            ) => stored == error && stored_kind == kind,
            (Self::Release, RecordState::Released) => true,
            _ => false,
        }
    }
}

/// What a [`finish`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Finished {
    /// The record changed and must be stored.
    Applied,
    /// The same transition had already finished the record with this token (a re-send after a
    /// lost reply): nothing changed and nothing needs storing; the caller answers `Ok`.
    Replayed,
}

/// Runs a finishing transition (section "Fenced transitions" of the contract, with the v2 replay
/// rule): on the caller's live record it applies `how`; on a record the same transition already
/// finished with the caller's token it changes nothing and answers [`Finished::Replayed`].
///
/// # Errors
/// [`Error::LeaseLost`] in every other case, saying what was found.
pub fn finish(
    existing: Option<&mut Record>,
    lease: &Lease,
    how: Finish<'_>,
    now: SystemTime,
) -> Result<Finished> {
    let Some(record) = existing.filter(|r| !r.is_expired(now)) else {
        return Err(Error::lease_lost(lease, None));
    };
    if record.token == lease.token {
        if record.state == RecordState::InProgress {
            apply_finish(record, how, now);
            return Ok(Finished::Applied);
        }
        if how.is_done_in(record) {
            return Ok(Finished::Replayed);
        }
    }
    Err(lost(Some(record), lease, now))
}

fn apply_finish(record: &mut Record, how: Finish<'_>, now: SystemTime) {
    match how {
        Finish::Complete { result, retention } => {
            record.state = RecordState::Completed {
                result: result.clone(),
            };
            finish_at(record, retention, now);
        }
        Finish::Fail {
            error,
            kind,
            retention,
        } => {
            record.state = RecordState::Failed {
                error: error.to_owned(),
                kind,
            };
            finish_at(record, retention, now);
        }
        Finish::Release => {
            record.state = RecordState::Released;
            record.attempts = record.attempts.saturating_sub(1);
            record.lease_expires_at = None;
            record.updated_at = now;
        }
    }
}

fn finish_at(record: &mut Record, retention: Duration, now: SystemTime) {
    record.lease_expires_at = None;
    record.updated_at = now;
    record.expires_at = Some(now + retention);
}
