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
/// replayed): see [`Outcome::ResultNotStored`](super::Outcome::ResultNotStored).
pub const RESULT_NOT_STORED: &str = "idem_result_not_stored";
/// Messages processed without deduplication (missing key pass-through or fail-open).
pub const NOT_DEDUPLICATED: &str = "idem_not_deduplicated";
