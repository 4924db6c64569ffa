//! Publications with publisher confirms: delayed retries and dead letters.

use std::sync::Arc;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};

use crate::error::RunnerError;
use crate::message::AmqpMessage;
use crate::topology::QueueTopology;

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
    /// Not sent: the session is over (its publisher closed), and its deliveries can no longer
    /// be acknowledged.
    #[error("not sent: the session's publisher is closed")]
    Closed,
    /// Not sent: the broker would close the connection over it (`FRAME_ERROR`).
    #[error(
        "not sent: its properties and headers take {size} bytes, more than the connection's frame size allows ({max})"
    )]
    TooLarge { size: usize, max: usize },
}

impl PublishError {
    /// Whether the broker refused the publication because an exchange (`404 NOT_FOUND`) or a
    /// queue bound for it (returned as unroutable, `312 NO_ROUTE`) is gone.
    pub(crate) fn topology_missing(&self) -> bool {
        match self {
            Self::Returned { code, .. } => *code == 312,
            Self::Amqp(e) => {
                matches!(e.kind(), lapin::ErrorKind::ProtocolError(a) if a.get_id() == 404)
            }
            _ => false,
        }
    }
}

/// What a content header frame's payload holds besides the properties: class id, weight and
/// body size.
const CONTENT_HEADER_FIXED: usize = 2 + 2 + 8;
/// What a frame holds besides its payload: type, channel, size and end octet.
const FRAME_OVERHEAD: usize = 1 + 2 + 4 + 1;

/// The payload size of the content header frame that carries `properties` (its headers
/// included); `None` when they cannot be encoded (then the publication fails as it would).
fn content_header_size(properties: &BasicProperties) -> Option<usize> {
    let written = lapin::protocol::basic::gen_properties(properties)(Vec::new().into()).ok()?;
    Some(CONTENT_HEADER_FIXED + written.write.len())
}

/// Publishes on a confirm-mode channel of a connection of its own (not the consuming one),
/// both opened when first needed and again once closed (a refused publication closes its
/// channel; a broker restart, the connection).
///
/// **A connection of its own.** When a memory or disk alarm is on, RabbitMQ blocks every
/// connection that publishes, and then reads nothing more from it, acknowledgements included (and
/// the client writes nothing to a connection the broker blocked). Were the retries and dead
/// letters published on the consuming connection, one publication during an alarm would stop
/// every acknowledgement of the runner: the prefetch would fill, and the backlog that raised the
/// alarm would never drain. On their own connection only they wait (and time out, the delivery
/// given back), while the consuming connection goes on acknowledging.
///
/// **One publication at a time.** The client does not tell which publication a `basic.return`
/// (unroutable) belongs to: it hands the oldest return to whichever confirmation completes next,
/// and the broker confirms several publications at once (`multiple`). With two publications in
/// flight, a routed one could be reported returned and an unroutable one confirmed, and the
/// original message then acknowledged with no queue holding its copy. So a publication holds the
/// channel from its send to its confirmation; one that times out leaves the channel (whose late
/// confirmation or return would be handed to the next) and the next opens another.
pub(crate) struct Publisher {
    uri: String,
    properties: ConnectionProperties,
    link: tokio::sync::Mutex<Link>,
    timeout: Duration,
}

/// The publisher's connection and channel, when open.
#[derive(Default)]
struct Link {
    connection: Option<Arc<Connection>>,
    channel: Option<Channel>,
    /// Closed for good ([`Publisher::close`]): nothing is opened again.
    closed: bool,
}

impl Link {
    /// The open connection, or a new one.
    async fn connection(
        &mut self,
        uri: &str,
        properties: &ConnectionProperties,
    ) -> Result<Arc<Connection>, lapin::Error> {
        if let Some(connection) = self.connection.as_ref().filter(|c| c.status().connected()) {
            return Ok(Arc::clone(connection));
        }
        self.channel = None;
        if let Some(old) = self.connection.take() {
            close_in_background(async move { old.close(200, "reconnecting".into()).await });
        }
        let connection = Arc::new(Connection::connect(uri, properties.clone()).await?);
        self.connection = Some(Arc::clone(&connection));
        Ok(connection)
    }

    /// The open confirm-mode channel, or a new one, with its connection.
    async fn channel(
        &mut self,
        uri: &str,
        properties: &ConnectionProperties,
    ) -> Result<(Channel, Arc<Connection>), lapin::Error> {
        let connection = self.connection(uri, properties).await?;
        if let Some(channel) = self.channel.as_ref().filter(|c| c.status().connected()) {
            return Ok((channel.clone(), connection));
        }
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        self.channel = Some(channel.clone());
        Ok((channel, connection))
    }
}

/// Runs `closing` (a channel's or a connection's close) in the background, for at most 5 s.
fn close_in_background<F>(closing: F)
where
    F: std::future::Future<Output = Result<(), lapin::Error>> + Send + 'static,
{
    tokio::spawn(async move {
        let _ = tokio::time::timeout(Duration::from_secs(5), closing).await;
    });
}

impl Publisher {
    /// A publisher that connects to `uri` with `properties` when it first publishes.
    pub(crate) fn new(uri: &str, properties: ConnectionProperties, timeout: Duration) -> Self {
        Self {
            uri: uri.to_owned(),
            properties,
            link: tokio::sync::Mutex::new(Link::default()),
            timeout,
        }
    }

