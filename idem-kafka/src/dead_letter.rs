//! The dead-letter topic: what is written there, and how.

use std::time::Duration;

pub use idem_executor::DeadLetterReason;
pub use idem_executor::broker::COMPACT_TEXT;
use idem_executor::broker::{DeadLetterInfo, Fit, attempts_value};
pub use idem_executor::broker::{HEADER_ATTEMPTS, HEADER_ERROR, HEADER_KEY, HEADER_REASON};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Timestamp};

use crate::error::RunnerError;
use crate::message::KafkaMessage;

/// Header with the topic the record was read from.
pub const HEADER_SOURCE_TOPIC: &str = "idem-dlq-source-topic";
/// Header with the partition the record was read from (decimal).
pub const HEADER_SOURCE_PARTITION: &str = "idem-dlq-source-partition";
/// Header with the offset the record was read from (decimal).
pub const HEADER_SOURCE_OFFSET: &str = "idem-dlq-source-offset";

/// Where dead-lettered records go. The runner never creates the topic: create it with the
/// source topic (see [Topics](crate#topics)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterTopic {
    /// The source topic's name followed by this suffix (default: `.dlq`, so `payments` goes to
    /// `payments.dlq`).
    Suffix(String),
    /// One topic for every source topic.
    Fixed(String),
}

impl Default for DeadLetterTopic {
    fn default() -> Self {
        Self::Suffix(".dlq".to_owned())
    }
}

impl DeadLetterTopic {
    /// The dead-letter topic of records read from `source`.
    pub fn for_source(&self, source: &str) -> String {
        match self {
            Self::Suffix(suffix) => format!("{source}{suffix}"),
            Self::Fixed(topic) => topic.clone(),
        }
    }

    pub(crate) fn validate(&self) -> Result<(), RunnerError> {
        match self {
            Self::Suffix(s) | Self::Fixed(s) if s.is_empty() => Err(RunnerError::config(
                "dead_letter_topic",
                "is empty: a suffix would write back to the source topic",
            )),
            _ => Ok(()),
        }
    }
}

/// The original headers (when `fit` keeps them; else [`HEADER_DROPPED`] names them) followed by
/// the dead-letter headers, their texts cut as `fit` cuts them.
pub(crate) fn headers(
    msg: &KafkaMessage,
    info: &DeadLetterInfo,
    attempts: Option<u32>,
    key_id: Option<&str>,
    fit: Fit,
) -> OwnedHeaders {
    let originals = fit.keeps_originals();
    // A copy made by librdkafka, not by reading them: rdkafka panics reading a header name that
    // is not UTF-8, which any producer may send.
    let mut headers = match msg.headers() {
        Some(original) if originals => original.clone(),
        _ => OwnedHeaders::new_with_capacity(8),
    };
    let dropped = (!originals)
        .then(|| msg.header_names())
        .filter(|names| !names.is_empty())
        .map(|names| fit.cut(&names.join(",")).into_owned());
    let attempts = attempts_value(attempts);
    let partition = msg.partition().to_string();
    let offset = msg.offset().to_string();
    let error = fit.cut(&info.error);
    let key_id = key_id.map(|key| fit.cut(key));
    let ours: [(&str, Option<&str>); 8] = [
        (HEADER_REASON, Some(info.reason.as_str())),
        (HEADER_ERROR, Some(&error)),
        (HEADER_ATTEMPTS, Some(attempts.as_str())),
        (HEADER_KEY, key_id.as_deref()),
        (HEADER_SOURCE_TOPIC, Some(msg.topic())),
        (HEADER_SOURCE_PARTITION, Some(partition.as_str())),
        (HEADER_SOURCE_OFFSET, Some(offset.as_str())),
        (HEADER_DROPPED, dropped.as_deref()),
    ];
    for (key, value) in ours {
        if let Some(value) = value {
            headers = headers.insert(Header {
                key,
                value: Some(value),
            });
        }
    }
    headers
}

/// Header naming (comma-separated, cut as [`HEADER_ERROR`] is) the original headers a dead
/// letter goes without (a name that is not UTF-8 as `<not UTF-8>`): present only when, with
/// them, the record was refused as too large. Refused again without them, the dead letter goes
/// with this header, [`HEADER_ERROR`] and [`HEADER_KEY`] cut to [`COMPACT_TEXT`] bytes.
pub const HEADER_DROPPED: &str = "idem-dlq-dropped-headers";

