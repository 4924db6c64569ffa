//! Whether a backend's server is there: run its suite, skip it with one line, or fail in CI.
//!
//! A plain `cargo test` on a machine without the servers runs everything that needs none and
//! prints one line per skipped backend suite, naming the variable to set and the script that
//! starts the servers. With `CI` set (to anything but `false` or `0`) a missing server fails the
//! test instead: in CI a backend test never skips.
//!
//! ```no_run
//! # async fn demo() {
//! // At the top of every test of a backend suite:
//! let Some(url) = idem_conformance::servers::endpoint("redis", "IDEM_REDIS_URL", "redis://127.0.0.1:6379")
//! else {
//!     return; // skipped outside CI, with one line on stderr
//! };
//! # let _ = url;
//! # }
//! ```
//!
//! The skip line goes straight to the process's standard error, not through `eprintln!`, so the
//! test harness's output capture does not swallow it.

use std::collections::HashSet;
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// How long the probe waits for a TCP connection.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Whether this run is CI (`CI` set, and not `false` or `0`): then nothing skips.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// The endpoint of `suite`'s server: the value of `var`, or `default`. Returns it when a TCP
/// connection to its first `host:port` succeeds within a second.
///
/// When nothing answers: in CI it panics, naming the variable; otherwise it prints one line per
/// suite and process (`skipped: ...`) and returns `None`, and the caller returns early.
///
/// `endpoint` may be a URL (`redis://user@host:port/db`), a comma-separated list of them (the
/// first is probed), or a bare `host:port`.
pub fn endpoint(suite: &str, var: &str, default: &str) -> Option<String> {
    let value = std::env::var(var).unwrap_or_else(|_| default.to_owned());
    let answers = probe_address(&value).is_some_and(|addr| reachable(&addr));
    if answers {
        return Some(value);
    }
    skip_or_fail(
        suite,
        &format!("nothing answers at {value} (set {var} to the server's address)"),
    );
    None
}

/// Whether `program` can be run (found on `PATH`, or an existing path), for suites that start
/// private copies of a server. When it cannot: fails in CI, otherwise prints one line per suite
/// and returns `false`.
pub fn program(suite: &str, program: &str, hint: &str) -> bool {
    if find_program(program) {
        return true;
    }
    skip_or_fail(suite, &format!("`{program}` is not installed ({hint})"));
    false
}

/// Skips `suite` outside CI (one line per suite and process), fails in CI, with `why`.
///
/// # Panics
/// In CI, always.
pub fn skip_or_fail(suite: &str, why: &str) {
    if in_ci() {
        panic!(
            "{suite}: {why}. In CI every backend's server must be up: start them with \
             scripts/test.sh (or scripts/services.sh)"
        );
    }
    static SAID: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let said = SAID.get_or_init(Mutex::default);
    let first = said
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(suite.to_owned());
    if first {
        // Straight to the process's stderr: the test harness captures only the print macros.
        let _ = writeln!(
            std::io::stderr(),
            "skipped: the {suite} suite: {why}; run scripts/test.sh to start every server and \
             run all suites"
        );
    }
}

/// A server on a free loopback port that accepts every connection and never reads, writes or
/// closes one, for the rest of the process: a peer that hangs, or a network that drops every
/// reply, as a store meets it mid-outage. A connection succeeds at once, so only the client's
/// own timeouts (connect handshake, response, whole operation) end a call to it. Each call
/// starts one such server, served by a thread of its own, and returns its address.
///
/// # Panics
/// When no loopback port can be bound, or no thread started.
pub fn silent_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a free loopback port");
    let addr = listener.local_addr().expect("the bound address");
    std::thread::Builder::new()
        .name("idem-silent-server".into())
        .spawn(move || {
            // Held, never read: the peer's requests fill the buffers and nothing comes back.
            let mut held = Vec::new();
            for conn in listener.incoming().flatten() {
                held.push(conn);
            }
        })
        .expect("a thread for the silent server");
    addr
}

/// The `host:port` to probe in an endpoint string.
fn probe_address(value: &str) -> Option<String> {
    let first = value.split(',').next()?.trim();
    let rest = first.split_once("://").map_or(first, |(_, rest)| rest);
    let authority = rest.split(['/', '?']).next()?;
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    (!host_port.is_empty()).then(|| host_port.to_owned())
}

fn reachable(addr: &str) -> bool {
    let Ok(addrs) = addr.to_socket_addrs() else {
        return false;
    };
    addrs
        .into_iter()
        .any(|a| TcpStream::connect_timeout(&a, PROBE_TIMEOUT).is_ok())
}

fn find_program(program: &str) -> bool {
    let path = std::path::Path::new(program);
    if path.components().count() > 1 {
        return path.is_file();
    }
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_addresses() {
        assert_eq!(
            probe_address("redis://127.0.0.1:6379").as_deref(),
            Some("127.0.0.1:6379")
        );
        assert_eq!(
            probe_address("redis://u:p@h:1/0,redis://x:2").as_deref(),
            Some("h:1")
        );
        assert_eq!(
            probe_address("postgres://root@127.0.0.1:5432/test?sslmode=disable").as_deref(),
            Some("127.0.0.1:5432")
        );
        assert_eq!(
            probe_address("127.0.0.1:9092").as_deref(),
            Some("127.0.0.1:9092")
        );
        assert_eq!(probe_address(""), None);
    }

    #[test]
    fn nothing_listens_on_port_one() {
        assert!(!reachable("127.0.0.1:1"));
    }
}
