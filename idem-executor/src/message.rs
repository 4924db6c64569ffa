//! The message abstraction the executor reads keys and fingerprints from.

use std::borrow::Cow;

use bytes::Bytes;

/// What the executor needs from a broker message: its payload and its headers.
///
/// Broker adapters implement this on a thin wrapper (or directly on the client's message type)
/// without copying: a Kafka record's value and headers, a RabbitMQ delivery's body and
/// properties, an SQS message's body and message attributes.
///
/// The trait is object safe: key closures receive a `&dyn Message`.
pub trait Message {
    /// The payload bytes (fingerprinted, and parsed as JSON by JSON key sources and
    /// [`FingerprintPolicy::JsonFields`](crate::FingerprintPolicy::JsonFields)).
    fn payload(&self) -> &[u8];

    /// The value of the header `name`, or `None` when the message has no such header.
    /// Names are compared the way the broker compares them: exactly (case-sensitively) for
    /// Kafka, AMQP, SQS message attributes and NATS; see [`KeySource`](crate::KeySource).
    fn header(&self, name: &str) -> Option<&[u8]>;

    /// The header `name` as a [`KeySource::header`](crate::KeySource::header) reads it for
    /// the idempotency key: `Ok(None)` when the message has no such header, `Err(what)` when it
    /// has one of a type no key can be read from (`what` says which, for the dead letter).
    /// Defaults to [`header`](Self::header). Brokers whose header values are typed override it,
    /// so that a key sent as another type is never taken for a missing one (which
    /// [`MissingKeyPolicy::PassThrough`](crate::MissingKeyPolicy::PassThrough) would run
    /// without deduplication): AMQP reads integers as their decimal text and refuses booleans,
    /// floats, tables and the like.
    ///
    /// # Errors
    /// What the header's type is, when no key can be read from it.
    fn key_header(&self, name: &str) -> Result<Option<Cow<'_, [u8]>>, String> {
        Ok(self.header(name).map(Cow::Borrowed))
    }

    /// The broker's own message key, when it has one (a Kafka record key, an AMQP
    /// `message_id`, an SQS deduplication id). Read by [`KeySource::message_key`](crate::KeySource::message_key).
    /// `None` by default.
    fn message_key(&self) -> Option<&[u8]> {
        None
    }
}

impl<M: Message + ?Sized> Message for &M {
    fn payload(&self) -> &[u8] {
        (**self).payload()
    }
    fn header(&self, name: &str) -> Option<&[u8]> {
        (**self).header(name)
    }
    fn key_header(&self, name: &str) -> Result<Option<Cow<'_, [u8]>>, String> {
        (**self).key_header(name)
    }
    fn message_key(&self) -> Option<&[u8]> {
        (**self).message_key()
    }
}

/// A plain owned message: payload, headers and an optional broker key. For tests, examples and
/// adapters that already copy their messages.
///
/// Header names are compared exactly (case-sensitive), the first match wins.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RawMessage {
    payload: Bytes,
    headers: Vec<(String, Bytes)>,
    key: Option<Bytes>,
}

impl RawMessage {
    /// A message with this payload and no header.
    pub fn new(payload: impl Into<Bytes>) -> Self {
        Self {
            payload: payload.into(),
            headers: Vec::new(),
            key: None,
        }
    }

    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Bytes>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Sets the broker key.
    pub fn with_message_key(mut self, key: impl Into<Bytes>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// The headers, in insertion order.
    pub fn headers(&self) -> &[(String, Bytes)] {
        &self.headers
    }
}

impl Message for RawMessage {
    fn payload(&self) -> &[u8] {
        &self.payload
    }

    fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| &v[..])
    }

    fn message_key(&self) -> Option<&[u8]> {
        self.key.as_deref()
    }
}
