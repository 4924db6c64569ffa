//! Shared by the SQLite tests: fresh database files and the store pointed at nothing.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idem_core::{DynStore, Result};
use idem_sqlite::SqliteStore;

/// Why C23 does not count round trips on SQLite.
pub(crate) const IN_PROCESS: &str = "SQLite is embedded: no round trips to count. The kit makes an acquire \
     one SELECT plus one INSERT/UPDATE, a duplicate one SELECT (tests/store.rs counts them)";

/// A path for a new database file, in a directory of this test process under cargo's
/// temporary directory for tests (directories of processes that are gone are removed first).
pub(crate) fn db_path(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("idem-sqlite");
    let mine = root.join(std::process::id().to_string());
    let n = N.fetch_add(1, Ordering::SeqCst);
    if n == 0
        && let Ok(dirs) = std::fs::read_dir(&root)
    {
        for dir in dirs.flatten() {
            let alive = PathBuf::from("/proc").join(dir.file_name()).exists();
            if !alive {
                let _ = std::fs::remove_dir_all(dir.path());
            }
        }
    }
    std::fs::create_dir_all(&mine).expect("test directory");
    mine.join(format!("{name}-{n}.db"))
}

/// A store whose file lies in a directory that does not exist: opening it is `Unavailable`.
pub(crate) async fn unreachable() -> Result<DynStore> {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("idem-sqlite-no-such-dir/x/idem.db");
    Ok(Arc::new(SqliteStore::open(path).await?) as DynStore)
}
