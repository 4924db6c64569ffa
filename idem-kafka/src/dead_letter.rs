//! The dead-letter topic: what is written there, and how.

use std::fmt;
use std::time::Duration;

use idem_core::executor::{ExecutorError, Outcome};
use rdkafka::message::{Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Timestamp};

use crate::error::RunnerError;
use crate::message::KafkaMessage;

/// Header naming why the record was dead-lettered: a [`DeadLetterReason`] code.
pub const HEADER_REASON: &str = "idem-dlq-reason";
/// Header with the error text: the last recorded error, or what was wrong with the record.
pub const HEADER_ERROR: &str = "idem-dlq-error";
/// Header with the number of attempts the store counted for the key (decimal; `0` when the
/// handler never ran for this payload, as for a conflict or an unreadable record).
pub const HEADER_ATTEMPTS: &str = "idem-dlq-attempts";
/// Header with the idempotency key id, when the record had a readable one.
pub const HEADER_KEY: &str = "idem-dlq-key";
/// Header with the topic the record was read from.
pub const HEADER_SOURCE_TOPIC: &str = "idem-dlq-source-topic";
/// Header with the partition the record was read from (decimal).
pub const HEADER_SOURCE_PARTITION: &str = "idem-dlq-source-partition";
/// Header with the offset the record was read from (decimal).
pub const HEADER_SOURCE_OFFSET: &str = "idem-dlq-source-offset";

/// Why a record went to the dead-letter topic; its [`as_str`](Self::as_str) code is the value of
/// the [`HEADER_REASON`] header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// `conflict`: the key was used before with a different payload
    /// ([`Outcome::Conflict`]). The handler did not run for this record.
    Conflict,
    /// `exhausted`: the key failed or crashed the maximum number of attempts
    /// ([`Outcome::Exhausted`]): a poison message.
    Exhausted,
    /// `failed`: the handler failed terminally, now or before ([`Outcome::Failed`], or a terminal
    /// failure of an un-deduplicated run).
    Failed,
    /// `missing_key`: the record has no idempotency key and the executor rejects such records.
    MissingKey,
    /// `invalid_key`: the record's key is not a valid idempotency key (too long, NUL).
    InvalidKey,
    /// `invalid_message`: the record cannot be read as configured (key header not UTF-8, payload
    /// not JSON, ...).
    InvalidMessage,
    /// `decode`: the stored result of the key does not decode as the handler's result type.
    Decode,
    /// `result_not_stored`: the handler succeeded (its effect is applied) but its result could
    /// not be stored; the key is recorded as terminal and never runs again.
    ResultNotStored,
    /// `other`: an outcome or error this version of the runner does not know, whose action is
    /// dead-lettering.
    Other,
}

impl DeadLetterReason {
    /// The code written in the [`HEADER_REASON`] header.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Conflict => "conflict",
            Self::Exhausted => "exhausted",
            Self::Failed => "failed",
            Self::MissingKey => "missing_key",
            Self::InvalidKey => "invalid_key",
            Self::InvalidMessage => "invalid_message",
            Self::Decode => "decode",
            Self::ResultNotStored => "result_not_stored",
            Self::Other => "other",
        }
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where dead-lettered records go.
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

/// What the runner writes beside the original record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DeadLetterInfo {
    pub(crate) reason: DeadLetterReason,
    pub(crate) error: String,
    /// `None` when the count must be read from the store.
    pub(crate) attempts: Option<u32>,
}

/// Classifies a result whose broker action is dead-lettering. `attempt` is the attempt of the
/// handler run in this call (0 when the handler did not run).
pub(crate) fn classify<T>(
    result: &Result<Outcome<T>, ExecutorError>,
    reason_text: String,
    attempt: u32,
) -> DeadLetterInfo {
    let ran = (attempt > 0).then_some(attempt);
    let (reason, error, attempts) = match result {
        Ok(Outcome::Conflict) => (DeadLetterReason::Conflict, reason_text, Some(0)),
        Ok(Outcome::Exhausted {
            attempts,
            last_error,
        }) => (
            DeadLetterReason::Exhausted,
            last_error
                .clone()
                .unwrap_or_else(|| "the last attempt crashed or stalled past its lease".into()),
            Some(*attempts),
        ),
        Ok(Outcome::Failed { error }) => (DeadLetterReason::Failed, error.clone(), ran),
        Ok(Outcome::NotDeduplicated {
            result: Err(failure),
            ..
        }) => (DeadLetterReason::Failed, failure.error.clone(), Some(1)),
        Ok(Outcome::ResultNotStored { error }) => {
            (DeadLetterReason::ResultNotStored, error.clone(), ran)
        }
        Ok(_) => (DeadLetterReason::Other, reason_text, ran),
        Err(ExecutorError::MissingKey) => (DeadLetterReason::MissingKey, reason_text, Some(0)),
        Err(ExecutorError::InvalidKey(_)) => (DeadLetterReason::InvalidKey, reason_text, Some(0)),
        Err(ExecutorError::InvalidMessage { .. }) => {
            (DeadLetterReason::InvalidMessage, reason_text, Some(0))
        }
        Err(ExecutorError::Decode { .. }) => (DeadLetterReason::Decode, reason_text, None),
        Err(_) => (DeadLetterReason::Other, reason_text, ran),
    };
    DeadLetterInfo {
        reason,
        error,
        attempts,
    }
}

