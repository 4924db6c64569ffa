//! Tokens, leases, records, requests and acquire outcomes.

use std::fmt;
use std::time::{Duration, SystemTime};

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;

/// Longest owner id accepted, in bytes.
pub const MAX_OWNER_LEN: usize = 128;
/// Longest lease accepted (one day): a longer one means a stalled worker holds a key for days.
pub const MAX_LEASE_TTL: Duration = Duration::from_secs(24 * 3600);
/// Longest retention accepted (about ten years).
pub const MAX_RETENTION: Duration = Duration::from_secs(3650 * 24 * 3600);
/// Default largest stored result, in bytes (256 KiB).
pub const DEFAULT_MAX_RESULT_LEN: usize = 256 * 1024;
/// Default largest stored error message, in bytes (4 KiB).
pub const DEFAULT_MAX_ERROR_LEN: usize = 4 * 1024;

/// A per-key fencing token: strictly increasing over the key's whole life, including after the
/// record was deleted or expired. Issued by the store at every acquisition and takeover; every
/// later transition of that acquisition presents it, and the store refuses any but the current one.
///
/// Handlers can fence their own writes with it: a downstream system that keeps the highest token
/// seen per key and refuses lower ones cannot be written by a worker that lost its lease.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token.
    pub const fn new(raw: u64) -> Self {
        Self(raw)
    }

    /// The raw value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// The right, held by one owner, to run the work of one key and then record its outcome.
///
/// Expiry is only an opportunity for someone else to take over: until a takeover happens the
/// holder's token stays valid and its transitions succeed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The key held.
    pub key: IdempotencyKey,
    /// Who holds it.
    pub owner: String,
    /// The token every transition of this acquisition presents.
    pub token: FencingToken,
    /// Which attempt this is (1 for the first).
    pub attempt: u32,
    /// When the lease expires, on the store's clock.
    pub expires_at: SystemTime,
}

/// The state of a stored record.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordState {
    /// A worker holds (or held, if its lease expired) the key.
    InProgress,
    /// The holder gave the key back with [`release`](crate::IdempotencyStore::release) without
    /// counting an attempt. The next acquire takes it as attempt `attempts + 1` with no takeover.
    Released,
    /// The work finished; the stored result is replayed to every duplicate.
    Completed {
        /// The stored result, replayed byte for byte.
        result: Bytes,
    },
    /// The work failed.
    Failed {
        /// The stored error message.
        error: String,
        /// Whether a later acquire may run the work again (until attempts run out).
        retryable: bool,
    },
}

impl RecordState {
    /// A short name: `in_progress`, `released`, `completed`, `failed_retryable`, `failed_terminal`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::InProgress => "in_progress",
            Self::Released => "released",
            Self::Completed { .. } => "completed",
            Self::Failed {
                retryable: true, ..
            } => "failed_retryable",
            Self::Failed {
                retryable: false, ..
            } => "failed_terminal",
        }
    }
}

/// Everything a store keeps for one key, as [`get`](crate::IdempotencyStore::get) shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The key.
    pub key: IdempotencyKey,
    /// The state, with the stored result or error.
    pub state: RecordState,
    /// The fingerprint of the first acquisition, or `None` when the caller opted out.
    pub fingerprint: Option<Fingerprint>,
    /// The current fencing token.
    pub token: FencingToken,
    /// The last owner that acquired the key.
    pub owner: String,
    /// Attempts counted so far (acquisitions, less the released ones).
    pub attempts: u32,
    /// When the current lease expires; `Some` only while [`RecordState::InProgress`].
    pub lease_expires_at: Option<SystemTime>,
    /// When the key was first acquired.
    pub created_at: SystemTime,
    /// When the record last changed.
    pub updated_at: SystemTime,
    /// Retention deadline: past it the record is treated as absent by every operation. `None`
    /// while in progress or released: such records are kept until completed, failed or deleted,
    /// so that the attempt count of a poison message is never lost.
    pub expires_at: Option<SystemTime>,
}

impl Record {
    /// Whether the record is past its retention deadline at `now`.
    pub fn is_expired(&self, now: SystemTime) -> bool {
        self.expires_at.is_some_and(|at| at <= now)
    }
}

/// Size limits a store enforces before writing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// Largest result accepted by [`complete`](crate::IdempotencyStore::complete), in bytes.
    pub max_result_len: usize,
    /// Largest error message accepted by [`fail`](crate::IdempotencyStore::fail), in bytes.
    pub max_error_len: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_result_len: DEFAULT_MAX_RESULT_LEN,
            max_error_len: DEFAULT_MAX_ERROR_LEN,
        }
    }
}

impl Limits {
    /// Sets the largest result accepted.
    pub fn with_max_result_len(mut self, len: usize) -> Self {
        self.max_result_len = len;
        self
    }

    /// Sets the largest error message accepted.
    pub fn with_max_error_len(mut self, len: usize) -> Self {
        self.max_error_len = len;
        self
    }

    /// Checks a result against [`Limits::max_result_len`].
    ///
    /// # Errors
    /// [`Error::ResultTooLarge`].
    pub fn check_result(&self, result: &[u8]) -> Result<()> {
        if result.len() > self.max_result_len {
            return Err(Error::ResultTooLarge {
                len: result.len(),
                max: self.max_result_len,
            });
        }
        Ok(())
    }

