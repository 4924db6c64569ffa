//! Executor: one span per message with namespace, key, attempt, token and outcome.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use idem_core::MemoryStore;
use idem_executor::{Executor, ExecutorConfig, HandlerError, Outcome, RawMessage};

#[derive(Clone, Default)]
struct Buffer(Arc<Mutex<Vec<u8>>>);

impl Write for Buffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn the_span_carries_namespace_key_attempt_token_and_outcome() {
    let buffer = Buffer::default();
    let writer = buffer.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_writer(move || writer.clone())
        .finish();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let exec = Executor::new(Arc::new(MemoryStore::new()), ExecutorConfig::new("traced")).unwrap();
    let msg = RawMessage::new("{}").with_header("idempotency-key", "order-7");
    tracing::subscriber::with_default(subscriber, || {
        rt.block_on(async {
            let r = exec
                .run(&msg, |_| async { Ok::<_, HandlerError>(1u8) })
                .await
                .unwrap();
            assert!(matches!(r, Outcome::Executed(1)));
            let r = exec
                .run(&msg, |_| async { Ok::<_, HandlerError>(1u8) })
                .await
                .unwrap();
            assert!(matches!(r, Outcome::Replayed(1)));
        });
    });
    let out = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
    let closes: Vec<&str> = out.lines().filter(|l| l.contains("close")).collect();
    assert_eq!(closes.len(), 2, "{out}");
    for field in [
        "namespace=traced",
        "key=\"order-7\"",
        "attempt=1",
        "token=1",
        "outcome=\"executed\"",
    ] {
        assert!(
            closes[0].contains(field),
            "{field} missing in {}",
            closes[0]
        );
    }
    assert!(closes[1].contains("outcome=\"replayed\""), "{}", closes[1]);
}

/// A handler pending long enough to be heartbeating (a ready one never starts).
async fn slow_one() -> Result<u8, HandlerError> {
    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    Ok(1)
}

/// A heartbeat that meets the record completed under its own token (the completion took effect,
/// its reply not yet back) is not a lost lease: no "lease lost" warning, and the message is
/// executed.
#[test]
fn a_heartbeat_behind_its_own_completion_warns_of_no_lost_lease() {
    let buffer = Buffer::default();
    let writer = buffer.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    // One thread, so that the heartbeat task logs through this thread's subscriber.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = common::Hooked {
        complete_reply_delay: std::time::Duration::from_millis(600),
        ..Default::default()
    };
    let config = ExecutorConfig::new("beat")
        .with_lease_ttl(std::time::Duration::from_millis(600))
        .with_heartbeat_interval(std::time::Duration::from_millis(100));
    let exec = Executor::new(Arc::new(store), config).unwrap();
    let msg = RawMessage::new("{}").with_header("idempotency-key", "order-8");
    tracing::subscriber::with_default(subscriber, || {
        rt.block_on(async {
            // Alone, and in a batch (whose completions go to the store after the handlers).
            let r = exec.run(&msg, |_| slow_one()).await.unwrap();
            assert!(matches!(r, Outcome::Executed(1)), "{r:?}");
            let batch = [
                RawMessage::new("{}").with_header("idempotency-key", "order-9"),
                RawMessage::new("{}").with_header("idempotency-key", "order-10"),
            ];
            let rs = exec.run_batch(&batch, |_, _| slow_one()).await.unwrap();
            for r in rs {
                assert!(matches!(r, Ok(Outcome::Executed(1))), "{r:?}");
            }
        });
    });
    let out = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
    assert!(!out.contains("lease lost"), "{out}");
}
