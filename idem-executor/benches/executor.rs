//! The executor's own overhead per message on `MemoryStore`, beside the raw store calls it makes.
//!
//! Run: `cargo bench -p idem-executor --bench executor`. Each iteration processes a fresh key (the
//! store's manual clock moves past the 1 ms retention between passes over 4096 keys), on a
//! current-thread Tokio runtime, without a tracing subscriber or metrics recorder.
//!
//! Criterion measures each case on its own; then a summary measures the raw store calls and the
//! executor in alternating rounds (so that both see the same machine state) and prints both
//! figures and the overhead per message, against the target of 1 µs. The baselines:
//!
//! - raw store calls: `acquire` + `complete` (or the `acquire` answering `Replayed`), with the
//!   request's key and fingerprint built beforehand;
//! - by hand: what a careful consumer writes without the executor: read the key header, build
//!   the key, fingerprint the payload, acquire, encode the result as JSON, complete.
//!
//! Batches of 100 fresh messages: [`Executor::run_batch`] against the raw batch calls it makes
//! (`acquire_many` of the 100 requests built beforehand, then `complete_many` of the 100
//! leases), per message, in the same alternating rounds.
//!
//! It also measures the transactional path against the plain one, in the same alternating
//! rounds: a `TransactionalExecutor` over the same `MemoryStore` whose handler returns a
//! `Commit` with one write (`MemoryWrites::put`, built per message), recorded with
//! `complete_with`, beside the plain executor whose handler returns the result alone.

#![allow(missing_docs)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use criterion::{Criterion, Throughput};
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Completion, Fingerprint, IdempotencyKey,
    IdempotencyStore, ManualClock, MemoryStore, MemoryWrites, Namespace,
};
use idem_executor::{
    Commit, Executor, ExecutorConfig, HandlerError, Message, Outcome, RawMessage,
    TransactionalExecutor,
};

const KEYS: usize = 4096;
const RETENTION: Duration = Duration::from_millis(1);
/// Messages per batch in the batch cases.
const BATCH: usize = 100;
/// The target: the executor's overhead over the raw store calls, per message.
const TARGET_NS: f64 = 1000.0;

