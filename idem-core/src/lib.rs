//! The core of `idem`: the vocabulary, the store contract, the state machine and the in-memory
//! reference store.
//!
//! Users depend on the `idem` facade; backend authors implement [`IdempotencyStore`] and run the
//! `idem-conformance` suite against it.

mod clock;
mod error;
pub mod executor;
mod fingerprint;
mod key;
pub mod machine;
mod memory;
mod record;
mod store;

pub use bytes::Bytes;
pub use clock::{Clock, ManualClock, SystemClock};
pub use error::{BoxError, Error, Result};
pub use executor::{
    BrokerAction, ConfigError, Executor, ExecutorBuilder, ExecutorConfig, ExecutorError,
    HandlerContext, HandlerError, KeySource, Message, Outcome, RawMessage,
};
pub use fingerprint::Fingerprint;
pub use key::{IdempotencyKey, MAX_ID_LEN, MAX_NAMESPACE_LEN, Namespace};
pub use memory::{MemoryStore, SimulatedOutage};
pub use record::{
    AcquireOutcome, AcquireRequest, DEFAULT_MAX_ERROR_LEN, DEFAULT_MAX_RESULT_LEN, FencingToken,
    Lease, Limits, MAX_LEASE_TTL, MAX_OWNER_LEN, MAX_RETENTION, Record, RecordState,
    check_lease_ttl, check_owner, check_retention,
};
pub use store::{DynStore, IdempotencyStore};