/// librdkafka's largest `message.max.bytes`: what the dead-letter producer is given unless its
/// configuration sets one.
const MAX_MESSAGE_BYTES: u32 = 1_000_000_000;

/// Produces dead-letter records and waits for the broker to acknowledge them.
pub(crate) struct DeadLetterProducer {
    producer: FutureProducer,
    topic: DeadLetterTopic,
    timeout: Duration,
}

impl DeadLetterProducer {
    pub(crate) fn new(
        config: &ClientConfig,
        topic: DeadLetterTopic,
        timeout: Duration,
    ) -> Result<Self, RunnerError> {
        // The client gives up on the message when the runner does, so that it is not still
        // queued, and sent later, behind the runner's next try. A write that timed out after it
        // was sent may still have been appended by the broker (only its acknowledgement was
        // missing): the next try then writes the dead letter a second time.
        let mut config = config.clone();
        config.set(
            "message.timeout.ms",
            timeout.as_millis().clamp(1, i32::MAX as u128).to_string(),
        );
        // The record was read, so the source topic took it; librdkafka's default limit
        // (1,000,000 bytes, checked before sending, headers included) would refuse a larger
        // one every time and stall its partition. Unless set, the broker's limit decides.
        if config.get("message.max.bytes").is_none() {
            config.set("message.max.bytes", MAX_MESSAGE_BYTES.to_string());
        }
        let producer = config.create().map_err(|source| RunnerError::Kafka {
            context: "creating the dead-letter producer",
            source,
        })?;
        Ok(Self {
            producer,
            topic,
            timeout,
        })
    }