struct Fixture {
    rt: tokio::runtime::Runtime,
    clock: Arc<ManualClock>,
    store: MemoryStore,
    exec: Executor,
    tx_exec: TransactionalExecutor<MemoryStore>,
    /// The effect key of each message, for the transactional handler's write.
    effect_keys: Vec<String>,
    msgs: Vec<RawMessage>,
    keys: Vec<IdempotencyKey>,
    fingerprints: Vec<Fingerprint>,
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
    let tx_exec = Executor::transactional(
        Arc::new(store.clone()),
        ExecutorConfig::new("bench-tx")
            .with_owner("bench")
            .with_retention(RETENTION),
    )
    .unwrap();
    let effect_keys = (0..KEYS).map(|i| format!("effect/order-{i}")).collect();
    let ns = Namespace::new("bench").unwrap();
    let msgs: Vec<RawMessage> = (0..KEYS)
        .map(|i| {
            RawMessage::new(format!(r#"{{"order":{i},"amount":1000,"currency":"EUR"}}"#))
                .with_header("idempotency-key", format!("order-{i}"))
        })
        .collect();
    let keys = (0..KEYS)
        .map(|i| ns.key(format!("order-{i}")).unwrap())
        .collect();
    let fingerprints = msgs.iter().map(|m| Fingerprint::of(m.payload())).collect();
    Fixture {
        rt,
        clock,
        store,
        exec,
        tx_exec,
        effect_keys,
        msgs,
        keys,
        fingerprints,
    }
}

impl Fixture {
    /// Runs `iters` messages through `one`, moving the clock past retention every pass when
    /// `fresh`.
    fn measure<F, Fut>(&self, iters: u64, fresh: bool, one: &F) -> Duration
    where
        F: Fn(usize) -> Fut,
        Fut: Future<Output = ()>,
    {
        self.passes(iters, fresh, KEYS, one)
    }

    /// Runs `iters` batches of [`BATCH`] fresh messages through `batch` (which takes the index
    /// of the batch's first message), moving the clock past retention every pass.
    fn measure_batches<F, Fut>(&self, iters: u64, batch: &F) -> Duration
    where
        F: Fn(usize) -> Fut,
        Fut: Future<Output = ()>,
    {
        self.passes(iters, true, KEYS / BATCH, &|b| batch(b * BATCH))
    }

    /// Runs `iters` calls of `unit`, in passes of `per_pass` (each call given its index in the
    /// pass), moving the clock past retention before every pass when `fresh`.
    fn passes<F, Fut>(&self, iters: u64, fresh: bool, per_pass: usize, unit: &F) -> Duration
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
                let n = (iters - done).min(per_pass as u64) as usize;
                let start = Instant::now();
                for i in 0..n {
                    unit(i).await;
                }
                elapsed += start.elapsed();
                done += n as u64;
            }
            elapsed
        })
    }

    /// Raw batch calls for [`BATCH`] new messages from `first`: `acquire_many` of the requests
    /// (built beforehand, as in `raw_new`), then `complete_many` of the leases.
    async fn raw_batch(&self, reqs: Vec<AcquireRequest>) {
        let completions: Vec<Completion> = self
            .store
            .acquire_many(&reqs)
            .await
            .unwrap()
            .into_iter()
            .map(|outcome| match outcome.unwrap() {
                AcquireOutcome::Acquired { lease, .. } => {
                    Completion::new(lease, Bytes::from_static(b"1"))
                }
                other => panic!("not acquired: {other:?}"),
            })
            .collect();
        for done in self
            .store
            .complete_many(&completions, RETENTION)
            .await
            .unwrap()
        {
            done.unwrap();
        }
    }

    /// The requests of the batch from `first`.
    fn batch_requests(&self, first: usize) -> Vec<AcquireRequest> {
        (first..first + BATCH).map(|i| self.request(i)).collect()
    }

    /// The executor, for the batch of [`BATCH`] new messages from `first`.
    async fn exec_batch(&self, first: usize) {
        let results = self
            .exec
            .run_batch(&self.msgs[first..first + BATCH], |_, _| async {
                Ok::<_, HandlerError>(black_box(1u64))
            })
            .await
            .unwrap();
        for r in results {
            assert!(matches!(r, Ok(Outcome::Executed(1))));
        }
    }

    /// The acquire request of message `i`, built beforehand by the raw baselines.
    fn request(&self, i: usize) -> AcquireRequest {
        AcquireRequest::new(self.keys[i].clone(), "bench")
            .with_fingerprint(self.fingerprints[i])
            .with_lease_ttl(Duration::from_secs(30))
            .with_max_attempts(5)
    }

    /// Raw store calls for a new message: acquire + complete.
    async fn raw_new(&self, req: AcquireRequest) {
        let AcquireOutcome::Acquired { lease, .. } = self.store.acquire(&req).await.unwrap() else {
            panic!("not acquired")
        };
        self.store
            .complete(&lease, Bytes::from_static(b"1"), RETENTION)
            .await
            .unwrap();
    }

    /// A hand-written consumer, for a new message.
    async fn by_hand(&self, i: usize, yielding: bool) {
        let m = &self.msgs[i];
        let id = std::str::from_utf8(m.header("idempotency-key").unwrap()).unwrap();
        let key = self.exec.namespace().key(id).unwrap();
        let req = AcquireRequest::new(key, "bench")
            .with_fingerprint(Fingerprint::of(m.payload()))
            .with_lease_ttl(Duration::from_secs(30))
            .with_max_attempts(5);
        let AcquireOutcome::Acquired { lease, .. } = self.store.acquire(&req).await.unwrap() else {
            panic!("not acquired")
        };
        if yielding {
            tokio::task::yield_now().await;
        }
        let result = serde_json::to_vec(&black_box(1u64)).unwrap();
        self.store
            .complete(&lease, Bytes::from(result), RETENTION)
            .await
            .unwrap();
    }

    /// The executor, for a new message.
    async fn exec_new(&self, i: usize, yielding: bool) {
        let r = self
            .exec
            .run(&self.msgs[i], |_| async move {
                if yielding {
                    tokio::task::yield_now().await;
                }
                Ok::<_, HandlerError>(black_box(1u64))
            })
            .await
            .unwrap();
        assert!(matches!(r, Outcome::Executed(1)));
    }

    /// The transactional executor, for a new message: the handler returns its result and one
    /// write, committed with the completion.
    async fn tx_new(&self, i: usize) {
        let key = &self.effect_keys[i];
        let r = self
            .tx_exec
            .run(&self.msgs[i], |_| async move {
                let writes = MemoryWrites::new().put(key.as_str(), Bytes::from_static(b"paid"));
                Ok::<_, HandlerError>(Commit::new(black_box(1u64), writes))
            })
            .await
            .unwrap();
        assert!(matches!(r, Outcome::Executed(1)));
    }

    /// The transactional executor, for a duplicate.
    async fn tx_duplicate(&self, i: usize) {
        let r = self
            .tx_exec
            .run(&self.msgs[i], |_| async {
                Ok::<_, HandlerError>(Commit::new(2u64, MemoryWrites::new()))
            })
            .await
            .unwrap();
        assert!(matches!(r, Outcome::Replayed(1)));
    }

    /// Raw store call for a duplicate: the acquire answering `Replayed`.
    async fn raw_duplicate(&self, req: AcquireRequest) {
        let r = self.store.acquire(&req).await.unwrap();
        assert!(matches!(r, AcquireOutcome::Replayed { .. }));
    }

    /// The executor, for a duplicate.
    async fn exec_duplicate(&self, i: usize) {
        let r = self
            .exec
            .run(&self.msgs[i], |_| async { Ok::<_, HandlerError>(2u64) })
            .await
            .unwrap();
        assert!(matches!(r, Outcome::Replayed(1)));
    }

    /// Completes every key of both executors, for the duplicate cases; the clock must stay
    /// still afterwards.
    fn complete_all(&self) {
        self.clock.advance(Duration::from_secs(1));
        self.rt.block_on(async {
            for (i, m) in self.msgs.iter().enumerate() {
                self.exec
                    .run(m, |_| async { Ok::<_, HandlerError>(1u64) })
                    .await
                    .unwrap();
                self.tx_new(i).await;
            }
        });
    }
}

