//! Script replies of the Redis store, from arbitrary RESP bytes: every decoder answers a value or
//! a typed `CorruptRecord`, never a panic.
#![no_main]

use idem_core::{Error, Namespace};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(reply) = redis::parse_redis_value(data) else {
        return;
    };
    let key = Namespace::new("fuzz").unwrap().key("k").unwrap();
    let corrupt = |e: &Error| matches!(e, Error::CorruptRecord { .. });
    if let Err(e) = idem_redis::fuzzing::get_reply(&reply, &key) {
        assert!(corrupt(&e), "get: {e:?}");
    }
    if let Err(e) = idem_redis::fuzzing::acquire_reply(&reply, &key, "owner") {
        assert!(corrupt(&e), "acquire: {e:?}");
    }
    if let Err(e) = idem_redis::fuzzing::fenced_reply(&reply, &key) {
        assert!(corrupt(&e), "fenced: {e:?}");
    }
});
