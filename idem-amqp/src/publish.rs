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

/// The headers RabbitMQ writes when it dead-letters a message: its dead-letter history.
const DEATH_HEADERS: [&str; 7] = [
    "x-death",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-first-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
    "x-last-death-exchange",
];

/// The header a quorum queue writes on a redelivery: how often *that* queue delivered the
/// message.
const DELIVERY_COUNT: &str = "x-delivery-count";

/// What a copy of a consumed message the runner publishes is for.
#[derive(Debug)]
pub(crate) enum Republish {
    /// A delayed retry, to the retry queue: it expires after `expiration` (milliseconds), and
    /// the broker then dead-letters it back to the work queue.
    Retry {
        /// The delay, as a message expiration.
        expiration: ShortString,
    },
    /// A dead letter, to the dead-letter exchange, persistent, with `headers` (the runner's,
    /// beside the original ones or not: [`dead_letter::headers`](crate::dead_letter::headers)).
    DeadLetter {
        /// Its headers.
        headers: FieldTable,
    },
}

/// The properties of a copy of `msg` published again: the original ones, with the headers
/// `copy` says and its expiration (a retry's delay; a dead letter has none, and is persistent).
///
/// Left out of every copy:
/// - the `user_id`: the broker refuses a `user_id` other than the publishing connection's user;
/// - the headers `CC` and `BCC`: the broker would route every copy to the queues they name
///   again (a `CC` naming the work queue sent each retry straight back, undelayed, beside the
///   delayed copy);
/// - `x-delivery-count`: a quorum queue's count of its own deliveries, stale on a copy (a
///   classic queue would hand it on as it is, to be taken for its own).
///
/// Left out of a retry also: RabbitMQ's dead-letter history (`x-death`,
/// `x-{first,last}-death-{queue,reason,exchange}`). A retry comes back to the work queue by the
/// broker's dead-lettering from the retry queue, and the broker drops a message dead-lettered
/// into a queue its history names without a rejection in between ("dead-letter queues cycle
/// detected"): a message the work queue itself had dead-lettered once (a delivery limit, a TTL,
/// a length limit) and that an operator moved back, retried with its history, was lost, its
/// original acknowledged already. A dead letter keeps the history: it goes to the dead-letter
/// exchange, and the runner never publishes it back towards the work queue.
pub(crate) fn republished(msg: &AmqpMessage, copy: Republish) -> BasicProperties {
    let p = msg.properties();
    let mut out = BasicProperties::default();
    if let Some(v) = p.content_type() {
        out = out.with_content_type(v.clone());
    }
    if let Some(v) = p.content_encoding() {
        out = out.with_content_encoding(v.clone());
    }
    let (headers, expiration, persistent) = match copy {
        Republish::Retry { expiration } => (
            p.headers()
                .clone()
                .map(|h| without(h, &[&ROUTING_HEADERS, &DEATH_HEADERS, &[DELIVERY_COUNT]])),
            Some(expiration),
            false,
        ),
        Republish::DeadLetter { headers } => (
            Some(without(headers, &[&ROUTING_HEADERS, &[DELIVERY_COUNT]])),
            None,
            true,
        ),
    };
    if let Some(v) = headers {
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

/// `headers` without the headers named in `left_out`.
fn without(headers: FieldTable, left_out: &[&[&str]]) -> FieldTable {
    let dropped = |name: &str| left_out.iter().any(|names| names.contains(&name));
    if !headers.inner().keys().any(|name| dropped(name.as_str())) {
        return headers;
    }
    let mut kept = headers.inner().clone();
    kept.retain(|name, _| !dropped(name.as_str()));
    FieldTable::from(kept)
}

#[cfg(test)]
mod tests {
    use idem_executor::DeadLetterReason;
    use idem_executor::broker::{DeadLetterInfo, Fit};
    use lapin::types::{AMQPValue, FieldArray, LongString};

    use super::*;

    fn retry(msg: &AmqpMessage) -> BasicProperties {
        republished(
            msg,
            Republish::Retry {
                expiration: "250".into(),
            },
        )
    }

    fn dead_letter(msg: &AmqpMessage, headers: FieldTable) -> BasicProperties {
        republished(msg, Republish::DeadLetter { headers })
    }

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
        let retry = retry(&msg);
        assert_eq!(retry.user_id(), &None);
        assert_eq!(retry.expiration().as_ref().map(|e| e.as_str()), Some("250"));
        assert_eq!(
            retry.delivery_mode(),
            &Some(1),
            "the producer's choice kept"
        );
        assert_eq!(retry.message_id().as_ref().map(|e| e.as_str()), Some("m-1"));
        assert_eq!(retry.kind().as_ref().map(|e| e.as_str()), Some("payment"));
        let dead = dead_letter(&msg, FieldTable::default());
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
        for copy in [retry(&msg), dead_letter(&msg, headers)] {
            let kept = copy.headers().as_ref().unwrap();
            assert!(kept.contains_key("trace"));
            assert!(!kept.contains_key("CC") && !kept.contains_key("BCC"));
        }
    }

    /// Headers as a message the work queue dead-lettered once, then redelivered by a quorum
    /// queue, carries them.
    fn broker_headers() -> FieldTable {
        let mut death = FieldTable::default();
        death.insert("queue".into(), AMQPValue::LongString("payments".into()));
        death.insert("reason".into(), AMQPValue::LongString("expired".into()));
        let mut headers = FieldTable::default();
        headers.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
        );
        for name in &DEATH_HEADERS[1..] {
            headers.insert((*name).into(), AMQPValue::LongString("payments".into()));
        }
        headers.insert(DELIVERY_COUNT.into(), AMQPValue::LongLongInt(3));
        headers.insert("idempotency-key".into(), AMQPValue::LongString("k".into()));
        headers
    }

    #[test]
    fn a_retry_goes_without_the_broker_s_dead_letter_history_and_delivery_count() {
        let msg = AmqpMessage::new(
            b"{}".to_vec(),
            BasicProperties::default().with_headers(broker_headers()),
        );
        let copy = retry(&msg);
        let kept = copy.headers().as_ref().unwrap();
        let names: Vec<&str> = kept.inner().keys().map(ShortString::as_str).collect();
        assert_eq!(names, ["idempotency-key"]);
    }

    #[test]
    fn a_dead_letter_keeps_the_dead_letter_history_but_not_the_delivery_count() {
        let headers = broker_headers();
        let msg = AmqpMessage::new(
            b"{}".to_vec(),
            BasicProperties::default().with_headers(headers.clone()),
        );
        let copy = dead_letter(&msg, headers);
        let kept = copy.headers().as_ref().unwrap();
        for name in DEATH_HEADERS {
            assert!(kept.contains_key(name), "{name} kept");
        }
        assert!(kept.contains_key("idempotency-key"));
        assert!(!kept.contains_key(DELIVERY_COUNT));
    }

    /// The compact form of a dead letter fits the smallest frame AMQP allows (4,096 bytes)
    /// whatever the message: every property is a short string (at most 255 bytes) and the
    /// runner's headers are cut to `COMPACT_TEXT` bytes. So a dead letter too large in the
    /// compact form cannot happen (the runner still handles it: held, then given back).
    #[test]
    fn the_compact_form_of_the_largest_dead_letter_fits_the_smallest_frame() {
        let long = || ShortString::from("s".repeat(255));
        let mut own = FieldTable::default();
        own.insert(
            ShortString::from("h".repeat(255)),
            AMQPValue::LongString(LongString::from("v".repeat(100_000))),
        );
        let props = BasicProperties::default()
            .with_content_type(long())
            .with_content_encoding(long())
            .with_headers(own)
            .with_delivery_mode(2)
            .with_priority(9)
            .with_correlation_id(long())
            .with_reply_to(long())
            .with_expiration(long())
            .with_message_id(long())
            .with_timestamp(u64::MAX)
            .with_type(long())
            .with_user_id(long())
            .with_app_id(long())
            .with_cluster_id(long());
        let msg = AmqpMessage::new(b"{}".to_vec(), props).with_source(
            &"q".repeat(255),
            &"x".repeat(255),
            &"r".repeat(255),
        );
        let info = DeadLetterInfo {
            reason: DeadLetterReason::ResultNotStored,
            error: "e".repeat(100_000),
            attempts: None,
        };
        let key = "k".repeat(100_000);
        let headers = crate::dead_letter::headers(&msg, &info, None, Some(&key), Fit::Compact);
        let size = content_header_size(&dead_letter(&msg, headers)).unwrap();
        assert!(size <= 4096 - FRAME_OVERHEAD, "{size} bytes");
    }
}
