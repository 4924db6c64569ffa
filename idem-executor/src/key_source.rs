//! Where the idempotency key of a message comes from.

use std::cell::OnceCell;
use std::fmt;
use std::sync::Arc;

use serde_json::Value;

use crate::config::ConfigError;
use crate::error::ExecutorError;
use crate::message::Message;

/// The header read by default: `idempotency-key`.
pub const DEFAULT_KEY_HEADER: &str = "idempotency-key";

/// The separator between the parts of a [composite](KeySource::composite) key.
pub const COMPOSITE_SEPARATOR: char = '|';

type KeyFn = Arc<dyn Fn(&dyn Message) -> Option<String> + Send + Sync>;

/// Where the idempotency key id of a message comes from.
///
/// The default reads the header [`DEFAULT_KEY_HEADER`] (`idempotency-key`).
///
/// **Header names are case-sensitive**: [`KeySource::header`] asks the message for exactly the
/// name given ([`Message::header`]), and the shipped messages compare names byte for byte
/// ([`RawMessage`](crate::RawMessage), the Kafka runner's record), so `Idempotency-Key` is not
/// `idempotency-key`. That is what each broker does itself: Kafka record header keys, AMQP
/// (RabbitMQ) header table keys, SQS message attribute names and NATS header names are all
/// case-sensitive (NATS headers look like HTTP headers, but unlike HTTP the server keeps and
/// compares them as written; some NATS clients offer a case-insensitive lookup). Use the
/// spelling your producers write; a message whose header is spelled otherwise has *no* key
/// (see [`MissingKeyPolicy`](crate::MissingKeyPolicy)).
///
/// Every source yields text: an id that is
/// absent, empty or JSON `null` counts as *missing* (see
/// [`MissingKeyPolicy`](crate::MissingKeyPolicy)); an id that is present but unreadable (a header
/// that is not UTF-8, a payload that is not JSON, a JSON field that is an object) is an
/// [`ExecutorError::InvalidMessage`].
///
/// ```
/// use idem_executor::KeySource;
///
/// // tenant + transaction id, joined unambiguously: "acme|tx-42"
/// let source = KeySource::composite([
///     KeySource::header("tenant"),
///     KeySource::json_pointer("/transaction/id"),
/// ]);
/// # let _ = source;
/// ```
#[derive(Clone)]
pub struct KeySource {
    kind: Kind,
}

#[derive(Clone)]
enum Kind {
    Header(Arc<str>),
    JsonPointer(Arc<str>),
    MessageKey,
    Closure(KeyFn),
    Composite(Arc<[KeySource]>),
}

impl Default for KeySource {
    /// The header [`DEFAULT_KEY_HEADER`].
    fn default() -> Self {
        Self::header(DEFAULT_KEY_HEADER)
    }
}

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Header(name) => f.debug_tuple("Header").field(name).finish(),
            Kind::JsonPointer(p) => f.debug_tuple("JsonPointer").field(p).finish(),
            Kind::MessageKey => f.write_str("MessageKey"),
            Kind::Closure(_) => f.write_str("Closure"),
            Kind::Composite(parts) => f.debug_tuple("Composite").field(parts).finish(),
        }
    }
}

impl KeySource {
    /// The UTF-8 value of the header `name`, matched case-sensitively, as every broker does
    /// (see [`KeySource`]): `header("idempotency-key")` does not read a header spelled
    /// `Idempotency-Key`.
    pub fn header(name: impl Into<String>) -> Self {
        Self {
            kind: Kind::Header(Arc::from(name.into())),
        }
    }

    /// A field of a JSON payload, addressed by a JSON pointer (RFC 6901, e.g. `/order/id`). A
    /// string is taken as it is, an integer within 64 bits as its decimal text; `null` or an
    /// absent field is missing. Any other number (a fraction, an exponent, an integer beyond 64
    /// bits, even `1.0`) is refused as an invalid message: it is read as a 64-bit float, which
    /// many texts share, so two different messages would get one key.
    pub fn json_pointer(pointer: impl Into<String>) -> Self {
        Self {
            kind: Kind::JsonPointer(Arc::from(pointer.into())),
        }
    }

    /// The broker's own message key ([`Message::message_key`]), as UTF-8.
    pub fn message_key() -> Self {
        Self {
            kind: Kind::MessageKey,
        }
    }

    /// A closure; `None` (or an empty string) means the message has no key.
    pub fn from_fn<F>(f: F) -> Self
    where
        F: Fn(&dyn Message) -> Option<String> + Send + Sync + 'static,
    {
        Self {
            kind: Kind::Closure(Arc::new(f)),
        }
    }

