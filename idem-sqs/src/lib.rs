#![doc = include_str!("../README.md")]

mod call;
mod dead_letter;
mod deleter;
mod error;
mod message;
mod options;
mod runner;
mod stats;
mod worker;

pub use aws_sdk_sqs;
pub use dead_letter::{
    ATTR_ATTEMPTS, ATTR_DROPPED, ATTR_ERROR, ATTR_KEY, ATTR_REASON, ATTR_SOURCE_MESSAGE_ID,
    COMPACT_TEXT, DeadLetterReason, MAX_ATTRIBUTES, MAX_ERROR_LEN,
};
pub use error::RunnerError;
pub use idem_executor::Handler;
pub use message::SqsMessage;
pub use options::{MAX_BATCH, MAX_DELETE_CALLS, MAX_VISIBILITY, MAX_WAIT_TIME, RunnerOptions};
pub use runner::{SqsRunner, SqsRunnerBuilder};
pub use stats::{RunnerStats, metric_names};
