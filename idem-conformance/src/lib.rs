//! The conformance suite of `idem`: scenarios C01-C20 that every
//! [`IdempotencyStore`](idem_core::IdempotencyStore) must pass.
//!
//! Each scenario is a plain `pub async fn` in [`scenarios`] taking a [`Harness`]; it panics with
//! a message naming the broken rule. Each works in its own random namespace and never wipes the
//! store, so several runs can share one server.
//!
//! # Running it on your own backend
//!
//! In your crate's `tests/conformance.rs` (with `tokio` and `idem-conformance` as
//! dev-dependencies):
//!
//! ```no_run
//! use std::sync::Arc;
//! use idem_conformance::{Config, Harness};
//! use idem_core::{DynStore, MemoryStore};
//! # type MyStore = MemoryStore;
//! # async fn connect(_url: &str) -> idem_core::Result<MyStore> { Ok(MemoryStore::new()) }
//!
//! async fn harness() -> Harness {
//!     let store: DynStore = Arc::new(connect("my://127.0.0.1:4000").await.unwrap());
//!     Harness::new(store, Config::real_time())
//!         .with_unreachable(|| async { Ok(Arc::new(connect("my://127.0.0.1:1").await?) as DynStore) })
//! }
//! idem_conformance::conformance_tests!(harness);
//! # fn main() {}
//! ```
//!
//! That expands to one `#[tokio::test]` per scenario (`c01_fresh_acquire`,
//! `c02_race_one_winner`, ...), so a failure names the rule that broke. For a store with an
//! injectable clock, [`Config::manual_time`] passes time without sleeping.
//!
//! # Harness support for C19 and C20
//!
//! - C19 (chaos) drives many workers over duplicated deliveries with random crashes (a worker
//!   drops its lease) and stalls past the lease (a zombie that later tries to write), and checks
//!   the outcome against a [`Ledger`]: a downstream system that accepts a write only with a token
//!   not lower than any it has seen. Every key must end completed exactly once, the ledger's
//!   standing write for each key must come from the completing acquisition, and every
//!   stale completion must have been refused by the store.
//! - C20 (unreachable store) needs [`Harness::with_unreachable`]: a factory for the same kind of
//!   store pointed at an endpoint where nothing listens. It must answer
//!   [`Error::Unavailable`](idem_core::Error::Unavailable) within [`Config::unavailable_within`],
//!   and the work it guards must not run.

mod harness;
mod ledger;
pub mod scenarios;

pub use harness::{Config, Harness, TimeControl};
pub use ledger::{Entry, Ledger};

/// Every scenario's name, in order.
pub const SCENARIOS: [&str; 20] = [
    "c01_fresh_acquire",
    "c02_race_one_winner",
    "c03_replay_byte_identical",
    "c04_conflict_in_every_state",
    "c05_busy_with_retry_after",
    "c06_crash_takeover",
    "c07_zombie_fenced",
    "c08_heartbeat_keeps_lease",
    "c09_retryable_failure_reacquires",
    "c10_poison_exhausted",
    "c11_terminal_failure_replayed",
    "c12_release_does_not_count",
    "c13_retention_expiry",
    "c14_operator_delete",
    "c15_namespaces_isolated",
    "c16_bad_input_rejected",
    "c17_hostile_keys",
    "c18_get_shows_record",
    "c19_chaos_ledger",
    "c20_unreachable_store",
];

/// Expands to one `#[tokio::test]` per scenario, each building its harness with `$make`
/// (a path to an `async fn() -> Harness`). Needs `tokio` (with `macros` and `rt-multi-thread`)
/// as a dev-dependency of the calling crate.
#[macro_export]
macro_rules! conformance_tests {
    ($make:path) => {
        $crate::__scenario_tests!($make;
            c01_fresh_acquire,
            c02_race_one_winner,
            c03_replay_byte_identical,
            c04_conflict_in_every_state,
            c05_busy_with_retry_after,
            c06_crash_takeover,
            c07_zombie_fenced,
            c08_heartbeat_keeps_lease,
            c09_retryable_failure_reacquires,
            c10_poison_exhausted,
            c11_terminal_failure_replayed,
            c12_release_does_not_count,
            c13_retention_expiry,
            c14_operator_delete,
            c15_namespaces_isolated,
            c16_bad_input_rejected,
            c17_hostile_keys,
            c18_get_shows_record,
            c19_chaos_ledger,
            c20_unreachable_store,
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __scenario_tests {
    ($make:path; $($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $name() {
            let harness: $crate::Harness = $make().await;
            $crate::scenarios::$name(&harness).await;
        }
    )*};
}
