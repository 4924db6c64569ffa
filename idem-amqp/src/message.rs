//! The message the handler receives.

use std::borrow::Cow;
use std::sync::Arc;

use lapin::BasicProperties;
use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable};

/// One delivery from the work queue, as the handler sees it: the body, the properties (headers
/// included) and where it came from. Cheap to clone (shared behind an `Arc`).
///
/// Implements [`idem_executor::Message`]: [`header`](idem_executor::Message::header) reads the
/// header table by exact (case-sensitive) name and gives the bytes of a string value
/// (`LongString`, `ShortString`) or a byte array; headers of other types (numbers, tables) read
/// as absent there and are available through [`header_value`](Self::header_value). The key
/// header is read by [`key_header`](idem_executor::Message::key_header): integers as their
/// decimal text, other types refused (an `invalid_message` dead letter).
/// [`message_key`](idem_executor::Message::message_key) is the `message_id` property.
#[derive(Clone, Debug)]
pub struct AmqpMessage {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    body: Vec<u8>,
    properties: BasicProperties,
    exchange: String,
    routing_key: String,
    redelivered: bool,
    delivery_tag: u64,
    queue: Arc<str>,
}

impl AmqpMessage {
    /// Takes the body and properties out of a delivery (the acker stays with the runner).
    pub(crate) fn from_delivery(delivery: &mut Delivery, queue: Arc<str>) -> Self {
        Self {
            inner: Arc::new(Inner {
                body: std::mem::take(&mut delivery.data),
                properties: std::mem::take(&mut delivery.properties),
                exchange: delivery.exchange.as_str().to_owned(),
                routing_key: delivery.routing_key.as_str().to_owned(),
                redelivered: delivery.redelivered,
                delivery_tag: delivery.delivery_tag,
                queue,
            }),
        }
    }

    /// A message built by hand, for tests of handlers.
    pub fn new(body: impl Into<Vec<u8>>, properties: BasicProperties) -> Self {
        Self {
            inner: Arc::new(Inner {
                body: body.into(),
                properties,
                exchange: String::new(),
                routing_key: String::new(),
                redelivered: false,
                delivery_tag: 0,
                queue: Arc::from(""),
            }),
        }
    }

    /// The message as consumed from `queue`, published to `exchange` with `routing_key` (for the
    /// crate's tests).
    #[cfg(test)]
    pub(crate) fn with_source(self, queue: &str, exchange: &str, routing_key: &str) -> Self {
        let inner = Arc::try_unwrap(self.inner).expect("not shared");
        Self {
            inner: Arc::new(Inner {
                exchange: exchange.to_owned(),
                routing_key: routing_key.to_owned(),
                queue: Arc::from(queue),
                ..inner
            }),
        }
    }

    /// The message body.
    pub fn body(&self) -> &[u8] {
        &self.inner.body
    }

    /// The message properties (content type, headers, `message_id`, ...).
    pub fn properties(&self) -> &BasicProperties {
        &self.inner.properties
    }

    /// The header table, when the message has one.
    pub fn headers(&self) -> Option<&FieldTable> {
        self.inner.properties.headers().as_ref()
    }

    /// The value of the header `name` whatever its type (exact name).
    pub fn header_value(&self, name: &str) -> Option<&AMQPValue> {
        self.headers()?.inner().get(name)
    }

    /// The exchange the message was published to (empty for the default exchange, which is
    /// where delayed retries come back from).
    pub fn exchange(&self) -> &str {
        &self.inner.exchange
    }

    /// The routing key it was published with.
    pub fn routing_key(&self) -> &str {
        &self.inner.routing_key
    }

    /// Whether the broker flagged the delivery as a redelivery (it was delivered before and not
    /// acknowledged: a consumer crashed or its channel closed). Delayed retries are new
    /// publications and are not flagged.
    pub fn redelivered(&self) -> bool {
        self.inner.redelivered
    }

    /// The delivery tag on the runner's channel.
    pub fn delivery_tag(&self) -> u64 {
        self.inner.delivery_tag
    }

    /// The queue it was consumed from.
    pub fn queue(&self) -> &str {
        &self.inner.queue
    }
}

impl idem_executor::Message for AmqpMessage {
    fn payload(&self) -> &[u8] {
        &self.inner.body
    }

    fn header(&self, name: &str) -> Option<&[u8]> {
        match self.header_value(name)? {
            AMQPValue::LongString(s) => Some(s.as_bytes()),
            AMQPValue::ShortString(s) => Some(s.as_str().as_bytes()),
            AMQPValue::ByteArray(b) => Some(b.as_slice()),
            _ => None,
        }
    }