/// The original headers followed by the dead-letter headers.
pub(crate) fn headers(
    msg: &KafkaMessage,
    info: &DeadLetterInfo,
    attempts: Option<u32>,
    key_id: Option<&str>,
) -> OwnedHeaders {
    let original = msg.headers().map_or(0, Headers::count);
    let mut headers = OwnedHeaders::new_with_capacity(original + 7);
    if let Some(orig) = msg.headers() {
        for h in orig.iter() {
            headers = headers.insert(Header {
                key: h.key,
                value: h.value,
            });
        }
    }
    let attempts = attempts.map_or_else(|| "unknown".to_owned(), |n| n.to_string());
    let partition = msg.partition().to_string();
    let offset = msg.offset().to_string();
    let ours: [(&str, Option<&str>); 7] = [
        (HEADER_REASON, Some(info.reason.as_str())),
        (HEADER_ERROR, Some(info.error.as_str())),
        (HEADER_ATTEMPTS, Some(attempts.as_str())),
        (HEADER_KEY, key_id),
        (HEADER_SOURCE_TOPIC, Some(msg.topic())),
        (HEADER_SOURCE_PARTITION, Some(partition.as_str())),
        (HEADER_SOURCE_OFFSET, Some(offset.as_str())),
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
        // A write that timed out must not be delivered later, behind the retry: the client gives
        // up on the message when the runner does.
        let mut config = config.clone();
        config.set(
            "message.timeout.ms",
            timeout.as_millis().clamp(1, i32::MAX as u128).to_string(),
        );
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
        match tokio::time::timeout(self.timeout + Duration::from_secs(1), send).await {
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
    use idem_core::executor::Outcome;
    use rdkafka::message::OwnedMessage;

    use super::*;

    #[test]
    fn result_not_stored_is_its_own_reason() {
        let outcome: Result<Outcome<()>, _> = Ok(Outcome::ResultNotStored {
            error: "too big".into(),
        });
        let info = classify(&outcome, "result_not_stored: too big".into(), 1);
        assert_eq!(info.reason, DeadLetterReason::ResultNotStored);
        assert_eq!(info.reason.as_str(), "result_not_stored");
        assert_eq!(info.error, "too big");
    }

    #[test]
    fn classification() {
        let conflict: Result<Outcome<()>, _> = Ok(Outcome::Conflict);
        let info = classify(&conflict, "fingerprint conflict".into(), 0);
        assert_eq!(
            (info.reason, info.attempts),
            (DeadLetterReason::Conflict, Some(0))
        );

        let exhausted: Result<Outcome<()>, _> = Ok(Outcome::Exhausted {
            attempts: 3,
            last_error: Some("boom".into()),
        });
        let info = classify(&exhausted, "x".into(), 3);
        assert_eq!(
            info,
            DeadLetterInfo {
                reason: DeadLetterReason::Exhausted,
                error: "boom".into(),
                attempts: Some(3)
            }
        );

        let failed: Result<Outcome<()>, _> = Ok(Outcome::Failed {
            error: "bad amount".into(),
        });
        assert_eq!(classify(&failed, "x".into(), 2).attempts, Some(2));
        assert_eq!(
            classify(&failed, "x".into(), 0).attempts,
            None,
            "a replayed terminal failure: read the count from the store"
        );

        let missing: Result<Outcome<()>, _> = Err(ExecutorError::MissingKey);
        let info = classify(&missing, "the message has no idempotency key".into(), 0);
        assert_eq!(info.reason, DeadLetterReason::MissingKey);
        assert_eq!(info.error, "the message has no idempotency key");
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
        let h = headers(&msg, &info, Some(3), Some("tx-1"));
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
}