    /// Publishes `body` (mandatory) and waits for the broker's confirmation: `Ok` once the
    /// message is routed to a queue and confirmed. Waits for the publication before it (see
    /// [`Publisher`]); the timeout counts from the call.
    pub(crate) async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let timed_out = || PublishError::TimedOut(self.timeout);
        let mut link = tokio::time::timeout_at(deadline, self.link.lock())
            .await
            .map_err(|_| timed_out())?;
        if link.closed {
            return Err(PublishError::Closed);
        }
        let (channel, connection) =
            tokio::time::timeout_at(deadline, link.channel(&self.uri, &self.properties))
                .await
                .map_err(|_| timed_out())??;
        // A content header frame must fit in one frame: the broker answers a larger one by
        // closing the connection.
        let frame_max =
            usize::try_from(connection.configuration().frame_max()).unwrap_or(usize::MAX);
        let max = frame_max.saturating_sub(FRAME_OVERHEAD);
        if let Some(size) = content_header_size(&properties).filter(|&size| size > max) {
            return Err(PublishError::TooLarge { size, max });
        }
        let confirmed = tokio::time::timeout_at(deadline, async {
            channel
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
                .await
        })
        .await;
        let confirm = match confirmed {
            Ok(confirm) => confirm?,
            Err(_) => {
                // Its confirmation or return may still come, and would be taken for the next
                // publication's: the next one gets a channel of its own.
                if let Some(left) = link.channel.take() {
                    close_in_background(async move {
                        left.close(200, "publication not confirmed in time".into())
                            .await
                    });
                }
                return Err(timed_out());
            }
        };
        drop(link);
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
    }

    /// Declares `topology` again on a channel of its own (a refused declaration closes it), for
    /// a publication refused because an exchange or a queue of it is gone.
    pub(crate) async fn redeclare(&self, topology: &QueueTopology) -> Result<(), RunnerError> {
        let context = "declaring the topology again";
        let declare = async {
            let connection = {
                let mut link = self.link.lock().await;
                if link.closed {
                    let closed =
                        lapin::ErrorKind::InvalidConnectionState(lapin::ConnectionState::Closed);
                    return Err(RunnerError::amqp(context, closed.into()));
                }
                link.connection(&self.uri, &self.properties)
                    .await
                    .map_err(|e| RunnerError::amqp(context, e))?
            };
            let channel = connection
                .create_channel()
                .await
                .map_err(|e| RunnerError::amqp(context, e))?;
            let declared = topology.declare_on(&channel).await;
            close_in_background(async move { channel.close(200, "declared".into()).await });
            declared
        };
        tokio::time::timeout(self.timeout, declare)
            .await
            .unwrap_or_else(|_| Err(RunnerError::amqp(context, timed_out_error(self.timeout))))
    }

    /// Closes the channel and the connection (best effort), for good: a later publication is
    /// [`PublishError::Closed`].
    pub(crate) async fn close(&self) {
        let mut link = self.link.lock().await;
        link.closed = true;
        if let Some(channel) = link.channel.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), channel.close(200, "bye".into()))
                .await;
        }
        if let Some(connection) = link.connection.take() {
            let _ =
                tokio::time::timeout(Duration::from_secs(5), connection.close(200, "bye".into()))
                    .await;
        }
    }
}

/// The error a step of the publisher's that took longer than `timeout` reports.
fn timed_out_error(timeout: Duration) -> lapin::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("no answer within {timeout:?}"),
    )
    .into()
}

/// The headers by which RabbitMQ routes a message to more queues (sender-selected distribution).
const ROUTING_HEADERS: [&str; 2] = ["CC", "BCC"];

/// The properties of a copy of `msg` published again (to the retry queue or the dead-letter
/// exchange): the original ones, with `headers` in place of the original headers (when given)
/// and `expiration` in place of the original expiration. The `user_id` is dropped: the broker
/// refuses a `user_id` other than the publishing connection's user. The `CC` and `BCC` headers
/// are dropped too: the broker would route every copy to the queues they name again (a `CC`
/// naming the work queue sent each retry straight back, undelayed, beside the delayed copy).
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
        out = out.with_headers(without_routing_headers(v));
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

/// `headers` without [`ROUTING_HEADERS`].
fn without_routing_headers(headers: FieldTable) -> FieldTable {
    if !ROUTING_HEADERS.iter().any(|h| headers.contains_key(h)) {
        return headers;
    }
    let mut kept = headers.inner().clone();
    kept.retain(|name, _| !ROUTING_HEADERS.contains(&name.as_str()));
    FieldTable::from(kept)
}

#[cfg(test)]
mod tests {
    use lapin::types::AMQPValue;

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

    #[test]
    fn republished_drops_the_routing_headers() {
        let mut headers = FieldTable::default();
        for name in ["CC", "BCC", "trace"] {
            headers.insert(name.into(), AMQPValue::LongString("x".into()));
        }
        let msg = AmqpMessage::new(
            b"{}".to_vec(),
            BasicProperties::default().with_headers(headers.clone()),
        );
        for copy in [
            republished(&msg, None, None, false),
            republished(&msg, Some(headers), None, true),
        ] {
            let kept = copy.headers().as_ref().unwrap();
            assert!(kept.contains_key("trace"));
            assert!(!kept.contains_key("CC") && !kept.contains_key("BCC"));
        }
    }
}
