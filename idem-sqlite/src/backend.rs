//! [`SqliteBackend`]: the kit's compare-and-swap on one SQLite table.

use std::cell::Cell;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use backon::{BlockingRetryable, ExponentialBuilder};
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
    /// The one write connection. A write waits for it at most the busy timeout
    /// (`try_lock_for`), and parking_lot's eventual fairness keeps a waiting write from being
    /// passed over for long.
    writer: parking_lot::Mutex<Connection>,
    readers: Mutex<Vec<Connection>>,
    statements: AtomicU64,
    created_table: bool,
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

/// Maps a SQLite error to the contract's: locks held past the busy timeout, I/O trouble and a
/// database that cannot be written (a read-only file) are `Unavailable`; a missing table (or
/// one of another shape) is `NotSetUp`; the rest `Backend`.
pub(crate) fn classify(e: rusqlite::Error) -> Error {
    use rusqlite::ErrorCode as C;
    match e.sqlite_error_code() {
        Some(
            C::DatabaseBusy
            | C::DatabaseLocked
            | C::CannotOpen
            | C::SystemIoFailure
            | C::DiskFull
            | C::OutOfMemory
            | C::ReadOnly,
        ) => return Error::unavailable(NAME, e),
        // (rusqlite gives no code for a statement refused while it is prepared.)
        Some(C::Unknown) | None => {
            // A statement that does not compile against the table: the table is missing or
            // has another shape (a failure while running, or while preparing: then rusqlite
            // names the token as well).
            let text = e.to_string();
            if text.starts_with("no such table") {
                return not_set_up(&text);
            }
            if text.starts_with("no such column")
                || text.contains("has no column named")
                || text.starts_with("ON CONFLICT clause does not match")
            {
                return other_shape(&text);
            }
        }
        _ => {}
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

/// A table of our name that is not ours: `CREATE TABLE IF NOT EXISTS` leaves it as it is.
fn other_shape(what: &str) -> Error {
    Error::not_set_up(
        NAME,
        format!("table {TABLE:?} of idem's shape (the file's has another: {what})"),
        format!(
            "open another file, or rename the table that is there and let open create idem's: \
             {CREATE_TABLE}"
        ),
    )
}

/// Refuses a table of our name whose columns are not idem's: `key BLOB` (the primary key),
/// `version INTEGER NOT NULL`, `value BLOB NOT NULL`, and no other column a row must fill.
fn check_shape(conn: &Connection) -> Result<()> {
    let mut columns = conn
        .prepare(
            "SELECT name, upper(type), \"notnull\", dflt_value IS NOT NULL, pk \
             FROM pragma_table_info(?1)",
        )
        .map_err(classify)?;
    let columns = columns
        .query_map([TABLE], |row| {
            Ok((
                row.get::<_, String>(0)?,
                row.get::<_, String>(1)?,
                row.get::<_, bool>(2)?,
                row.get::<_, bool>(3)?,
                row.get::<_, i64>(4)?,
            ))
        })
        .map_err(classify)?
        .collect::<rusqlite::Result<Vec<_>>>()
        .map_err(classify)?;
    let wanted = [
        ("key", "BLOB", 1),
        ("version", "INTEGER", 0),
        ("value", "BLOB", 0),
    ];
    for (name, ty, pk) in wanted {
        match columns.iter().find(|c| c.0.eq_ignore_ascii_case(name)) {
            None => return Err(other_shape(&format!("no column {name}"))),
            Some(c) if c.1 != ty || c.4 != pk || (pk == 0 && !c.2) => {
                return Err(other_shape(&format!(
                    "column {name} is {}{}{}",
                    if c.1.is_empty() { "untyped" } else { &c.1 },
                    if c.2 { " NOT NULL" } else { "" },
                    if c.4 > 0 { " in the primary key" } else { "" },
                )));
            }
            Some(_) => {}
        }
    }
    if columns.iter().filter(|c| c.4 > 0).count() > 1 {
        return Err(other_shape("its primary key has more than the key column"));
    }
    if let Some(c) = columns
        .iter()
        .find(|c| !wanted.iter().any(|w| c.0.eq_ignore_ascii_case(w.0)) && c.2 && !c.3)
    {
        return Err(other_shape(&format!(
            "column {} is NOT NULL without a default",
            c.0
        )));
    }
    Ok(())
}

impl SqliteBackend {
    /// Opens (and with [`SqliteOptions::create`], creates) the database at `path`: WAL mode,
    /// the options' busy timeout and durability, the table. Blocks: call it from
    /// [`SqliteStore::open_with`](crate::SqliteStore::open_with), or on a blocking thread.
    pub(crate) fn open_blocking(path: &Path, options: SqliteOptions) -> Result<Self> {
        let path = database_file(path)?;
        with_busy_timeout(options.busy_timeout, || Self::open_here(&path, options))
    }

    /// Opens `path`, which [`database_file`] made absolute.
    fn open_here(path: &Path, options: SqliteOptions) -> Result<Self> {
        let writer = connect(path, &options, options.create).map_err(classify)?;
        // Read connections are opened later, on demand: they open the file the write
        // connection opened, by the full path SQLite resolved for it (symbolic links resolved),
        // so that neither the working directory nor a link changed since can send them
        // elsewhere.
        let path = writer
            .path()
            .filter(|opened| !opened.is_empty())
            .map_or_else(|| path.to_owned(), PathBuf::from);
        // SQLite opens a file it may not write read-only, without a word: every write would
        // then fail, while duplicates still answered.
        if writer.is_readonly(rusqlite::MAIN_DB).map_err(classify)? {
            return Err(read_only(&path));
        }
        use_wal(&writer, &path, options.busy_timeout)?;
        let found: Option<String> = writer
            .query_row(
                "SELECT name FROM sqlite_schema WHERE type = 'table' AND name = ?1",
                [TABLE],
                |row| row.get(0),
            )
            .optional()
            .map_err(classify)?;
        if options.create {
            writer.execute_batch(CREATE_TABLE).map_err(classify)?;
        } else if found.is_none() {
            return Err(not_set_up("no such table"));
        }
        check_shape(&writer)?;
        // Compile every statement once.
        for sql in [LOAD, INSERT, UPDATE, DELETE, SCAN, SCAN_TO_END] {
            writer.prepare_cached(sql).map_err(classify)?;
        }
        Ok(Self {
            shared: Arc::new(Shared {
                path,
                options,
                writer: parking_lot::Mutex::new(writer),
                readers: Mutex::default(),
                statements: AtomicU64::new(0),
                created_table: found.is_none(),
            }),
        })
    }

    /// The database file, as an absolute path: the file `open` opened, with symbolic links
    /// resolved (as SQLite opened it). Every connection of the backend opens this path, so a
    /// later change of the working directory does not move them.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// Whether opening this backend created the table (with [`SqliteOptions::create`], on a
    /// database that did not have it; another process may have created it at the same moment).
    pub fn created_table(&self) -> bool {
        self.shared.created_table
    }

    /// How many SQL statements this backend (and its clones) ran for the kit so far: one per
    /// `load`, `store`, `delete` and `scan`.
    pub fn statements(&self) -> u64 {
        self.shared.statements.load(Ordering::Relaxed)
    }

    /// Runs `f` on a read connection, off the async scheduling as [`SqliteOptions::offload`]
    /// says (in place on the calling worker thread by default).
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

    /// Runs `f` on the write connection, off the async scheduling as
    /// [`SqliteOptions::offload`] says (in place on the calling worker thread by default).
    async fn write<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        let shared = self.shared.clone();
        blocking(self.shared.options.offload, move || {
            shared.statements.fetch_add(1, Ordering::Relaxed);
            // The busy timeout bounds the whole wait: for this process's other writes (queued
            // behind the one connection) and then for the file lock. Without that, writes queued
            // behind a lock another process holds would each wait a full timeout in turn: a
            // heartbeat behind fifteen of them would outlast its lease. A write whose time went
            // in the queue still tries once, and succeeds where the file lock is free.
            let queued = Instant::now();
            let timeout = shared.options.busy_timeout;
            let Some(writer) = shared.writer.try_lock_for(timeout) else {
                return Err(rusqlite::Error::SqliteFailure(
                    rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_BUSY),
                    Some(format!(
                        "this process's other writes held the write connection for the busy \
                         timeout ({timeout:?})"
                    )),
                ));
            };
            let left = timeout.saturating_sub(queued.elapsed());
            with_busy_timeout(left, || f(&writer))
        })
        .await
    }
}

