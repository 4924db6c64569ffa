//! [`SqliteBackend`]: the kit's compare-and-swap on one SQLite table.

use std::cell::Cell;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::kit::{Cas, CasBackend, Scanned, Versioned};
use idem_core::{Error, Result};
use rusqlite::{Connection, OpenFlags, OptionalExtension, params};

use crate::options::{Offload, SqliteOptions};

/// The backend's name, in errors and metrics.
pub(crate) const NAME: &str = "sqlite";

/// The table every record lives in.
pub const TABLE: &str = "idem_records";

/// The statement `open` runs when [`SqliteOptions::create`] is on (and what to run by hand
/// when it is off).
pub const CREATE_TABLE: &str = "CREATE TABLE IF NOT EXISTS idem_records (\
     key BLOB PRIMARY KEY NOT NULL, \
     version INTEGER NOT NULL, \
     value BLOB NOT NULL\
     ) WITHOUT ROWID";

const LOAD: &str = "SELECT value, version FROM idem_records WHERE key = ?1";
// A new row's version starts at a random number (within +-2^61, so `+ 1` never overflows): a
// row purged and written again never gets back a version a stalled writer may still hold.
const INSERT: &str = "INSERT INTO idem_records (key, version, value) VALUES (?1, random() / 4, ?2) \
     ON CONFLICT (key) DO NOTHING";
const UPDATE: &str =
    "UPDATE idem_records SET value = ?2, version = version + 1 WHERE key = ?1 AND version = ?3";
const DELETE: &str = "DELETE FROM idem_records WHERE key = ?1 AND version = ?2";
const SCAN: &str = "SELECT key, value, version FROM idem_records \
     WHERE key >= ?1 AND key > ?2 AND key < ?3 ORDER BY key LIMIT ?4";
const SCAN_TO_END: &str = "SELECT key, value, version FROM idem_records \
     WHERE key >= ?1 AND key > ?2 ORDER BY key LIMIT ?3";

/// The kit's [`CasBackend`] on SQLite: one `WITHOUT ROWID` table of `(key, version, value)`,
/// in WAL mode. Loads and scans run on a small pool of read connections; writes go through one
/// connection, so the writers of one process never wait on each other's locks (only on other
/// processes', up to the busy timeout). Statements run off the async scheduling as
/// [`SqliteOptions::offload`] says.
///
/// Cloning is cheap and shares the connections.
#[derive(Clone)]
pub struct SqliteBackend {
    shared: Arc<Shared>,
}

struct Shared {
    path: PathBuf,
    options: SqliteOptions,
    writer: Mutex<Connection>,
    readers: Mutex<Vec<Connection>>,
    statements: AtomicU64,
}

impl fmt::Debug for SqliteBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteBackend")
            .field("path", &self.shared.path)
            .field("synchronous", &self.shared.options.synchronous)
            .field("busy_timeout", &self.shared.options.busy_timeout)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic in a statement leaves the connection usable: SQLite rolls back what it did.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Maps a SQLite error to the contract's: locks held past the busy timeout and I/O trouble are
/// `Unavailable`; a missing table (or one of another shape) is `NotSetUp`; the rest `Backend`.
pub(crate) fn classify(e: rusqlite::Error) -> Error {
    use rusqlite::ErrorCode as C;
    if let rusqlite::Error::SqliteFailure(failure, message) = &e {
        let message = message.as_deref().unwrap_or("");
        match failure.code {
            C::DatabaseBusy | C::DatabaseLocked => return Error::unavailable(NAME, e),
            C::CannotOpen | C::SystemIoFailure | C::DiskFull | C::OutOfMemory => {
                return Error::unavailable(NAME, e);
            }
            C::Unknown
                if message.starts_with("no such table")
                    || message.starts_with("no such column")
                    || message.contains("has no column named") =>
            {
                return not_set_up(message);
            }
            _ => {}
        }
    }
    Error::backend(NAME, e)
}

fn not_set_up(what: &str) -> Error {
    Error::not_set_up(
        NAME,
        format!("table {TABLE:?} ({what})"),
        format!(
            "open the store with SqliteOptions::create(true) (the default), or run: {CREATE_TABLE}"
        ),
    )
}

