#![doc = include_str!("../README.md")]
// The crate's lints deny unsafe code (one test helper calls librdkafka); the library forbids it.
#![forbid(unsafe_code)]

mod context;
mod dead_letter;
mod error;
mod flow;
mod message;
mod options;
mod runner;
mod stats;
mod worker;

pub use dead_letter::{
    COMPACT_TEXT, DeadLetterReason, DeadLetterTopic, HEADER_ATTEMPTS, HEADER_DROPPED, HEADER_ERROR,
    HEADER_KEY, HEADER_REASON, HEADER_SOURCE_OFFSET, HEADER_SOURCE_PARTITION, HEADER_SOURCE_TOPIC,
};
pub use error::RunnerError;
pub use idem_executor::Handler;
pub use message::KafkaMessage;
pub use options::RunnerOptions;
pub use rdkafka;
pub use runner::{KafkaRunner, KafkaRunnerBuilder};
pub use stats::{RunnerStats, metric_names};
