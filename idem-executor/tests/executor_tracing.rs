//! Executor: one span per message with namespace, key, attempt, token and outcome.

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
