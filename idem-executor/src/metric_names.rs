//! Names of the counters the executor emits through the `metrics` facade.
//!
//! Every counter carries the label `namespace`. Install the recorder (exporter) before messages
//! flow; the executor registers counters per message, so a recorder installed later is picked up
//! from then on.

/// Handlers run to completion and recorded.
pub const EXECUTED: &str = "idem_executed";
/// Duplicates answered with a stored result.
pub const REPLAYED: &str = "idem_replayed";
/// Deliveries that found the key held by another worker (after the optional wait).
pub const IN_PROGRESS: &str = "idem_in_progress";
/// Fingerprint conflicts.
pub const CONFLICTS: &str = "idem_conflicts";
/// Acquisitions that took over the expired lease of a crashed or stalled worker.
pub const TAKEOVERS: &str = "idem_takeovers";
/// Handlers cancelled, or completions refused, because the lease was lost.
pub const LEASE_LOST: &str = "idem_lease_lost";
/// Deliveries of exhausted (poison) keys.
pub const EXHAUSTED: &str = "idem_exhausted";
/// Dead-letter hook calls (once per key exhausted by a recorded failure).
pub const DEAD_LETTERED: &str = "idem_dead_lettered";
/// Store errors (acquire, heartbeat, complete, fail).
pub const STORE_ERRORS: &str = "idem_store_errors";
/// Handler failures recorded as retryable (panics included).
pub const RETRYABLE_FAILURES: &str = "idem_retryable_failures";
/// Handler panics.
pub const PANICS: &str = "idem_panics";
/// Terminal failures (recorded in this call or replayed).
pub const FAILED: &str = "idem_failed";
/// Handlers that succeeded but whose result could not be stored (recorded in this call or
/// replayed): see [`Outcome::ResultNotStored`](crate::Outcome::ResultNotStored).
pub const RESULT_NOT_STORED: &str = "idem_result_not_stored";
/// Messages processed without deduplication (missing key pass-through or fail-open).
pub const NOT_DEDUPLICATED: &str = "idem_not_deduplicated";
/// Transactional commits refused as a whole (nothing committed, the failure recorded): see
/// [`Outcome::NotCommitted`](crate::Outcome::NotCommitted).
pub const NOT_COMMITTED: &str = "idem_not_committed";

/// The executor's counters, with their keys built once per executor (a name and the `namespace`
/// label) rather than per message; each increment still goes to the recorder installed at the
/// time.
pub(crate) struct Counters {
    keys: [metrics::Key; Counter::ALL.len()],
}

/// One of the executor's counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Counter {
    Executed,
    Replayed,
    InProgress,
    Conflicts,
    Takeovers,
    LeaseLost,
    Exhausted,
    DeadLettered,
    StoreErrors,
    RetryableFailures,
    Panics,
    Failed,
    ResultNotStored,
    NotDeduplicated,
    NotCommitted,
}

impl Counter {
    const ALL: [Counter; 15] = [
        Self::Executed,
        Self::Replayed,
        Self::InProgress,
        Self::Conflicts,
        Self::Takeovers,
        Self::LeaseLost,
        Self::Exhausted,
        Self::DeadLettered,
        Self::StoreErrors,
        Self::RetryableFailures,
        Self::Panics,
        Self::Failed,
        Self::ResultNotStored,
        Self::NotDeduplicated,
        Self::NotCommitted,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Executed => EXECUTED,
            Self::Replayed => REPLAYED,
            Self::InProgress => IN_PROGRESS,
            Self::Conflicts => CONFLICTS,
            Self::Takeovers => TAKEOVERS,
            Self::LeaseLost => LEASE_LOST,
            Self::Exhausted => EXHAUSTED,
            Self::DeadLettered => DEAD_LETTERED,
            Self::StoreErrors => STORE_ERRORS,
            Self::RetryableFailures => RETRYABLE_FAILURES,
            Self::Panics => PANICS,
            Self::Failed => FAILED,
            Self::ResultNotStored => RESULT_NOT_STORED,
            Self::NotDeduplicated => NOT_DEDUPLICATED,
            Self::NotCommitted => NOT_COMMITTED,
        }
    }
}

/// What `metrics::counter!` would pass from this crate.
static METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new("idem_executor", metrics::Level::INFO, Some("idem_executor"));

impl Counters {
    /// The keys of every counter, labelled with `namespace`.
    pub(crate) fn new(namespace: &metrics::SharedString) -> Self {
        Self {
            keys: Counter::ALL.map(|c| {
                metrics::Key::from_parts(
                    c.name(),
                    vec![metrics::Label::new("namespace", namespace.clone())],
                )
            }),
        }
    }

    /// Adds one to `counter`, on the recorder in force.
    pub(crate) fn increment(&self, counter: Counter) {
        let key = &self.keys[counter as usize];
        metrics::with_recorder(|recorder| recorder.register_counter(key, &METADATA)).increment(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_counter_has_its_own_name_and_place() {
        let counters = Counters::new(&metrics::SharedString::const_str("ns"));
        for (i, c) in Counter::ALL.into_iter().enumerate() {
            assert_eq!(c as usize, i, "{c:?}");
            assert_eq!(counters.keys[i].name(), c.name());
        }
    }
}
