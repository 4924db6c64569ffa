//! The message a handler receives.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use aws_sdk_sqs::types::{Message as Received, MessageAttributeValue, MessageSystemAttributeName};

/// One received SQS message: its body, message attributes and system attributes, as the
/// handler and the executor's key sources see it. Cheap to clone (shared behind an `Arc`).
///
/// It implements [`idem_executor::Message`]: the payload is the body's bytes, a *header* is a
/// message attribute (its string value, for the `String` and `Number` data types and their custom
/// subtypes, or its binary value, for `Binary`), matched by exact name as SQS does, and the
/// [message key](idem_executor::Message::message_key) is the FIFO deduplication id. The runner
/// never reads the deduplication id by itself: it is the producer's *transport* deduplication
/// token (five minutes, per queue), not the idempotency key (see the [crate docs](crate#keys)).
#[derive(Clone)]
pub struct SqsMessage {
    inner: Arc<Inner>,
}

struct Inner {
    message: Received,
    queue_url: Arc<str>,
}

impl fmt::Debug for SqsMessage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqsMessage")
            .field("queue_url", &self.queue_url())
            .field("message_id", &self.message_id())
            .field("message_group_id", &self.message_group_id())
            .field("receive_count", &self.receive_count())
            .field("body_len", &self.body().len())
            .finish_non_exhaustive()
    }
}

impl SqsMessage {
    /// Wraps a message received from the queue `queue_url`.
    pub fn new(message: Received, queue_url: impl Into<Arc<str>>) -> Self {
        Self {
            inner: Arc::new(Inner {
                message,
                queue_url: queue_url.into(),
            }),
        }
    }

    /// The queue it was received from.
    pub fn queue_url(&self) -> &str {
        &self.inner.queue_url
    }

    /// The SQS message id (`""` if SQS sent none).
    pub fn message_id(&self) -> &str {
        self.inner.message.message_id().unwrap_or_default()
    }

    /// The receipt handle of this receive (`""` if SQS sent none).
    pub fn receipt_handle(&self) -> &str {
        self.inner.message.receipt_handle().unwrap_or_default()
    }

    /// The body (`""` if SQS sent none).
    pub fn body(&self) -> &str {
        self.inner.message.body().unwrap_or_default()
    }

    /// The message attribute `name`, exactly as received.
    pub fn attribute(&self, name: &str) -> Option<&MessageAttributeValue> {
        self.inner.message.message_attributes()?.get(name)
    }

    /// Every message attribute.
    pub fn attributes(&self) -> Option<&HashMap<String, MessageAttributeValue>> {
        self.inner.message.message_attributes()
    }

    /// A system attribute (`ApproximateReceiveCount`, `MessageGroupId`, `SentTimestamp`, ...).
    pub fn system_attribute(&self, name: &MessageSystemAttributeName) -> Option<&str> {
        self.inner
            .message
            .attributes()?
            .get(name)
            .map(String::as_str)
    }

    /// The FIFO message group, `None` on a standard queue.
    pub fn message_group_id(&self) -> Option<&str> {
        self.system_attribute(&MessageSystemAttributeName::MessageGroupId)
    }

    /// The FIFO deduplication id, `None` on a standard queue.
    pub fn deduplication_id(&self) -> Option<&str> {
        self.system_attribute(&MessageSystemAttributeName::MessageDeduplicationId)
    }

    /// How many times SQS delivered the message, this delivery included
    /// (`ApproximateReceiveCount`).
    pub fn receive_count(&self) -> Option<u32> {
        self.system_attribute(&MessageSystemAttributeName::ApproximateReceiveCount)?
            .parse()
            .ok()
    }

    /// The message as the SDK returned it.
    pub fn raw(&self) -> &Received {
        &self.inner.message
    }
}

impl idem_executor::Message for SqsMessage {
    fn payload(&self) -> &[u8] {
        self.body().as_bytes()
    }

    fn header(&self, name: &str) -> Option<&[u8]> {
        let value = self.attribute(name)?;
        match (value.string_value(), value.binary_value()) {
            (Some(s), _) => Some(s.as_bytes()),
            (None, Some(b)) => Some(b.as_ref()),
            (None, None) => None,
        }
    }

    fn message_key(&self) -> Option<&[u8]> {
        self.deduplication_id().map(str::as_bytes)
    }
}

#[cfg(test)]
mod tests {
    use aws_sdk_sqs::primitives::Blob;
    use idem_executor::{KeySource, Message as _};

    use super::*;

    fn attr(data_type: &str, s: Option<&str>, b: Option<&[u8]>) -> MessageAttributeValue {
        MessageAttributeValue::builder()
            .data_type(data_type)
            .set_string_value(s.map(str::to_owned))
            .set_binary_value(b.map(Blob::new))
            .build()
            .unwrap()
    }

    #[test]
    fn attributes_are_headers_and_the_body_is_the_payload() {
        let msg = SqsMessage::new(
            Received::builder()
                .message_id("m-1")
                .receipt_handle("r-1")
                .body(r#"{"order":{"id":"o-7"}}"#)
                .message_attributes("idempotency-key", attr("String", Some("tx-1"), None))
                .message_attributes("amount", attr("Number.cents", Some("1250"), None))
                .message_attributes("blob", attr("Binary", None, Some(b"\x00\x01")))
                .attributes(MessageSystemAttributeName::MessageGroupId, "g-1")
                .attributes(MessageSystemAttributeName::MessageDeduplicationId, "d-1")
                .attributes(MessageSystemAttributeName::ApproximateReceiveCount, "3")
                .build(),
            "http://q",
        );
        assert_eq!(msg.payload(), br#"{"order":{"id":"o-7"}}"#);
        assert_eq!(msg.header("idempotency-key"), Some(&b"tx-1"[..]));
        assert_eq!(msg.header("Idempotency-Key"), None, "names are exact");
        assert_eq!(msg.header("amount"), Some(&b"1250"[..]));
        assert_eq!(msg.header("blob"), Some(&b"\x00\x01"[..]));
        assert_eq!(msg.message_key(), Some(&b"d-1"[..]));
        assert_eq!(msg.message_group_id(), Some("g-1"));
        assert_eq!(msg.receive_count(), Some(3));
        assert_eq!((msg.message_id(), msg.receipt_handle()), ("m-1", "r-1"));

        let key = |source: KeySource| source.extract(&msg).unwrap();
        assert_eq!(key(KeySource::default()), Some("tx-1".into()));
        assert_eq!(
            key(KeySource::json_pointer("/order/id")),
            Some("o-7".into())
        );
        assert_eq!(
            key(KeySource::from_fn(|m| m
                .header("amount")
                .map(|a| format!("amount-{}", String::from_utf8_lossy(a))))),
            Some("amount-1250".into())
        );
    }
}
