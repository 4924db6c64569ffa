//! Several processes on one database file: two processes racing for the same keys (one
//! winner per key), and a process killed with `SIGKILL` in the middle of its handler, whose key
//! is taken over once its lease is over, while everything it had completed stays completed.
//! And a process that may only read the file, whose `open` is refused.
//!
//! The processes are this test binary itself, run again with `IDEM_SQLITE_CHILD` set and the
//! test name `child_process` (which does nothing in a normal run).

#![cfg(unix)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::db_path;
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, IdempotencyStore, ManualClock, Namespace, RecordState,
};
use idem_sqlite::{SqliteOptions, SqliteStore};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

const CHILD: &str = "IDEM_SQLITE_CHILD";
const DB: &str = "IDEM_SQLITE_DB";
const OWNER: &str = "IDEM_SQLITE_OWNER";
const RACE_KEYS: usize = 400;
const RACE_TASKS: usize = 8;
const DOOMED_LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(3600);

fn ns() -> Namespace {
    Namespace::new("processes").unwrap()
}

/// The child process (only when run by the tests below).
#[test]
fn child_process() {
    let Ok(role) = std::env::var(CHILD) else {
        return;
    };
    let db = std::env::var(DB).expect("db path");
    let owner = std::env::var(OWNER).expect("owner");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        if role == "open" {
            let opened = SqliteStore::open(&db).await;
            say(&format!("open {:?}", opened.map(drop)));
            return;
        }
        let store = SqliteStore::open(&db).await.expect("child open");
        match role.as_str() {
            "race-up" => race(store, owner, false).await,
            "race-down" => race(store, owner, true).await,
            "doomed" => doomed(store, owner).await,
            other => panic!("unknown role {other}"),
        }
    });
}

/// Waits for `go` on stdin and the instant it names, acquires every key from several tasks, reports each outcome, then
/// waits for `complete` and completes the keys it won with its own name.
async fn race(store: SqliteStore, owner: String, descending: bool) {
    say("ready");
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    // `go <ms since the epoch>`: both processes start at that instant.
    let go = stdin.next_line().await.unwrap().expect("go");
    let at: u64 = go.strip_prefix("go ").expect("go <ms>").parse().unwrap();
    let start = UNIX_EPOCH + Duration::from_millis(at);
    if let Ok(wait) = start.duration_since(SystemTime::now()) {
        tokio::time::sleep(wait).await;
    }
    let tasks: Vec<_> = (0..RACE_TASKS)
        .map(|t| {
            let (store, owner) = (store.clone(), owner.clone());
            tokio::spawn(async move {
                let mut won = Vec::new();
                let mine: Vec<usize> = (t..RACE_KEYS).step_by(RACE_TASKS).collect();
                // One process goes up the keys, the other down: each wins the keys it reaches
                // first, and they fight over the keys where they meet.
                let order: Box<dyn Iterator<Item = usize> + Send> = if descending {
                    Box::new(mine.into_iter().rev())
                } else {
                    Box::new(mine.into_iter())
                };
                for i in order {
                    let req = AcquireRequest::new(ns().key(format!("k{i}")).unwrap(), &owner)
                        .with_lease_ttl(Duration::from_secs(600));
                    match store.acquire(&req).await.expect("child acquire") {
                        AcquireOutcome::Acquired { lease, .. } => {
                            say(&format!("won {i} {}", lease.token));
                            won.push(lease);
                        }
                        AcquireOutcome::InProgress { owner, .. } => {
                            say(&format!("busy {i} {owner}"))
                        }
                        other => say(&format!("other {i} {other:?}")),
                    }
                }
                won
            })
        })
        .collect();
    let mut won = Vec::new();
    for t in tasks {
        won.extend(t.await.unwrap());
    }
    // Both processes acquire everything before either completes: the loser of each key sees
    // it in progress, never replayed.
    say("acquired all");
    assert_eq!(
        stdin.next_line().await.unwrap().as_deref(),
        Some("complete")
    );
    for lease in won {
        store
            .complete(&lease, Bytes::from(owner.clone()), RETENTION)
            .await
            .expect("child complete");
    }
    say("finished");
}

