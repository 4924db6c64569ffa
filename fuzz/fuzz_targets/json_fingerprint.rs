//! Canonical-JSON fingerprints (`FingerprintPolicy::JsonFields`) on arbitrary payloads and
//! pointers: a fingerprint or a typed `InvalidMessage`, never a panic; and the fingerprint does
//! not depend on formatting (the payload re-serialized gives the same one).
#![no_main]

use idem_executor::{ExecutorError, FingerprintPolicy, RawMessage};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (Vec<u8>, Vec<String>)| {
    let (payload, pointers) = input;
    let policy = FingerprintPolicy::json_fields(pointers);
    match policy.compute(&RawMessage::new(payload.clone())) {
        Ok(fp) => {
            assert!(fp.is_some());
            let value: serde_json::Value =
                serde_json::from_slice(&payload).expect("a fingerprinted payload is JSON");
            let reformatted = serde_json::to_vec_pretty(&value).unwrap();
            let again = policy.compute(&RawMessage::new(reformatted)).unwrap();
            assert_eq!(fp, again, "formatting changed the fingerprint");
        }
        Err(e) => assert!(matches!(e, ExecutorError::InvalidMessage { .. }), "{e:?}"),
    }
});