impl SqliteBackend {
    /// Opens (and with [`SqliteOptions::create`], creates) the database at `path`: WAL mode,
    /// the options' busy timeout and durability, the table. Blocks: call it from
    /// [`SqliteStore::open_with`](crate::SqliteStore::open_with), or on a blocking thread.
    pub(crate) fn open_blocking(path: &Path, options: SqliteOptions) -> Result<Self> {
        with_busy_timeout(options.busy_timeout, || Self::open_here(path, options))
    }

    fn open_here(path: &Path, options: SqliteOptions) -> Result<Self> {
        let writer = connect(path, &options, options.create).map_err(classify)?;
        writer
            .pragma_update(None, "journal_mode", "WAL")
            .map_err(classify)?;
        if options.create {
            writer.execute_batch(CREATE_TABLE).map_err(classify)?;
        } else {
            let found: Option<String> = writer
                .query_row(
                    "SELECT name FROM sqlite_schema WHERE type = 'table' AND name = ?1",
                    [TABLE],
                    |row| row.get(0),
                )
                .optional()
                .map_err(classify)?;
            if found.is_none() {
                return Err(not_set_up("no such table"));
            }
        }
        // Compile every statement once: a table of another shape is refused here.
        for sql in [LOAD, INSERT, UPDATE, DELETE, SCAN, SCAN_TO_END] {
            writer.prepare_cached(sql).map_err(classify)?;
        }
        Ok(Self {
            shared: Arc::new(Shared {
                path: path.to_owned(),
                options,
                writer: Mutex::new(writer),
                readers: Mutex::default(),
                statements: AtomicU64::new(0),
            }),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// How many SQL statements this backend (and its clones) ran for the kit so far: one per
    /// `load`, `store`, `delete` and `scan`.
    pub fn statements(&self) -> u64 {
        self.shared.statements.load(Ordering::Relaxed)
    }

    /// Runs `f` on a read connection, on the blocking pool.
    async fn read<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        let shared = self.shared.clone();
        blocking(self.shared.options.offload, move || {
            shared.statements.fetch_add(1, Ordering::Relaxed);
            let idle = lock(&shared.readers).pop();
            let conn = match idle {
                Some(conn) => conn,
                None => connect(&shared.path, &shared.options, false)?,
            };
            let out = with_busy_timeout(shared.options.busy_timeout, || f(&conn));
            let mut idle = lock(&shared.readers);
            if idle.len() < shared.options.readers {
                idle.push(conn);
            }
            out
        })
        .await
    }

    /// Runs `f` on the write connection, on the blocking pool.
    async fn write<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        let shared = self.shared.clone();
        blocking(self.shared.options.offload, move || {
            shared.statements.fetch_add(1, Ordering::Relaxed);
            let writer = lock(&shared.writer);
            with_busy_timeout(shared.options.busy_timeout, || f(&writer))
        })
        .await
    }
}

/// Runs a statement off the async runtime's scheduling, as [`Offload`] says.
async fn blocking<T, F>(offload: Offload, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> rusqlite::Result<T> + Send + 'static,
{
    let in_place = offload == Offload::InPlace
        && tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if in_place {
        return tokio::task::block_in_place(f).map_err(classify);
    }
    match tokio::task::spawn_blocking(f).await {
        Ok(out) => out.map_err(classify),
        // The statement panicked or the runtime is shutting down: it may or may not have run.
        Err(e) => Err(Error::unavailable(NAME, e)),
    }
}

thread_local! {
    /// The busy timeout of the statement running on this thread, and when it first met a lock.
    static BUSY: Cell<(Duration, Option<Instant>)> = const { Cell::new((Duration::ZERO, None)) };
}

/// Runs `f` with `timeout` as the bound of [`wait_for_lock`] on this thread.
fn with_busy_timeout<T>(timeout: Duration, f: impl FnOnce() -> T) -> T {
    BUSY.with(|b| b.set((timeout, None)));
    f()
}

/// SQLite's busy handler: called while another connection (another process, a checkpoint)
/// holds the lock a statement needs. Retries after short pauses (20 us doubling to 1 ms) until
/// the busy timeout has passed since the first call. SQLite's own handler sleeps up to 100 ms
/// between tries, so a process whose writes follow each other closely starves the others;
/// short pauses let every process in between.
fn wait_for_lock(attempt: i32) -> bool {
    BUSY.with(|b| {
        let (timeout, since) = b.get();
        let now = Instant::now();
        let since = match (attempt, since) {
            (0, _) | (_, None) => now,
            (_, Some(since)) => since,
        };
        b.set((timeout, Some(since)));
        if now.duration_since(since) >= timeout {
            return false;
        }
        let pause = Duration::from_micros(20 << attempt.clamp(0, 6)).min(Duration::from_millis(1));
        std::thread::sleep(pause);
        true
    })
}

fn connect(path: &Path, options: &SqliteOptions, create: bool) -> rusqlite::Result<Connection> {
    let mut flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    if create {
        flags |= OpenFlags::SQLITE_OPEN_CREATE;
    }
    let conn = Connection::open_with_flags(path, flags)?;
    conn.busy_handler(Some(wait_for_lock))?;
    conn.pragma_update(None, "synchronous", options.synchronous.pragma())?;
    Ok(conn)
}

/// The smallest byte string above every string that starts with `prefix`; `None` when there is
/// none (an empty prefix, or only `0xff` bytes).
fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

#[async_trait]
impl CasBackend for SqliteBackend {
    type Version = i64;

    fn name(&self) -> &'static str {
        NAME
    }

    async fn load(&self, key: &[u8]) -> Result<Option<Versioned<i64>>> {
        let key = key.to_vec();
        self.read(move |conn| {
            conn.prepare_cached(LOAD)?
                .query_row([key], |row| {
                    Ok(Versioned::new(row.get::<_, Vec<u8>>(0)?, row.get(1)?))
                })
                .optional()
        })
        .await
    }

    async fn store(&self, key: &[u8], value: Bytes, expected: Option<&i64>) -> Result<Cas> {
        let key = key.to_vec();
        let expected = expected.copied();
        self.write(move |conn| {
            let changed = match expected {
                None => conn
                    .prepare_cached(INSERT)?
                    .execute(params![key, &value[..]])?,
                Some(version) => {
                    conn.prepare_cached(UPDATE)?
                        .execute(params![key, &value[..], version])?
                }
            };
            Ok(if changed == 1 {
                Cas::Written
            } else {
                Cas::Conflict
            })
        })
        .await
    }

    async fn delete(&self, key: &[u8], expected: &i64) -> Result<Cas> {
        let key = key.to_vec();
        let expected = *expected;
        self.write(move |conn| {
            let changed = conn
                .prepare_cached(DELETE)?
                .execute(params![key, expected])?;
            Ok(if changed == 1 {
                Cas::Written
            } else {
                Cas::Conflict
            })
        })
        .await
    }

    /// One range query on the primary key.
    async fn scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<Scanned<i64>>> {
        let prefix = prefix.to_vec();
        let after = after.map(<[u8]>::to_vec).unwrap_or_default();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.read(move |conn| {
            let row = |row: &rusqlite::Row<'_>| {
                Ok(Scanned::new(
                    row.get::<_, Vec<u8>>(0)?,
                    Versioned::new(row.get::<_, Vec<u8>>(1)?, row.get(2)?),
                ))
            };
            match prefix_end(&prefix) {
                Some(end) => conn
                    .prepare_cached(SCAN)?
                    .query_map(params![prefix, after, end, limit], row)?
                    .collect(),
                None => conn
                    .prepare_cached(SCAN_TO_END)?
                    .query_map(params![prefix, after, limit], row)?
                    .collect(),
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"ns:"), Some(b"ns;".to_vec()));
        assert_eq!(prefix_end(b"a\xff"), Some(b"b".to_vec()));
        assert_eq!(prefix_end(b"\xff\xff"), None);
        assert_eq!(prefix_end(b""), None);
    }
}
