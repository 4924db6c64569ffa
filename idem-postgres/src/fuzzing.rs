//! The value decoders of row decoding, for the fuzz targets in `fuzz/`. Built only with
//! `--cfg fuzzing` (as `cargo fuzz` builds); not part of the API.

use idem_core::{FencingToken, IdempotencyKey, Result, StateKind};

/// Decodes a `state` column as row decoding does.
///
/// # Errors
/// [`Error::CorruptRecord`](idem_core::Error::CorruptRecord) for an unknown state.
pub fn state(name: &str, key: &IdempotencyKey) -> Result<StateKind> {
    crate::store::state_kind(name, key)
}

/// Decodes a `token` column as row decoding does.
///
/// # Errors
/// [`Error::CorruptRecord`](idem_core::Error::CorruptRecord) for a negative token.
pub fn token(raw: i64, key: &IdempotencyKey) -> Result<FencingToken> {
    crate::store::token_of(raw, key)
}
