//! Executor: one span per message with namespace, key, attempt, token and outcome.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use idem_core::MemoryStore;
use idem_executor::{Executor, ExecutorConfig, HandlerError, Outcome, RawMessage};
use tracing::Level;
use tracing_subscriber::fmt::format::FmtSpan;

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

/// What `work` logs, run to completion on a one-thread runtime (so that the tasks it spawns log
/// through the same subscriber) under a subscriber writing, without colours, the events `level`
/// enables and the span events `spans` names.
fn logged(level: Level, spans: FmtSpan, work: impl Future<Output = ()>) -> String {
    let buffer = Buffer::default();
    let writer = buffer.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_ansi(false)
        .with_span_events(spans)
        .with_writer(move || writer.clone())
        .finish();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    tracing::subscriber::with_default(subscriber, || rt.block_on(work));
    String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap()
}

#[test]
fn the_span_carries_namespace_key_attempt_token_and_outcome() {
    let exec = Executor::new(Arc::new(MemoryStore::new()), ExecutorConfig::new("traced")).unwrap();
    let msg = RawMessage::new("{}").with_header("idempotency-key", "order-7");
    let out = logged(Level::DEBUG, FmtSpan::CLOSE, async {
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
    let store = common::Hooked {
        complete_reply_delay: std::time::Duration::from_millis(600),
        ..Default::default()
    };
    let config = ExecutorConfig::new("beat")
        .with_lease_ttl(std::time::Duration::from_millis(600))
        .with_heartbeat_interval(std::time::Duration::from_millis(100));
    let exec = Executor::new(Arc::new(store), config).unwrap();
    let msg = RawMessage::new("{}").with_header("idempotency-key", "order-8");
    let out = logged(Level::WARN, FmtSpan::NONE, async {
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
    assert!(!out.contains("lease lost"), "{out}");
}