fn bench(c: &mut Criterion) {
    let f = &fixture();
    let mut group = c.benchmark_group("per_message");
    group.throughput(Throughput::Elements(1));
    group.measurement_time(Duration::from_secs(4));

    group.bench_function("raw_store/acquire_complete", |b| {
        b.iter_custom(|iters| f.measure(iters, true, &|i| f.raw_new(f.request(i))))
    });
    group.bench_function("raw_store/by_hand", |b| {
        b.iter_custom(|iters| f.measure(iters, true, &|i| f.by_hand(i, false)))
    });
    // The executor around a handler that returns at once.
    group.bench_function("executor/run_trivial", |b| {
        b.iter_custom(|iters| f.measure(iters, true, &|i| f.exec_new(i, false)))
    });
    // A handler that yields once (a yield on a current-thread runtime makes the scheduler poll
    // its drivers): the executor registers the lease with its heartbeat task.
    group.bench_function("raw_store/by_hand_yielding", |b| {
        b.iter_custom(|iters| f.measure(iters, true, &|i| f.by_hand(i, true)))
    });
    group.bench_function("executor/run_yielding", |b| {
        b.iter_custom(|iters| f.measure(iters, true, &|i| f.exec_new(i, true)))
    });
    // The transactional path: result + one write, committed with `complete_with`.
    group.bench_function("transactional/run_one_write", |b| {
        b.iter_custom(|iters| f.measure(iters, true, &|i| f.tx_new(i)))
    });

    group.throughput(Throughput::Elements(BATCH as u64));
    group.bench_function("raw_store/acquire_many_complete_many", |b| {
        b.iter_custom(|iters| f.measure_batches(iters, &|i| f.raw_batch(f.batch_requests(i))))
    });
    group.bench_function("executor/run_batch", |b| {
        b.iter_custom(|iters| f.measure_batches(iters, &|i| f.exec_batch(i)))
    });
    group.throughput(Throughput::Elements(1));

    // Duplicates: raw acquire answering Replayed, vs the executor decoding the replay.
    f.complete_all();
    group.bench_function("raw_store/acquire_replayed", |b| {
        b.iter_custom(|iters| f.measure(iters, false, &|i| f.raw_duplicate(f.request(i))))
    });
    group.bench_function("executor/run_replayed", |b| {
        b.iter_custom(|iters| f.measure(iters, false, &|i| f.exec_duplicate(i)))
    });
    group.bench_function("transactional/run_replayed", |b| {
        b.iter_custom(|iters| f.measure(iters, false, &|i| f.tx_duplicate(i)))
    });
    group.finish();
}

