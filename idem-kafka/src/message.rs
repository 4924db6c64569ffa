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
/// `get`), and its safe API has no other way to read a name. A `KafkaMessage` finds such
/// headers once, when it is made, and [`header`](Self::header) (so every key source) passes
/// over them: a name that is not UTF-8 is never the name asked for. Code that walks
/// [`headers`](Self::headers) itself must check [`headers_readable`](Self::headers_readable)
/// first. Finding one runs the process's panic hook once (the default hook prints a
/// "panicked" line on standard error; a hook that reports or exits does so); the dead letter
/// copies the headers without reading them.
///
/// # Records whose headers are not read
///
/// The work of reading the names is bounded, as a hostile record could otherwise hold the
/// runner's poll thread for seconds (a 1 MB record holds some 330,000 one-byte names, and each
/// name that is not UTF-8 costs a panic). A record with more than
/// [`MAX_HEADERS`](Self::MAX_HEADERS) headers, or with more than
/// [`MAX_UNREADABLE_HEADER_NAMES`](Self::MAX_UNREADABLE_HEADER_NAMES) names that are not UTF-8,
/// has its headers refused: [`invalid_headers`](Self::invalid_headers) says why,
/// [`header`](Self::header) finds nothing, and the runner dead-letters the record as
/// `invalid_message` without handing it to the executor. Reading them runs the panic hook at
/// most `MAX_UNREADABLE_HEADER_NAMES + 1` times.
#[derive(Clone)]
pub struct KafkaMessage {
    inner: Arc<OwnedMessage>,
    /// What reading the header names found.
    names: Names,
    /// The bytes the record holds: see [`size`](Self::size).
    size: usize,
}

/// What reading a record's header names found.
#[derive(Clone, Debug, Default)]
enum Names {
    /// Every name is UTF-8 (or there are no headers).
    #[default]
    Readable,
    /// The indexes (ascending) of the names that are not UTF-8, at most
    /// [`KafkaMessage::MAX_UNREADABLE_HEADER_NAMES`]; the other names are readable.
    Unreadable(Box<[usize]>),
    /// The headers are not read, for this reason.
    Refused(Box<str>),
}

impl KafkaMessage {
    /// Most headers a record may have: the headers of a record with more are not read (see
    /// [Records whose headers are not read](Self#records-whose-headers-are-not-read)) and the
    /// runner dead-letters it as `invalid_message`.
    pub const MAX_HEADERS: usize = 10_000;

    /// Most header names that are not UTF-8 a record may have (each costs a panic to find): the
    /// headers of a record with more are not read (see
    /// [Records whose headers are not read](Self#records-whose-headers-are-not-read)) and the
    /// runner dead-letters it as `invalid_message`.
    pub const MAX_UNREADABLE_HEADER_NAMES: usize = 1;

    /// Bytes counted per header on top of its name and value in [`size`](Self::size): about
    /// what librdkafka allocates for a header besides them (its `rd_kafka_header_t` and list
    /// slot), so that a record of many empty headers counts for the memory it takes.
    pub const HEADER_OVERHEAD: usize = 48;

    /// Wraps an owned record (the runner detaches every polled record into one).
    pub fn new(message: OwnedMessage) -> Self {
        let (names, header_bytes) = message
            .headers()
            .map_or_else(|| (Names::default(), 0), read_names);
        let size = message.key().map_or(0, <[u8]>::len)
            + message.payload().map_or(0, <[u8]>::len)
            + header_bytes;
        Self {
            inner: Arc::new(message),
            names,
            size,
        }
    }

    /// Bytes of this record the runner counts against
    /// [`max_buffered_bytes_per_partition`](crate::RunnerOptions::max_buffered_bytes_per_partition):
    /// its key and value, and per header its name, its value and
    /// [`HEADER_OVERHEAD`](Self::HEADER_OVERHEAD) bytes of bookkeeping (for the headers whose
    /// names are not read, the overhead only).
    pub fn size(&self) -> usize {
        self.size
    }

