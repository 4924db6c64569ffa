#![doc = include_str!("../README.md")]

pub mod backend;
pub mod effects;
pub mod faults;
mod harness;
mod ledger;
pub mod model;
pub mod outage;
pub mod scenarios;
pub mod servers;

pub use faults::FaultyStore;
pub use harness::{Config, Harness, TimeControl};
pub use ledger::{Entry, Ledger};

/// Every scenario's name, in order.
pub const SCENARIOS: [&str; 25] = [
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
    "c21_replayed_transitions",
    "c22_text_fidelity",
    "c23_round_trips",
    "c24_batches_equal_singles",
    "c26_listing",
];

/// Expands to one `#[tokio::test]` per scenario, each building its harness with `$make`
/// (a path to an `async fn() -> Harness`). Needs `tokio` (with `macros` and `rt-multi-thread`)
/// as a dev-dependency of the calling crate.
///
/// `conformance_tests!(make, listing: make_listing)` builds C26 (listing) with `make_listing`
/// instead, for a store whose listing reads everything the store holds (a DynamoDB `Scan`):
/// there C26 gets a store of its own, so its age filter is not slowed down by the other
/// scenarios' records. C25 (transactional effects) needs a probe and is not part of the macro
/// (see [`effects`]).
#[macro_export]
macro_rules! conformance_tests {
    ($make:path) => {
        $crate::conformance_tests!($make, listing: $make);
    };
    ($make:path, listing: $listing:path) => {
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
            c21_replayed_transitions,
            c22_text_fidelity,
            c23_round_trips,
            c24_batches_equal_singles,
        );
        $crate::__scenario_tests!($listing; c26_listing);
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __scenario_tests {
    ($make:path; $($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $name() {
            // `$make` returns a `Harness`, or an `Option<Harness>` that is `None` when the
            // backend's server is missing outside CI (see `servers`): the test then skips.
            let harness: ::std::option::Option<$crate::Harness> = $make().await.into();
            let ::std::option::Option::Some(harness) = harness else {
                return;
            };
            $crate::scenarios::$name(&harness).await;
        }
    )*};
}