    /// Writes the record's key, value, timestamp and headers plus the dead-letter headers, and
    /// waits until the broker acknowledged it (or the timeout ran out). Returns the topic written.
    pub(crate) async fn send(
        &self,
        msg: &KafkaMessage,
        headers: OwnedHeaders,
    ) -> Result<String, rdkafka::error::KafkaError> {
        let topic = self.topic.for_source(msg.topic());
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&topic).headers(headers);
        if let Some(key) = msg.key() {
            record = record.key(key);
        }
        if let Some(value) = msg.value() {
            record = record.payload(value);
        }
        if let Timestamp::CreateTime(ms) | Timestamp::LogAppendTime(ms) = msg.timestamp() {
            record = record.timestamp(ms);
        }
        let send = self.producer.send(record, self.timeout);
        match tokio::time::timeout(self.timeout.saturating_add(Duration::from_secs(1)), send).await
        {
            Ok(Ok(_delivery)) => Ok(topic),
            Ok(Err((e, _))) => Err(e),
            Err(_) => Err(rdkafka::error::KafkaError::MessageProduction(
                rdkafka::types::RDKafkaErrorCode::MessageTimedOut,
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use idem_executor::broker::classify;
    use idem_executor::{BrokerAction, ExecutorError, Outcome};
    use rdkafka::message::{Headers, OwnedMessage};

    use super::*;

    /// What the worker writes for `result` after the handler's attempt `attempt` (0: none).
    fn info(result: &Result<Outcome<()>, ExecutorError>, attempt: u32) -> DeadLetterInfo {
        let BrokerAction::DeadLetter { reason, error } = BrokerAction::of(result) else {
            panic!("not dead-lettered: {result:?}");
        };
        classify(result, reason, error, attempt)
    }

    #[test]
    fn result_not_stored_is_its_own_reason() {
        let info = info(
            &Ok(Outcome::ResultNotStored {
                error: "too big".into(),
            }),
            1,
        );
        assert_eq!(info.reason, DeadLetterReason::ResultNotStored);
        assert_eq!(info.reason.as_str(), "result_not_stored");
        assert_eq!(info.error, "too big", "no prefix on the error text");
        assert_eq!(info.attempts, Some(1));
    }

    #[test]
    fn the_header_codes_are_unchanged() {
        // Dead-letter consumers match on these strings: they must never change.
        let codes: Vec<&str> = DeadLetterReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            codes,
            [
                "conflict",
                "exhausted",
                "failed",
                "result_not_stored",
                "missing_key",
                "invalid_key",
                "invalid_message",
                "decode",
                "undelivered"
            ]
        );
    }

    #[test]
    fn classification() {
        let conflict = info(&Ok(Outcome::Conflict), 0);
        assert_eq!(
            (conflict.reason, conflict.attempts),
            (DeadLetterReason::Conflict, Some(0))
        );
        assert!(conflict.error.contains("conflict"), "{conflict:?}");

        let exhausted = Ok(Outcome::Exhausted {
            attempts: 3,
            last_error: Some("boom".into()),
        });
        assert_eq!(
            info(&exhausted, 3),
            DeadLetterInfo {
                reason: DeadLetterReason::Exhausted,
                error: "boom".into(),
                attempts: Some(3)
            }
        );
        let crashed = Ok(Outcome::Exhausted {
            attempts: 5,
            last_error: None,
        });
        let crashed = info(&crashed, 0);
        assert_eq!(
            crashed.attempts,
            Some(5),
            "the count comes with the outcome"
        );
        assert!(crashed.error.contains("crashed"), "{crashed:?}");

        let failed = Ok(Outcome::Failed {
            error: "bad amount".into(),
        });
        assert_eq!(info(&failed, 2).reason, DeadLetterReason::Failed);
        assert_eq!(info(&failed, 2).error, "bad amount");
        assert_eq!(info(&failed, 2).attempts, Some(2));
        assert_eq!(
            info(&failed, 0).attempts,
            None,
            "a replayed terminal failure: read the count from the store"
        );

        let missing = info(&Err(ExecutorError::MissingKey), 0);
        assert_eq!(missing.reason, DeadLetterReason::MissingKey);
        assert_eq!(
            missing.error,
            "the message has no idempotency key (none where the key source looks, or an empty one)"
        );
        assert_eq!(missing.attempts, Some(0));
    }

    #[test]
    fn headers_keep_the_original_ones_first() {
        let orig = OwnedHeaders::new().insert(Header {
            key: "trace",
            value: Some("abc"),
        });
        let msg = KafkaMessage::new(OwnedMessage::new(
            Some(b"v".to_vec()),
            Some(b"k".to_vec()),
            "payments".into(),
            Timestamp::NotAvailable,
            1,
            99,
            Some(orig),
        ));
        let info = DeadLetterInfo {
            reason: DeadLetterReason::Exhausted,
            error: "boom".into(),
            attempts: Some(3),
        };
        let h = headers(&msg, &info, Some(3), Some("tx-1"), Fit::Whole);
        let got: Vec<(String, String)> = h
            .iter()
            .map(|h| {
                (
                    h.key.to_owned(),
                    String::from_utf8(h.value.unwrap().to_vec()).unwrap(),
                )
            })
            .collect();
        let want: Vec<(String, String)> = [
            ("trace", "abc"),
            (HEADER_REASON, "exhausted"),
            (HEADER_ERROR, "boom"),
            (HEADER_ATTEMPTS, "3"),
            (HEADER_KEY, "tx-1"),
            (HEADER_SOURCE_TOPIC, "payments"),
            (HEADER_SOURCE_PARTITION, "1"),
            (HEADER_SOURCE_OFFSET, "99"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert_eq!(got, want);
        assert_eq!(
            DeadLetterTopic::default().for_source("payments"),
            "payments.dlq"
        );
        assert_eq!(
            DeadLetterTopic::Fixed("dlq".into()).for_source("payments"),
            "dlq"
        );
    }

    #[test]
    fn a_long_error_and_key_are_cut() {
        let msg = KafkaMessage::new(OwnedMessage::new(
            Some(b"v".to_vec()),
            None,
            "payments".into(),
            Timestamp::NotAvailable,
            0,
            7,
            None,
        ));
        let info = DeadLetterInfo {
            reason: DeadLetterReason::InvalidKey,
            error: "e".repeat(100_000),
            attempts: Some(0),
        };
        let h = headers(&msg, &info, Some(0), Some(&"k".repeat(100_000)), Fit::Whole);
        for name in [HEADER_ERROR, HEADER_KEY] {
            let value = h.iter().find(|h| h.key == name).unwrap().value.unwrap();
            let value = std::str::from_utf8(value).unwrap();
            assert!(
                value.len() <= idem_executor::broker::MAX_HEADER_TEXT && value.ends_with('…'),
                "{name}: {} bytes",
                value.len()
            );
        }
    }
}
