//! The rules of a custom-store kit backend ([`CasBackend`]), checked on the backend itself.
//!
//! The store-level scenarios ([`scenarios`](crate::scenarios)) find most broken backends, but
//! not all: a backend that reuses a version after a delete, or deletes without comparing the
//! version, passes every one of them, because the kit deletes only in `purge_expired` and a
//! reused version needs a delete, a re-creation and a stale writer in one window. Run
//! [`check_backend`] in a test beside the suite:
//!
//! ```no_run
//! # async fn demo(backend: impl idem_core::kit::CasBackend) {
//! // In a `#[tokio::test]` of your backend's crate, `backend` connected to its server:
//! idem_conformance::backend::check_backend(&backend, "cas-check").await;
//! # }
//! ```

use std::collections::HashSet;
use std::fmt::Debug;

use bytes::Bytes;
use futures::future::join_all;
use idem_core::kit::{Cas, CasBackend, Versioned};
use idem_core::{Error, MAX_PAGE};

/// The longest key the kit gives a backend, in bytes (a namespace, `:`, an id).
pub const MAX_KEY_LEN: usize = 577;

/// How many writers [`check_backend`] sends at one key at once.
const RACERS: usize = 16;

/// Checks, on `backend`, the rules [`CasBackend`] states, and panics naming the first one
/// broken:
///
/// - `load` of an absent key is `None`; a value comes back byte for byte (every byte value, and
///   a value of 64 KiB), under a key of [`MAX_KEY_LEN`] bytes too;
/// - `store` with `None` writes only an absent key, with a version only the current one, and
///   answers [`Cas::Conflict`] otherwise, writing nothing;
/// - of [`RACERS`](self) writers racing at one key with the same expectation, exactly one
///   succeeds (for an absent key and for a present one);
/// - `delete` removes a key only at its current version (a stale one is a conflict, and the key
///   stays);
/// - a version is never reused for a key, after a delete and a re-creation included: the
///   version seen before the delete is refused afterwards;
/// - `scan` (unless it answers [`Error::Unsupported`]) lists the keys under a prefix in
///   ascending byte order, only those, resumes strictly after `after`, and returns as many as
///   asked for while there are more (no cap below `limit`).
///
/// Every key it writes starts with `prefix` and a random part, so runs and parallel tests do
/// not meet; it deletes what it wrote except when a check fails. The backend must be empty under
/// no particular prefix; its values need hold 64 KiB.
///
/// # Panics
/// On the first rule broken, or on any error from the backend.
pub async fn check_backend<B: CasBackend>(backend: &B, prefix: &str) {
    let run = format!("{prefix}:{:016x}:", rand::random::<u64>());
    let key = |name: &str| format!("{run}{name}").into_bytes();
    let name = backend.name();

    // Absent, then written once, byte for byte.
    let a = key("a");
    if load(backend, &a).await.is_some() {
        fail(name, "a key never written loads as present");
    }
    let every_byte: Bytes = (0..=255u8).collect::<Vec<u8>>().into();
    expect(
        store(backend, &a, every_byte.clone(), None).await,
        Cas::Written,
        || fail(name, "store(None) of an absent key must write it"),
    );
    let v1 = match load(backend, &a).await {
        Some(found) if found.value == every_byte => found.version,
        Some(found) => fail(
            name,
            &format!(
                "a value must load byte for byte: wrote every byte value, loaded {:?}",
                found.value
            ),
        ),
        None => fail(name, "a key stored must load"),
    };
    expect(
        store(backend, &a, Bytes::from_static(b"x"), None).await,
        Cas::Conflict,
        || fail(name, "store(None) of a present key must be a conflict"),
    );

    // A write at the current version, then the old version is stale.
    let second = Bytes::from(vec![0xA5; 64 * 1024]);
    expect(
        store(backend, &a, second.clone(), Some(&v1)).await,
        Cas::Written,
        || fail(name, "store at the current version must write"),
    );
    let v2 = loaded(
        backend,
        &a,
        &second,
        "a 64 KiB value must load byte for byte",
    )
    .await;
    if v2 == v1 {
        fail(name, "a write must give the key a new version");
    }
    expect(
        store(backend, &a, Bytes::from_static(b"stale"), Some(&v1)).await,
        Cas::Conflict,
        || {
            fail(
                name,
                "store at a version the key no longer holds must be a conflict",
            )
        },
    );
    loaded(backend, &a, &second, "a refused store must write nothing").await;

    // Deletes compare, and versions are not reused after one.
    expect(delete(backend, &a, &v1).await, Cas::Conflict, || {
        fail(
            name,
            "delete at a version the key no longer holds must be a conflict",
        )
    });
    loaded(backend, &a, &second, "a refused delete must remove nothing").await;
    expect(delete(backend, &a, &v2).await, Cas::Written, || {
        fail(name, "delete at the current version must remove the key")
    });
    if load(backend, &a).await.is_some() {
        fail(name, "a deleted key must load as absent");
    }
    expect(delete(backend, &a, &v2).await, Cas::Conflict, || {
        fail(name, "delete of an absent key must be a conflict")
    });
    expect(
        store(backend, &a, Bytes::from_static(b"again"), None).await,
        Cas::Written,
        || fail(name, "store(None) of a deleted key must write it"),
    );
    let v3 = loaded(backend, &a, b"again", "a re-created key must load").await;
    if v3 == v1 || v3 == v2 {
        fail(
            name,
            "a version must never be reused for a key, after a delete included",
        );
    }
    for stale in [&v1, &v2] {
        expect(
            store(backend, &a, Bytes::from_static(b"late"), Some(stale)).await,
            Cas::Conflict,
            || {
                fail(
                    name,
                    "a version from before a delete must be refused after the key is created again",
                )
            },
        );
    }
    loaded(backend, &a, b"again", "a refused store must write nothing").await;

    // Racing writers: one wins, for an absent key and for a present one.
    let raced = key("race");
    let wins = race(backend, &raced, None).await;
    if wins != 1 {
        fail(
            name,
            &format!(
                "{wins} of {RACERS} store(None) racing at an absent key wrote; exactly one must"
            ),
        );
    }
    let current = load(backend, &raced).await.map(|v| v.version);
    let Some(current) = current else {
        fail(name, "a raced key must load");
    };
    let wins = race(backend, &raced, Some(&current)).await;
    if wins != 1 {
        fail(
            name,
            &format!("{wins} of {RACERS} stores racing at one version wrote; exactly one must"),
        );
    }

    // The longest key.
    let long = {
        let mut k = key("l");
        k.resize(MAX_KEY_LEN.max(k.len()), b'k');
        k
    };
    expect(
        store(backend, &long, Bytes::from_static(b"long"), None).await,
        Cas::Written,
        || {
            fail(
                name,
                &format!("a key of {} bytes must be stored", long.len()),
            )
        },
    );
    let long_version = loaded(backend, &long, b"long", "a long key must load").await;

    let mut written = vec![(a, v3), (long, long_version)];
    if let Some(current) = load(backend, &raced).await {
        written.push((raced, current.version));
    }
    scan(backend, &run, &mut written).await;
    for (k, version) in written {
        expect(delete(backend, &k, &version).await, Cas::Written, || {
            fail(name, "delete at the current version must remove the key")
        });
    }
}

