//! Options of a [`SqliteStore`](crate::SqliteStore).

use std::sync::Arc;
use std::time::Duration;

use idem_core::kit::KitOptions;
use idem_core::{Clock, Limits};

/// How hard SQLite works to make a commit durable (`PRAGMA synchronous`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Synchronous {
    /// `FULL`: every commit is on disk (fsync) before the call returns. A record survives a
    /// process crash, an operating-system crash and a power cut. The default.
    #[default]
    Full,
    /// `NORMAL`: in WAL mode, commits are written to the log but synced only at checkpoints.
    /// A record survives a process crash (`SIGKILL` included); an operating-system crash or a
    /// power cut may lose the last commits, which then run again (a completed record that is
    /// lost means its handler runs again). Several times faster on slow disks.
    Normal,
}

impl Synchronous {
    pub(crate) fn pragma(self) -> &'static str {
        match self {
            Self::Full => "FULL",
            Self::Normal => "NORMAL",
        }
    }
}

/// How statements are kept from blocking the async runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Offload {
    /// On a multi-thread tokio runtime, [`tokio::task::block_in_place`]: the statement runs on
    /// the calling worker thread, which first hands its other tasks to another thread, so the
    /// runtime keeps running them. No thread hop when the worker has nothing else queued (a
    /// statement costs what it costs in plain rusqlite). Other futures of the *same* task (a
    /// `select!` or `join!` around the call) wait for the statement, which is short except
    /// when another process holds the lock (up to the busy timeout). On a current-thread
    /// runtime, falls back to [`Offload::BlockingPool`]. The default.
    ///
    /// Not inside a [`tokio::task::LocalSet`]: tokio refuses to block in place there and
    /// panics, before any statement runs (nothing is written), and gives no way to tell
    /// beforehand. A consumer that runs its handlers in a `LocalSet` opens the store with
    /// [`Offload::BlockingPool`].
    ///
    /// A timeout around a call cannot cut it short. The call blocks the task that makes it
    /// until its statements are done, so `tokio::time::timeout(d, store.release(&lease))`
    /// looks at its clock only once the call has ended, and then answers the call's own result,
    /// however short `d` is. While another process holds the write lock, a call that writes
    /// answers [`Error::Unavailable`](idem_core::Error::Unavailable) only after about twice the
    /// busy timeout: its write waits the busy timeout, and once it is refused the kit loads the
    /// key again and writes once more ([`KitOptions::max_ambiguous`] 1). Calls that one task
    /// makes at once (`join!`, `join_all`) run one after another, each sent when the one before
    /// has answered. So where idem's executor bounds a store call with a timeout (releasing the
    /// lease of a handler that never started), the call can take about twice the busy timeout,
    /// whatever that timeout; and its heartbeat, which extends the leases in flight from one
    /// task, extends them in turn, each taking up to about twice the busy timeout: with many
    /// leases in flight, the last ones may expire before their extends are sent (their
    /// handlers are then cancelled at their lease deadlines). Where a timeout must bound each
    /// call, use [`Offload::BlockingPool`], or a busy timeout small enough that twice it fits
    /// the timeout (and, times the leases in flight, the heartbeat's margin before a lease
    /// ends).
    #[default]
    InPlace,
    /// Always [`tokio::task::spawn_blocking`]: every statement hops to tokio's blocking pool
    /// and back (about 15 us per statement on a small machine), and nothing of the caller's
    /// task waits on it: a timeout around a call fires on time, and calls one task makes at
    /// once wait together. A call cut short by a timeout leaves its statement to run to its
    /// end on the blocking pool, so its write may still take effect (as after any
    /// `Unavailable`).
    BlockingPool,
}

/// Options of [`SqliteStore::open_with`](crate::SqliteStore::open_with).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SqliteOptions {
    /// Whether `open` creates the database file and the table when they are missing. When
    /// `false`, a missing table is [`Error::NotSetUp`](idem_core::Error::NotSetUp) (and a
    /// missing file [`Error::Unavailable`](idem_core::Error::Unavailable)). Default `true`.
    pub create: bool,
    /// How long one statement waits for the locks it needs before it gives up with
    /// [`Error::Unavailable`](idem_core::Error::Unavailable): the file lock another process
    /// (or a checkpoint) holds (SQLite's `busy_timeout`), and before it the process's one write
    /// connection, where writes queue behind each other. The time spent in that queue counts
    /// against the same timeout, so however many writes are queued, each gives up about one
    /// timeout after it was sent (a write whose timeout went in the queue still tries once). A
    /// call whose write is refused loads the key again and writes once more, so it answers
    /// `Unavailable` after up to about twice the timeout (and under [`Offload::InPlace`], a
    /// timeout around the call cannot end it sooner). Default 5 s.
    pub busy_timeout: Duration,
    /// Durability of each commit. Default [`Synchronous::Full`].
    pub synchronous: Synchronous,
    /// Most idle read connections kept open for loads and scans (writes go through one
    /// connection). Default 8.
    pub readers: usize,
    /// How statements are kept from blocking the async runtime. Default [`Offload::InPlace`].
    pub offload: Offload,
    /// The kit's options: limits, the clock, conflict and retry bounds, tombstone time. The
    /// default is [`KitOptions::default`] with `max_ambiguous` 1 (see the crate docs, "Errors").
    pub kit: KitOptions,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        Self {
            create: true,
            busy_timeout: Duration::from_secs(5),
            synchronous: Synchronous::default(),
            readers: 8,
            offload: Offload::default(),
            kit: KitOptions::default().with_max_ambiguous(1),
        }
    }
}

impl SqliteOptions {
    /// Sets whether `open` creates the file and the table.
    pub fn with_create(mut self, create: bool) -> Self {
        self.create = create;
        self
    }

    /// Sets the busy timeout.
    pub fn with_busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Sets the durability of commits.
    pub fn with_synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// Sets the most idle read connections.
    pub fn with_readers(mut self, readers: usize) -> Self {
        self.readers = readers;
        self
    }

    /// Sets how statements are kept from blocking the async runtime.
    pub fn with_offload(mut self, offload: Offload) -> Self {
        self.offload = offload;
        self
    }

    /// Sets the kit's options.
    pub fn with_kit(mut self, kit: KitOptions) -> Self {
        self.kit = kit;
        self
    }

    /// Sets the clock leases and retention are judged on (a
    /// [`ManualClock`](idem_core::ManualClock) in tests); shorthand for the kit's.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.kit = self.kit.with_clock(clock);
        self
    }

    /// Sets the size limits; shorthand for the kit's.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.kit = self.kit.with_limits(limits);
        self
    }
}