/// Per-message times of alternating rounds of `base` and `exec`: their medians.
fn alternate<B, BF, E, EF>(f: &Fixture, rounds: usize, fresh: bool, base: B, exec: E) -> (f64, f64)
where
    B: Fn(usize) -> BF,
    BF: Future<Output = ()>,
    E: Fn(usize) -> EF,
    EF: Future<Output = ()>,
{
    let per_message = |d: Duration| d.as_nanos() as f64 / KEYS as f64;
    // One round of each to warm up.
    f.measure(KEYS as u64, fresh, &base);
    f.measure(KEYS as u64, fresh, &exec);
    let (mut bases, mut execs) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        bases.push(per_message(f.measure(KEYS as u64, fresh, &base)));
        execs.push(per_message(f.measure(KEYS as u64, fresh, &exec)));
    }
    (median(bases), median(execs))
}

/// [`alternate`] for batches: per-message times of alternating rounds of `base` and `exec`
/// over every batch of [`BATCH`] messages in the keys, their medians.
fn alternate_batches<B, BF, E, EF>(f: &Fixture, rounds: usize, base: B, exec: E) -> (f64, f64)
where
    B: Fn(usize) -> BF,
    BF: Future<Output = ()>,
    E: Fn(usize) -> EF,
    EF: Future<Output = ()>,
{
    let batches = (KEYS / BATCH) as u64;
    let per_message = |d: Duration| d.as_nanos() as f64 / (batches as usize * BATCH) as f64;
    f.measure_batches(batches, &base);
    f.measure_batches(batches, &exec);
    let (mut bases, mut execs) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        bases.push(per_message(f.measure_batches(batches, &base)));
        execs.push(per_message(f.measure_batches(batches, &exec)));
    }
    (median(bases), median(execs))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The raw store calls and the executor in one run, and the overhead per message.
fn summary() {
    // `cargo test --benches` runs this binary with `--test`: one round is enough there.
    let rounds = if std::env::args().any(|a| a == "--test") {
        1
    } else {
        31
    };
    let f = &fixture();
    let new = alternate(
        f,
        rounds,
        true,
        |i| f.raw_new(f.request(i)),
        |i| f.exec_new(i, false),
    );
    let by_hand = alternate(
        f,
        rounds,
        true,
        |i| f.by_hand(i, false),
        |i| f.exec_new(i, false),
    );
    let batch = alternate_batches(
        f,
        rounds,
        |i| f.raw_batch(f.batch_requests(i)),
        |i| f.exec_batch(i),
    );
    let transactional = alternate(f, rounds, true, |i| f.exec_new(i, false), |i| f.tx_new(i));
    f.complete_all();
    let duplicate = alternate(
        f,
        rounds,
        false,
        |i| f.raw_duplicate(f.request(i)),
        |i| f.exec_duplicate(i),
    );
    let tx_duplicate = alternate(
        f,
        rounds,
        false,
        |i| f.exec_duplicate(i),
        |i| f.tx_duplicate(i),
    );

    println!();
    println!(
        "summary: per message on MemoryStore (medians of {rounds} alternating rounds of {KEYS} messages)"
    );
    println!(
        "  {:<46} {:>10} {:>10} {:>10}",
        "", "baseline", "executor", "overhead"
    );
    let row = |case: &str, (base, exec): (f64, f64), target: bool| {
        let overhead = exec - base;
        let verdict = match (target, overhead <= TARGET_NS) {
            (false, _) => "",
            (true, true) => "target <= 1 µs: met",
            (true, false) => "target <= 1 µs: MISSED",
        };
        println!("  {case:<46} {base:>7.0} ns {exec:>7.0} ns {overhead:>7.0} ns  {verdict}");
    };
    row("new message: raw store calls (acquire+complete)", new, true);
    row(
        "duplicate: raw store call (acquire: Replayed)",
        duplicate,
        true,
    );
    row(
        "new message: by hand (+ key, SHA-256, JSON)",
        by_hand,
        false,
    );
    row(
        "batch of 100 new: acquire_many + complete_many",
        batch,
        false,
    );

    println!();
    println!("transactional vs plain path, same run (medians of {rounds} alternating rounds)");
    println!("  {:<46} {:>10} {:>10} {:>10}", "", "plain", "tx", "extra");
    let tx_row = |case: &str, (plain, tx): (f64, f64)| {
        let rate = |ns: f64| 1e9 / ns / 1000.0;
        println!(
            "  {case:<46} {plain:>7.0} ns {tx:>7.0} ns {:>7.0} ns  ({:.0}k vs {:.0}k msg/s on one thread)",
            tx - plain,
            rate(plain),
            rate(tx)
        );
    };
    tx_row(
        "new message (tx: result + 1 write, complete_with)",
        transactional,
    );
    tx_row("duplicate (acquire: Replayed)", tx_duplicate);
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    bench(&mut criterion);
    criterion.final_summary();
    summary();
}
