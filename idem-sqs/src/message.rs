//! The message a handler receives.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_sqs::types::{Message as Received, MessageAttributeValue, MessageSystemAttributeName};
use tokio::time::Instant;

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
    /// When the receive that returned it answered: SQS started the message's visibility clock
    /// just before.
    received_at: Instant,
    /// Until when this receive surely keeps the message invisible: the receive's answer, or the
    /// sending of the last visibility change SQS accepted, plus the visibility timeout it set.
    /// Past it the visibility may have run out and the message be another receive's.
    held_until: Mutex<Instant>,
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
        Self::received(message, queue_url, Duration::ZERO)
    }

    /// Wraps a message that a receive answering just now returned, with `visibility` as its
    /// visibility timeout.
    pub(crate) fn received(
        message: Received,
        queue_url: impl Into<Arc<str>>,
        visibility: Duration,
    ) -> Self {
        let now = Instant::now();
        Self {
            inner: Arc::new(Inner {
                message,
                queue_url: queue_url.into(),
                received_at: now,
                held_until: Mutex::new(now + visibility),
            }),
        }
    }

    /// When the receive that returned it answered.
    pub(crate) fn received_at(&self) -> Instant {
        self.inner.received_at
    }

    /// Until when this receive surely keeps the message invisible (see [`held`](Self::held)).
    pub(crate) fn held_until(&self) -> Instant {
        *self
            .inner
            .held_until
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// SQS accepted a visibility change of `visibility` sent at `sent`: the message is invisible
    /// until `sent + visibility` at least (SQS applied it after it was sent).
    pub(crate) fn held(&self, sent: Instant, visibility: Duration) {
        let mut until = self
            .inner
            .held_until
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *until = (*until).max(sent + visibility);
    }

    /// Whether the message's visibility may have run out by now: no visibility change was
    /// accepted for a whole visibility timeout. It may then be another receive's.
    pub(crate) fn may_have_lapsed(&self) -> bool {
        Instant::now() >= self.held_until()
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

    /// The receive holds the message for a visibility timeout from its answer; each change SQS
    /// accepted holds it from when it was sent; past the last hold it may be another receive's.
    /// (Paused time: the sleeps move the clock exactly.)
    #[tokio::test(start_paused = true)]
    async fn the_hold_runs_from_the_receive_and_each_accepted_change() {
        let visibility = Duration::from_secs(1);
        let msg = SqsMessage::received(Received::builder().build(), "http://q", visibility);
        assert_eq!(msg.held_until(), msg.received_at() + visibility);
        assert!(!msg.may_have_lapsed());
        tokio::time::sleep(Duration::from_millis(700)).await;
        let sent = Instant::now();
        msg.held(sent, visibility);
        assert_eq!(msg.held_until(), sent + visibility);
        msg.held(msg.received_at(), visibility);
        assert_eq!(
            msg.held_until(),
            sent + visibility,
            "an older change holds no longer"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !msg.may_have_lapsed(),
            "held by the change, past the receive's hold"
        );
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(msg.may_have_lapsed());
        let unknown = SqsMessage::new(Received::builder().build(), "http://q");
        assert!(
            unknown.may_have_lapsed(),
            "a message not received here holds nothing"
        );
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
