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
/// Default largest batch of keys one batch call takes (`acquire_many`, `complete_many`, ...).
pub const DEFAULT_MAX_BATCH: usize = 100;

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

/// How a failed attempt ended, as stored with the record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureKind {
    /// A later acquire may run the work again, until attempts run out.
    Retryable,
    /// The work must never run again; every later acquire gets the stored error.
    Terminal,
    /// The handler succeeded and its effect was applied, but its result could not be stored
    /// (too large, or it did not encode). Terminal: the work must never run again, and the
    /// stored text is only the reason the result was not kept.
    ResultNotStored,
}

impl FailureKind {
    /// Whether a later acquire may run the work again.
    pub fn is_retryable(self) -> bool {
        matches!(self, Self::Retryable)
    }

    /// A short name: `retryable`, `terminal`, `result_not_stored`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Retryable => "retryable",
            Self::Terminal => "terminal",
            Self::ResultNotStored => "result_not_stored",
        }
    }

    /// Every kind, for stores that encode the kind as a small number or a name.
    pub const ALL: [FailureKind; 3] = [Self::Retryable, Self::Terminal, Self::ResultNotStored];
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
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
        /// How it failed: whether a later acquire may run the work again.
        kind: FailureKind,
    },
}

impl RecordState {
    /// The state without its data.
    pub fn kind(&self) -> StateKind {
        match self {
            Self::InProgress => StateKind::InProgress,
            Self::Released => StateKind::Released,
            Self::Completed { .. } => StateKind::Completed,
            Self::Failed { kind, .. } => StateKind::Failed(*kind),
        }
    }

    /// A short name: `in_progress`, `released`, `completed`, `failed_retryable`,
    /// `failed_terminal`, `failed_result_not_stored`.
    pub fn name(&self) -> &'static str {
        self.kind().name()
    }
}

/// A record's state without its data: what [`LostLease`](crate::LostLease) reports and what
/// operators filter on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StateKind {
    /// [`RecordState::InProgress`].
    InProgress,
    /// [`RecordState::Released`].
    Released,
    /// [`RecordState::Completed`].
    Completed,
    /// [`RecordState::Failed`] with its kind.
    Failed(FailureKind),
}

impl StateKind {
    /// A short name: `in_progress`, `released`, `completed`, `failed_retryable`,
    /// `failed_terminal`, `failed_result_not_stored`.
    pub fn name(self) -> &'static str {
        match self {
            Self::InProgress => "in_progress",
            Self::Released => "released",
            Self::Completed => "completed",
            Self::Failed(FailureKind::Retryable) => "failed_retryable",
            Self::Failed(FailureKind::Terminal) => "failed_terminal",
            Self::Failed(FailureKind::ResultNotStored) => "failed_result_not_stored",
        }
    }

    /// Every state kind, in the order of [`StateKind::name`]'s list.
    pub const ALL: [StateKind; 6] = [
        Self::InProgress,
        Self::Released,
        Self::Completed,
        Self::Failed(FailureKind::Retryable),
        Self::Failed(FailureKind::Terminal),
        Self::Failed(FailureKind::ResultNotStored),
    ];

    /// The state kind with this [`name`](StateKind::name), for stores that keep the name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }
}

impl fmt::Display for StateKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
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
    /// Default [`DEFAULT_MAX_RESULT_LEN`].
    pub max_result_len: usize,
    /// Largest error message accepted by [`fail`](crate::IdempotencyStore::fail), in bytes.
    /// Default [`DEFAULT_MAX_ERROR_LEN`].
    pub max_error_len: usize,
    /// Most keys one batch call takes ([`acquire_many`](crate::IdempotencyStore::acquire_many)
    /// and the other `_many` calls). Default [`DEFAULT_MAX_BATCH`].
    pub max_batch: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_result_len: DEFAULT_MAX_RESULT_LEN,
            max_error_len: DEFAULT_MAX_ERROR_LEN,
            max_batch: DEFAULT_MAX_BATCH,
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

    /// Sets the most keys one batch call takes.
    pub fn with_max_batch(mut self, len: usize) -> Self {
        self.max_batch = len;
        self
    }

    /// Checks a batch's size against [`Limits::max_batch`].
    ///
    /// # Errors
    /// [`Error::InvalidInput`] with field `batch`.
    pub fn check_batch(&self, len: usize) -> Result<()> {
        if len > self.max_batch {
            return Err(Error::invalid(
                "batch",
                format!(
                    "has {len} keys, the most one batch takes is {}",
                    self.max_batch
                ),
            ));
        }
        Ok(())
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

    /// Checks an error message: at most [`Limits::max_error_len`] bytes and no NUL (which some
    /// stores cannot hold; every store refuses it so that stored texts round-trip exactly).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] with field `error`.
    pub fn check_error(&self, error: &str) -> Result<()> {
        if error.contains('\0') {
            return Err(Error::invalid(
                "error",
                "contains NUL, which no store keeps exactly",
            ));
        }
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

    /// The checks of [`complete`](crate::IdempotencyStore::complete): retention and result size.
    /// Every store calls this before it writes anything.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] or [`Error::ResultTooLarge`].
    pub fn check_complete(&self, result: &[u8], retention: Duration) -> Result<()> {
        check_retention(retention)?;
        self.check_result(result)
    }

    /// The checks of [`fail`](crate::IdempotencyStore::fail): retention and error text. Every
    /// store calls this before it writes anything.
    ///
    /// # Errors
    /// [`Error::InvalidInput`].
    pub fn check_fail(&self, error: &str, retention: Duration) -> Result<()> {
        check_retention(retention)?;
        self.check_error(error)
    }

    /// Makes a caller's error text storable under these limits: a NUL becomes the two
    /// characters `\0`, and a text over [`Limits::max_error_len`] is cut on a character
    /// boundary and ends with `…`. For callers (the executor, runners) that record a handler's
    /// error and must not fail because of its content; stores never alter what they are given.
    pub fn fit_error<'a>(&self, error: &'a str) -> std::borrow::Cow<'a, str> {
        fit_text(error, self.max_error_len)
    }

    /// [`fit_error`](Self::fit_error) in ASCII, for a store that refused an error text with
    /// [`Error::InvalidInput`] on `error` because it cannot hold one of its characters (a
    /// PostgreSQL database whose encoding lacks it): see [`fit_text_ascii`].
    pub fn fit_error_ascii(&self, error: &str) -> String {
        fit_text_ascii(error, self.max_error_len)
    }
}

