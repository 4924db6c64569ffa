//! The executor's key extraction (headers, message key, JSON pointers, composites) on arbitrary
//! messages: a key, no key, or a typed `InvalidMessage`, never a panic.
#![no_main]

use arbitrary::Arbitrary;
use idem_executor::{ExecutorError, KeySource, RawMessage};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Source {
    Header(String),
    Pointer(String),
    MessageKey,
    Composite(Vec<Source>),
}

impl Source {
    fn build(self, depth: usize) -> KeySource {
        match self {
            Self::Header(name) => KeySource::header(name),
            Self::Pointer(p) => KeySource::json_pointer(p),
            Self::MessageKey => KeySource::message_key(),
            Self::Composite(parts) if depth < 4 => {
                KeySource::composite(parts.into_iter().map(|p| p.build(depth + 1)))
            }
            Self::Composite(_) => KeySource::message_key(),
        }
    }
}

#[derive(Arbitrary, Debug)]
struct Input {
    source: Source,
    payload: Vec<u8>,
    /// A JSON payload made from text, so pointers find something more often.
    json: Option<String>,
    headers: Vec<(String, Vec<u8>)>,
    message_key: Option<Vec<u8>>,
}

fuzz_target!(|input: Input| {
    let payload = match input.json {
        Some(text) => text.into_bytes(),
        None => input.payload,
    };
    let mut msg = RawMessage::new(payload);
    for (name, value) in input.headers {
        msg = msg.with_header(name, value);
    }
    if let Some(key) = input.message_key {
        msg = msg.with_message_key(key);
    }
    let source = input.source.build(0);
    match source.extract(&msg) {
        Ok(Some(id)) => assert!(!id.is_empty()),
        Ok(None) => {}
        Err(e) => assert!(matches!(e, ExecutorError::InvalidMessage { .. }), "{e:?}"),
    }
});
