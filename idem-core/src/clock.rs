//! Clocks for the in-memory store.

use std::fmt::Debug;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

/// A source of the store's current time.
pub trait Clock: Send + Sync + Debug + 'static {
    /// The current time.
    fn now(&self) -> SystemTime;
}

/// The system's wall clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// A clock that moves only when told to, so tests can expire leases and retention without
/// sleeping.
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<SystemTime>,
}

impl ManualClock {
    /// A clock stopped at `start`.
    pub fn new(start: SystemTime) -> Self {
        Self {
            now: Mutex::new(start),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        *self.now.lock().unwrap_or_else(|e| e.into_inner()) += by;
    }

    /// Sets the clock to `to`, forward or back.
    pub fn set(&self, to: SystemTime) {
        *self.now.lock().unwrap_or_else(|e| e.into_inner()) = to;
    }
}

impl Default for ManualClock {
    /// A clock stopped at the current system time.
    fn default() -> Self {
        Self::new(SystemTime::now())
    }
}

impl Clock for ManualClock {
    fn now(&self) -> SystemTime {
        *self.now.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The latest clock reading a store acts on: the end of the year 9999 (UTC). A lease or a
/// retention (at most [`MAX_RETENTION`](crate::MAX_RETENTION)) added to any earlier reading
/// fits in a `SystemTime` on every platform.
const LATEST: Duration = Duration::from_secs(253_402_300_799);

/// `now`, when a store may act on it: a reading past the year 9999 (a broken clock, a garbage
/// server time) is [`Error::Backend`](crate::Error::Backend), before anything is written,
/// instead of a panic on the deadline it would give.
pub(crate) fn checked(store: &'static str, now: SystemTime) -> crate::Result<SystemTime> {
    match now.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(since) if since > LATEST => Err(crate::Error::backend(
            store,
            format!("the clock reads {since:?} after 1970, past the year 9999"),
        )),
        _ => Ok(now),
    }
}
