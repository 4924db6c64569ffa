//! The kit's worked example (`idem/examples/kit_memory.rs`, the in-memory map of
//! `docs/custom-store.md`) through the whole conformance suite, and the proof that the suite
//! catches a kit backend whose compare-and-swap is not atomic (C02 and C19 fail on it).

// The example is written against the facade (`idem::...`), which re-exports `idem_core`.
extern crate idem_core as idem;

#[allow(dead_code, unreachable_pub)]
#[path = "../../idem/examples/kit_memory.rs"]
mod kit_memory;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;
use idem_conformance::{Config, Harness, scenarios};
use idem_core::kit::{Cas, CasBackend, KitOptions, KitStore, Scanned, Versioned};
use idem_core::{Bytes, DynStore, Error, ManualClock, Result};
use kit_memory::MapBackend;

/// A backend that cannot be reached: every call is `Unavailable`.
#[derive(Debug)]
struct Down;

#[derive(Debug, thiserror::Error)]
#[error("connection refused")]
struct Refused;

#[async_trait]
impl CasBackend for Down {
    type Version = u64;
    fn name(&self) -> &'static str {
        "kit-memory"
    }
    async fn load(&self, _: &[u8]) -> Result<Option<Versioned<u64>>> {
        Err(Error::unavailable("kit-memory", Refused))
    }
    async fn store(&self, _: &[u8], _: Bytes, _: Option<&u64>) -> Result<Cas> {
        Err(Error::unavailable("kit-memory", Refused))
    }
    async fn delete(&self, _: &[u8], _: &u64) -> Result<Cas> {
        Err(Error::unavailable("kit-memory", Refused))
    }
}

const IN_PROCESS: &str = "an in-process map: no round trips (the kit makes an acquire one load \
     plus one compare-and-swap, a duplicate one load; idem-core/tests/kit.rs counts them)";

fn harness_over(store: DynStore, config: Config) -> Harness {
    Harness::new(store, config)
        .in_process(IN_PROCESS)
        .with_unreachable(|| async { Ok(Arc::new(KitStore::new(Down)) as DynStore) })
}

mod manual_clock {
    use super::*;

    pub(super) async fn harness() -> Harness {
        let clock = Arc::new(ManualClock::default());
        let options = KitOptions::default().with_clock(clock.clone());
        let store = KitStore::with_options(MapBackend::default(), options);
        harness_over(Arc::new(store), Config::manual_time(clock))
    }

    idem_conformance::conformance_tests!(harness);
}

mod system_clock {
    use super::*;

    pub(super) async fn harness() -> Harness {
        harness_over(
            Arc::new(KitStore::new(MapBackend::default())),
            Config::real_time(),
        )
    }

    idem_conformance::conformance_tests!(harness);
}

/// The example's map with a compare-and-swap that is not atomic: it compares the version,
/// lets other tasks run (as a backend does when it reads and then writes in two requests), then
/// writes whatever the key holds by then.
#[derive(Debug, Default)]
struct NotAtomic(MapBackend);

#[async_trait]
impl CasBackend for NotAtomic {
    type Version = u64;
    fn name(&self) -> &'static str {
        "not-atomic"
    }
    async fn load(&self, key: &[u8]) -> Result<Option<Versioned<u64>>> {
        self.0.load(key).await
    }
    async fn store(&self, key: &[u8], value: Bytes, expected: Option<&u64>) -> Result<Cas> {
        let current = self.0.load(key).await?.map(|v| v.version);
        if current.as_ref() != expected {
            return Ok(Cas::Conflict);
        }
        tokio::time::sleep(Duration::from_millis(2)).await; // the gap between compare and swap
        let now = self.0.load(key).await?.map(|v| v.version);
        self.0.store(key, value, now.as_ref()).await
    }
    async fn delete(&self, key: &[u8], expected: &u64) -> Result<Cas> {
        self.0.delete(key, expected).await
    }
    async fn scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<Scanned<u64>>> {
        self.0.scan(prefix, after, limit).await
    }
}

type Scenario = fn(&Harness) -> BoxFuture<'_, ()>;

/// Runs `scenario` on a kit store on the system clock, over the example's map or the broken
/// one, in its own task; returns whether it passed.
async fn passes(atomic: bool, scenario: Scenario) -> bool {
    let store: DynStore = if atomic {
        Arc::new(KitStore::new(MapBackend::default()))
    } else {
        Arc::new(KitStore::new(NotAtomic::default()))
    };
    let h = harness_over(store, Config::real_time());
    tokio::spawn(async move { scenario(&h).await })
        .await
        .map_err(|e| assert!(e.is_panic(), "{e:?}"))
        .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_compare_and_swap_that_is_not_atomic_fails_c02_and_c19() {
    let guarding: [(&str, Scenario); 2] = [
        ("c02", |h| Box::pin(scenarios::c02_race_one_winner(h))),
        ("c19", |h| Box::pin(scenarios::c19_chaos_ledger(h))),
    ];
    for (name, scenario) in guarding {
        assert!(
            passes(true, scenario).await,
            "control: {name} must pass on the example's atomic map"
        );
        assert!(
            !passes(false, scenario).await,
            "{name} must catch a compare-and-swap that is not atomic"
        );
    }
}

/// The guide quotes the example's backend: the quote must be the file's text, as it compiles.
#[test]
fn the_guide_quotes_the_example_as_it_is() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let guide = std::fs::read_to_string(root.join("docs/custom-store.md")).unwrap();
    let example = std::fs::read_to_string(root.join("idem/examples/kit_memory.rs")).unwrap();
    let section = guide
        .split_once("## Worked example: the kit")
        .expect("the guide's kit section")
        .1;
    let quoted = section
        .split_once("```rust\n")
        .and_then(|(_, rest)| rest.split_once("```"))
        .expect("a rust block in the kit section")
        .0;
    assert!(
        quoted.contains("impl CasBackend for MapBackend"),
        "{quoted}"
    );
    assert!(
        example.contains(quoted),
        "docs/custom-store.md quotes idem/examples/kit_memory.rs: update the quote"
    );
}

/// The guide's example backend keeps every rule of a kit backend, checked on the backend itself.
#[tokio::test]
async fn the_example_backend_keeps_the_kit_backend_rules() {
    idem_conformance::backend::check_backend(&MapBackend::default(), "kit-memory").await;
}
