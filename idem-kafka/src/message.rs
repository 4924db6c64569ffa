//! The Kafka record handed to handlers, readable by the executor's key sources.

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use rdkafka::Timestamp;
use rdkafka::message::{Headers, Message as _, OwnedHeaders, OwnedMessage};

/// One Kafka record as the runner hands it to the handler: topic, partition, offset, key,
/// value, headers and timestamp. Cheap to clone (the record is shared behind an `Arc`).
///
/// It implements [`idem_executor::Message`], so every [`KeySource`](idem_executor::KeySource)
/// works on it: [`KeySource::header`](idem_executor::KeySource::header) reads a record header (the
/// first one of that name, compared case-sensitively; a header with a null value counts as
/// absent), [`KeySource::message_key`](idem_executor::KeySource::message_key) reads the record
/// key, and [`KeySource::from_fn`](idem_executor::KeySource::from_fn) sees the payload, headers
/// and key. A record without a value (a tombstone) has an empty payload.
///
/// # Header names that are not UTF-8
///
/// Kafka header names are bytes on the wire, and any producer may send one that is not UTF-8.
/// rdkafka reads names as text and panics on such a name (in `Headers::iter`, `try_get`,
/// `get`). A `KafkaMessage` finds such headers once, when it is made, and
/// [`header`](Self::header) (so every key source) passes over them: a name that is not UTF-8
/// is never the name asked for. Code that walks [`headers`](Self::headers) itself must check
/// [`headers_readable`](Self::headers_readable) first. Finding them runs the process's panic
/// hook once per such header (the default hook prints a "panicked" line on standard error; a
/// hook that reports or exits does so); the dead letter copies the headers without reading them.
#[derive(Clone)]
pub struct KafkaMessage {
    inner: Arc<OwnedMessage>,
    /// The indexes of the headers whose names rdkafka cannot read (empty, not allocated, when
    /// every name is UTF-8).
    unreadable: Box<[usize]>,
}

impl KafkaMessage {
    /// Wraps an owned record (the runner detaches every polled record into one).
    pub fn new(message: OwnedMessage) -> Self {
        let unreadable = message.headers().map_or_else(Box::default, unreadable);
        Self {
            inner: Arc::new(message),
            unreadable,
        }
    }

    /// Whether every header name is UTF-8, so that walking [`headers`](Self::headers) does not
    /// panic (see [the type's docs](Self#header-names-that-are-not-utf-8)).
    pub fn headers_readable(&self) -> bool {
        self.unreadable.is_empty()
    }

    /// The topic the record was read from.
    pub fn topic(&self) -> &str {
        self.inner.topic()
    }

    /// Its partition.
    pub fn partition(&self) -> i32 {
        self.inner.partition()
    }

    /// Its offset within the partition.
    pub fn offset(&self) -> i64 {
        self.inner.offset()
    }

    /// The record key, if any.
    pub fn key(&self) -> Option<&[u8]> {
        self.inner.key()
    }

    /// The record value; `None` for a tombstone.
    pub fn value(&self) -> Option<&[u8]> {
        self.inner.payload()
    }

    /// The record value, empty for a tombstone.
    pub fn payload(&self) -> &[u8] {
        self.inner.payload().unwrap_or(&[])
    }

    /// The record headers, if any. Walking them panics in rdkafka when a name is not UTF-8:
    /// check [`headers_readable`](Self::headers_readable) first.
    pub fn headers(&self) -> Option<&OwnedHeaders> {
        self.inner.headers()
    }