/// The absolute path of the database file `path` names, so that every connection (the write
/// connection now, read connections later, on demand) opens the same file whatever the working
/// directory is by then. Refuses what is not one file that all connections share: an empty
/// path and `:memory:` (each SQLite connection would get a private database of its own) and
/// SQLite URIs (`file:...`, in-memory ones included: a relative URI would follow the working
/// directory, and no option of a URI is needed).
fn database_file(path: &Path) -> Result<PathBuf> {
    let given = path.as_os_str().as_encoded_bytes();
    const SHARED: &str = "the store's connections (one writer, several readers, opened as \
                          needed) must all open one database file";
    if given.is_empty() {
        return Err(Error::invalid(
            "path",
            format!(
                "an empty path gives each SQLite connection a private temporary database of \
                 its own; {SHARED}: give the path of a file"
            ),
        ));
    }
    if given == b":memory:" {
        return Err(Error::invalid(
            "path",
            format!(
                "\":memory:\" gives each SQLite connection a private in-memory database of its \
                 own; {SHARED}: give the path of a file (for a file of that name, \"./:memory:\")"
            ),
        ));
    }
    if given.starts_with(b"file:") {
        let memory = given.windows(8).any(|w| w == b":memory:")
            || given.windows(11).any(|w| w == b"mode=memory");
        let what = if memory {
            "is an in-memory SQLite URI: SQLite keeps no file for it, and a private database \
             for each connection unless its cache is shared (then no WAL mode)"
        } else {
            "is a SQLite URI, which the store does not take (a relative one would follow the \
             working directory)"
        };
        return Err(Error::invalid(
            "path",
            format!(
                "{} {what}; {SHARED}: give the path of a file (for a file whose name starts \
                 with \"file:\", \"./file:...\")",
                path.display()
            ),
        ));
    }
    std::path::absolute(path).map_err(|e| {
        Error::unavailable(
            NAME,
            format!(
                "cannot make {} an absolute path (the working directory: {e})",
                path.display()
            ),
        )
    })
}

