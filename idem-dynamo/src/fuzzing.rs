//! The item decoder, for the fuzz targets in `fuzz/`. Built only with `--cfg fuzzing` (as
//! `cargo fuzz` builds); not part of the API.

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;
use idem_core::{IdempotencyKey, Record, Result};

use crate::item::{Decoder, is_tombstone};

/// Decodes an item as the store does when it reads one: `None` for a tombstone.
///
/// # Errors
/// [`Error::CorruptRecord`](idem_core::Error::CorruptRecord) when the item does not decode.
pub fn decode_item(
    item: &HashMap<String, AttributeValue>,
    key: &IdempotencyKey,
) -> Result<Option<Record>> {
    if is_tombstone(item) {
        return Ok(None);
    }
    Decoder::new(item, key).record().map(Some)
}

/// The attribute names the store reads, for the fuzz target to build plausible items.
pub const ATTRIBUTES: &[&str] = &[
    crate::item::attr::PK,
    crate::item::attr::STATE,
    crate::item::attr::TOKEN,
    crate::item::attr::OWNER,
    crate::item::attr::ATTEMPTS,
    crate::item::attr::CREATED,
    crate::item::attr::FINGERPRINT,
    crate::item::attr::FINAL_ATTEMPTS,
    crate::item::attr::FINAL_CREATED,
    crate::item::attr::FINAL_FINGERPRINT,
    crate::item::attr::LEASE,
    crate::item::attr::UPDATED,
    crate::item::attr::EXPIRES,
    crate::item::attr::TTL,
    crate::item::attr::RESULT,
    crate::item::attr::ERROR,
    crate::item::attr::ACQ_ID,
    crate::item::attr::ACQ_PREV,
];
