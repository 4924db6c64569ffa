//! A JSON field's canonical text with its numbers exact, for
//! [`FingerprintPolicy::JsonFields`](crate::FingerprintPolicy::JsonFields).
//!
//! `serde_json::Value` keeps a number as a 64-bit integer or a double, so two numbers that differ
//! only past a double's 17 significant digits (`20000000000000000001` and `20000000000000000000`,
//! an amount in wei; `100.00000000000000001` and `100`) become one value, and a key reused with
//! the other amount would fingerprint alike: a replay where a conflict is due. This walks the
//! payload's own text (`RawValue`) instead. A number whose value is that of the text
//! `serde_json` writes for its double (the shortest that reads back as that double: `0.1`,
//! `12.50`, `2e19`) keeps that text, so it fingerprints as the `Value` walk made it before; any
//! other number (more digits than its double keeps) is written `~` and its exact decimal value,
//! which no double's text is.

use std::collections::BTreeMap;

use serde_json::Value;
use serde_json::value::RawValue;

/// The payload's text as a JSON value, for [`field`]: read once per payload, whatever the
/// number of fields.
pub(crate) fn root(payload: &[u8]) -> Result<&RawValue, serde_json::Error> {
    serde_json::from_slice(payload)
}

/// The canonical text of the field at `pointer` in `root`, its numbers exact; `None` when the
/// pointer finds nothing (as `Value::pointer` would).
pub(crate) fn field(
    root: &RawValue,
    pointer: &str,
    out: &mut Vec<u8>,
) -> Result<Option<()>, serde_json::Error> {
    let Some(found) = find(root, pointer)? else {
        return Ok(None);
    };
    canonical(found, out)?;
    Ok(Some(()))
}

/// `Value::pointer`'s walk (RFC 6901), over the text.
fn find<'a>(root: &'a RawValue, pointer: &str) -> Result<Option<&'a RawValue>, serde_json::Error> {
    if pointer.is_empty() {
        return Ok(Some(root));
    }
    let Some(rest) = pointer.strip_prefix('/') else {
        return Ok(None);
    };
    let mut node = root;
    for token in rest.split('/') {
        let token = token.replace("~1", "/").replace("~0", "~");
        let next = match first(node) {
            b'{' => {
                let mut map: BTreeMap<String, &RawValue> = serde_json::from_str(node.get())?;
                map.remove(&token)
            }
            b'[' => {
                let mut items: Vec<&RawValue> = serde_json::from_str(node.get())?;
                index(&token)
                    .filter(|&i| i < items.len())
                    .map(|i| items.swap_remove(i))
            }
            _ => None,
        };
        match next {
            Some(next) => node = next,
            None => return Ok(None),
        }
    }
    Ok(Some(node))
}

/// An array index as `Value::pointer` reads one: no sign, no leading zero.
fn index(token: &str) -> Option<usize> {
    if token.starts_with('+') || (token.starts_with('0') && token.len() != 1) {
        return None;
    }
    token.parse().ok()
}

fn first(raw: &RawValue) -> u8 {
    raw.get()
        .trim_start()
        .as_bytes()
        .first()
        .copied()
        .unwrap_or(b' ')
}

/// Object keys sorted, no whitespace, numbers exact (see the module's text).
fn canonical(raw: &RawValue, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
    let text = raw.get().trim_matches([' ', '\t', '\n', '\r']);
    match first(raw) {
        b'{' => {
            // A key given twice keeps its last value, as `Value` does.
            let map: BTreeMap<String, &RawValue> = serde_json::from_str(text)?;
            out.push(b'{');
            for (i, (k, v)) in map.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, &k)?;
                out.push(b':');
                canonical(v, out)?;
            }
            out.push(b'}');
        }
        b'[' => {
            let items: Vec<&RawValue> = serde_json::from_str(text)?;
            out.push(b'[');
            for (i, v) in items.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical(v, out)?;
            }
            out.push(b']');
        }
        b'"' => {
            let s: String = serde_json::from_str(text)?;
            serde_json::to_writer(&mut *out, &s)?;
        }
        b'-' | b'0'..=b'9' => {
            let value: Value = serde_json::from_str(text)?;
            let usual = value.to_string();
            match (Decimal::parse(text), Decimal::parse(&usual)) {
                (Some(exact), Some(held)) if exact == held => {
                    out.extend_from_slice(usual.as_bytes())
                }
                (Some(exact), _) => {
                    out.push(b'~');
                    exact.write(out);
                }
                // Not reached: serde_json read it as a number.
                (None, _) => out.extend_from_slice(usual.as_bytes()),
            }
        }
        _ => out.extend_from_slice(text.as_bytes()),
    }
    Ok(())
}

/// A decimal number exactly: `-`? `0.digits` × 10^`exp`, `digits` without leading or trailing
/// zeros (empty for zero, which has no sign).
#[derive(Debug, PartialEq, Eq)]
struct Decimal {
    negative: bool,
    digits: String,
    exp: i64,
}

