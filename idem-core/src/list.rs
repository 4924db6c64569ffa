//! The operator's listing: records found by namespace, status, age and owner, paged.

use std::fmt;
use std::time::{Duration, SystemTime};

use crate::error::{Error, Result};
use crate::key::Namespace;
use crate::record::{FailureKind, Record, RecordState, StateKind};

/// Most records one page holds.
pub const MAX_PAGE: usize = 1000;

/// What an operator looks for: a record's status at a moment, for a given maximum of attempts.
///
/// Every record has exactly one status. [`Status::Exhausted`] wins over the states it covers:
/// a record whose attempts reached the maximum and that is failed retryably, released, or in
/// progress with an expired lease is exhausted (every acquire with that maximum answers
/// [`Exhausted`](crate::AcquireOutcome::Exhausted)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Status {
    /// In progress, its lease live.
    InProgress,
    /// In progress, its lease expired: the holder crashed or stalled; the next acquire takes the
    /// key over.
    LeaseExpired,
    /// Given back without counting the attempt.
    Released,
    /// Completed: duplicates get the stored result.
    Completed,
    /// Failed retryably, attempts left.
    FailedRetryable,
    /// Failed terminally: never re-run.
    FailedTerminal,
    /// The handler succeeded but its result could not be stored: never re-run.
    ResultNotStored,
    /// Out of attempts: a poison message.
    Exhausted,
}

impl Status {
    /// Every status, in order.
    pub const ALL: [Status; 8] = [
        Self::InProgress,
        Self::LeaseExpired,
        Self::Released,
        Self::Completed,
        Self::FailedRetryable,
        Self::FailedTerminal,
        Self::ResultNotStored,
        Self::Exhausted,
    ];

    /// The status of `record` at `now`, for acquires with at most `max_attempts` attempts.
    pub fn of(record: &Record, now: SystemTime, max_attempts: u32) -> Self {
        let out_of_attempts = record.attempts >= max_attempts;
        match &record.state {
            RecordState::InProgress => {
                let live = record.lease_expires_at.is_some_and(|end| end > now);
                match (live, out_of_attempts) {
                    (true, _) => Self::InProgress,
                    (false, true) => Self::Exhausted,
                    (false, false) => Self::LeaseExpired,
                }
            }
            RecordState::Released if out_of_attempts => Self::Exhausted,
            RecordState::Released => Self::Released,
            RecordState::Completed { .. } => Self::Completed,
            RecordState::Failed { kind, .. } => match kind {
                FailureKind::Retryable if out_of_attempts => Self::Exhausted,
                FailureKind::Retryable => Self::FailedRetryable,
                FailureKind::Terminal => Self::FailedTerminal,
                FailureKind::ResultNotStored => Self::ResultNotStored,
            },
        }
    }

    /// The stored states a record with this status can be in: what a store with an index by
    /// state reads to find it ([`Status::Exhausted`] comes from three).
    pub fn states(self) -> &'static [StateKind] {
        match self {
            Self::InProgress | Self::LeaseExpired => &[StateKind::InProgress],
            Self::Released => &[StateKind::Released],
            Self::Completed => &[StateKind::Completed],
            Self::FailedRetryable => &[StateKind::Failed(FailureKind::Retryable)],
            Self::FailedTerminal => &[StateKind::Failed(FailureKind::Terminal)],
            Self::ResultNotStored => &[StateKind::Failed(FailureKind::ResultNotStored)],
            Self::Exhausted => &[
                StateKind::InProgress,
                StateKind::Released,
                StateKind::Failed(FailureKind::Retryable),
            ],
        }
    }

    /// A short name: `in_progress`, `lease_expired`, `released`, `completed`,
    /// `failed_retryable`, `failed_terminal`, `result_not_stored`, `exhausted`.
    pub fn name(self) -> &'static str {
        match self {
            Self::InProgress => "in_progress",
            Self::LeaseExpired => "lease_expired",
            Self::Released => "released",
            Self::Completed => "completed",
            Self::FailedRetryable => "failed_retryable",
            Self::FailedTerminal => "failed_terminal",
            Self::ResultNotStored => "result_not_stored",
            Self::Exhausted => "exhausted",
        }
    }

    /// The status with this [`name`](Status::name).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a listing goes on: an opaque position a store hands out with a [`Page`] and takes back
