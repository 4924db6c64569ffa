//! SHA-256 payload fingerprints.

use std::fmt;
use std::str::FromStr;

use sha2::{Digest, Sha256};

use crate::error::Error;

/// SHA-256 of a message's canonical payload (or of the fields a caller selects).
///
/// The same key arriving with a different fingerprint is a [`Conflict`](crate::AcquireOutcome::Conflict)
/// in every state: the sender reused an idempotency key for a different request.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Fingerprint of one byte string.
    pub fn of(payload: impl AsRef<[u8]>) -> Self {
        Self(Sha256::digest(payload.as_ref()).into())
    }

    /// Fingerprint of several byte strings, each length-prefixed so that `["ab", "c"]` and
    /// `["a", "bc"]` differ.
    pub fn of_parts<I, P>(parts: I) -> Self
    where
        I: IntoIterator<Item = P>,
        P: AsRef<[u8]>,
    {
        let mut hasher = Sha256::new();
        for part in parts {
            let part = part.as_ref();
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
        Self(hasher.finalize().into())
    }

    /// Wraps raw digest bytes, for backends reading a stored fingerprint.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 digest bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hexadecimal form (64 characters).
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl TryFrom<&[u8]> for Fingerprint {
    type Error = Error;

    fn try_from(bytes: &[u8]) -> Result<Self, Error> {
        <[u8; 32]>::try_from(bytes).map(Self).map_err(|_| {
            Error::invalid(
                "fingerprint",
                format!("is {} bytes, a SHA-256 digest is 32", bytes.len()),
            )
        })
    }
}

impl FromStr for Fingerprint {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out)
            .map_err(|e| Error::invalid("fingerprint", format!("not 64 hex digits: {e}")))?;
        Ok(Self(out))
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_digest_and_hex_round_trip() {
        let fp = Fingerprint::of("abc");
        assert_eq!(
            fp.to_hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(fp.to_hex().parse::<Fingerprint>().unwrap(), fp);
        assert!("zz".parse::<Fingerprint>().is_err());
        assert_eq!(Fingerprint::try_from(&fp.as_bytes()[..]).unwrap(), fp);
        assert!(Fingerprint::try_from(&b"short"[..]).is_err());
    }

    #[test]
    fn parts_are_length_prefixed() {
        assert_ne!(
            Fingerprint::of_parts(["ab", "c"]),
            Fingerprint::of_parts(["a", "bc"])
        );
    }
}
