//! Executor: replay, key extraction, fingerprints, configuration, results and errors.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::{FailureKind, Limits, ManualClock, MemoryStore, RecordState, SystemClock};
use idem_executor::{
    BrokerAction, ConfigError, DeadLetterReason, Executor, ExecutorConfig, ExecutorError,
    FingerprintPolicy, Handler, HandlerContext, HandlerError, InProgressWait, KeySource, Message,
    MissingKeyPolicy, Outcome, PassThroughReason, RawMessage,
};
use serde::{Deserialize, Serialize};

fn msg(key: &str, payload: &str) -> RawMessage {
    RawMessage::new(payload.to_owned()).with_header("idempotency-key", key.to_owned())
}

fn executor(store: &MemoryStore, config: ExecutorConfig) -> Executor {
    Executor::new(Arc::new(store.clone()), config).expect("valid config")
}

#[derive(Serialize, Deserialize, Debug, PartialEq, Clone)]
struct Receipt {
    charge_id: String,
    amount: u64,
    token: u64,
}

#[tokio::test]
async fn duplicate_gets_the_stored_typed_result_and_the_handler_does_not_run_again() {
    let store = MemoryStore::new();
    let exec = executor(&store, ExecutorConfig::new("payments"));
    let runs = AtomicUsize::new(0);
    let m = msg("tx-1", r#"{"amount": 42}"#);
    let handler = |ctx: idem_executor::HandlerContext| {
        runs.fetch_add(1, Ordering::SeqCst);
        async move {
            assert_eq!(ctx.attempt(), 1);
            assert_eq!(ctx.key().unwrap().id(), "tx-1");
            assert!(ctx.is_deduplicated() && !ctx.is_takeover());
            Ok::<_, HandlerError>(Receipt {
                charge_id: "ch_1".into(),
                amount: 42,
                token: ctx.token().unwrap().get(),
            })
        }
    };
    let first = exec.run(&m, handler).await.unwrap();
    let Outcome::Executed(receipt) = &first else {
        panic!("{first:?}")
    };
    assert_eq!(first.action(), BrokerAction::Ack);
    for _ in 0..3 {
        let again = exec
            .run(&m, |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<Receipt, HandlerError>(Receipt {
                    charge_id: "ch_WRONG".into(),
                    amount: 0,
                    token: 0,
                })
            })
            .await
            .unwrap();
        match &again {
            Outcome::Replayed(r) => assert_eq!(r, receipt),
            other => panic!("{other:?}"),
        }
        assert_eq!(again.action(), BrokerAction::Ack);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let record = store
        .get_record(&exec.namespace().key("tx-1").unwrap())
        .await;
    assert!(
        matches!(record.state, RecordState::Completed { .. }),
        "{record:?}"
    );
    assert_eq!(record.attempts, 1);
}

/// `get` through the trait, unwrapped.
trait GetRecord {
    async fn get_record(&self, key: &idem_core::IdempotencyKey) -> idem_core::Record;
}

impl GetRecord for MemoryStore {
    async fn get_record(&self, key: &idem_core::IdempotencyKey) -> idem_core::Record {
        use idem_core::IdempotencyStore;
        self.get(key).await.unwrap().expect("record present")
    }
}

#[tokio::test]
async fn replay_that_does_not_decode_is_a_typed_error() {
    let store = MemoryStore::new();
    let exec = executor(&store, ExecutorConfig::new("n"));
    let m = msg("k", "{}");
    let first = exec
        .run(&m, |_| async { Ok::<_, HandlerError>(7u32) })
        .await;
    assert!(matches!(first, Ok(Outcome::Executed(7))), "{first:?}");
    let again = exec
        .run(&m, |_| async {
            Ok::<_, HandlerError>(vec!["x".to_owned()])
        })
        .await;
    match &again {
        Err(ExecutorError::Decode { key, .. }) => assert_eq!(key.id(), "k"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        BrokerAction::of(&again),
        BrokerAction::DeadLetter { .. }
    ));
}

#[tokio::test]
async fn key_extraction_variants() {
    let payload =
        r#"{"order": {"id": "o-9", "n": 17, "nothing": null, "obj": {}}, "tenant": "acme"}"#;
    let m = RawMessage::new(payload)
        .with_header("idempotency-key", "from-header")
        .with_header("x-key", "custom")
        .with_header("tenant", "acme|eu")
        .with_header("binary", vec![0xff, 0xfe])
        .with_message_key("broker-key");
    let get = |source: KeySource| source.extract(&m);
    assert_eq!(
        get(KeySource::default()).unwrap().as_deref(),
        Some("from-header")
    );
    assert_eq!(
        get(KeySource::header("x-key")).unwrap().as_deref(),
        Some("custom")
    );
    assert_eq!(get(KeySource::header("absent")).unwrap(), None);
    // Header names are case-sensitive, as on every broker.
    assert_eq!(get(KeySource::header("X-Key")).unwrap(), None);
    assert_eq!(get(KeySource::header("Idempotency-Key")).unwrap(), None);
    assert_eq!(
        get(KeySource::json_pointer("/order/id"))
            .unwrap()
            .as_deref(),
        Some("o-9")
    );
    assert_eq!(
        get(KeySource::json_pointer("/order/n")).unwrap().as_deref(),
        Some("17")
    );
    assert_eq!(
        get(KeySource::json_pointer("/order/nothing")).unwrap(),
        None
    );
    assert_eq!(get(KeySource::json_pointer("/order/absent")).unwrap(), None);
    assert!(matches!(
        get(KeySource::json_pointer("/order/obj")),
        Err(ExecutorError::InvalidMessage { .. })
    ));
    // Integers within 64 bits are keys as they are; any other number is read as a float many
    // texts share, so it is refused rather than made a key two messages could share.
    let key_of =
        |payload: &'static str| KeySource::json_pointer("/id").extract(&RawMessage::new(payload));
    assert_eq!(key_of(r#"{"id": -42}"#).unwrap().as_deref(), Some("-42"));
    assert_eq!(
        key_of(r#"{"id": 18446744073709551615}"#)
            .unwrap()
            .as_deref(),
        Some("18446744073709551615")
    );
    for number in [
        "12345678901234567890123",
        "12345678901234567890124",
        "0.1",
        "0.10000000000000000001",
        "1.0",
        "1e3",
    ] {
        let payload: &'static str = Box::leak(format!(r#"{{"id": {number}}}"#).into_boxed_str());
        assert!(
            matches!(key_of(payload), Err(ExecutorError::InvalidMessage { .. })),
            "{number} must be refused as a key: {:?}",
            key_of(payload)
        );
    }
    assert!(matches!(
        get(KeySource::header("binary")),
        Err(ExecutorError::InvalidMessage { .. })
    ));
    assert_eq!(
        get(KeySource::message_key()).unwrap().as_deref(),
        Some("broker-key")
    );
    let closure = KeySource::from_fn(|m: &dyn Message| {
        m.header("x-key")
            .map(|v| format!("fn-{}", String::from_utf8_lossy(v)))
    });
    assert_eq!(get(closure).unwrap().as_deref(), Some("fn-custom"));

    // Composite: tenant + order id, joined unambiguously.
    let composite = KeySource::composite([
        KeySource::json_pointer("/tenant"),
        KeySource::json_pointer("/order/id"),
    ]);
    assert_eq!(get(composite).unwrap().as_deref(), Some("acme|o-9"));
    let escaped = KeySource::composite([KeySource::header("tenant"), KeySource::header("x-key")]);
    assert_eq!(get(escaped).unwrap().as_deref(), Some(r"acme\|eu|custom"));
    let missing_part =
        KeySource::composite([KeySource::header("tenant"), KeySource::header("absent")]);
    assert_eq!(get(missing_part).unwrap(), None);

    // ("a|b", "c") and ("a", "b|c") stay distinct.
    let pair = |a: &str, b: &str| {
        KeySource::composite([KeySource::header("a"), KeySource::header("b")])
            .extract(
                &RawMessage::new("")
                    .with_header("a", a.to_owned())
                    .with_header("b", b.to_owned()),
            )
            .unwrap()
            .unwrap()
    };
    assert_ne!(pair("a|b", "c"), pair("a", "b|c"));
    assert_ne!(pair(r"a\", "|b"), pair("a", r"\|b"));

    // A JSON pointer on a payload that is not JSON.
    assert!(matches!(
        KeySource::json_pointer("/id").extract(&RawMessage::new("not json")),
        Err(ExecutorError::InvalidMessage { .. })
    ));
}

#[tokio::test]
async fn keys_from_a_json_payload_drive_deduplication() {
    let store = MemoryStore::new();
    let exec = executor(
        &store,
        ExecutorConfig::new("orders").with_key_source(KeySource::composite([
            KeySource::json_pointer("/tenant"),
            KeySource::json_pointer("/tx"),
        ])),
    );
    let runs = AtomicUsize::new(0);
    let run = |payload: &'static str| {
        let exec = exec.clone();
        let runs = &runs;
        async move {
            exec.run(&RawMessage::new(payload), |ctx| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, HandlerError>(ctx.key().unwrap().id().to_owned())
            })
            .await
        }
    };
    let a = run(r#"{"tenant": "t1", "tx": 5}"#).await.unwrap();
    assert!(matches!(&a, Outcome::Executed(id) if id == "t1|5"), "{a:?}");
    let b = run(r#"{"tx": 5, "tenant": "t1"}"#).await.unwrap();
    // Same key, but the payload bytes differ: the default fingerprint covers the whole payload.
    assert!(matches!(b, Outcome::Conflict), "{b:?}");
    let c = run(r#"{"tenant": "t2", "tx": 5}"#).await.unwrap();
    assert!(matches!(&c, Outcome::Executed(id) if id == "t2|5"), "{c:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn missing_key_is_an_error_by_default_and_pass_through_is_explicit() {
    let store = MemoryStore::new();
    let runs = AtomicUsize::new(0);
    let no_key = RawMessage::new("{}");

    let strict = executor(&store, ExecutorConfig::new("n"));
    let r = strict
        .run(&no_key, |_| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, HandlerError>(())
        })
        .await;
    assert!(matches!(r, Err(ExecutorError::MissingKey)), "{r:?}");
    assert!(matches!(
        BrokerAction::of(&r),
        BrokerAction::DeadLetter { .. }
    ));
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    let lenient = executor(
        &store,
        ExecutorConfig::new("n").with_missing_key(MissingKeyPolicy::PassThrough),
    );
    let counter = &runs;
    for _ in 0..2 {
        let r = lenient
            .run(&no_key, |ctx| async move {
                counter.fetch_add(1, Ordering::SeqCst);
                assert!(!ctx.is_deduplicated());
                assert!(ctx.key().is_none() && ctx.token().is_none());
                Ok::<_, HandlerError>(5)
            })
            .await
            .unwrap();
        match &r {
            Outcome::NotDeduplicated {
                result: Ok(5),
                reason: PassThroughReason::MissingKey,
                ..
            } => {}
            other => panic!("{other:?}"),
        }
        assert!(!r.is_deduplicated());
        assert_eq!(r.action(), BrokerAction::Ack);
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "pass-through runs every time"
    );
    assert!(store.is_empty(), "nothing written for a pass-through");

    // A pass-through handler that fails terminally is dead-lettered.
    let r = lenient
        .run(&no_key, |_| async {
            Err::<(), _>(HandlerError::terminal("bad"))
        })
        .await;
    assert!(
        matches!(BrokerAction::of(&r), BrokerAction::DeadLetter { .. }),
        "{r:?}"
    );

    // A key too long for the store is an error, not a pass-through.
    let long = msg(&"k".repeat(idem_core::MAX_ID_LEN + 1), "{}");
    let r = lenient
        .run(&long, |_| async { Ok::<_, HandlerError>(()) })
        .await;
    assert!(matches!(r, Err(ExecutorError::InvalidKey(_))), "{r:?}");
}

#[tokio::test]
async fn fingerprint_conflict_and_policies() {
    let store = MemoryStore::new();
    let runs = AtomicUsize::new(0);
    let run = |exec: &Executor, key: &str, payload: &str| {
        let exec = exec.clone();
        let m = msg(key, payload);
        let runs = &runs;
        async move {
            exec.run(&m, |_| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, HandlerError>(1u8)
            })
            .await
            .unwrap()
        }
    };

    let whole = executor(&store, ExecutorConfig::new("whole"));
    assert!(matches!(
        run(&whole, "k", r#"{"a":1}"#).await,
        Outcome::Executed(1)
    ));
    let conflict = run(&whole, "k", r#"{"a":2}"#).await;
    assert!(matches!(conflict, Outcome::Conflict), "{conflict:?}");
    assert!(matches!(conflict.action(), BrokerAction::DeadLetter { .. }));
    assert!(matches!(
        run(&whole, "k", r#"{"a":1}"#).await,
        Outcome::Replayed(1)
    ));

    let off = executor(
        &store,
        ExecutorConfig::new("off").with_fingerprint(FingerprintPolicy::Off),
    );
    assert!(matches!(run(&off, "k", "one").await, Outcome::Executed(1)));
    assert!(matches!(run(&off, "k", "two").await, Outcome::Replayed(1)));

    let fields = executor(
        &store,
        ExecutorConfig::new("fields")
            .with_fingerprint(FingerprintPolicy::json_fields(["/amount", "/currency"])),
    );
    let base = r#"{"amount": 10, "currency": "EUR", "sent_at": "10:00"}"#;
    assert!(matches!(
        run(&fields, "k", base).await,
        Outcome::Executed(1)
    ));
    let retried = r#"{"sent_at": "10:05", "currency": "EUR", "amount": 10}"#;
    assert!(matches!(
        run(&fields, "k", retried).await,
        Outcome::Replayed(1)
    ));
    let changed = r#"{"amount": 11, "currency": "EUR", "sent_at": "10:00"}"#;
    assert!(matches!(
        run(&fields, "k", changed).await,
        Outcome::Conflict
    ));
    let r = fields
        .run(&msg("k2", "not json"), |_| async {
            Ok::<_, HandlerError>(1u8)
        })
        .await;
    assert!(
        matches!(r, Err(ExecutorError::InvalidMessage { .. })),
        "{r:?}"
    );

    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

#[test]
fn invalid_configurations_name_the_field() {
    let store: idem_core::DynStore = Arc::new(MemoryStore::with_options(
        Arc::new(SystemClock),
        Limits::default().with_max_result_len(1000),
    ));
    let ok = || ExecutorConfig::new("ns");
    let cases: Vec<(&str, ExecutorConfig)> = vec![
        ("namespace", ExecutorConfig::default()),
        ("namespace", ok().with_namespace("has space")),
        ("namespace", ok().with_namespace("n".repeat(65))),
        ("owner", ok().with_owner("")),
        ("lease_ttl", ok().with_lease_ttl(Duration::ZERO)),
        (
            "lease_ttl",
            ok().with_lease_ttl(Duration::from_secs(2 * 24 * 3600)),
        ),
        (
            "heartbeat_interval",
            ok().with_lease_ttl(Duration::from_secs(10))
                .with_heartbeat_interval(Duration::from_secs(10)),
        ),
        (
            "heartbeat_interval",
            ok().with_lease_ttl(Duration::from_secs(10))
                .with_heartbeat_interval(Duration::from_secs(11)),
        ),
        (
            "heartbeat_interval",
            ok().with_lease_ttl(Duration::from_secs(10))
                .with_heartbeat_interval(Duration::from_millis(5001)),
        ),
        (
            "heartbeat_interval",
            ok().with_heartbeat_interval(Duration::ZERO),
        ),
        ("retention", ok().with_retention(Duration::ZERO)),
        ("max_attempts", ok().with_max_attempts(0)),
        ("max_result_len", ok().with_max_result_len(0)),
        ("max_result_len", ok().with_max_result_len(1001)),
        ("key_source", ok().with_key_source(KeySource::header(""))),
        (
            "key_source",
            ok().with_key_source(KeySource::json_pointer("id")),
        ),
        ("key_source", ok().with_key_source(KeySource::composite([]))),
        (
            "key_source",
            ok().with_key_source(KeySource::composite([KeySource::json_pointer("bad")])),
        ),
        (
            "fingerprint",
            ok().with_fingerprint(FingerprintPolicy::json_fields(Vec::<String>::new())),
        ),
        (
            "fingerprint",
            ok().with_fingerprint(FingerprintPolicy::json_fields(["amount"])),
        ),
        (
            "in_progress_wait",
            ok().with_in_progress_wait(InProgressWait::default().with_max_wait(Duration::ZERO)),
        ),
        (
            "in_progress_wait",
            ok().with_in_progress_wait(
                InProgressWait::default()
                    .with_min_delay(Duration::from_secs(2))
                    .with_max_delay(Duration::from_secs(1)),
            ),
        ),
    ];
    for (field, config) in cases {
        let r = Executor::builder(store.clone())
            .config(config.clone())
            .build();
        match r {
            Err(ConfigError {
                field: got,
                ref reason,
                ..
            }) => {
                assert_eq!(got, field, "{config:?}: {reason}");
                let shown = r.unwrap_err().to_string();
                assert!(shown.contains(field), "{shown}");
            }
            Ok(e) => panic!("accepted {config:?}: {e:?}"),
        }
    }
    let exec = Executor::builder(store.clone())
        .config(ok().with_lease_ttl(Duration::from_secs(9)))
        .build()
        .unwrap();
    assert_eq!(exec.heartbeat_interval(), Duration::from_secs(3));
    assert_eq!(exec.max_result_len(), 1000);
    assert!(exec.owner().starts_with("idem-"));
    let exec = Executor::builder(store)
        .configure(|c| {
            c.with_namespace("ok")
                .with_owner("worker-1")
                .with_max_result_len(10)
        })
        .build()
        .unwrap();
    assert_eq!(exec.owner(), "worker-1");
    assert_eq!(exec.max_result_len(), 10);
}

#[tokio::test]
async fn long_error_messages_are_cut_to_the_store_limit_on_a_char_boundary() {
    let store = MemoryStore::with_options(
        Arc::new(SystemClock),
        Limits::default().with_max_error_len(10),
    );
    let exec = executor(&store, ExecutorConfig::new("n"));
    let r = exec
        .run(&msg("k", "{}"), |_| async {
            Err::<(), _>(HandlerError::retryable("ééééééééé: way too long"))
        })
        .await
        .unwrap();
    // `Limits::fit_error`: 10 bytes at most, the cut marked with `…` (3 bytes).
    let want = "ééé…";
    match &r {
        Outcome::Retry {
            attempt: 1,
            error,
            panicked: false,
            ..
        } => assert_eq!(error, want),
        other => panic!("{other:?}"),
    }
    let record = store.get_record(&exec.namespace().key("k").unwrap()).await;
    assert_eq!(
        record.state,
        RecordState::Failed {
            error: want.into(),
            kind: FailureKind::Retryable
        }
    );
}

/// A NUL in a handler's error would be refused by every store (`InvalidInput`): the executor
/// records it escaped instead of failing the record.
#[tokio::test]
async fn a_nul_in_a_handler_error_is_recorded_escaped() {
    let store = MemoryStore::new();
    let exec = executor(&store, ExecutorConfig::new("n"));
    let r = exec
        .run(&msg("k", "{}"), |_| async {
            Err::<(), _>(HandlerError::terminal("bad\0byte"))
        })
        .await
        .unwrap();
    assert!(
        matches!(&r, Outcome::Failed { error } if error == "bad\\0byte"),
        "{r:?}"
    );
    let record = store.get_record(&exec.namespace().key("k").unwrap()).await;
    assert_eq!(
        record.state,
        RecordState::Failed {
            error: "bad\\0byte".into(),
            kind: FailureKind::Terminal
        }
    );
}

#[test]
fn half_the_lease_is_the_longest_heartbeat_interval() {
    let store: idem_core::DynStore = Arc::new(MemoryStore::new());
    let exec = Executor::new(
        store,
        ExecutorConfig::new("ns")
            .with_lease_ttl(Duration::from_secs(10))
            .with_heartbeat_interval(Duration::from_secs(5)),
    )
    .unwrap();
    assert_eq!(exec.heartbeat_interval(), Duration::from_secs(5));
}

#[tokio::test]
async fn oversized_results_are_not_stored_but_never_rerun() {
    use idem_core::IdempotencyStore;
    let store = MemoryStore::new();
    let exec = executor(&store, ExecutorConfig::new("n").with_max_result_len(16));
    let runs = AtomicUsize::new(0);
    let detail = "the result of 102 bytes is over the limit of 16 bytes";
    for _ in 0..2 {
        let r = exec
            .run(&msg("k", "{}"), |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, HandlerError>("x".repeat(100))
            })
            .await
            .unwrap();
        let Outcome::ResultNotStored { error } = &r else {
            panic!("{r:?}")
        };
        assert_eq!(error, detail);
        assert_eq!(r.name(), "result_not_stored");
        assert_eq!(
            r.action(),
            BrokerAction::DeadLetter {
                reason: DeadLetterReason::ResultNotStored,
                error: detail.to_owned(),
            }
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let record = store
        .get(&exec.namespace().key("k").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        record.state,
        RecordState::Failed {
            error: detail.to_owned(),
            kind: FailureKind::ResultNotStored
        }
    );
}

/// "Result not stored" is the recorded kind, not a text: a handler's own error that reads like
/// the old prefix is a plain terminal failure, now and on every later delivery.
#[tokio::test]
async fn an_error_text_that_reads_like_result_not_stored_is_a_plain_failure() {
    let store = MemoryStore::new();
    let exec = executor(&store, ExecutorConfig::new("n"));
    let text = "result not stored (the handler's effect was applied): said the handler";
    let runs = AtomicUsize::new(0);
    for _ in 0..2 {
        let r = exec
            .run(&msg("k", "{}"), |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Err::<u8, _>(HandlerError::terminal(text))
            })
            .await
            .unwrap();
        assert!(
            matches!(&r, Outcome::Failed { error } if error == text),
            "{r:?}"
        );
        assert!(matches!(
            r.action(),
            BrokerAction::DeadLetter {
                reason: DeadLetterReason::Failed,
                ..
            }
        ));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let record = store.get_record(&exec.namespace().key("k").unwrap()).await;
    assert!(
        matches!(
            record.state,
            RecordState::Failed {
                kind: FailureKind::Terminal,
                ..
            }
        ),
        "{record:?}"
    );
}

/// With a `max_error_len` too short for any explanation, a result that was not stored is still
/// told apart from a failure on every delivery: the kind is recorded, whatever the text.
#[tokio::test]
async fn result_not_stored_survives_a_tiny_max_error_len() {
    let store = MemoryStore::with_options(
        Arc::new(SystemClock),
        Limits::default().with_max_error_len(2),
    );
    let exec = executor(&store, ExecutorConfig::new("n").with_max_result_len(4));
    let runs = AtomicUsize::new(0);
    for _ in 0..2 {
        let r = exec
            .run(&msg("k", "{}"), |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, HandlerError>("far over four bytes".to_owned())
            })
            .await
            .unwrap();
        match &r {
            Outcome::ResultNotStored { error } => assert_eq!(error, "th"),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let record = store.get_record(&exec.namespace().key("k").unwrap()).await;
    assert_eq!(
        record.state,
        RecordState::Failed {
            error: "th".into(),
            kind: FailureKind::ResultNotStored
        }
    );
}

/// A result whose serialization fails.
struct Unencodable;

impl Serialize for Unencodable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom("cannot encode this"))
    }
}

impl<'de> Deserialize<'de> for Unencodable {
    fn deserialize<D: serde::Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
        Err(serde::de::Error::custom("never stored"))
    }
}

#[tokio::test]
async fn results_that_do_not_encode_are_not_stored_but_never_rerun() {
    let store = MemoryStore::new();
    let exec = executor(&store, ExecutorConfig::new("n"));
    let r = exec
        .run(&msg("k", "{}"), |_| async {
            Ok::<_, HandlerError>(Unencodable)
        })
        .await
        .unwrap();
    let Outcome::ResultNotStored { error } = &r else {
        panic!("{:?}", r.name())
    };
    assert!(error.starts_with("the result does not encode: "), "{error}");
    assert!(error.contains("cannot encode this"), "{error}");
}

#[tokio::test]
async fn terminal_failures_are_replayed_never_rerun() {
    let store = MemoryStore::new();
    let exec = executor(&store, ExecutorConfig::new("n"));
    let runs = AtomicUsize::new(0);
    for _ in 0..3 {
        let r = exec
            .run(&msg("k", "{}"), |_| async {
                runs.fetch_add(1, Ordering::SeqCst);
                "12x".parse::<u32>().map_err(HandlerError::terminal)
            })
            .await
            .unwrap();
        match &r {
            Outcome::Failed { error } => assert!(error.contains("invalid digit"), "{error}"),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn run_with_key_bypasses_extraction() {
    let store = MemoryStore::new();
    let exec = executor(&store, ExecutorConfig::new("n"));
    let fp = Some(idem_core::Fingerprint::of("p"));
    let a = exec
        .run_with_key("topic/0/42", fp, |ctx| async move {
            Ok::<_, HandlerError>(ctx.attempt())
        })
        .await
        .unwrap();
    assert!(matches!(a, Outcome::Executed(1)), "{a:?}");
    let b = exec
        .run_with_key("topic/0/42", fp, |_| async { Ok::<_, HandlerError>(9) })
        .await
        .unwrap();
    assert!(matches!(b, Outcome::Replayed(1)), "{b:?}");
    let c = exec
        .run_with_key("", None, |_| async { Ok::<_, HandlerError>(9) })
        .await;
    assert!(matches!(c, Err(ExecutorError::InvalidKey(_))), "{c:?}");
}

#[test]
fn run_future_is_send_for_send_handlers() {
    fn assert_send<T: Send>(_: &T) {}
    let store = MemoryStore::with_clock(Arc::new(ManualClock::default()));
    let exec = executor(&store, ExecutorConfig::new("n"));
    let m = msg("k", "{}");
    let fut = exec.run(&m, |_| async { Ok::<_, HandlerError>(1) });
    assert_send(&fut);
}

#[test]
fn outcome_actions() {
    let d = Duration::from_millis(250);
    let cases: Vec<(Outcome<u8>, BrokerAction)> = vec![
        (Outcome::Executed(1), BrokerAction::Ack),
        (Outcome::Replayed(1), BrokerAction::Ack),
        (
            Outcome::InProgress {
                owner: "w".into(),
                retry_after: d,
            },
            BrokerAction::Retry { after: d },
        ),
        (
            Outcome::LeaseLost { retry_after: d },
            BrokerAction::Retry { after: d },
        ),
        (
            Outcome::Retry {
                attempt: 1,
                error: "e".into(),
                panicked: false,
                retry_after: d,
            },
            BrokerAction::Retry { after: d },
        ),
    ];
    for (outcome, action) in cases {
        assert_eq!(outcome.action(), action, "{outcome:?}");
    }
    let dead = |reason, error: &str| BrokerAction::DeadLetter {
        reason,
        error: error.to_owned(),
    };
    let cases: Vec<(Outcome<u8>, BrokerAction)> = vec![
        (
            Outcome::Conflict,
            dead(
                DeadLetterReason::Conflict,
                "fingerprint conflict: the key was used before for a different payload",
            ),
        ),
        (
            Outcome::Failed { error: "e".into() },
            dead(DeadLetterReason::Failed, "e"),
        ),
        (
            Outcome::ResultNotStored {
                error: "big".into(),
            },
            dead(DeadLetterReason::ResultNotStored, "big"),
        ),
        (
            Outcome::Exhausted {
                attempts: 3,
                last_error: Some("boom".into()),
            },
            dead(DeadLetterReason::Exhausted, "boom"),
        ),
        (
            Outcome::Exhausted {
                attempts: 3,
                last_error: None,
            },
            dead(
                DeadLetterReason::Exhausted,
                "no attempt recorded an outcome: the last one crashed, stalled past its lease, \
                 or its acquire took effect after the reply was lost (a store timeout)",
            ),
        ),
    ];
    for (outcome, action) in cases {
        assert_eq!(outcome.action(), action, "{outcome:?}");
    }
}

#[tokio::test]
async fn errors_dead_letter_with_their_reason() {
    let store = MemoryStore::new();
    let exec = executor(
        &store,
        ExecutorConfig::new("n").with_fingerprint(FingerprintPolicy::json_fields(["/a"])),
    );
    let ok = |_| async { Ok::<_, HandlerError>(1u8) };
    let cases = [
        (RawMessage::new("{}"), DeadLetterReason::MissingKey),
        (
            msg(&"k".repeat(idem_core::MAX_ID_LEN + 1), "{}"),
            DeadLetterReason::InvalidKey,
        ),
        (msg("k", "not json"), DeadLetterReason::InvalidMessage),
    ];
    for (m, want) in cases {
        let r = exec.run(&m, ok).await;
        let e = r.as_ref().expect_err("an error");
        assert_eq!(e.dead_letter_reason(), Some(want), "{e}");
        assert_eq!(
            BrokerAction::of(&r),
            BrokerAction::DeadLetter {
                reason: want,
                error: e.to_string()
            }
        );
    }
    exec.run(&msg("k", r#"{"a":1}"#), ok).await.unwrap();
    let r = exec
        .run(&msg("k", r#"{"a":1}"#), |_| async {
            Ok::<_, HandlerError>("a string".to_owned())
        })
        .await;
    assert!(
        matches!(
            BrokerAction::of(&r),
            BrokerAction::DeadLetter {
                reason: DeadLetterReason::Decode,
                ..
            }
        ),
        "{r:?}"
    );
}

/// A registered handler type, as runners keep one.
struct Charge {
    fee: u64,
}

impl Handler<RawMessage, u64> for Charge {
    type Future = std::future::Ready<Result<u64, HandlerError>>;

    fn call(&self, msg: RawMessage, ctx: HandlerContext) -> Self::Future {
        assert!(ctx.is_deduplicated());
        let amount: u64 = std::str::from_utf8(msg.payload()).unwrap().parse().unwrap();
        std::future::ready(Ok(amount + self.fee))
    }
}

#[tokio::test]
async fn registered_handlers_run_through_handle() {
    let store = MemoryStore::new();
    let exec = executor(&store, ExecutorConfig::new("h"));
    let charge = Charge { fee: 1 };
    let r = exec.handle(msg("a", "41"), &charge).await.unwrap();
    assert!(matches!(r, Outcome::Executed(42)), "{r:?}");
    let r = exec.handle(msg("a", "41"), &charge).await.unwrap();
    assert!(matches!(r, Outcome::Replayed(42)), "{r:?}");

    // A closure taking the message and the context.
    let closure = |m: RawMessage, ctx: HandlerContext| async move {
        Ok::<_, HandlerError>(format!(
            "{} at attempt {}",
            m.payload().len(),
            ctx.attempt()
        ))
    };
    let r = exec.handle(msg("b", "xyz"), &closure).await.unwrap();
    assert!(
        matches!(&r, Outcome::Executed(s) if s == "3 at attempt 1"),
        "{r:?}"
    );

    // A closure taking the context only is a `Handler<(), T>`.
    fn context_only<H: Handler<(), u32>>(h: H) -> H {
        h
    }
    let attempt = context_only(|ctx: HandlerContext| async move { Ok(ctx.attempt()) });
    let r = exec
        .run(&msg("c", "{}"), |ctx| Handler::call(&attempt, (), ctx))
        .await
        .unwrap();
    assert!(matches!(r, Outcome::Executed(1)), "{r:?}");
}
