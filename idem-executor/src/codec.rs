//! How typed handler results are stored.

use serde::Serialize;
use serde::de::DeserializeOwned;

use idem_core::BoxError;

/// Turns handler results into the bytes a store keeps, and back on replay.
///
/// The default is [`JsonCodec`]. A codec must decode what it encoded; a stored result that does
/// not decode (the result type changed between deployments, say) is reported as
/// [`ExecutorError::Decode`](crate::ExecutorError::Decode), never a panic.
pub trait Codec: Send + Sync + 'static {
    /// Encodes a result.
    ///
    /// # Errors
    /// When the value cannot be represented.
    fn encode<T: Serialize + ?Sized>(&self, value: &T) -> Result<Vec<u8>, BoxError>;

    /// Decodes a stored result.
    ///
    /// # Errors
    /// When the bytes are not a valid `T`.
    fn decode<T: DeserializeOwned>(&self, bytes: &[u8]) -> Result<T, BoxError>;
}

/// JSON through `serde_json` (the default codec).
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct JsonCodec;

impl Codec for JsonCodec {
    fn encode<T: Serialize + ?Sized>(&self, value: &T) -> Result<Vec<u8>, BoxError> {
        Ok(serde_json::to_vec(value)?)
    }

    fn decode<T: DeserializeOwned>(&self, bytes: &[u8]) -> Result<T, BoxError> {
        Ok(serde_json::from_slice(bytes)?)
    }
}