/// The `scan` rules, on keys under `run`; adds the keys it writes to `written`.
async fn scan<B: CasBackend>(backend: &B, run: &str, written: &mut Vec<(Vec<u8>, B::Version)>) {
    let name = backend.name();
    let prefix = format!("{run}s/").into_bytes();
    // Written out of order; one key just past the prefix's range ('/' + 1 is '0').
    let count = 25;
    let mut keys: Vec<Vec<u8>> = (0..count)
        .rev()
        .map(|i| [prefix.as_slice(), format!("{i:02}").as_bytes()].concat())
        .collect();
    let outside = format!("{run}s0").into_bytes();
    for k in keys.iter().chain(std::iter::once(&outside)) {
        expect(
            store(backend, k, Bytes::from_static(b"s"), None).await,
            Cas::Written,
            || fail(name, "store(None) of an absent key must write it"),
        );
        let version = loaded(backend, k, b"s", "a key stored must load").await;
        written.push((k.clone(), version));
    }
    keys.sort();
    let page = match backend.scan(&prefix, None, count).await {
        Ok(page) => page,
        Err(Error::Unsupported { .. }) => return,
        Err(e) => panic!("kit backend {}: scan: {e}", backend.name()),
    };
    let got: Vec<&[u8]> = page.iter().map(|s| s.key.as_slice()).collect();
    let want: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    if got != want {
        fail(
            name,
            &format!(
                "scan(prefix, None, {count}) of {count} keys must return them all, in byte order, \
             and no key outside the prefix: got {} keys",
                got.len()
            ),
        );
    }
    if page
        .iter()
        .any(|s| s.value.value != Bytes::from_static(b"s"))
    {
        fail(name, "scan must return each key's value");
    }
    let first = scan_ok(backend, &prefix, None, 10).await;
    if first.len() != 10 || first.iter().map(|s| &s.key).ne(keys[..10].iter()) {
        fail(name, "scan(prefix, None, 10) must return the first 10 keys");
    }
    let rest = scan_ok(backend, &prefix, Some(&keys[9]), MAX_PAGE + 1).await;
    if rest.iter().map(|s| &s.key).ne(keys[10..].iter()) {
        fail(
            name,
            "scan after a key must resume strictly after it, up to the limit (no cap)",
        );
    }
    let distinct: HashSet<&Vec<u8>> = rest.iter().map(|s| &s.key).collect();
    if distinct.len() != rest.len() {
        fail(name, "scan must return each key once");
    }
}