fn read_only(path: &Path) -> Error {
    Error::unavailable(
        NAME,
        format!(
            "{} can only be read (no write permission on the file, its directory or its -wal \
             and -shm files)",
            path.display()
        ),
    )
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

/// Puts the database in WAL mode. While another connection switches a new file to WAL (or
/// reads it in its old mode), the switch is answered `SQLITE_BUSY` at once, without the busy
/// handler (SQLite does not wait where waiting could deadlock): it is tried again after short
/// pauses until `timeout` has passed. (6 connections opening one new file at once: 13 of 1,800
/// opens failed with "database is locked" before.)
///
/// SQLite answers the pragma with the journal mode the database is in afterwards, and leaves
/// the old one, without an error, where it cannot use WAL (an in-memory or temporary database,
/// a VFS without shared memory): then the store refuses the file ([`Error::Backend`]) rather
/// than run without WAL, where readers would wait for writers.
fn use_wal(conn: &Connection, path: &Path, timeout: Duration) -> Result<()> {
    let pauses = ExponentialBuilder::new()
        .with_min_delay(Duration::from_micros(100))
        .with_max_delay(Duration::from_millis(10))
        .with_total_delay(Some(timeout))
        .without_max_times()
        .with_jitter();
    let mode = (|| {
        conn.pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get::<_, String>(0))
    })
    .retry(pauses)
    .sleep(std::thread::sleep)
    .when(|e| e.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy))
    .call()
    .map_err(classify)?;
    if mode.eq_ignore_ascii_case("wal") {
        return Ok(());
    }
    Err(Error::backend(
        NAME,
        format!(
            "{} cannot be put in WAL mode: SQLite left its journal mode {mode:?}, and the store \
             needs WAL (readers that do not wait for the writer, processes that share the file)",
            path.display()
        ),
    ))
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

    /// SQLite answers `journal_mode=WAL` on a database that cannot use WAL with the mode it
    /// keeps, without an error; `use_wal` reads the answer and refuses it.
    #[test]
    fn a_database_that_stays_out_of_wal_mode_is_refused() {
        let conn = Connection::open_in_memory().unwrap();
        let r = use_wal(&conn, Path::new("/in/memory"), Duration::from_millis(100));
        match r {
            Err(e @ Error::Backend { store: NAME, .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains("/in/memory cannot be put in WAL mode")
                        && text.contains("\"memory\""),
                    "{text}"
                );
            }
            other => panic!("expected Backend, got {other:?}"),
        }
        let file = tempfile::tempdir().unwrap();
        let path = file.path().join("wal.db");
        let conn = Connection::open(&path).unwrap();
        use_wal(&conn, &path, Duration::from_millis(100)).unwrap();
    }

    #[test]
    fn errors_of_the_table_and_the_file_are_classified() {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch("CREATE TABLE idem_records (id INTEGER PRIMARY KEY)")
            .unwrap();
        // Refused while prepared, and while running.
        let prepared = conn.prepare(LOAD).map(drop).unwrap_err();
        assert!(
            matches!(classify(prepared), Error::NotSetUp { .. }),
            "a missing column"
        );
        let running = conn
            .execute_batch("INSERT INTO idem_records (id, value) VALUES (1, 2)")
            .unwrap_err();
        assert!(
            matches!(classify(running), Error::NotSetUp { .. }),
            "a missing column named"
        );
        let missing = conn.prepare("SELECT * FROM nowhere").map(drop).unwrap_err();
        assert!(matches!(classify(missing), Error::NotSetUp { .. }));
        let read_only = rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_READONLY),
            Some("attempt to write a readonly database".into()),
        );
        assert!(matches!(classify(read_only), Error::Unavailable { .. }));
    }
}
