//! The values PostgreSQL row decoding parses (the `state` name and the `token`): a value or a
//! typed `CorruptRecord`, never a panic.
#![no_main]

use idem_core::{Error, Namespace, StateKind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (String, i64)| {
    let (state, token) = input;
    let key = Namespace::new("fuzz").unwrap().key("k").unwrap();
    match idem_postgres::fuzzing::state(&state, &key) {
        Ok(kind) => assert_eq!(kind.name(), state),
        Err(e) => {
            assert!(matches!(e, Error::CorruptRecord { .. }), "{e:?}");
            assert!(StateKind::from_name(&state).is_none());
        }
    }
    match idem_postgres::fuzzing::token(token, &key) {
        Ok(t) => assert_eq!(i64::try_from(t.get()), Ok(token)),
        Err(e) => {
            assert!(matches!(e, Error::CorruptRecord { .. }), "{e:?}");
            assert!(token < 0);
        }
    }
});