impl Decimal {
    /// Reads JSON's number grammar (and a double's text as `serde_json` writes it); `None` for
    /// anything else. An exponent past ±2^62 saturates.
    fn parse(text: &str) -> Option<Self> {
        let (negative, rest) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let (mantissa, exponent) = match rest.find(['e', 'E']) {
            Some(at) => (&rest[..at], Some(&rest[at + 1..])),
            None => (rest, None),
        };
        let (int, frac) = match mantissa.split_once('.') {
            Some((_, "")) => return None,
            Some((int, frac)) => (int, frac),
            None => (mantissa, ""),
        };
        let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        if int.is_empty() || !all_digits(int) || !all_digits(frac) {
            return None;
        }
        let mut exp: i64 = 0;
        if let Some(e) = exponent {
            let (sign, digits) = match e.as_bytes().first() {
                Some(b'-') => (-1, &e[1..]),
                Some(b'+') => (1, &e[1..]),
                _ => (1, e),
            };
            if digits.is_empty() || !all_digits(digits) {
                return None;
            }
            for b in digits.bytes() {
                exp = exp
                    .saturating_mul(10)
                    .saturating_add(i64::from(b - b'0'))
                    .min(1 << 62);
            }
            exp *= sign;
        }
        let all = format!("{int}{frac}");
        let lead = all.len() - all.trim_start_matches('0').len();
        let digits = all.trim_matches('0').to_owned();
        if digits.is_empty() {
            return Some(Self {
                negative: false,
                digits,
                exp: 0,
            });
        }
        // 0.d1d2... × 10^e: the point sits after `int`, less the leading zeros.
        let int_len = i64::try_from(int.len()).unwrap_or(i64::MAX);
        let lead = i64::try_from(lead).unwrap_or(i64::MAX);
        Some(Self {
            negative,
            digits,
            exp: exp.saturating_add(int_len).saturating_sub(lead),
        })
    }

    fn write(&self, out: &mut Vec<u8>) {
        if self.negative {
            out.push(b'-');
        }
        out.extend_from_slice(b"0.");
        if self.digits.is_empty() {
            out.push(b'0');
        }
        out.extend_from_slice(self.digits.as_bytes());
        out.extend_from_slice(format!("e{}", self.exp).as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `Value` walk's canonical text (keys sorted whatever `Value`'s map keeps: another
    /// crate of the build may turn on serde_json's `preserve_order`).
    fn sorted(value: &Value) -> String {
        let mut out = Vec::new();
        crate::fingerprint_policy::canonical(value, &mut out);
        String::from_utf8(out).unwrap()
    }

    fn canon(payload: &str, pointer: &str) -> Option<String> {
        let mut out = Vec::new();
        field(root(payload.as_bytes()).unwrap(), pointer, &mut out)
            .unwrap()
            .map(|()| String::from_utf8(out).unwrap())
    }

    #[test]
    fn decimals_compare_by_value() {
        let d = |s: &str| Decimal::parse(s).unwrap();
        assert_eq!(d("1"), d("1.000"));
        assert_eq!(d("1"), d("10e-1"));
        assert_eq!(d("0.00120"), d("1.2e-3"));
        assert_eq!(d("-0"), d("0.0e99"));
        assert_eq!(d("120"), d("1.2E+2"));
        assert_ne!(d("1"), d("-1"));
        assert_ne!(d("20000000000000000001"), d("20000000000000000000"));
        assert_ne!(d("100.00000000000000001"), d("100"));
        for bad in ["", "-", "1.", ".5", "1e", "1e+", "0x1", "1.2.3", "--1"] {
            assert_eq!(Decimal::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn numbers_written_as_short_as_their_double_keep_its_text() {
        let payload =
            r#"{"b": [0.1, 5555.5E57, -0.0, 1e-7, 12.50], "a": {"y": 2, "x": "s\u0041"}}"#;
        let value: Value = serde_json::from_str(payload).unwrap();
        assert_eq!(canon(payload, "").unwrap(), sorted(&value));
        assert_eq!(canon(payload, "/b/4").unwrap(), "12.5");
        assert_eq!(canon(payload, "/a/x").unwrap(), r#""sA""#);
    }

    #[test]
    fn numbers_past_a_doubles_precision_are_written_exactly() {
        assert_eq!(
            canon("20000000000000000001", "").unwrap(),
            "~0.20000000000000000001e20"
        );
        assert_eq!(
            canon("[100.00000000000000001]", "/0").unwrap(),
            "~0.10000000000000000001e3"
        );
        assert_ne!(
            canon(r#"{"n": 20000000000000000001}"#, "/n"),
            canon(r#"{"n": 20000000000000000000}"#, "/n")
        );
    }

    #[test]
    fn pointers_find_what_value_pointer_finds() {
        let payload = r#"{"a/b": {"m~n": [1, 2]}, "": 3, "k": 1, "k": 2, "arr": [0, 1]}"#;
        let value: Value = serde_json::from_str(payload).unwrap();
        for pointer in [
            "",
            "/a~1b",
            "/a~1b/m~0n",
            "/a~1b/m~0n/1",
            "/",
            "/k",
            "/arr/01",
            "/arr/+1",
            "/arr/2",
            "/missing",
            "/k/0",
            "no-slash",
        ] {
            let want = value.pointer(pointer).map(sorted);
            assert_eq!(canon(payload, pointer), want, "{pointer:?}");
        }
    }
}
