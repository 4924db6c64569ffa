//! Namespace and key constructors, and fingerprint parsing, on arbitrary text: a value or a typed
//! `InvalidInput`, never a panic; a valid key displays as `namespace:id`, and two different keys
//! never display the same.
#![no_main]

use idem_core::{Error, Fingerprint, IdempotencyKey, Namespace};
use libfuzzer_sys::fuzz_target;

fn invalid(e: &Error) -> bool {
    matches!(e, Error::InvalidInput { .. })
}

fn key(ns: &str, id: &str) -> Option<IdempotencyKey> {
    match Namespace::new(ns) {
        Ok(namespace) => {
            assert_eq!(namespace.as_str(), ns);
            assert!(!ns.contains(':'));
            match namespace.key(id) {
                Ok(key) => {
                    assert_eq!(key.id(), id);
                    assert_eq!(key.to_string(), format!("{ns}:{id}"));
                    Some(key)
                }
                Err(e) => {
                    assert!(invalid(&e), "{e:?}");
                    None
                }
            }
        }
        Err(e) => {
            assert!(invalid(&e), "{e:?}");
            None
        }
    }
}

fuzz_target!(|input: (String, String, String, String, Vec<u8>)| {
    let (ns1, id1, ns2, id2, raw) = input;
    if let (Some(a), Some(b)) = (key(&ns1, &id1), key(&ns2, &id2)) {
        assert_eq!(a == b, a.to_string() == b.to_string());
    }
    match ns1.parse::<Fingerprint>() {
        Ok(fp) => assert_eq!(fp.to_hex(), ns1.to_ascii_lowercase()),
        Err(e) => assert!(invalid(&e), "{e:?}"),
    }
    match Fingerprint::try_from(raw.as_slice()) {
        Ok(fp) => assert_eq!(&fp.as_bytes()[..], &raw[..]),
        Err(e) => assert!(invalid(&e), "{e:?}"),
    }
});
