//! Publications with publisher confirms: delayed retries and dead letters.

use std::sync::Arc;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection};

use crate::message::AmqpMessage;

/// Why a publication did not land.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PublishError {
    #[error("{0}")]
    Amqp(#[from] lapin::Error),
    #[error("returned as unroutable ({code} {text}): no queue is bound for it")]
    Returned { code: u16, text: String },
    #[error("refused by the broker (basic.nack)")]
    Nacked,
    #[error("not confirmed within {0:?}")]
    TimedOut(Duration),
}

/// Publishes on its own confirm-mode channel of the session's connection, opened again when a
/// refused publication closed it.
pub(crate) struct Publisher {
    connection: Arc<Connection>,
    channel: tokio::sync::Mutex<Option<Channel>>,
    timeout: Duration,
}

impl Publisher {
    pub(crate) fn new(connection: Arc<Connection>, timeout: Duration) -> Self {
        Self {
            connection,
            channel: tokio::sync::Mutex::new(None),
            timeout,
        }
    }

    async fn channel(&self) -> Result<Channel, lapin::Error> {
        let mut guard = self.channel.lock().await;
        if let Some(channel) = guard.as_ref().filter(|c| c.status().connected()) {
            return Ok(channel.clone());
        }
        let channel = self.connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        *guard = Some(channel.clone());
        Ok(channel)
    }

    /// Publishes `body` (mandatory) and waits for the broker's confirmation: `Ok` once the
    /// message is routed to a queue and confirmed.
    pub(crate) async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        let publish = async {
            let channel = self.channel().await?;
            let confirm = channel
                .basic_publish(
                    ShortString::from(exchange),
                    ShortString::from(routing_key),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    body,
                    properties,
                )
                .await?
                .await?;
            match confirm {
                Confirmation::Ack(None) => Ok(()),
                Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => {
                    Err(PublishError::Returned {
                        code: returned.reply_code,
                        text: returned.reply_text.to_string(),
                    })
                }
                Confirmation::Nack(None) => Err(PublishError::Nacked),
                // The channel is in confirm mode: a publication is always confirmed.
                Confirmation::NotRequested => Err(PublishError::Nacked),
            }
        };
        match tokio::time::timeout(self.timeout, publish).await {
            Ok(result) => result,
            Err(_) => Err(PublishError::TimedOut(self.timeout)),
        }
    }

    /// Closes the channel (best effort).
    pub(crate) async fn close(&self) {
        if let Some(channel) = self.channel.lock().await.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), channel.close(200, "bye".into()))
                .await;
        }
    }
}

/// The properties of a copy of `msg` published again (to the retry queue or the dead-letter
/// exchange): the original ones, with `headers` in place of the original headers (when given)
/// and `expiration` in place of the original expiration. The `user_id` is dropped: the broker
/// refuses a `user_id` other than the publishing connection's user.
pub(crate) fn republished(
    msg: &AmqpMessage,
    headers: Option<FieldTable>,
    expiration: Option<ShortString>,
    persistent: bool,
) -> BasicProperties {
    let p = msg.properties();
    let mut out = BasicProperties::default();
    if let Some(v) = p.content_type() {
        out = out.with_content_type(v.clone());
    }
    if let Some(v) = p.content_encoding() {
        out = out.with_content_encoding(v.clone());
    }
    if let Some(v) = headers.or_else(|| p.headers().clone()) {
        out = out.with_headers(v);
    }
    if persistent {
        out = out.with_delivery_mode(2);
    } else if let Some(v) = p.delivery_mode() {
        out = out.with_delivery_mode(*v);
    }
    if let Some(v) = p.priority() {
        out = out.with_priority(*v);
    }
    if let Some(v) = p.correlation_id() {
        out = out.with_correlation_id(v.clone());
    }
    if let Some(v) = p.reply_to() {
        out = out.with_reply_to(v.clone());
    }
    if let Some(v) = expiration {
        out = out.with_expiration(v);
    }
    if let Some(v) = p.message_id() {
        out = out.with_message_id(v.clone());
    }
    if let Some(v) = p.timestamp() {
        out = out.with_timestamp(*v);
    }
    if let Some(v) = p.kind() {
        out = out.with_type(v.clone());
    }
    if let Some(v) = p.app_id() {
        out = out.with_app_id(v.clone());
    }
    if let Some(v) = p.cluster_id() {
        out = out.with_cluster_id(v.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn republished_copies_all_but_user_id_and_expiration() {
        let props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_message_id("m-1".into())
            .with_user_id("someone".into())
            .with_expiration("60000".into())
            .with_delivery_mode(1)
            .with_type("payment".into());
        let msg = AmqpMessage::new(b"{}".to_vec(), props);
        let retry = republished(&msg, None, Some("250".into()), false);
        assert_eq!(retry.user_id(), &None);
        assert_eq!(retry.expiration().as_ref().map(|e| e.as_str()), Some("250"));
        assert_eq!(
            retry.delivery_mode(),
            &Some(1),
            "the producer's choice kept"
        );
        assert_eq!(retry.message_id().as_ref().map(|e| e.as_str()), Some("m-1"));
        assert_eq!(retry.kind().as_ref().map(|e| e.as_str()), Some("payment"));
        let dead = republished(&msg, Some(FieldTable::default()), None, true);
        assert_eq!(dead.expiration(), &None, "a dead letter does not expire");
        assert_eq!(
            dead.delivery_mode(),
            &Some(2),
            "dead letters are persistent"
        );
        assert_eq!(dead.headers(), &Some(FieldTable::default()));
    }
}
