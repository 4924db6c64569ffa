//! The queues and exchange the runner uses, and their declaration.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, ExchangeKind};

use crate::error::RunnerError;

/// The type of the queues the runner declares (`x-queue-type`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QueueType {
    /// A classic queue (the default).
    #[default]
    Classic,
    /// A quorum queue (replicated, Raft-based). Its dead-lettering (what brings a delayed retry
    /// back from the retry queue) is declared `at-least-once` with `x-overflow = reject-publish`,
    /// so an expired retry is never lost on the way back.
    Quorum,
}

impl QueueType {
    /// `classic` or `quorum`, the value of `x-queue-type`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Classic => "classic",
            Self::Quorum => "quorum",
        }
    }
}

/// The names and types of everything the runner reads from and writes to, and whether it
/// declares them itself.
///
/// | what | default name | declared as (when [`declare`](Self::declare) is on) |
/// |---|---|---|
/// | work queue | the name given | durable, `x-queue-type` = [`queue_type`](Self::queue_type) |
/// | retry queue | `<queue>.retry` | durable, same type, `x-dead-letter-exchange = ""`, `x-dead-letter-routing-key = <queue>` (quorum: also `x-dead-letter-strategy = at-least-once`, `x-overflow = reject-publish`) |
/// | dead-letter exchange | `<queue>.dlx` | durable `direct` exchange |
/// | dead-letter queue | `<queue>.dlq` | durable, same type, bound to the dead-letter exchange with the routing key [`dead_letter_routing_key`](Self::dead_letter_routing_key) |
///
/// A delayed retry is published to the retry queue (through the default exchange) with a
/// per-message `expiration` of the delay; when it expires the broker dead-letters it back to the
/// work queue. No broker plugin is needed.
///
/// ```
/// use idem_amqp::{QueueTopology, QueueType};
///
/// let topology = QueueTopology::new("payments").with_queue_type(QueueType::Quorum);
/// assert_eq!(topology.retry_queue, "payments.retry");
/// assert_eq!(topology.dead_letter_exchange, "payments.dlx");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueTopology {
    /// The work queue consumed.
    pub queue: String,
    /// The type of the queues declared (default classic).
    pub queue_type: QueueType,
    /// Whether the runner declares the queues, the exchange and the binding at every (re)connect
    /// (default `true`). A declaration is idempotent when the arguments are the same; an existing
    /// queue with other arguments (another type, no dead-letter arguments on the retry queue)
    /// makes the broker refuse it (`PRECONDITION_FAILED`): [`run`](crate::AmqpRunner::run) fails
    /// with that error on its first connection; after a reconnect the refusal is logged and the
    /// connection tried again with the reconnect delays. Turn it off when the operator declares them (with the arguments of
    /// the table above): the runner then only checks that the work queue exists.
    pub declare: bool,
    /// The retry queue (default `<queue>.retry`).
    pub retry_queue: String,
    /// The dead-letter exchange (default `<queue>.dlx`).
    pub dead_letter_exchange: String,
    /// The dead-letter queue bound to it when declaring (default `<queue>.dlq`; empty: none is
    /// declared or bound, bind your own to the exchange).
    pub dead_letter_queue: String,
    /// The routing key of dead letters (default: the work queue's name).
    pub dead_letter_routing_key: String,
}

impl QueueTopology {
    /// The default topology around the work queue `queue`.
    pub fn new(queue: impl Into<String>) -> Self {
        let queue = queue.into();
        Self {
            queue_type: QueueType::Classic,
            declare: true,
            retry_queue: format!("{queue}.retry"),
            dead_letter_exchange: format!("{queue}.dlx"),
            dead_letter_queue: format!("{queue}.dlq"),
            dead_letter_routing_key: queue.clone(),
            queue,
        }
    }

    /// Sets [`queue_type`](Self::queue_type).
    pub fn with_queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// Sets [`declare`](Self::declare).
    pub fn with_declare(mut self, declare: bool) -> Self {
        self.declare = declare;
        self
    }

    /// Sets [`retry_queue`](Self::retry_queue).
    pub fn with_retry_queue(mut self, name: impl Into<String>) -> Self {
        self.retry_queue = name.into();
        self
    }

    /// Sets [`dead_letter_exchange`](Self::dead_letter_exchange) and
    /// [`dead_letter_routing_key`](Self::dead_letter_routing_key).
    pub fn with_dead_letter_exchange(
        mut self,
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
    ) -> Self {
        self.dead_letter_exchange = exchange.into();
        self.dead_letter_routing_key = routing_key.into();
        self
    }

    /// Sets [`dead_letter_queue`](Self::dead_letter_queue).
    pub fn with_dead_letter_queue(mut self, name: impl Into<String>) -> Self {
        self.dead_letter_queue = name.into();
        self
    }

    pub(crate) fn validate(&self) -> Result<(), RunnerError> {
        let names = [
            ("queue", &self.queue),
            ("retry_queue", &self.retry_queue),
            ("dead_letter_exchange", &self.dead_letter_exchange),
            ("dead_letter_queue", &self.dead_letter_queue),
            ("dead_letter_routing_key", &self.dead_letter_routing_key),
        ];
        for (field, name) in names {
            if name.len() > 255 {
                return Err(RunnerError::config(
                    field,
                    format!("{} bytes: AMQP names are at most 255", name.len()),
                ));
            }
        }
        for (field, name) in &names[..3] {
            if name.is_empty() {
                return Err(RunnerError::config(
                    field,
                    "is empty: the default exchange and server-named queues cannot be used here",
                ));
            }
        }
        if self.retry_queue == self.queue || self.dead_letter_queue == self.queue {
            return Err(RunnerError::config(
                "retry_queue",
                "the retry and dead-letter queues must differ from the work queue",
            ));
        }
        Ok(())
    }