    /// The value of the first header called `name` (compared exactly); `None` when there is no
    /// such header or its value is null. Headers whose names are not UTF-8 are passed over.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        let headers = self.inner.headers()?;
        (0..headers.count())
            .filter(|i| !self.unreadable.contains(i))
            .filter_map(|i| headers.try_get(i))
            .find(|h| h.key == name)
            .and_then(|h| h.value)
    }

    /// The header names in order, a name that is not UTF-8 as `<not UTF-8>`.
    pub(crate) fn header_names(&self) -> Vec<&str> {
        let Some(headers) = self.inner.headers() else {
            return Vec::new();
        };
        (0..headers.count())
            .map(|i| {
                if self.unreadable.contains(&i) {
                    "<not UTF-8>"
                } else {
                    headers.try_get(i).map_or("", |h| h.key)
                }
            })
            .collect()
    }

    /// The record timestamp.
    pub fn timestamp(&self) -> Timestamp {
        self.inner.timestamp()
    }

    /// The underlying rdkafka record.
    pub fn as_owned(&self) -> &OwnedMessage {
        &self.inner
    }
}

/// The indexes of the headers whose names rdkafka cannot read: it panics on a name that is not
/// UTF-8.
fn unreadable(headers: &OwnedHeaders) -> Box<[usize]> {
    (0..headers.count())
        .filter(|&i| catch_unwind(AssertUnwindSafe(|| headers.try_get(i))).is_err())
        .collect()
}

impl fmt::Debug for KafkaMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaMessage")
            .field("topic", &self.topic())
            .field("partition", &self.partition())
            .field("offset", &self.offset())
            .field("key_len", &self.key().map(<[u8]>::len))
            .field("value_len", &self.value().map(<[u8]>::len))
            .field("headers", &self.headers().map_or(0, |h| h.count()))
            .finish()
    }
}

impl idem_executor::Message for KafkaMessage {
    fn payload(&self) -> &[u8] {
        KafkaMessage::payload(self)
    }

    fn header(&self, name: &str) -> Option<&[u8]> {
        KafkaMessage::header(self, name)
    }

    fn message_key(&self) -> Option<&[u8]> {
        self.key()
    }
}

#[cfg(test)]
mod tests {
    use idem_executor::KeySource;
    use rdkafka::message::Header;

    use super::*;

    fn record() -> KafkaMessage {
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "idempotency-key",
                value: Some("tx-1"),
            })
            .insert(Header {
                key: "idempotency-key",
                value: Some("second"),
            })
            .insert(Header::<&str> {
                key: "null",
                value: None,
            });
        KafkaMessage::new(OwnedMessage::new(
            Some(b"{\"amount\":10}".to_vec()),
            Some(b"order-7".to_vec()),
            "payments".into(),
            Timestamp::CreateTime(1),
            2,
            41,
            Some(headers),
        ))
    }

    #[test]
    fn key_sources_read_headers_and_record_key() {
        let msg = record();
        assert_eq!(msg.header("idempotency-key"), Some(&b"tx-1"[..]));
        assert_eq!(msg.header("null"), None);
        assert_eq!(msg.header("Idempotency-Key"), None);
        let by_header = KeySource::default().extract(&msg).unwrap();
        assert_eq!(by_header.as_deref(), Some("tx-1"));
        let by_key = KeySource::message_key().extract(&msg).unwrap();
        assert_eq!(by_key.as_deref(), Some("order-7"));
        let by_fn = KeySource::from_fn(|m| {
            Some(format!(
                "{}-{}",
                m.payload().len(),
                m.header("idempotency-key")?.len()
            ))
        })
        .extract(&msg)
        .unwrap();
        assert_eq!(by_fn.as_deref(), Some("13-4"));
        assert_eq!(
            (msg.topic(), msg.partition(), msg.offset()),
            ("payments", 2, 41)
        );
    }

    #[test]
    fn tombstone_has_an_empty_payload() {
        let msg = KafkaMessage::new(OwnedMessage::new(
            None,
            None,
            "t".into(),
            Timestamp::NotAvailable,
            0,
            0,
            None,
        ));
        assert_eq!(msg.payload(), b"");
        assert_eq!(msg.value(), None);
        assert_eq!(msg.header("idempotency-key"), None);
        assert_eq!(KeySource::default().extract(&msg).unwrap(), None);
    }
}