/// Acquires `doomed` and never finishes it; meanwhile completes one key after another,
/// reporting each completion, until it is killed.
async fn doomed(store: SqliteStore, owner: String) {
    let req = AcquireRequest::new(ns().key("doomed").unwrap(), &owner).with_lease_ttl(DOOMED_LEASE);
    let AcquireOutcome::Acquired { lease, .. } = store.acquire(&req).await.unwrap() else {
        panic!("the doomed key is fresh");
    };
    say(&format!("acquired {}", lease.token));
    for n in 0.. {
        let req = AcquireRequest::new(ns().key(format!("bg-{n}")).unwrap(), &owner);
        let AcquireOutcome::Acquired { lease, .. } = store.acquire(&req).await.unwrap() else {
            panic!("bg keys are fresh");
        };
        store
            .complete(&lease, Bytes::from(format!("bg {n}")), RETENTION)
            .await
            .unwrap();
        say(&format!("done {n}"));
    }
}

/// Marks what a child reports: the test harness writes its own text on the same lines.
const MARK: &str = "IDEM> ";

fn say(what: &str) {
    println!("{MARK}{what}");
}

fn spawn(role: &str, db: &Path, owner: &str) -> (Child, Lines<BufReader<ChildStdout>>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "child_process",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, role)
        .env(DB, db)
        .env(OWNER, owner)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the child process");
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}