    /// The arguments of the work queue (and of the dead-letter queue).
    fn queue_args(&self) -> FieldTable {
        let mut args = FieldTable::default();
        args.insert(
            ShortString::from("x-queue-type"),
            AMQPValue::LongString(LongString::from(self.queue_type.as_str())),
        );
        args
    }

    /// The arguments of the retry queue: expired messages go back to the work queue.
    pub(crate) fn retry_queue_args(&self) -> FieldTable {
        let mut args = self.queue_args();
        args.insert(
            ShortString::from("x-dead-letter-exchange"),
            AMQPValue::LongString(LongString::from("")),
        );
        args.insert(
            ShortString::from("x-dead-letter-routing-key"),
            AMQPValue::LongString(LongString::from(self.queue.as_str())),
        );
        if self.queue_type == QueueType::Quorum {
            args.insert(
                ShortString::from("x-dead-letter-strategy"),
                AMQPValue::LongString(LongString::from("at-least-once")),
            );
            args.insert(
                ShortString::from("x-overflow"),
                AMQPValue::LongString(LongString::from("reject-publish")),
            );
        }
        args
    }

    /// Declares everything (or, with `declare` off, checks that the work queue exists) on
    /// `channel`, which a refused declaration closes.
    pub(crate) async fn declare_on(&self, channel: &Channel) -> Result<(), RunnerError> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        if !self.declare {
            let passive = QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            };
            channel
                .queue_declare(name(&self.queue), passive, FieldTable::default())
                .await
                .map_err(|e| {
                    RunnerError::amqp(format!("checking that queue {} exists", self.queue), e)
                })?;
            return Ok(());
        }
        let refused = |what: String| {
            move |e| {
                RunnerError::amqp(
                    format!(
                        "declaring {what} (an existing one with other arguments is refused: \
                         declare it as documented in QueueTopology, or turn `declare` off)"
                    ),
                    e,
                )
            }
        };
        channel
            .queue_declare(name(&self.queue), durable, self.queue_args())
            .await
            .map_err(refused(format!("queue {}", self.queue)))?;
        channel
            .queue_declare(name(&self.retry_queue), durable, self.retry_queue_args())
            .await
            .map_err(refused(format!("retry queue {}", self.retry_queue)))?;
        channel
            .exchange_declare(
                name(&self.dead_letter_exchange),
                ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(refused(format!(
                "dead-letter exchange {}",
                self.dead_letter_exchange
            )))?;
        if !self.dead_letter_queue.is_empty() {
            channel
                .queue_declare(name(&self.dead_letter_queue), durable, self.queue_args())
                .await
                .map_err(refused(format!(
                    "dead-letter queue {}",
                    self.dead_letter_queue
                )))?;
            channel
                .queue_bind(
                    name(&self.dead_letter_queue),
                    name(&self.dead_letter_exchange),
                    name(&self.dead_letter_routing_key),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(refused(format!(
                    "the binding of {} to {}",
                    self.dead_letter_queue, self.dead_letter_exchange
                )))?;
        }
        Ok(())
    }
}

/// A validated name (at most 255 bytes: checked by [`QueueTopology::validate`]).
pub(crate) fn name(s: &str) -> ShortString {
    ShortString::from(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_validation() {
        let t = QueueTopology::new("payments");
        assert_eq!(t.retry_queue, "payments.retry");
        assert_eq!(t.dead_letter_queue, "payments.dlq");
        assert_eq!(t.dead_letter_routing_key, "payments");
        assert!(t.validate().is_ok());
        let r = QueueTopology::new("").validate();
        assert!(
            matches!(r, Err(RunnerError::Config { field: "queue", .. })),
            "{r:?}"
        );
        let r = QueueTopology::new("q").with_retry_queue("q").validate();
        assert!(
            matches!(
                r,
                Err(RunnerError::Config {
                    field: "retry_queue",
                    ..
                })
            ),
            "{r:?}"
        );
        let r = QueueTopology::new("x".repeat(256)).validate();
        assert!(matches!(r, Err(RunnerError::Config { .. })), "{r:?}");
    }

    #[test]
    fn retry_queue_dead_letters_back_to_the_work_queue() {
        let t = QueueTopology::new("payments").with_queue_type(QueueType::Quorum);
        let args = t.retry_queue_args();
        let get = |k: &str| match args.inner().get(k) {
            Some(AMQPValue::LongString(s)) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
            other => panic!("{k}: {other:?}"),
        };
        assert_eq!(get("x-dead-letter-exchange"), "");
        assert_eq!(get("x-dead-letter-routing-key"), "payments");
        assert_eq!(get("x-queue-type"), "quorum");
        assert_eq!(get("x-dead-letter-strategy"), "at-least-once");
        assert_eq!(get("x-overflow"), "reject-publish");
        let classic = QueueTopology::new("payments").retry_queue_args();
        assert!(!classic.contains_key("x-dead-letter-strategy"));
    }
}