async fn scan_ok<B: CasBackend>(
    backend: &B,
    prefix: &[u8],
    after: Option<&[u8]>,
    limit: usize,
) -> Vec<idem_core::kit::Scanned<B::Version>> {
    backend
        .scan(prefix, after, limit)
        .await
        .unwrap_or_else(|e| panic!("kit backend {}: scan: {e}", backend.name()))
}

/// How many of [`RACERS`] writers of one value each, at `key` with `expected`, wrote.
async fn race<B: CasBackend>(backend: &B, key: &[u8], expected: Option<&B::Version>) -> usize {
    let writes = (0..RACERS).map(|i| {
        let value = Bytes::from(format!("racer {i}"));
        store(backend, key, value, expected)
    });
    join_all(writes)
        .await
        .into_iter()
        .filter(|cas| *cas == Cas::Written)
        .count()
}

async fn load<B: CasBackend>(backend: &B, key: &[u8]) -> Option<Versioned<B::Version>> {
    backend
        .load(key)
        .await
        .unwrap_or_else(|e| panic!("kit backend {}: load: {e}", backend.name()))
}

/// The version of `key`, which must hold `value` (else panics with `rule`).
async fn loaded<B: CasBackend>(backend: &B, key: &[u8], value: &[u8], rule: &str) -> B::Version {
    match load(backend, key).await {
        Some(found) if found.value == value => found.version,
        other => panic!(
            "kit backend {}: {rule}: found {:?}",
            backend.name(),
            other.map(|v| v.value.len())
        ),
    }
}

async fn store<B: CasBackend>(
    backend: &B,
    key: &[u8],
    value: Bytes,
    expected: Option<&B::Version>,
) -> Cas {
    backend
        .store(key, value, expected)
        .await
        .unwrap_or_else(|e| panic!("kit backend {}: store: {e}", backend.name()))
}

async fn delete<B: CasBackend>(backend: &B, key: &[u8], expected: &B::Version) -> Cas {
    backend
        .delete(key, expected)
        .await
        .unwrap_or_else(|e| panic!("kit backend {}: delete: {e}", backend.name()))
}

fn expect<T: PartialEq + Debug>(got: T, want: T, broken: impl FnOnce()) {
    if got != want {
        broken();
    }
}

/// Panics naming the backend and the rule it broke.
fn fail(name: &str, rule: &str) -> ! {
    panic!("kit backend {name}: {rule}")
}
