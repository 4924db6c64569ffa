//! Canonical-JSON fingerprints (`FingerprintPolicy::JsonFields`) on arbitrary payloads and
//! pointers: a fingerprint or a typed `InvalidMessage`, never a panic; and the fingerprint does
//! not depend on formatting (the payload with whitespace added between its tokens gives the same
//! one). Re-serializing through `serde_json::Value` is not formatting: it rounds a number with
//! more digits than a double keeps, and such numbers fingerprint by their exact value.
#![no_main]

use idem_executor::{ExecutorError, FingerprintPolicy, RawMessage};
use libfuzzer_sys::fuzz_target;

/// `payload` with a space and a line feed after every `,`, `:`, `[` and `{` outside strings.
fn spaced(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() * 2);
    let (mut in_string, mut escaped) = (false, false);
    for &b in payload {
        out.push(b);
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
        } else if b == b'"' {
            in_string = true;
        } else if matches!(b, b',' | b':' | b'[' | b'{') {
            out.extend_from_slice(b" \n");
        }
    }
    out
}

fuzz_target!(|input: (Vec<u8>, Vec<String>)| {
    let (payload, pointers) = input;
    let policy = FingerprintPolicy::json_fields(pointers);
    match policy.compute(&RawMessage::new(payload.clone())) {
        Ok(fp) => {
            assert!(fp.is_some());
            let again = policy.compute(&RawMessage::new(spaced(&payload))).unwrap();
            assert_eq!(fp, again, "formatting changed the fingerprint");
        }
        Err(e) => assert!(matches!(e, ExecutorError::InvalidMessage { .. }), "{e:?}"),
    }
});
