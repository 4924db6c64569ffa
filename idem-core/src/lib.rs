#![doc = include_str!("../README.md")]

mod clock;
mod error;
mod fingerprint;
mod key;
pub mod kit;
mod list;
pub mod machine;
mod memory;
mod record;
mod store;

pub use bytes::Bytes;
pub use clock::{Clock, ManualClock, SystemClock};
pub use error::{BoxError, Error, LostLease, Result, TimedOut};
pub use fingerprint::Fingerprint;
pub use key::{IdempotencyKey, MAX_ID_LEN, MAX_NAMESPACE_LEN, Namespace};
pub use list::{Cursor, ListQuery, MAX_PAGE, Page, Status};
pub use memory::{MAX_MEMORY_WRITES, MemoryStore, MemoryWrites, SimulatedOutage};
pub use record::{
    AcquireOutcome, AcquireRequest, Completion, DEFAULT_MAX_BATCH, DEFAULT_MAX_ERROR_LEN,
    DEFAULT_MAX_RESULT_LEN, Failure, FailureKind, FencingToken, Lease, Limits, MAX_LEASE_TTL,
    MAX_OWNER_LEN, MAX_RETENTION, Record, RecordState, StateKind, check_lease_ttl, check_owner,
    check_retention, fit_text, fit_text_ascii,
};
pub use store::{DynStore, IdempotencyStore, TransactionalStore};
