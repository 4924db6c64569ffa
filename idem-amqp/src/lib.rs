#![doc = include_str!("../README.md")]

mod dead_letter;
mod error;
mod message;
mod options;
mod publish;
mod runner;
mod stats;
mod topology;

pub use dead_letter::{
    DeadLetterReason, HEADER_ATTEMPTS, HEADER_DROPPED, HEADER_ERROR, HEADER_KEY, HEADER_REASON,
    HEADER_SOURCE_EXCHANGE, HEADER_SOURCE_QUEUE, HEADER_SOURCE_ROUTING_KEY,
};
pub use error::RunnerError;
pub use idem_executor::Handler;
pub use lapin;
pub use message::AmqpMessage;
pub use options::RunnerOptions;
pub use runner::{AmqpRunner, AmqpRunnerBuilder};
pub use stats::{RunnerStats, metric_names};
pub use topology::{QueueTopology, QueueType};
