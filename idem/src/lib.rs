#![doc = include_str!("../../README.md")]

pub use idem_core::*;