    /// Checks an error message against [`Limits::max_error_len`].
    ///
    /// # Errors
    /// [`Error::InvalidInput`] with field `error`.
    pub fn check_error(&self, error: &str) -> Result<()> {
        if error.len() > self.max_error_len {
            return Err(Error::invalid(
                "error",
                format!(
                    "is {} bytes, the maximum is {}",
                    error.len(),
                    self.max_error_len
                ),
            ));
        }
        Ok(())
    }
}

/// Checks a lease length: at least one millisecond, at most [`MAX_LEASE_TTL`].
///
/// # Errors
/// [`Error::InvalidInput`] with field `lease_ttl`.
pub fn check_lease_ttl(ttl: Duration) -> Result<()> {
    if ttl < Duration::from_millis(1) || ttl > MAX_LEASE_TTL {
        return Err(Error::invalid(
            "lease_ttl",
            format!("is {ttl:?}; it must be between 1ms and {MAX_LEASE_TTL:?}"),
        ));
    }
    Ok(())
}

/// Checks a retention: at least one millisecond, at most [`MAX_RETENTION`].
///
/// # Errors
/// [`Error::InvalidInput`] with field `retention`.
pub fn check_retention(retention: Duration) -> Result<()> {
    if retention < Duration::from_millis(1) || retention > MAX_RETENTION {
        return Err(Error::invalid(
            "retention",
            format!("is {retention:?}; it must be between 1ms and {MAX_RETENTION:?}"),
        ));
    }
    Ok(())
}

/// The arguments of one [`acquire`](crate::IdempotencyStore::acquire).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AcquireRequest {
    /// The key to acquire.
    pub key: IdempotencyKey,
    /// The payload fingerprint, or `None` when the namespace opted out of conflict detection.
    pub fingerprint: Option<Fingerprint>,
    /// Who asks (reported to others as the busy owner).
    pub owner: String,
    /// How long the lease lasts before someone else may take over.
    pub lease_ttl: Duration,
    /// Attempts (failures and crashes) after which the key is [`Exhausted`](AcquireOutcome::Exhausted).
    pub max_attempts: u32,
}

impl AcquireRequest {
    /// A request with no fingerprint, a 30 s lease and 5 attempts.
    pub fn new(key: IdempotencyKey, owner: impl Into<String>) -> Self {
        Self {
            key,
            fingerprint: None,
            owner: owner.into(),
            lease_ttl: Duration::from_secs(30),
            max_attempts: 5,
        }
    }

    /// Sets the fingerprint.
    pub fn with_fingerprint(mut self, fingerprint: impl Into<Option<Fingerprint>>) -> Self {
        self.fingerprint = fingerprint.into();
        self
    }

    /// Sets the lease length.
    pub fn with_lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// Sets the maximum number of attempts.
    pub fn with_max_attempts(mut self, max: u32) -> Self {
        self.max_attempts = max;
        self
    }

    /// Checks owner, lease length and attempts; stores call this before touching anything.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] naming the field.
    pub fn validate(&self) -> Result<()> {
        check_owner(&self.owner)?;
        check_lease_ttl(self.lease_ttl)?;
        if self.max_attempts == 0 {
            return Err(Error::invalid("max_attempts", "must be at least 1"));
        }
        Ok(())
    }
}

/// Checks an owner id: 1 to [`MAX_OWNER_LEN`] bytes, no NUL.
///
/// # Errors
/// [`Error::InvalidInput`] with field `owner`.
pub fn check_owner(owner: &str) -> Result<()> {
    if owner.is_empty() || owner.len() > MAX_OWNER_LEN || owner.contains('\0') {
        return Err(Error::invalid(
            "owner",
            format!("must be 1 to {MAX_OWNER_LEN} bytes without NUL"),
        ));
    }
    Ok(())
}

/// What one [`acquire`](crate::IdempotencyStore::acquire) found and did. Exactly one of these,
/// as the table in [`IdempotencyStore`](crate::IdempotencyStore)'s contract says.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AcquireOutcome {
    /// The caller holds the key now and must run the work.
    Acquired {
        /// The lease to present to every later transition.
        lease: Lease,
        /// Whether an expired lease of another attempt was taken over.
        takeover: bool,
    },
    /// Another worker holds a live lease.
    InProgress {
        /// Who holds it.
        owner: String,
        /// Time until that lease expires (on the store's clock).
        retry_after: Duration,
    },
    /// The work completed before: here is its stored result, byte for byte.
    Replayed {
        /// The stored result.
        result: Bytes,
    },
    /// The key was seen with a different fingerprint. The record was not touched.
    Conflict,
    /// The work failed or crashed `attempts` times, reaching the maximum: a poison message for a
    /// dead-letter path. Returned to every later acquire as well.
    Exhausted {
        /// Attempts made.
        attempts: u32,
        /// The last stored error; `None` when the last attempt crashed or stalled past its lease.
        last_error: Option<String>,
    },
    /// The work failed terminally before; the error is replayed and the work never re-run.
    Failed {
        /// The stored error.
        error: String,
    },
}

impl AcquireOutcome {
    /// A short name for logs and metrics: `acquired`, `in_progress`, `replayed`, `conflict`,
    /// `exhausted`, `failed`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Acquired { .. } => "acquired",
            Self::InProgress { .. } => "in_progress",
            Self::Replayed { .. } => "replayed",
            Self::Conflict => "conflict",
            Self::Exhausted { .. } => "exhausted",
            Self::Failed { .. } => "failed",
        }
    }
}
