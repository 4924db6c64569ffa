#![doc = include_str!("../README.md")]

mod dead_letter;
mod error;
mod message;
mod options;
mod runner;
mod stats;
mod subject;

pub use async_nats;
pub use dead_letter::{
    COMPACT_TEXT, DeadLetterReason, HEADER_ATTEMPTS, HEADER_DELIVERED, HEADER_DROPPED,
    HEADER_ERROR, HEADER_KEY, HEADER_REASON, HEADER_SOURCE_CONSUMER, HEADER_SOURCE_MSG_ID,
    HEADER_SOURCE_NATS_PREFIX, HEADER_SOURCE_SEQUENCE, HEADER_SOURCE_STREAM, HEADER_SOURCE_SUBJECT,
    dead_letter_id, escape, unescape,
};
pub use error::RunnerError;
pub use idem_executor::Handler;
pub use message::NatsMessage;
pub use options::{DeadLetterSubject, RunnerOptions, SUBJECT_TOO_LONG};
pub use runner::{NatsRunner, NatsRunnerBuilder};
pub use stats::{RunnerStats, metric_names};