    /// Several sources joined into one id, e.g. tenant + transaction id. The key is missing when
    /// any part is missing.
    ///
    /// The join is unambiguous: in each part `\` becomes `\\` and `|` becomes `\|`, then the parts
    /// are joined with `|` ([`COMPOSITE_SEPARATOR`]). So `("a|b", "c")` gives `a\|b|c` and
    /// `("a", "b|c")` gives `a|b\|c`, and plain parts stay readable (`acme|tx-42`).
    pub fn composite(parts: impl IntoIterator<Item = KeySource>) -> Self {
        Self {
            kind: Kind::Composite(parts.into_iter().collect()),
        }
    }

    /// Extracts the key id of `msg`: `Ok(None)` when it has none.
    ///
    /// # Errors
    /// [`ExecutorError::InvalidMessage`] when the key is present but unreadable.
    pub fn extract(&self, msg: &dyn Message) -> Result<Option<String>, ExecutorError> {
        self.extract_with(msg, &PayloadJson::new(msg.payload()))
    }

    pub(crate) fn extract_with(
        &self,
        msg: &dyn Message,
        json: &PayloadJson<'_>,
    ) -> Result<Option<String>, ExecutorError> {
        let id = match &self.kind {
            Kind::Header(name) => match msg.key_header(name) {
                Ok(Some(bytes)) => Some(utf8(&bytes, || format!("header {name:?}"))?),
                Ok(None) => None,
                Err(what) => {
                    return Err(ExecutorError::invalid_message(format!(
                        "the key header {name:?} is {what}"
                    )));
                }
            },
            Kind::MessageKey => match msg.message_key() {
                Some(bytes) => Some(utf8(bytes, || "message key".to_owned())?),
                None => None,
            },
            Kind::JsonPointer(pointer) => match json.get()?.pointer(pointer) {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                // An integer within 64 bits is held exactly; any other number was read as a
                // 64-bit float, which many texts share (`12345678901234567890123` and
                // `...124`, `0.1` and `0.10000000000000000001`): as a key it would make
                // different messages one.
                Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Some(n.to_string()),
                Some(Value::Number(n)) => {
                    return Err(ExecutorError::invalid_message(format!(
                        "the key field {pointer:?} is the number {n}, which is not an integer \
                         within 64 bits: it cannot be read exactly (other numbers would give \
                         the same key); send the key as a string"
                    )));
                }
                Some(other) => {
                    return Err(ExecutorError::invalid_message(format!(
                        "the key field {pointer:?} is {}, not a string or a number",
                        json_kind(other)
                    )));
                }
            },
            Kind::Closure(f) => f(msg),
            Kind::Composite(parts) => {
                let mut joined = String::new();
                for (i, part) in parts.iter().enumerate() {
                    let Some(id) = part.extract_with(msg, json)? else {
                        return Ok(None);
                    };
                    if i > 0 {
                        joined.push(COMPOSITE_SEPARATOR);
                    }
                    for c in id.chars() {
                        if c == '\\' || c == COMPOSITE_SEPARATOR {
                            joined.push('\\');
                        }
                        joined.push(c);
                    }
                }
                Some(joined)
            }
        };
        Ok(id.filter(|id| !id.is_empty()))
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        match &self.kind {
            Kind::Header(name) if name.is_empty() => {
                Err(ConfigError::new("key_source", "the header name is empty"))
            }
            Kind::JsonPointer(p) => check_pointer("key_source", p),
            Kind::Composite(parts) if parts.is_empty() => Err(ConfigError::new(
                "key_source",
                "a composite key needs parts",
            )),
            Kind::Composite(parts) => parts.iter().try_for_each(KeySource::validate),
            _ => Ok(()),
        }
    }
}

pub(crate) fn check_pointer(field: &'static str, pointer: &str) -> Result<(), ConfigError> {
    if pointer.is_empty() || pointer.starts_with('/') {
        Ok(())
    } else {
        Err(ConfigError::new(
            field,
            format!("{pointer:?} is not a JSON pointer: it must be empty or start with '/'"),
        ))
    }
}

fn utf8(bytes: &[u8], what: impl FnOnce() -> String) -> Result<String, ExecutorError> {
    std::str::from_utf8(bytes)
        .map(str::to_owned)
        .map_err(|e| ExecutorError::invalid_message(format!("the {} is not UTF-8: {e}", what())))
}

pub(crate) fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The payload parsed as JSON at most once per message, shared by key extraction and
/// fingerprinting.
pub(crate) struct PayloadJson<'a> {
    payload: &'a [u8],
    parsed: OnceCell<Result<Value, String>>,
}

impl<'a> PayloadJson<'a> {
    pub(crate) fn new(payload: &'a [u8]) -> Self {
        Self {
            payload,
            parsed: OnceCell::new(),
        }
    }

    /// The payload's bytes.
    pub(crate) fn payload(&self) -> &'a [u8] {
        self.payload
    }

    pub(crate) fn get(&self) -> Result<&Value, ExecutorError> {
        self.parsed
            .get_or_init(|| serde_json::from_slice(self.payload).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| ExecutorError::invalid_message(format!("the payload is not JSON: {e}")))
    }
}