    /// Strings and byte arrays as they are, integers as their decimal text (a payment id sent
    /// as a number), a void value as no header; any other type is refused (an
    /// `invalid_message` dead letter), never taken for a missing key.
    fn key_header(&self, name: &str) -> Result<Option<Cow<'_, [u8]>>, String> {
        let Some(value) = self.header_value(name) else {
            return Ok(None);
        };
        let integer = match value {
            AMQPValue::LongString(_) | AMQPValue::ShortString(_) | AMQPValue::ByteArray(_) => {
                return Ok(self.header(name).map(Cow::Borrowed));
            }
            AMQPValue::Void => return Ok(None),
            AMQPValue::ShortShortInt(n) => i128::from(*n),
            AMQPValue::ShortShortUInt(n) => i128::from(*n),
            AMQPValue::ShortInt(n) => i128::from(*n),
            AMQPValue::ShortUInt(n) => i128::from(*n),
            AMQPValue::LongInt(n) => i128::from(*n),
            AMQPValue::LongUInt(n) => i128::from(*n),
            AMQPValue::LongLongInt(n) => i128::from(*n),
            other => {
                return Err(format!(
                    "{} value, where a key is a string, a byte array or an integer",
                    type_name(other)
                ));
            }
        };
        Ok(Some(Cow::Owned(integer.to_string().into_bytes())))
    }

    fn message_key(&self) -> Option<&[u8]> {
        self.inner
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().as_bytes())
    }
}

/// An AMQP field value's type, as an error names it.
fn type_name(value: &AMQPValue) -> &'static str {
    match value {
        AMQPValue::Boolean(_) => "a boolean",
        AMQPValue::Float(_) | AMQPValue::Double(_) => "a floating-point",
        AMQPValue::DecimalValue(_) => "a decimal",
        AMQPValue::Timestamp(_) => "a timestamp",
        AMQPValue::FieldArray(_) => "an array",
        AMQPValue::FieldTable(_) => "a table",
        _ => "an unexpected",
    }
}

#[cfg(test)]
mod tests {
    use idem_executor::Message;
    use lapin::types::{LongString, ShortString};

    use super::*;

    #[test]
    fn headers_are_read_by_exact_name_and_string_type() {
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("idempotency-key"),
            AMQPValue::LongString(LongString::from("tx-1")),
        );
        headers.insert(
            ShortString::from("short"),
            AMQPValue::ShortString(ShortString::from("s")),
        );
        headers.insert(ShortString::from("n"), AMQPValue::LongLongInt(3));
        let props = BasicProperties::default()
            .with_headers(headers)
            .with_message_id(ShortString::from("m-1"));
        let msg = AmqpMessage::new(b"{}".to_vec(), props);
        assert_eq!(msg.header("idempotency-key"), Some(&b"tx-1"[..]));
        assert_eq!(msg.header("Idempotency-Key"), None, "names are exact");
        assert_eq!(msg.header("short"), Some(&b"s"[..]));
        assert_eq!(msg.header("n"), None, "not a string");
        assert_eq!(msg.header_value("n"), Some(&AMQPValue::LongLongInt(3)));
        assert_eq!(msg.message_key(), Some(&b"m-1"[..]));
        assert_eq!(msg.payload(), b"{}");
    }

    #[test]
    fn a_key_header_of_another_type_is_read_or_refused_never_missing() {
        use idem_executor::{ExecutorError, KeySource};
        let key = |value: AMQPValue| {
            let mut headers = FieldTable::default();
            headers.insert(ShortString::from("idempotency-key"), value);
            let msg = AmqpMessage::new(
                b"{}".to_vec(),
                BasicProperties::default().with_headers(headers),
            );
            KeySource::header("idempotency-key").extract(&msg)
        };
        assert_eq!(
            key(AMQPValue::LongLongInt(-42)).unwrap(),
            Some("-42".into())
        );
        assert_eq!(key(AMQPValue::LongUInt(7)).unwrap(), Some("7".into()));
        assert_eq!(
            key(AMQPValue::ShortShortUInt(255)).unwrap(),
            Some("255".into())
        );
        assert_eq!(
            key(AMQPValue::ByteArray(b"tx".to_vec().into())).unwrap(),
            Some("tx".into())
        );
        assert_eq!(key(AMQPValue::Void).unwrap(), None);
        for (value, named) in [
            (AMQPValue::Boolean(true), "boolean"),
            (AMQPValue::Double(1.5), "floating-point"),
            (AMQPValue::Timestamp(1), "timestamp"),
            (AMQPValue::FieldTable(FieldTable::default()), "table"),
        ] {
            match key(value) {
                Err(e @ ExecutorError::InvalidMessage { .. }) => {
                    assert!(e.to_string().contains(named), "{e}");
                }
                other => panic!("{named}: expected InvalidMessage, got {other:?}"),
            }
        }
    }
}
