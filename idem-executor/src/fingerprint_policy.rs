//! What the payload fingerprint covers.

use serde_json::Value;

use crate::config::ConfigError;
use crate::error::ExecutorError;
use crate::exact_json;
use crate::key_source::{PayloadJson, check_pointer};
use crate::message::Message;
use idem_core::Fingerprint;

/// What the [`Fingerprint`] of a message covers. The same key seen again with a different
/// fingerprint is a [`Conflict`](crate::Outcome::Conflict): the sender reused a key for a
/// different request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FingerprintPolicy {
    /// SHA-256 of the whole payload, byte for byte (the default).
    #[default]
    Payload,
    /// SHA-256 of the JSON fields at these JSON pointers (RFC 6901), for payloads that carry
    /// volatile fields (timestamps, trace ids) beside the request itself. Each field is hashed
    /// with its pointer, in canonical form (object keys sorted, no whitespace), so key order and
    /// formatting do not matter; an absent field hashes differently from `null`. Numbers are
    /// compared exactly, digit for digit, even past a double's precision
    /// (`20000000000000000001` and `20000000000000000000` differ); an integer and the same value
    /// written with a fraction or an exponent (`1` and `1.0`) differ too. A payload that is not JSON is an
    /// [`ExecutorError::InvalidMessage`].
    JsonFields(Vec<String>),
    /// No fingerprint: records never conflict. Turning conflict detection off is explicit.
    Off,
}

impl FingerprintPolicy {
    /// [`FingerprintPolicy::JsonFields`] from pointers such as `"/amount"`.
    pub fn json_fields<I, S>(pointers: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::JsonFields(pointers.into_iter().map(Into::into).collect())
    }

    /// The fingerprint of `msg` under this policy (`None` when [`Off`](Self::Off)).
    ///
    /// # Errors
    /// [`ExecutorError::InvalidMessage`] when fields are selected and the payload is not JSON.
    pub fn compute(&self, msg: &dyn Message) -> Result<Option<Fingerprint>, ExecutorError> {
        self.compute_with(msg, &PayloadJson::new(msg.payload()))
    }

    pub(crate) fn compute_with(
        &self,
        msg: &dyn Message,
        json: &PayloadJson<'_>,
    ) -> Result<Option<Fingerprint>, ExecutorError> {
        match self {
            Self::Payload => Ok(Some(Fingerprint::of(msg.payload()))),
            Self::Off => Ok(None),
            Self::JsonFields(pointers) => {
                let doc = json.get()?;
                // The payload's text, read once, when a field holds a double.
                let mut text = None;
                let mut parts = Vec::with_capacity(pointers.len() * 2);
                for pointer in pointers {
                    parts.push(pointer.as_bytes().to_vec());
                    let mut field = Vec::new();
                    match doc.pointer(pointer) {
                        None => field.push(b'-'),
                        Some(v) => {
                            field.push(b'=');
                            if holds_a_double(v) {
                                // Doubles may have lost digits: the field's own text decides.
                                let not_json = |e: serde_json::Error| {
                                    ExecutorError::invalid_message(format!(
                                        "the payload is not JSON: {e}"
                                    ))
                                };
                                let root = match text {
                                    Some(root) => root,
                                    None => *text.insert(
                                        exact_json::root(json.payload()).map_err(not_json)?,
                                    ),
                                };
                                let found = exact_json::field(root, pointer, &mut field)
                                    .map_err(not_json)?;
                                if found.is_none() {
                                    return Err(ExecutorError::invalid_message(format!(
                                        "the fingerprint field {pointer:?} was found in the \
                                         parsed payload but not in its text"
                                    )));
                                }
                            } else {
                                canonical(v, &mut field);
                            }
                        }
                    }
                    parts.push(field);
                }
                Ok(Some(Fingerprint::of_parts(parts)))
            }
        }
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        match self {
            Self::JsonFields(pointers) if pointers.is_empty() => Err(ConfigError::new(
                "fingerprint",
                "no JSON field selected; use FingerprintPolicy::Off to turn fingerprints off",
            )),
            Self::JsonFields(pointers) => pointers
                .iter()
                .try_for_each(|p| check_pointer("fingerprint", p)),
            _ => Ok(()),
        }
    }
}

/// Whether `v` holds a number `Value` keeps as a double (any number not a 64-bit integer),
/// which may have lost digits of the payload's.
fn holds_a_double(v: &Value) -> bool {
    match v {
        Value::Number(n) => n.is_f64(),
        Value::Array(items) => items.iter().any(holds_a_double),
        Value::Object(map) => map.values().any(holds_a_double),
        _ => false,
    }
}

/// Canonical JSON: object keys sorted, no whitespace.
pub(crate) fn canonical(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical_str(k, out);
                out.push(b':');
                canonical(v, out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical(v, out);
            }
            out.push(b']');
        }
        Value::String(s) => canonical_str(s, out),
        other => out.extend_from_slice(other.to_string().as_bytes()),
    }
}