/// The next report of the child that starts with one of `prefixes`.
async fn next(lines: &mut Lines<BufReader<ChildStdout>>, prefixes: &[&str]) -> Option<String> {
    while let Some(line) = lines.next_line().await.unwrap() {
        let Some((_, said)) = line.split_once(MARK) else {
            continue;
        };
        if prefixes.iter().any(|p| said.starts_with(p)) {
            return Some(said.to_owned());
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_racing_for_the_same_keys_have_one_winner_per_key() {
    let db = db_path("race");
    SqliteStore::open(&db).await.unwrap(); // create the file and the table first
    let owners = ["proc-a", "proc-b"];
    let mut children = vec![
        spawn("race-up", &db, owners[0]),
        spawn("race-down", &db, owners[1]),
    ];
    for (_, lines) in &mut children {
        assert_eq!(next(lines, &["ready"]).await.as_deref(), Some("ready"));
    }
    let at = SystemTime::now() + Duration::from_millis(300);
    let go = format!(
        "go {}\n",
        at.duration_since(UNIX_EPOCH).unwrap().as_millis()
    );
    for (child, _) in &mut children {
        let stdin = child.stdin.as_mut().unwrap();
        stdin.write_all(go.as_bytes()).await.unwrap();
        stdin.flush().await.unwrap();
    }
    // key -> (winner, token); key -> the owner each loser saw.
    let mut winners: BTreeMap<usize, Vec<(String, u64)>> = BTreeMap::new();
    let mut busy: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for ((_, lines), owner) in children.iter_mut().zip(owners) {
        while let Some(line) = next(lines, &["won", "busy", "other", "acquired all"]).await {
            let parts: Vec<&str> = line.splitn(3, ' ').collect();
            match parts[0] {
                "won" => winners
                    .entry(parts[1].parse().unwrap())
                    .or_default()
                    .push((owner.to_owned(), parts[2].parse().unwrap())),
                "busy" => busy
                    .entry(parts[1].parse().unwrap())
                    .or_default()
                    .push(parts[2].to_owned()),
                "acquired" => break,
                _ => panic!("{owner}: unexpected outcome {line}"),
            }
        }
    }
    for ((child, lines), owner) in children.iter_mut().zip(owners) {
        let stdin = child.stdin.as_mut().unwrap();
        stdin.write_all(b"complete\n").await.unwrap();
        stdin.flush().await.unwrap();
        assert_eq!(
            next(lines, &["finished"]).await.as_deref(),
            Some("finished")
        );
        let status = child.wait().await.unwrap();
        assert!(status.success(), "{owner} exited with {status}");
    }

    let store = SqliteStore::open(&db).await.unwrap();
    let mut won_by: BTreeMap<&str, usize> = BTreeMap::new();
    for i in 0..RACE_KEYS {
        let w = winners.get(&i).map(Vec::as_slice).unwrap_or_default();
        assert_eq!(w.len(), 1, "key {i} must have exactly one winner: {w:?}");
        let (winner, token) = &w[0];
        *won_by.entry(winner.as_str()).or_default() += 1;
        assert_eq!(
            busy.get(&i).map(Vec::as_slice).unwrap_or_default(),
            std::slice::from_ref(winner),
            "the other process saw key {i} in progress, held by the winner"
        );
        let record = store
            .get(&ns().key(format!("k{i}")).unwrap())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            record.token.get(),
            *token,
            "the winner's token stands on k{i}"
        );
        assert_eq!(
            record.state,
            RecordState::Completed {
                result: Bytes::from(winner.clone())
            }
        );
    }
    eprintln!("keys won per process: {won_by:?}");
    assert_eq!(
        won_by.len(),
        2,
        "both processes won keys: a real race ({won_by:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killed_mid_handler_is_taken_over_after_its_lease() {
    let db = db_path("killed");
    SqliteStore::open(&db).await.unwrap();
    let (mut child, mut lines) = spawn("doomed", &db, "doomed-worker");
    let line = next(&mut lines, &["acquired"])
        .await
        .expect("the child acquired");
    let doomed_token: u64 = line["acquired ".len()..].parse().unwrap();
    // Let it complete a few keys, then kill it in the middle of whatever it is writing.
    let mut done = BTreeSet::new();
    while done.len() < 50 {
        let line = next(&mut lines, &["done"]).await.expect("the child works");
        done.insert(line["done ".len()..].parse::<u64>().unwrap());
    }
    child.start_kill().unwrap(); // SIGKILL
    let status = child.wait().await.unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9),
        "killed by SIGKILL: {status}"
    );
    // Completions it printed after the ones counted above are also durable.
    while let Some(line) = next(&mut lines, &["done"]).await {
        done.insert(line["done ".len()..].parse().unwrap());
    }

    let clock = Arc::new(ManualClock::default());
    let store = SqliteStore::open_with(&db, SqliteOptions::default().with_clock(clock.clone()))
        .await
        .unwrap();
    let key = ns().key("doomed").unwrap();
    let req = AcquireRequest::new(key.clone(), "rescuer").with_lease_ttl(Duration::from_secs(30));
    match store.acquire(&req).await.unwrap() {
        AcquireOutcome::InProgress { owner, .. } => assert_eq!(owner, "doomed-worker"),
        other => {
            panic!("the dead worker's lease is still live: expected InProgress, got {other:?}")
        }
    }
    clock.advance(DOOMED_LEASE + Duration::from_millis(1));
    let lease = match store.acquire(&req).await.unwrap() {
        AcquireOutcome::Acquired { lease, takeover } => {
            assert!(takeover, "a takeover");
            assert_eq!(lease.attempt, 2);
            assert!(lease.token.get() > doomed_token);
            lease
        }
        other => panic!("expected a takeover after the lease, got {other:?}"),
    };
    store
        .complete(&lease, Bytes::from_static(b"rescued"), RETENTION)
        .await
        .unwrap();

    for n in &done {
        let record = store
            .get(&ns().key(format!("bg-{n}")).unwrap())
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("bg-{n} was completed before the kill"));
        assert_eq!(
            record.state,
            RecordState::Completed {
                result: Bytes::from(format!("bg {n}"))
            }
        );
    }
    let conn = rusqlite::Connection::open(&db).unwrap();
    let check: String = conn
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(check, "ok");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_the_process_may_only_read_is_refused_at_open() {
    use std::os::unix::fs::PermissionsExt;
    let db = db_path("read-only");
    let store = SqliteStore::open(&db).await.unwrap();
    let lease = match store
        .acquire(&AcquireRequest::new(ns().key("done").unwrap(), "a"))
        .await
        .unwrap()
    {
        AcquireOutcome::Acquired { lease, .. } => lease,
        other => panic!("{other:?}"),
    };
    store
        .complete(&lease, Bytes::from_static(b"r"), RETENTION)
        .await
        .unwrap();
    drop(store);
    let before = std::fs::read(&db).unwrap();
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o444)).unwrap();

    // The child opens the file without the right to write it. Root may write any file: its
    // child runs without CAP_DAC_OVERRIDE, so the file's mode binds it too.
    let mut command = if runs_as_root() {
        let mut c = Command::new("setpriv");
        c.args(["--bounding-set", "-dac_override", "--"])
            .arg(std::env::current_exe().unwrap());
        c
    } else {
        Command::new(std::env::current_exe().unwrap())
    };
    let out = command
        .args([
            "child_process",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "open")
        .env(DB, &db)
        .env(OWNER, "ro")
        .output()
        .await
        .expect("run the child (setpriv, from util-linux, when the tests run as root)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let said = stdout
        .lines()
        .find_map(|l| l.split_once(MARK).map(|(_, s)| s.to_owned()))
        .unwrap_or_else(|| {
            panic!(
                "the child said nothing: {stdout} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    assert!(
        said.starts_with("open Err(Unavailable") && said.contains("can only be read"),
        "{said}"
    );
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(
        std::fs::read(&db).unwrap(),
        before,
        "the file is left as it was"
    );
}

/// Whether this process runs as root (which file modes do not bind).
fn runs_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}