    /// Whether every header name is UTF-8, so that walking [`headers`](Self::headers) does not
    /// panic (see [the type's docs](Self#header-names-that-are-not-utf-8)). `false` too when
    /// the headers are not read ([`invalid_headers`](Self::invalid_headers)).
    pub fn headers_readable(&self) -> bool {
        matches!(self.names, Names::Readable)
    }

    /// Why the record's headers are not read, when they are not: more than
    /// [`MAX_HEADERS`](Self::MAX_HEADERS) headers, or more than
    /// [`MAX_UNREADABLE_HEADER_NAMES`](Self::MAX_UNREADABLE_HEADER_NAMES) names that are not
    /// UTF-8. [`header`](Self::header) then finds nothing, and the runner dead-letters the
    /// record as `invalid_message` without handing it to the executor.
    pub fn invalid_headers(&self) -> Option<&str> {
        match &self.names {
            Names::Refused(reason) => Some(reason),
            _ => None,
        }
    }

    /// Whether the name of header `i` can be read without a panic.
    fn readable(&self, i: usize) -> bool {
        match &self.names {
            Names::Readable => true,
            Names::Unreadable(unreadable) => unreadable.binary_search(&i).is_err(),
            Names::Refused(_) => false,
        }
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
    /// such header or its value is null. Headers whose names are not UTF-8 are passed over;
    /// nothing is found in headers that are not read
    /// ([`invalid_headers`](Self::invalid_headers)).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        if let Names::Refused(_) = self.names {
            return None;
        }
        let headers = self.inner.headers()?;
        (0..headers.count())
            .filter(|&i| self.readable(i))
            .filter_map(|i| headers.try_get(i))
            .find(|h| h.key == name)
            .and_then(|h| h.value)
    }

    /// The header names in order, a name that is not UTF-8 as `<not UTF-8>`; for headers that
    /// are not read, one entry saying so.
    pub(crate) fn header_names(&self) -> Vec<&str> {
        let Some(headers) = self.inner.headers() else {
            return Vec::new();
        };
        if let Names::Refused(_) = self.names {
            return vec!["<not read: see the error>"];
        }
        (0..headers.count())
            .map(|i| {
                if self.readable(i) {
                    headers.try_get(i).map_or("", |h| h.key)
                } else {
                    "<not UTF-8>"
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

/// Reads every header name once to find those rdkafka cannot read (it panics on a name that is
/// not UTF-8, and its safe API has no other way to read a name): one `catch_unwind` over the
/// names from the first on, then from the one after each that panicked. Refuses the headers
/// without reading any when there are more than [`KafkaMessage::MAX_HEADERS`], and stops at the
/// first unreadable name past [`KafkaMessage::MAX_UNREADABLE_HEADER_NAMES`]. Also returns the
/// bytes the headers count in [`KafkaMessage::size`].
fn read_names(headers: &OwnedHeaders) -> (Names, usize) {
    let count = headers.count();
    let overhead = count.saturating_mul(KafkaMessage::HEADER_OVERHEAD);
    if count > KafkaMessage::MAX_HEADERS {
        let reason = format!(
            "{count} headers, over the runner's limit of {}",
            KafkaMessage::MAX_HEADERS
        );
        return (Names::Refused(reason.into()), overhead);
    }
    let mut bytes = overhead;
    let mut unreadable = Vec::new();
    let mut next = 0;
    while next < count {
        // Left at the name that panicked, if one does.
        let mut at = next;
        let read = catch_unwind(AssertUnwindSafe(|| {
            while at < count {
                if let Some(h) = headers.try_get(at) {
                    bytes += h.key.len() + h.value.map_or(0, <[u8]>::len);
                }
                at += 1;
            }
        }));
        if read.is_ok() {
            break;
        }
        if unreadable.len() == KafkaMessage::MAX_UNREADABLE_HEADER_NAMES {
            let reason = format!(
                "more than {} header names that are not UTF-8",
                KafkaMessage::MAX_UNREADABLE_HEADER_NAMES
            );
            return (Names::Refused(reason.into()), bytes);
        }
        unreadable.push(at);
        next = at + 1;
    }
    let names = if unreadable.is_empty() {
        Names::Readable
    } else {
        Names::Unreadable(unreadable.into())
    };
    (names, bytes)
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
