//! DynamoDB items (as edited in the console, or written by another version) through the store's
//! item decoder: a record, a tombstone, or a typed `CorruptRecord`, never a panic.
#![no_main]

use std::collections::HashMap;

use arbitrary::Arbitrary;
use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use idem_core::{Error, Namespace, StateKind};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Name {
    /// One of the attributes the store reads.
    Known(u8),
    Other(String),
}

#[derive(Arbitrary, Debug)]
enum Attr {
    /// A state name the store writes.
    State(u8),
    S(String),
    /// A number as the store writes it.
    Number(u64),
    /// Any text as a number.
    N(String),
    B(Vec<u8>),
    /// A 32-byte blob (a plausible fingerprint).
    Digest([u8; 32]),
    Bool(bool),
    Null,
    L(Vec<Attr>),
    M(Vec<(String, Attr)>),
    Ss(Vec<String>),
    Ns(Vec<String>),
}

impl Attr {
    fn value(self) -> AttributeValue {
        match self {
            Self::State(i) => AttributeValue::S(
                StateKind::ALL[usize::from(i) % StateKind::ALL.len()]
                    .name()
                    .into(),
            ),
            Self::S(s) => AttributeValue::S(s),
            Self::Number(n) => AttributeValue::N(n.to_string()),
            Self::N(s) => AttributeValue::N(s),
            Self::B(b) => AttributeValue::B(Blob::new(b)),
            Self::Digest(d) => AttributeValue::B(Blob::new(d.to_vec())),
            Self::Bool(b) => AttributeValue::Bool(b),
            Self::Null => AttributeValue::Null(true),
            Self::L(items) => AttributeValue::L(items.into_iter().map(Attr::value).collect()),
            Self::M(items) => {
                AttributeValue::M(items.into_iter().map(|(k, v)| (k, v.value())).collect())
            }
            Self::Ss(items) => AttributeValue::Ss(items),
            Self::Ns(items) => AttributeValue::Ns(items),
        }
    }
}

fuzz_target!(|attrs: Vec<(Name, Attr)>| {
    let names = idem_dynamo::fuzzing::ATTRIBUTES;
    let item: HashMap<String, AttributeValue> = attrs
        .into_iter()
        .map(|(name, attr)| {
            let name = match name {
                Name::Known(i) => names[usize::from(i) % names.len()].to_owned(),
                Name::Other(s) => s,
            };
            (name, attr.value())
        })
        .collect();
    let key = Namespace::new("fuzz").unwrap().key("k").unwrap();
    if let Err(e) = idem_dynamo::fuzzing::decode_item(&item, &key) {
        assert!(matches!(e, Error::CorruptRecord { .. }), "{e:?}");
    }
});
