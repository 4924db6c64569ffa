//! Namespaced idempotency keys.

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};

/// Longest namespace accepted, in bytes.
pub const MAX_NAMESPACE_LEN: usize = 64;
/// Longest key id accepted, in bytes (UTF-8).
pub const MAX_ID_LEN: usize = 512;

/// The scope of a set of keys: usually one consumer group or one handler.
///
/// Two services that see the same event id keep independent records as long as their namespaces
/// differ. A namespace is 1 to [`MAX_NAMESPACE_LEN`] bytes of ASCII letters, digits, `.`, `_` and
/// `-`: it is chosen by developers, not by message senders, and the restricted alphabet lets every
/// backend build an unambiguous storage key from `namespace` and `id`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Namespace(Arc<str>);

impl Namespace {
    /// Validates and builds a namespace.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] with field `namespace` when it is empty, longer than
    /// [`MAX_NAMESPACE_LEN`] bytes, or holds a character outside `[A-Za-z0-9._-]`.
    pub fn new(name: impl AsRef<str>) -> Result<Self> {
        let name = name.as_ref();
        if name.is_empty() {
            return Err(Error::invalid("namespace", "must not be empty"));
        }
        if name.len() > MAX_NAMESPACE_LEN {
            return Err(Error::invalid(
                "namespace",
                format!(
                    "is {} bytes, the maximum is {MAX_NAMESPACE_LEN}",
                    name.len()
                ),
            ));
        }
        if let Some(c) = name
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            return Err(Error::invalid(
                "namespace",
                format!("holds {c:?}; only ASCII letters, digits, '.', '_' and '-' are allowed"),
            ));
        }
        Ok(Self(Arc::from(name)))
    }

    /// The namespace as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Builds the key `id` in this namespace.
    ///
    /// # Errors
    /// See [`IdempotencyKey::new`].
    pub fn key(&self, id: impl AsRef<str>) -> Result<IdempotencyKey> {
        IdempotencyKey::new(self.clone(), id)
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// A namespaced idempotency key: the unit that is processed at most once to completion.
///
/// The id is any UTF-8 text of 1 to [`MAX_ID_LEN`] bytes except the NUL character (which
/// PostgreSQL cannot store in text). Quotes, `%`, `*`, `{}`, `:`, whitespace, newlines and
/// non-ASCII characters are all allowed and stay distinct: backends pass ids as parameters and
/// never interpret them.
///
/// # Display, and what to pass downstream
///
/// `Display` writes `namespace:id`. Since a namespace cannot contain `:`, the text is
/// unambiguous: two different keys never display the same. It is the value to give a payment
/// provider (or any downstream API) as *its* idempotency key, so that a retry of the same work
/// after a takeover is deduplicated by the provider too. Send the lease's
/// [`FencingToken`](crate::FencingToken) with it where the downstream system can fence (keep the
/// highest token seen per key, refuse lower ones): the key makes the provider's retry idempotent,
/// the token stops a worker that lost its lease from writing at all.
///
/// ```
/// # use idem_core::Namespace;
/// let key = Namespace::new("payments")?.key("charge-1001")?;
/// assert_eq!(key.to_string(), "payments:charge-1001");
/// # Ok::<(), idem_core::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey {
    namespace: Namespace,
    id: Arc<str>,
}

impl IdempotencyKey {
    /// Validates and builds a key.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] with field `key` when the id is empty, longer than
    /// [`MAX_ID_LEN`] bytes, or contains NUL.
    pub fn new(namespace: Namespace, id: impl AsRef<str>) -> Result<Self> {
        let id = id.as_ref();
        if id.is_empty() {
            return Err(Error::invalid("key", "must not be empty"));
        }
        if id.len() > MAX_ID_LEN {
            return Err(Error::invalid(
                "key",
                format!("is {} bytes, the maximum is {MAX_ID_LEN}", id.len()),
            ));
        }
        if id.contains('\0') {
            return Err(Error::invalid("key", "must not contain the NUL character"));
        }
        Ok(Self {
            namespace,
            id: Arc::from(id),
        })
    }

    /// The namespace of the key.
    pub fn namespace(&self) -> &Namespace {
        &self.namespace
    }

    /// The id within the namespace, as the message carried it.
    pub fn id(&self) -> &str {
        &self.id
    }
}

/// `namespace:id`: unambiguous, since a namespace never contains `:` (see the type's docs).
impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.namespace, self.id)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyKey")
            .field("namespace", &self.namespace)
            .field("id", &&*self.id)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_rules() {
        assert!(Namespace::new("orders.v1_payments-2").is_ok());
        for bad in [
            "",
            "a:b",
            "a b",
            "ä",
            "{x}",
            &"n".repeat(MAX_NAMESPACE_LEN + 1),
        ] {
            let r = Namespace::new(bad);
            assert!(
                matches!(
                    r,
                    Err(Error::InvalidInput {
                        field: "namespace",
                        ..
                    })
                ),
                "{bad:?}: {r:?}"
            );
        }
    }

    #[test]
    fn key_rules() {
        let ns = Namespace::new("n").unwrap();
        assert!(ns.key("it's {a}:b* %\n€").is_ok());
        assert!(ns.key("k".repeat(MAX_ID_LEN)).is_ok());
        for bad in [String::new(), "k".repeat(MAX_ID_LEN + 1), "a\0b".into()] {
            let r = ns.key(&bad);
            assert!(
                matches!(r, Err(Error::InvalidInput { field: "key", .. })),
                "{r:?}"
            );
        }
    }
}
