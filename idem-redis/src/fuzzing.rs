//! The decoders of script replies, for the fuzz targets in `fuzz/`. Built only with
//! `--cfg fuzzing` (as `cargo fuzz` builds); not part of the API.

use idem_core::{AcquireOutcome, IdempotencyKey, Record, Result};
use redis::Value;

use crate::codec;

const STORE: &str = "redis";

/// Decodes a `get.lua` reply as [`RedisStore::get`](crate::RedisStore) does.
///
/// # Errors
/// [`Error::CorruptRecord`](idem_core::Error::CorruptRecord) when the reply does not decode.
pub fn get_reply(reply: &Value, key: &IdempotencyKey) -> Result<Option<Record>> {
    codec::record(reply, key).map_err(|b| codec::corrupt(STORE, key.id().as_bytes(), b))
}

/// Decodes an `acquire.lua` reply as [`RedisStore::acquire`](crate::RedisStore) does.
///
/// # Errors
/// [`Error::CorruptRecord`](idem_core::Error::CorruptRecord) when the reply does not decode.
pub fn acquire_reply(reply: &Value, key: &IdempotencyKey, owner: &str) -> Result<AcquireOutcome> {
    codec::acquire_outcome(reply, key, owner)
        .map_err(|b| codec::corrupt(STORE, key.id().as_bytes(), b))
}

/// Decodes the reply of a fenced script (and an `extend`'s lease end), returning its debug form.
///
/// # Errors
/// [`Error::CorruptRecord`](idem_core::Error::CorruptRecord) when the reply does not decode.
pub fn fenced_reply(reply: &Value, key: &IdempotencyKey) -> Result<String> {
    let corrupt = |b| codec::corrupt(STORE, key.id().as_bytes(), b);
    let fenced = codec::fenced(reply).map_err(corrupt)?;
    if let codec::Fenced::Applied(end) = &fenced {
        let _ = codec::lease_end(*end);
    }
    Ok(format!("{fenced:?}"))
}
