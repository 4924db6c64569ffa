//! The executor's own overhead per message on `MemoryStore`, beside the raw store calls it makes.
//!
//! Run: `cargo bench -p idem-core --bench executor`. Each iteration processes a fresh key (the
//! store's manual clock moves past the 1 ms retention between passes over 4096 keys), on a
//! current-thread Tokio runtime, without a tracing subscriber or metrics recorder.

#![allow(missing_docs)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use idem_core::executor::{Executor, ExecutorConfig, HandlerError, Outcome, RawMessage};
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Fingerprint, IdempotencyKey, IdempotencyStore,
    ManualClock, MemoryStore, Message, Namespace,
};

const KEYS: usize = 4096;
const RETENTION: Duration = Duration::from_millis(1);

struct Fixture {
    rt: tokio::runtime::Runtime,
    clock: Arc<ManualClock>,
    store: MemoryStore,
    exec: Executor,
    msgs: Vec<RawMessage>,
    keys: Vec<IdempotencyKey>,
}

fn fixture() -> Fixture {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let clock = Arc::new(ManualClock::new(
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
    ));
    let store = MemoryStore::with_clock(clock.clone());
    let exec = Executor::new(
        Arc::new(store.clone()),
        ExecutorConfig::new("bench")
            .with_owner("bench")
            .with_retention(RETENTION),
    )
    .unwrap();
    let ns = Namespace::new("bench").unwrap();
    let msgs = (0..KEYS)
        .map(|i| {
            RawMessage::new(format!(r#"{{"order":{i},"amount":1000,"currency":"EUR"}}"#))
                .with_header("idempotency-key", format!("order-{i}"))
        })
        .collect();
    let keys = (0..KEYS)
        .map(|i| ns.key(format!("order-{i}")).unwrap())
        .collect();
    Fixture {
        rt,
        clock,
        store,
        exec,
        msgs,
        keys,
    }
}

impl Fixture {
    /// Runs `iters` messages through `one`, moving the clock past retention every pass.
    fn measure<F, Fut>(&self, iters: u64, fresh: bool, one: F) -> Duration
    where
        F: Fn(usize) -> Fut,
        Fut: Future<Output = ()>,
    {
        self.rt.block_on(async {
            let mut elapsed = Duration::ZERO;
            let mut done = 0u64;
            while done < iters {
                if fresh {
                    self.clock.advance(Duration::from_secs(1));
                }
                let n = (iters - done).min(KEYS as u64) as usize;
                let start = Instant::now();
                for i in 0..n {
                    one(i).await;
                }
                elapsed += start.elapsed();
                done += n as u64;
            }
            elapsed
        })
    }

    fn request(&self, i: usize, fingerprint: Option<Fingerprint>) -> AcquireRequest {
        AcquireRequest::new(self.keys[i].clone(), "bench")
            .with_fingerprint(fingerprint)
            .with_lease_ttl(Duration::from_secs(30))
            .with_max_attempts(5)
    }
}

fn bench(c: &mut Criterion) {
    let f = &fixture();
    let fingerprints: &Vec<Fingerprint> = &f
        .msgs
        .iter()
        .map(|m| Fingerprint::of(m.payload()))
        .collect();
    let mut group = c.benchmark_group("per_message");
    group.throughput(Throughput::Elements(1));
    group.measurement_time(Duration::from_secs(4));

    // The store alone: acquire + complete, fingerprint precomputed, result bytes ready.
    group.bench_function("raw_store/acquire_complete", |b| {
        b.iter_custom(|iters| {
            f.measure(iters, true, |i| {
                let req = f.request(i, Some(fingerprints[i]));
                async move {
                    let AcquireOutcome::Acquired { lease, .. } =
                        f.store.acquire(&req).await.unwrap()
                    else {
                        panic!("not acquired")
                    };
                    f.store
                        .complete(&lease, Bytes::from_static(b"1"), RETENTION)
                        .await
                        .unwrap();
                }
            })
        })
    });

    // What a careful hand-written consumer does without the executor: read the key header,
    // fingerprint the payload, acquire, encode the result as JSON, complete.
    group.bench_function("raw_store/by_hand", |b| {
        b.iter_custom(|iters| {
            f.measure(iters, true, |i| {
                let m = &f.msgs[i];
                let id = std::str::from_utf8(m.header("idempotency-key").unwrap()).unwrap();
                let key = f.exec.namespace().key(id).unwrap();
                let req = AcquireRequest::new(key, "bench")
                    .with_fingerprint(Fingerprint::of(m.payload()))
                    .with_lease_ttl(Duration::from_secs(30))
                    .with_max_attempts(5);
                async move {
                    let AcquireOutcome::Acquired { lease, .. } =
                        f.store.acquire(&req).await.unwrap()
                    else {
                        panic!("not acquired")
                    };
                    let result = serde_json::to_vec(&black_box(1u64)).unwrap();
                    f.store
                        .complete(&lease, Bytes::from(result), RETENTION)
                        .await
                        .unwrap();
                }
            })
        })
    });

    // The same, with a handler that yields once (the baseline of `executor/run_yielding`: a
    // yield on a current-thread runtime makes the scheduler poll its drivers).
    group.bench_function("raw_store/by_hand_yielding", |b| {
        b.iter_custom(|iters| {
            f.measure(iters, true, |i| {
                let m = &f.msgs[i];
                let id = std::str::from_utf8(m.header("idempotency-key").unwrap()).unwrap();
                let key = f.exec.namespace().key(id).unwrap();
                let req = AcquireRequest::new(key, "bench")
                    .with_fingerprint(Fingerprint::of(m.payload()))
                    .with_lease_ttl(Duration::from_secs(30))
                    .with_max_attempts(5);
                async move {
                    let AcquireOutcome::Acquired { lease, .. } =
                        f.store.acquire(&req).await.unwrap()
                    else {
                        panic!("not acquired")
                    };
                    tokio::task::yield_now().await;
                    let result = serde_json::to_vec(&black_box(1u64)).unwrap();
                    f.store
                        .complete(&lease, Bytes::from(result), RETENTION)
                        .await
                        .unwrap();
                }
            })
        })
    });

    // The executor around a handler that returns at once.
    group.bench_function("executor/run_trivial", |b| {
        b.iter_custom(|iters| {
            f.measure(iters, true, |i| async move {
                let r = f
                    .exec
                    .run(&f.msgs[i], |_| async {
                        Ok::<_, HandlerError>(black_box(1u64))
                    })
                    .await
                    .unwrap();
                assert!(matches!(r, Outcome::Executed(1)));
            })
        })
    });

    // A handler that yields once: the executor spawns (and aborts) its heartbeat task.
    group.bench_function("executor/run_yielding", |b| {
        b.iter_custom(|iters| {
            f.measure(iters, true, |i| async move {
                let r = f
                    .exec
                    .run(&f.msgs[i], |_| async {
                        tokio::task::yield_now().await;
                        Ok::<_, HandlerError>(black_box(1u64))
                    })
                    .await
                    .unwrap();
                assert!(matches!(r, Outcome::Executed(1)));
            })
        })
    });

    // Duplicates: raw acquire answering Replayed, vs the executor decoding the replay.
    f.clock.advance(Duration::from_secs(1));
    f.rt.block_on(async {
        for m in &f.msgs {
            f.exec
                .run(m, |_| async { Ok::<_, HandlerError>(1u64) })
                .await
                .unwrap();
        }
    });
    // The clock stays still from here on, so the records stay within their retention.
    group.bench_function("raw_store/acquire_replayed", |b| {
        b.iter_custom(|iters| {
            f.measure(iters, false, |i| {
                let req = f.request(i, Some(fingerprints[i]));
                async move {
                    let r = f.store.acquire(&req).await.unwrap();
                    assert!(matches!(r, AcquireOutcome::Replayed { .. }));
                }
            })
        })
    });
    group.bench_function("executor/run_replayed", |b| {
        b.iter_custom(|iters| {
            f.measure(iters, false, |i| async move {
                let r = f
                    .exec
                    .run(&f.msgs[i], |_| async { Ok::<_, HandlerError>(2u64) })
                    .await
                    .unwrap();
                assert!(matches!(r, Outcome::Replayed(1)));
            })
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