fn canonical_str(s: &str, out: &mut Vec<u8>) {
    // Writing a string into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RawMessage;

    #[test]
    fn json_fields_ignore_order_and_other_fields() {
        let policy = FingerprintPolicy::json_fields(["/amount", "/meta"]);
        let a = RawMessage::new(r#"{"amount": 10, "meta": {"x": 1, "y": [1, "a"]}, "ts": 1}"#);
        let b = RawMessage::new(r#"{"ts": 2, "meta": {"y": [1, "a"], "x": 1}, "amount": 10}"#);
        let c = RawMessage::new(r#"{"amount": 11, "meta": {"x": 1, "y": [1, "a"]}}"#);
        let d = RawMessage::new(r#"{"amount": 10, "meta": null}"#);
        let e = RawMessage::new(r#"{"amount": 10}"#);
        let fp = |m: &RawMessage| policy.compute(m).unwrap().unwrap();
        assert_eq!(fp(&a), fp(&b));
        assert_ne!(fp(&a), fp(&c));
        assert_ne!(fp(&d), fp(&e));
        assert!(policy.compute(&RawMessage::new("not json")).is_err());
    }

    /// A key reused with an amount that differs only past a double's 17 significant digits (an
    /// amount in wei, a high-precision decimal) is a conflict, not a replay of the other amount.
    #[test]
    fn amounts_that_differ_past_a_doubles_precision_fingerprint_apart() {
        let policy = FingerprintPolicy::json_fields(["/amount"]);
        let fp = |payload: &str| {
            policy
                .compute(&RawMessage::new(payload.to_owned()))
                .unwrap()
        };
        for (a, b) in [
            ("20000000000000000001", "20000000000000000000"),
            ("100.00000000000000001", "100.0"),
            ("-9223372036854775809", "-9223372036854775808.0"),
            ("[1.5, 18446744073709551617]", "[1.5, 18446744073709551616]"),
            (r#"{"v": 0.30000000000000000001}"#, r#"{"v": 0.3}"#),
        ] {
            let (a, b) = (
                format!(r#"{{"amount": {a}}}"#),
                format!(r#"{{"amount": {b}}}"#),
            );
            assert_ne!(fp(&a), fp(&b), "{a} and {b}");
            let spaced = a.replace(':', " :  ");
            assert_eq!(fp(&a), fp(&spaced), "{a} and {spaced}");
        }
    }

    /// Numbers a double holds exactly fingerprint as they did before numbers were read from the
    /// text, so a record stored by an earlier version still matches its message's copies.
    #[test]
    fn exact_numbers_keep_the_fingerprint_of_the_parsed_value() {
        let pointers = ["/amount", "/meta"];
        let policy = FingerprintPolicy::json_fields(pointers);
        for payload in [
            r#"{"amount": 12.50, "meta": {"b": [0.1, 1e-7, -0.0], "a": 5555.5E57}}"#,
            r#"{"amount": 3, "meta": [1.0, 2, "x"]}"#,
            r#"{"amount": 1e21}"#,
        ] {
            let doc: Value = serde_json::from_str(payload).unwrap();
            let mut parts = Vec::new();
            for pointer in pointers {
                parts.push(pointer.as_bytes().to_vec());
                let mut field = Vec::new();
                match doc.pointer(pointer) {
                    None => field.push(b'-'),
                    Some(v) => {
                        field.push(b'=');
                        canonical(v, &mut field);
                    }
                }
                parts.push(field);
            }
            let before = Fingerprint::of_parts(parts);
            let now = policy.compute(&RawMessage::new(payload)).unwrap().unwrap();
            assert_eq!(now, before, "{payload}");
        }
    }

    /// Found by the `json_fingerprint` fuzz target: serde_json's default float parsing is fast
    /// but not always correctly rounded, so `5555.5E57` was read as a double whose own shortest
    /// text, `5.5555000000000005e60`, reads back as another double: the same payload
    /// re-serialized got another fingerprint (a conflict with itself). Parsing is now exact
    /// (serde_json's `float_roundtrip`).
    #[test]
    fn a_reserialized_number_fingerprints_alike() {
        let policy = FingerprintPolicy::json_fields([""]);
        let fp = |payload: &str| {
            policy
                .compute(&RawMessage::new(payload.to_owned()))
                .unwrap()
        };
        for payload in ["5555.5E57", r#"{"a": [5555.5E57, 0.1, 1e-7]}"#] {
            let value: Value = serde_json::from_str(payload).unwrap();
            let again = serde_json::to_string(&value).unwrap();
            assert_eq!(fp(payload), fp(&again), "{payload} and {again}");
        }
    }
}
