//! The message the handler receives.

use std::sync::Arc;

use async_nats::{HeaderMap, HeaderName, Subject};
use bytes::Bytes;

/// One JetStream message, as the handler sees it: subject, payload, headers, and where it sits
/// in its stream. Cheap to clone (shared behind an `Arc`).
///
/// Implements [`idem_executor::Message`]: [`header`](idem_executor::Message::header) reads the
/// first value of a header by its exact name (NATS keeps header names as written);
/// [`message_key`](idem_executor::Message::message_key) is the `Nats-Msg-Id` header, JetStream's
/// own deduplication id.
#[derive(Clone, Debug)]
pub struct NatsMessage {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    subject: Subject,
    payload: Bytes,
    headers: Option<HeaderMap>,
    stream: String,
    stream_sequence: u64,
    delivered: i64,
}

impl NatsMessage {
    pub(crate) fn from_parts(
        message: async_nats::Message,
        stream: &str,
        stream_sequence: u64,
        delivered: i64,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                subject: message.subject,
                payload: message.payload,
                headers: message.headers,
                stream: stream.to_owned(),
                stream_sequence,
                delivered,
            }),
        }
    }

    /// A message built by hand, for tests of handlers.
    pub fn new(
        subject: impl Into<String>,
        payload: impl Into<Bytes>,
        headers: Option<HeaderMap>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                subject: Subject::from(subject.into()),
                payload: payload.into(),
                headers,
                stream: String::new(),
                stream_sequence: 0,
                delivered: 1,
            }),
        }
    }

    /// The subject it was published on.
    pub fn subject(&self) -> &str {
        &self.inner.subject
    }

    /// The payload.
    pub fn payload(&self) -> &Bytes {
        &self.inner.payload
    }

    /// The headers, when it has any.
    pub fn headers(&self) -> Option<&HeaderMap> {
        self.inner.headers.as_ref()
    }

    /// The stream it was read from.
    pub fn stream(&self) -> &str {
        &self.inner.stream
    }

    /// Its sequence number in the stream.
    pub fn stream_sequence(&self) -> u64 {
        self.inner.stream_sequence
    }

    /// How many times the server delivered it to the consumer, this delivery included (1 for
    /// the first). Naks and expired ack deadlines both count.
    pub fn delivered(&self) -> i64 {
        self.inner.delivered
    }
}

impl idem_executor::Message for NatsMessage {
    fn payload(&self) -> &[u8] {
        &self.inner.payload
    }

    fn header(&self, name: &str) -> Option<&[u8]> {
        // A name NATS cannot carry (control characters, ':') is absent rather than a panic.
        let name = HeaderName::try_from(name).ok()?;
        self.inner
            .headers
            .as_ref()?
            .get(name)
            .map(|v| v.as_str().as_bytes())
    }

    fn message_key(&self) -> Option<&[u8]> {
        self.header("Nats-Msg-Id")
    }
}

#[cfg(test)]
mod tests {
    use idem_executor::Message;

    use super::*;

    #[test]
    fn headers_are_read_by_exact_name() {
        let mut headers = HeaderMap::new();
        headers.insert("idempotency-key", "tx-1");
        headers.insert("Nats-Msg-Id", "m-1");
        let msg = NatsMessage::new("orders.created", "{}", Some(headers));
        assert_eq!(msg.header("idempotency-key"), Some(&b"tx-1"[..]));
        assert_eq!(msg.header("Idempotency-Key"), None, "names are exact");
        assert_eq!(
            msg.header("bad:name"),
            None,
            "no panic on a name NATS refuses"
        );
        assert_eq!(msg.message_key(), Some(&b"m-1"[..]));
        assert_eq!(Message::payload(&msg), b"{}");
    }
}