/// `text` in ASCII, storable in `max` bytes: every character outside ASCII written as `\u{…}`
/// (its code point in hex), a NUL as `\0`; a longer text is cut between two characters and
/// ends with `...`.
pub fn fit_text_ascii(text: &str, max: usize) -> String {
    const END: &str = "...";
    let piece = |c: char| match c {
        '\0' => "\\0".to_owned(),
        c if c.is_ascii() => c.to_string(),
        c => c.escape_unicode().to_string(),
    };
    let whole: usize = text.chars().map(|c| piece(c).len()).sum();
    let room = match whole <= max {
        true => max,
        false => max.saturating_sub(END.len()),
    };
    let mut out = String::with_capacity(whole.min(max));
    for c in text.chars() {
        let p = piece(c);
        if out.len() + p.len() > room {
            out.push_str(&END[..END.len().min(max - out.len())]);
            break;
        }
        out.push_str(&p);
    }
    out
}

/// Makes `text` storable in `max` bytes: a NUL becomes the two characters `\0`, and a longer
/// text is cut on a character boundary and ends with `…` (when `max` leaves room for it).
pub fn fit_text(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    use std::borrow::Cow;
    let mut text: Cow<'_, str> = if text.contains('\0') {
        Cow::Owned(text.replace('\0', "\\0"))
    } else {
        Cow::Borrowed(text)
    };
    if text.len() > max {
        const ELLIPSIS: &str = "…";
        let room = if max >= ELLIPSIS.len() {
            max - ELLIPSIS.len()
        } else {
            max
        };
        let mut cut = room;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        let mut short = text[..cut].to_owned();
        if max >= ELLIPSIS.len() {
            short.push_str(ELLIPSIS);
        }
        text = Cow::Owned(short);
    }
    text
}

/// One completion of a batch: [`complete_many`](crate::IdempotencyStore::complete_many).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Completion {
    /// The lease to complete.
    pub lease: Lease,
    /// The result to store.
    pub result: Bytes,
}

impl Completion {
    /// A completion of `lease` with `result`.
    pub fn new(lease: Lease, result: impl Into<Bytes>) -> Self {
        Self {
            lease,
            result: result.into(),
        }
    }
}

/// One failure of a batch: [`fail_many`](crate::IdempotencyStore::fail_many).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Failure {
    /// The lease whose attempt failed.
    pub lease: Lease,
    /// The error text to store.
    pub error: String,
    /// How it failed.
    pub kind: FailureKind,
}

impl Failure {
    /// A failure of `lease` with `error` of `kind`.
    pub fn new(lease: Lease, error: impl Into<String>, kind: FailureKind) -> Self {
        Self {
            lease,
            error: error.into(),
            kind,
        }
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
        /// The last stored error; `None` when the last attempt recorded none: it crashed,
        /// stalled past its lease, or its acquire took effect after its reply was lost.
        last_error: Option<String>,
    },
    /// The work failed terminally before; the error is replayed and the work never re-run.
    Failed {
        /// The stored error.
        error: String,
        /// [`FailureKind::Terminal`], or [`FailureKind::ResultNotStored`] when the handler
        /// succeeded but its result could not be stored.
        kind: FailureKind,
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

#[cfg(test)]
mod tests {
    use super::fit_text_ascii;

    #[test]
    fn fit_text_ascii_escapes_and_cuts_between_characters() {
        assert_eq!(fit_text_ascii("plain", 100), "plain");
        assert_eq!(fit_text_ascii("é支\0", 100), "\\u{e9}\\u{652f}\\0");
        let cut = fit_text_ascii(&"支".repeat(100), 20);
        assert_eq!(cut, "\\u{652f}\\u{652f}...");
        assert!(cut.len() <= 20 && cut.is_ascii());
        assert_eq!(fit_text_ascii("支", 2), "..");
        assert_eq!(fit_text_ascii("abc", 3), "abc");
        assert_eq!(fit_text_ascii("abcd", 3), "...");
    }
}