/// in the next [`ListQuery`]. Only the store that made it understands it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Cursor(String);

impl Cursor {
    /// Wraps a store's position (stores only; operators pass back what they were given).
    pub fn new(position: impl Into<String>) -> Self {
        Self(position.into())
    }

    /// The position as text (what an operator's tool prints and reads back).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What to list: records of one namespace, filtered by status, age and owner, one page at a
/// time.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListQuery {
    /// The namespace to list.
    pub namespace: Namespace,
    /// The statuses wanted; empty means every status. Default: empty.
    pub statuses: Vec<Status>,
    /// Only records that last changed at least this long ago (on the store's clock): stuck
    /// leases, old failures. Default: `None` (any age).
    pub min_age: Option<Duration>,
    /// Only records whose last owner is this one. Default: `None` (any owner).
    pub owner: Option<String>,
    /// The maximum attempts the consumers use, which decides [`Status::Exhausted`]. Default 5,
    /// as [`AcquireRequest::new`](crate::AcquireRequest::new).
    pub max_attempts: u32,
    /// Most records in one page, 1 to [`MAX_PAGE`]. Default 100.
    pub limit: usize,
    /// Where to go on from; `None` starts at the beginning. Default `None`.
    pub cursor: Option<Cursor>,
}

impl ListQuery {
    /// Every record of `namespace`, 100 per page.
    pub fn new(namespace: Namespace) -> Self {
        Self {
            namespace,
            statuses: Vec::new(),
            min_age: None,
            owner: None,
            max_attempts: 5,
            limit: 100,
            cursor: None,
        }
    }

    /// Only these statuses.
    pub fn with_statuses(mut self, statuses: impl IntoIterator<Item = Status>) -> Self {
        self.statuses = statuses.into_iter().collect();
        self
    }

    /// Only records unchanged for at least `age`.
    pub fn with_min_age(mut self, age: Duration) -> Self {
        self.min_age = Some(age);
        self
    }

    /// Only records of this owner.
    pub fn with_owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = Some(owner.into());
        self
    }

    /// The consumers' maximum attempts (for [`Status::Exhausted`]).
    pub fn with_max_attempts(mut self, max: u32) -> Self {
        self.max_attempts = max;
        self
    }

    /// Most records per page.
    pub fn with_limit(mut self, limit: usize) -> Self {
        self.limit = limit;
        self
    }

    /// Goes on from `cursor`.
    pub fn with_cursor(mut self, cursor: Option<Cursor>) -> Self {
        self.cursor = cursor;
        self
    }

    /// Checks the limit and the maximum of attempts; stores call this before anything else.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] naming the field.
    pub fn validate(&self) -> Result<()> {
        if self.limit == 0 || self.limit > MAX_PAGE {
            return Err(Error::invalid(
                "limit",
                format!("is {}; it must be between 1 and {MAX_PAGE}", self.limit),
            ));
        }
        if self.max_attempts == 0 {
            return Err(Error::invalid("max_attempts", "must be at least 1"));
        }
        Ok(())
    }

    /// Whether `record` (already known to be of [`ListQuery::namespace`] and not past retention)
    /// matches the filters at `now`: the reference every store's listing is held to.
    pub fn matches(&self, record: &Record, now: SystemTime) -> bool {
        let status_ok = self.statuses.is_empty()
            || self
                .statuses
                .contains(&Status::of(record, now, self.max_attempts));
        let age_ok = self.min_age.is_none_or(|age| {
            now.duration_since(record.updated_at)
                .is_ok_and(|since| since >= age)
        });
        let owner_ok = self.owner.as_ref().is_none_or(|o| *o == record.owner);
        status_ok && age_ok && owner_ok
    }
}

/// One page of a listing.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Page {
    /// The matching records of this page (at most the query's limit; possibly fewer, even none,
    /// while more follow, for stores that filter while they scan).
    pub records: Vec<Record>,
    /// Where the next page starts; `None` when the listing is complete.
    pub next: Option<Cursor>,
}

impl Page {
    /// A page of `records`, followed by `next`.
    pub fn new(records: Vec<Record>, next: Option<Cursor>) -> Self {
        Self { records, next }
    }
}
