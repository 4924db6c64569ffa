//! Differential model tests: random histories run against a real store and against the
//! reference state machine ([`idem_core::machine`]), comparing every outcome and every `get`.
//!
//! A history is a list of [`Step`]s over a few keys of a fresh namespace: acquires (alone or in
//! `acquire_many` batches) by several owners with mixed fingerprints, 1 to 3 attempts and short
//! or long leases; `extend`, `complete`, `fail` and `release` on any lease acquired earlier in
//! the history (live, stale or finished); `get`, `delete`; and waits that let every short lease
//! expire. The model is a map of
//! [`Record`]s driven by the `machine` functions, the same ones [`MemoryStore`](idem_core::MemoryStore)
//! runs under its lock.
//!
//! What is compared, step by step: the acquire outcome (variant, attempt, takeover, owner,
//! replayed bytes, stored error and kind, exhausted count), the answer of every fenced
//! transition (`Ok`, or `LeaseLost` and why: superseded by which token, not in progress in which
//! state, or gone), `delete`'s answer, and every `get` (state, result or error, fingerprint,
//! token, owner, attempts, and whether a lease end and a retention deadline are set). Stores
//! number their tokens as they like, so tokens are compared through the pairing that each
//! acquisition makes between the store's new token and the model's; a store's tokens must also
//! rise for each key. Times are not compared, except that a busy key's `retry_after` is at most
//! the lease asked for.
//!
//! **Time.** With [`TimeControl::Manual`] the store and the model read the same clock and a wait
//! advances it. With [`TimeControl::Real`] (a server's clock) the model reads the system clock
//! before and after each call, and a wait sleeps past the short lease. The store decided at some
//! instant in between, so when a lease ends within that window (widened by the uncertainty of
//! when the store started that lease, and by the slack) both answers, live and expired, are
//! legitimate: the model takes the branch the store took. Anywhere else the model decides alone.
//!
//! **Failures.** [`check`] runs the histories with proptest on several threads, each history in
//! a namespace of its own, and panics on the first divergence with the shortest failing history
//! proptest's shrinking found, one numbered step per line, and what differed. [`run`] returns
//! the same as a value, for tests that expect a store to fail.
//!
//! ```no_run
//! # async fn demo(store: idem_core::DynStore) {
//! use idem_conformance::model::{self, ModelConfig};
//! // 500 histories (IDEM_MODEL_HISTORIES raises it), on a server's clock.
//! model::check(store, ModelConfig::real_time()).await;
//! # }
//! ```

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use idem_core::machine::{self, AcquireDecision, Finish, Finished};
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, DynStore, Error, FailureKind, FencingToken, Fingerprint,
    IdempotencyKey, Lease, LostLease, ManualClock, Namespace, Record, RecordState,
};
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, RngAlgorithm, TestError, TestRng, TestRunner};

use crate::TimeControl;

/// Default number of histories per [`check`]; `IDEM_MODEL_HISTORIES` overrides it.
pub const DEFAULT_HISTORIES: u32 = 500;

/// The retention of every finished record: long, so no record expires during a history.
const RETENTION: Duration = Duration::from_secs(3600);

const OWNERS: [&str; 3] = ["owner-1", "owner-2", "owner-3"];
const KEYS: [&str; 3] = ["a", "b", "it's {a}:b* %\n€"];
const RESULTS: [&[u8]; 3] = [b"", b"ok", b"\x00\xff\x01 binary"];
/// How far back a step may pick a lease.
const LEASE_PICKS: usize = 6;
const ERRORS: [&str; 3] = ["", "boom", "é ☃ 𝄞"];

/// How a model run goes: how many histories, how long, on which clock.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ModelConfig {
    /// Histories to run.
    pub histories: u32,
    /// Histories run at once (each on a thread of its own, in a namespace of its own).
    pub threads: usize,
    /// Most steps in one history.
    pub max_steps: usize,
    /// The short lease: a [`Step::Wait`] lets it expire.
    pub short_lease: Duration,
    /// The long lease: it never expires during a history.
    pub long_lease: Duration,
    /// The store's clock: manual (waits advance it) or real (waits sleep).
    pub time: TimeControl,
    /// The seed of the first thread's generator (the others add their index); random if `None`.
    /// `IDEM_MODEL_SEED` sets it.
    pub seed: Option<u64>,
}

impl ModelConfig {
    /// For a store on a server's clock: 100 ms short leases, waits of 150 ms.
    pub fn real_time() -> Self {
        Self {
            histories: env_u32("IDEM_MODEL_HISTORIES").unwrap_or(DEFAULT_HISTORIES),
            threads: 8,
            max_steps: 24,
            short_lease: Duration::from_millis(100),
            long_lease: Duration::from_secs(60),
            time: TimeControl::Real {
                slack: Duration::from_millis(50),
            },
            seed: env_u64("IDEM_MODEL_SEED"),
        }
    }

    /// For a store on `clock` (shared with the model): waits advance it, nothing sleeps.
    pub fn manual_time(clock: Arc<ManualClock>) -> Self {
        Self {
            time: TimeControl::Manual(clock),
            ..Self::real_time()
        }
    }

    /// Sets the number of histories.
    pub fn with_histories(mut self, histories: u32) -> Self {
        self.histories = histories;
        self
    }

    /// Sets how many histories run at once.
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }

    /// Sets the seed.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }
}

fn env_u32(var: &str) -> Option<u32> {
    env_u64(var).map(|n| {
        u32::try_from(n).unwrap_or_else(|_| panic!("{var}={n} is larger than {}", u32::MAX))
    })
}

fn env_u64(var: &str) -> Option<u64> {
    let value = std::env::var(var).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{var}={value:?} is not a whole number")),
    )
}

/// One step of a history. Keys, owners, fingerprints, results and errors are indexes into small
/// fixed sets, so that histories collide on purpose; leases are picked among those acquired
/// earlier in the history (a step that names a lease before any was acquired does nothing).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Step {
    /// `acquire` of key `key` by owner `owner`.
    Acquire {
        /// Which key.
        key: usize,
        /// Which owner.
        owner: usize,
        /// Which fingerprint (`None`: the caller opted out).
        fingerprint: Option<u8>,
        /// The request's maximum attempts (1 to 3).
        max_attempts: u32,
        /// A short lease (one wait expires it) rather than a long one.
        short: bool,
    },
    /// `extend` of a lease acquired earlier.
    Extend {
        /// Which lease, counted back from the latest (0: the latest).
        lease: usize,
        /// To the short lease length rather than the long one.
        short: bool,
    },
    /// `complete` of a lease acquired earlier.
    Complete {
        /// Which lease, counted back from the latest (0: the latest).
        lease: usize,
        /// Which result.
        result: usize,
    },
    /// `fail` of a lease acquired earlier.
    Fail {
        /// Which lease, counted back from the latest (0: the latest).
        lease: usize,
        /// Which error text.
        error: usize,
        /// Which kind (an index into [`FailureKind::ALL`]).
        kind: usize,
    },
    /// `release` of a lease acquired earlier.
    Release {
        /// Which lease, counted back from the latest (0: the latest).
        lease: usize,
    },
    /// `get` of a key.
    Get {
        /// Which key.
        key: usize,
    },
    /// `delete` of a key.
    Delete {
        /// Which key.
        key: usize,
    },
    /// `acquire_many` of these [`Step::Acquire`]s, in order (other steps in it are skipped).
    AcquireMany(Vec<Step>),
    /// Let every short lease expire.
    Wait,
}

/// A history: the steps run in order on one fresh namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct History(pub Vec<Step>);

impl fmt::Display for History {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, step) in self.0.iter().enumerate() {
            write!(f, "  {i:>2}. ")?;
            match step {
                Step::Acquire {
                    key,
                    owner,
                    fingerprint,
                    max_attempts,
                    short,
                } => write!(
                    f,
                    "acquire key {:?} by {} fingerprint {} max_attempts {max_attempts} lease {}",
                    KEYS[*key],
                    OWNERS[*owner],
                    fingerprint.map_or("none".to_owned(), |fp| format!("#{fp}")),
                    if *short { "short" } else { "long" },
                )?,
                Step::Extend { lease, short } => write!(
                    f,
                    "extend lease {} by the {} length",
                    show_index(lease),
                    if *short { "short" } else { "long" }
                )?,
                Step::Complete { lease, result } => write!(
                    f,
                    "complete lease {} with {:?}",
                    show_index(lease),
                    Bytes::from_static(RESULTS[*result])
                )?,
                Step::Fail { lease, error, kind } => write!(
                    f,
                    "fail lease {} with {:?} ({})",
                    show_index(lease),
                    ERRORS[*error],
                    FailureKind::ALL[*kind]
                )?,
                Step::Release { lease } => write!(f, "release lease {}", show_index(lease))?,
                Step::Get { key } => write!(f, "get key {:?}", KEYS[*key])?,
                Step::Delete { key } => write!(f, "delete key {:?}", KEYS[*key])?,
                Step::Wait => f.write_str("wait until every short lease expired")?,
                Step::AcquireMany(items) => {
                    f.write_str("acquire_many [")?;
                    for (j, item) in items.iter().enumerate() {
                        if let Step::Acquire {
                            key,
                            owner,
                            fingerprint,
                            max_attempts,
                            short,
                        } = item
                        {
                            write!(
                                f,
                                "{}key {:?} by {} fingerprint {} max_attempts {max_attempts} lease {}",
                                if j > 0 { "; " } else { "" },
                                KEYS[*key],
                                OWNERS[*owner],
                                fingerprint.map_or("none".to_owned(), |fp| format!("#{fp}")),
                                if *short { "short" } else { "long" },
                            )?;
                        }
                    }
                    f.write_str("]")?;
                }
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

fn show_index(back: &usize) -> String {
    match back {
        0 => "latest".to_owned(),
        n => format!("latest-{n}"),
    }
}

/// The proptest strategy of one [`Step::Acquire`].
fn acquire_step() -> impl Strategy<Value = Step> {
    (
        0..KEYS.len(),
        0..OWNERS.len(),
        prop_oneof![2 => Just(Some(0u8)), 1 => Just(Some(1u8)), 1 => Just(None)],
        1..=3u32,
        any::<bool>(),
    )
        .prop_map(
            |(key, owner, fingerprint, max_attempts, short)| Step::Acquire {
                key,
                owner,
                fingerprint,
                max_attempts,
                short,
            },
        )
}

/// The proptest strategy of one step.
pub fn step() -> impl Strategy<Value = Step> {
    let key = 0..KEYS.len();
    prop_oneof![
        5 => acquire_step(),
        1 => proptest::collection::vec(acquire_step(), 1..=3).prop_map(Step::AcquireMany),
        1 => (0..LEASE_PICKS, any::<bool>()).prop_map(|(lease, short)| Step::Extend { lease, short }),
        2 => (0..LEASE_PICKS, 0..RESULTS.len())
            .prop_map(|(lease, result)| Step::Complete { lease, result }),
        2 => (0..LEASE_PICKS, 0..ERRORS.len(), 0..FailureKind::ALL.len())
            .prop_map(|(lease, error, kind)| Step::Fail { lease, error, kind }),
        1 => (0..LEASE_PICKS).prop_map(|lease| Step::Release { lease }),
        2 => key.clone().prop_map(|key| Step::Get { key }),
        1 => key.prop_map(|key| Step::Delete { key }),
        1 => Just(Step::Wait),
    ]
}

/// The proptest strategy of a history of 1 to `max_steps` steps.
pub fn history(max_steps: usize) -> impl Strategy<Value = History> {
    proptest::collection::vec(step(), 1..=max_steps.max(1)).prop_map(History)
}

/// What a model run did.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Report {
    /// The store's name.
    pub store: &'static str,
    /// Histories run to the end (shrinking runs included).
    pub histories: u64,
    /// Steps run.
    pub steps: u64,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// The first divergence, if any.
    pub divergence: Option<Divergence>,
}

/// A history on which the store and the model disagreed.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Divergence {
    /// The shortest failing history proptest found.
    pub history: History,
    /// Step by step, what the shortest history did, and what differed.
    pub reason: String,
    /// How many histories had run to the end (without diverging) before the first failing one
    /// started, over all threads.
    pub histories_before: u64,
}

impl fmt::Display for Divergence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the store diverged from the model. Shortest failing history ({} steps):\n{}\n{}",
            self.history.0.len(),
            self.history,
            self.reason
        )
    }
}

/// Runs `config.histories` random histories against `store` and the model, and panics on the
/// first divergence, naming the shortest failing history. Prints one line with the counts and
/// the time taken.
///
/// # Panics
/// On a divergence, or when the store answers an error the model never gives (`Unavailable`,
/// `CorruptRecord`, ...).
pub async fn check(store: DynStore, config: ModelConfig) -> Report {
    let report = run(store, config).await;
    if let Some(divergence) = &report.divergence {
        panic!("{}: {divergence}", report.store);
    }
    report
}

/// Like [`check`], but returns the divergence in the report instead of panicking.
pub async fn run(store: DynStore, config: ModelConfig) -> Report {
    let started = Instant::now();
    let name = store.name();
    let shared = Arc::new(Shared {
        store,
        config: config.clone(),
        stop: AtomicBool::new(false),
        histories: AtomicU64::new(0),
        steps: AtomicU64::new(0),
        first_failure: AtomicU64::new(u64::MAX),
    });
    let seed = config.seed.unwrap_or_else(rand::random);
    let threads = config.threads.max(1);
    let handle = tokio::runtime::Handle::current();
    let mut tasks = Vec::new();
    for t in 0..threads {
        let cases = config.histories / threads as u32
            + u32::from((t as u32) < config.histories % threads as u32);
        if cases == 0 {
            continue;
        }
        let shared = shared.clone();
        let handle = handle.clone();
        let thread_seed = seed.wrapping_add(t as u64);
        tasks.push(tokio::task::spawn_blocking(move || {
            run_thread(&shared, &handle, cases, thread_seed)
        }));
    }
    // Of the failures the threads found, the shortest.
    let mut divergence: Option<Divergence> = None;
    for task in tasks {
        let found = task.await.expect("a model thread panicked");
        if let Some(found) = found
            && divergence
                .as_ref()
                .is_none_or(|d| found.history.0.len() < d.history.0.len())
        {
            divergence = Some(found);
        }
    }
    let report = Report {
        store: name,
        histories: shared.histories.load(Ordering::SeqCst),
        steps: shared.steps.load(Ordering::SeqCst),
        elapsed: started.elapsed(),
        divergence,
    };
    eprintln!(
        "model: {} store: {} histories ({} steps), {} in {:.1} s (seed {seed}; set IDEM_MODEL_SEED to repeat)",
        report.store,
        report.histories,
        report.steps,
        if report.divergence.is_some() {
            "a divergence"
        } else {
            "0 divergences"
        },
        report.elapsed.as_secs_f64()
    );
    report
}

struct Shared {
    store: DynStore,
    config: ModelConfig,
    stop: AtomicBool,
    histories: AtomicU64,
    steps: AtomicU64,
    first_failure: AtomicU64,
}

fn run_thread(
    shared: &Shared,
    handle: &tokio::runtime::Handle,
    cases: u32,
    seed: u64,
) -> Option<Divergence> {
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes);
    let runner_config = RunnerConfig {
        cases,
        failure_persistence: None,
        max_shrink_iters: 4096,
        ..RunnerConfig::default()
    };
    let mut runner = TestRunner::new_with_rng(runner_config, rng);
    // Once a history of this thread failed, the runner shrinks it: those runs go on even when
    // another thread stopped the others.
    let shrinking = std::cell::Cell::new(false);
    let result = runner.run(&history(shared.config.max_steps), |history| {
        if shared.stop.load(Ordering::SeqCst) && !shrinking.get() {
            return Ok(());
        }
        let outcome = handle.block_on(run_history(shared, &history));
        shared
            .steps
            .fetch_add(history.0.len() as u64, Ordering::SeqCst);
        let done = shared.histories.fetch_add(1, Ordering::SeqCst);
        match outcome {
            Ok(()) => Ok(()),
            Err(reason) => {
                if !shrinking.replace(true) {
                    shared.first_failure.fetch_min(done, Ordering::SeqCst);
                    shared.stop.store(true, Ordering::SeqCst);
                }
                Err(TestCaseError::fail(reason))
            }
        }
    });
    if result.is_err() {
        shared.stop.store(true, Ordering::SeqCst);
    }
    match result {
        Ok(()) => None,
        Err(TestError::Fail(reason, history)) => Some(Divergence {
            history,
            reason: reason.message().to_owned(),
            histories_before: shared.first_failure.load(Ordering::SeqCst),
        }),
        Err(TestError::Abort(reason)) => Some(Divergence {
            history: History(Vec::new()),
            reason: format!("proptest aborted: {reason}"),
            histories_before: shared.first_failure.load(Ordering::SeqCst),
        }),
    }
}

/// The model's side of one key's lease: when it ends on the model's clock, and how much later
/// it may end on the store's (the store started it at some instant during the call).
#[derive(Clone, Copy, Debug)]
struct Uncertainty(Duration);

/// One history's run: the store, the model, the leases acquired so far (the store's and the
/// model's), and the token pairing.
struct Run<'a> {
    shared: &'a Shared,
    keys: Vec<IdempotencyKey>,
    model: HashMap<IdempotencyKey, Record>,
    uncertainty: HashMap<IdempotencyKey, Uncertainty>,
    model_tokens: u64,
    leases: Vec<(Lease, Lease)>,
    /// (key, store token) -> model token.
    tokens: HashMap<(IdempotencyKey, FencingToken), FencingToken>,
    /// Highest store token seen per key.
    highest: HashMap<IdempotencyKey, FencingToken>,
    log: Vec<String>,
}

async fn run_history(shared: &Shared, history: &History) -> Result<(), String> {
    let ns = Namespace::new(format!("model-{}", uuid::Uuid::new_v4().simple()))
        .expect("a generated namespace is valid");
    let keys = KEYS
        .iter()
        .map(|id| ns.key(id).expect("model keys are valid"))
        .collect();
    let mut run = Run {
        shared,
        keys,
        model: HashMap::new(),
        uncertainty: HashMap::new(),
        model_tokens: 0,
        leases: Vec::new(),
        tokens: HashMap::new(),
        highest: HashMap::new(),
        log: Vec::new(),
    };
    for (i, step) in history.0.iter().enumerate() {
        let len = run.log.len();
        if let Err(why) = run.step(step).await {
            run.log.truncate(len);
            run.log.push(format!("  {i:>2}. DIVERGED: {why}"));
            return Err(format!(
                "namespace {ns}; what each step answered (store = model unless said):\n{}",
                run.log.join("\n")
            ));
        }
        let line = run.log.pop().unwrap_or_default();
        run.log.push(format!("  {i:>2}. {line}"));
    }
    // Every key's final record must match as well.
    for k in 0..KEYS.len() {
        let len = run.log.len();
        if let Err(why) = run.step(&Step::Get { key: k }).await {
            run.log.truncate(len);
            run.log.push(format!("  end. DIVERGED: {why}"));
            return Err(format!(
                "namespace {ns}; what each step answered (store = model unless said), then the \
                 final get of every key:\n{}",
                run.log.join("\n")
            ));
        }
        run.log.pop();
    }
    Ok(())
}

/// The clock readings around one store call.
#[derive(Clone, Copy, Debug)]
struct Window {
    before: SystemTime,
    after: SystemTime,
}

impl Run<'_> {
    fn config(&self) -> &ModelConfig {
        &self.shared.config
    }

    fn now(&self) -> SystemTime {
        match &self.config().time {
            TimeControl::Manual(clock) => idem_core::Clock::now(&**clock),
            TimeControl::Real { .. } => SystemTime::now(),
        }
    }

    fn slack(&self) -> Duration {
        match &self.config().time {
            TimeControl::Manual(_) => Duration::ZERO,
            TimeControl::Real { slack } => *slack,
        }
    }

    fn ttl(&self, short: bool) -> Duration {
        if short {
            self.config().short_lease
        } else {
            self.config().long_lease
        }
    }

    /// The request of a [`Step::Acquire`].
    fn request(&self, step: &Step) -> Option<AcquireRequest> {
        let Step::Acquire {
            key,
            owner,
            fingerprint,
            max_attempts,
            short,
        } = step
        else {
            return None;
        };
        Some(
            AcquireRequest::new(self.keys[*key].clone(), OWNERS[*owner])
                .with_fingerprint(fingerprint.map(|fp| Fingerprint::of([fp])))
                .with_max_attempts(*max_attempts)
                .with_lease_ttl(self.ttl(*short)),
        )
    }

    /// The lease `back` places before the latest (wrapping around when fewer were acquired).
    fn pick(&self, back: usize) -> Option<usize> {
        let n = self.leases.len();
        (n > 0).then(|| n - 1 - back % n)
    }

    async fn step(&mut self, step: &Step) -> Result<(), String> {
        let store = self.shared.store.clone();
        match step {
            Step::Acquire { .. } => {
                let Some(req) = self.request(step) else {
                    return Ok(());
                };
                let before = self.now();
                let got = store.acquire(&req).await;
                let window = Window {
                    before,
                    after: self.now(),
                };
                let got = got.map_err(|e| format!("acquire answered an error: {e}"))?;
                self.acquire(&req, got, window)
            }
            Step::AcquireMany(items) => {
                let reqs: Vec<AcquireRequest> =
                    items.iter().filter_map(|item| self.request(item)).collect();
                let before = self.now();
                let got = store.acquire_many(&reqs).await;
                let window = Window {
                    before,
                    after: self.now(),
                };
                let got = got.map_err(|e| format!("acquire_many answered an error: {e}"))?;
                if got.len() != reqs.len() {
                    return Err(format!(
                        "acquire_many answered {} results for {} requests",
                        got.len(),
                        reqs.len()
                    ));
                }
                let start = self.log.len();
                for (j, (req, got)) in reqs.iter().zip(got).enumerate() {
                    let got = got.map_err(|e| format!("acquire_many item {j}: an error: {e}"))?;
                    self.acquire(req, got, window)
                        .map_err(|why| format!("acquire_many item {j}: {why}"))?;
                }
                let lines = self.log.split_off(start);
                self.log.push(format!("acquire_many: {}", lines.join("; ")));
                Ok(())
            }
            Step::Extend { lease, short } => {
                let Some(i) = self.pick(*lease) else {
                    self.log.push("extend: no lease yet".into());
                    return Ok(());
                };
                let ttl = self.ttl(*short);
                let (real, model) = self.leases[i].clone();
                let before = self.now();
                let got = store.extend(&real, ttl).await;
                let after = self.now();
                let expected = machine::check_fence(self.model.get_mut(&model.key), &model, before)
                    .map(|record| {
                        let lease = machine::extend(record, &model, ttl, before);
                        (lease, record.token)
                    });
                let got_text = self.show_result(&real.key, got.as_ref().map(|_| ()));
                let want_text = self.show_model(expected.as_ref().map(|_| ()));
                self.log.push(format!(
                    "extend lease {i} ({}) by {ttl:?}: {got_text}",
                    lease_text(&real)
                ));
                if got_text != want_text {
                    return Err(format!("extend: store {got_text}, model {want_text}"));
                }
                if let (Ok(new_real), Ok((new_model, _))) = (got, expected) {
                    self.uncertainty.insert(
                        model.key.clone(),
                        Uncertainty(after.duration_since(before).unwrap_or_default()),
                    );
                    self.leases[i] = (new_real, new_model);
                }
                Ok(())
            }
            Step::Complete { lease, result } => {
                let result = Bytes::from_static(RESULTS[*result]);
                self.finish(
                    *lease,
                    "complete",
                    |store, lease| {
                        let result = result.clone();
                        Box::pin(async move { store.complete(&lease, result, RETENTION).await })
                    },
                    Finish::Complete {
                        result: &result,
                        retention: RETENTION,
                    },
                )
                .await
            }
            Step::Fail { lease, error, kind } => {
                let error = ERRORS[*error];
                let kind = FailureKind::ALL[*kind];
                self.finish(
                    *lease,
                    "fail",
                    move |store, lease| {
                        Box::pin(async move { store.fail(&lease, error, kind, RETENTION).await })
                    },
                    Finish::Fail {
                        error,
                        kind,
                        retention: RETENTION,
                    },
                )
                .await
            }
            Step::Release { lease } => {
                self.finish(
                    *lease,
                    "release",
                    |store, lease| Box::pin(async move { store.release(&lease).await }),
                    Finish::Release,
                )
                .await
            }
            Step::Get { key } => {
                let key = self.keys[*key].clone();
                let got = store
                    .get(&key)
                    .await
                    .map_err(|e| format!("get answered an error: {e}"))?;
                let now = self.now();
                let want = self.model.get(&key).filter(|r| !r.is_expired(now)).cloned();
                let got_text = match &got {
                    Some(record) => self.show_record(record, true)?,
                    None => "none".to_owned(),
                };
                let want_text = match &want {
                    Some(record) => self.show_record(record, false)?,
                    None => "none".to_owned(),
                };
                self.log.push(format!("get {:?}: {got_text}", key.id()));
                if got_text != want_text {
                    return Err(format!(
                        "get {:?}: store {got_text}, model {want_text}",
                        key.id()
                    ));
                }
                Ok(())
            }
            Step::Delete { key } => {
                let key = self.keys[*key].clone();
                let got = store
                    .delete(&key)
                    .await
                    .map_err(|e| format!("delete answered an error: {e}"))?;
                let now = self.now();
                let want = self.model.remove(&key).is_some_and(|r| !r.is_expired(now));
                self.uncertainty.remove(&key);
                self.log.push(format!("delete {:?}: {got}", key.id()));
                if got != want {
                    return Err(format!("delete {:?}: store {got}, model {want}", key.id()));
                }
                Ok(())
            }
            Step::Wait => {
                match &self.config().time {
                    TimeControl::Manual(clock) => {
                        clock.advance(self.config().short_lease + Duration::from_millis(1));
                    }
                    TimeControl::Real { slack } => {
                        tokio::time::sleep(self.config().short_lease + *slack).await;
                    }
                }
                self.log.push("wait".into());
                Ok(())
            }
        }
    }

    fn acquire(
        &mut self,
        req: &AcquireRequest,
        got: AcquireOutcome,
        window: Window,
    ) -> Result<(), String> {
        let key = req.key.clone();
        let existing = self.model.get(&key).cloned();
        // The instants at which the model may decide: one, unless a lease ends within the window
        // of this call (then both "still live" and "expired" are legitimate).
        let mut candidates = vec![window.before];
        if let Some(record) = &existing
            && record.state == RecordState::InProgress
            && let Some(end) = record.lease_expires_at
        {
            let unc = self.uncertainty.get(&key).map_or(Duration::ZERO, |u| u.0);
            let slack = self.slack();
            let surely_live = end > window.after + slack;
            let surely_expired = end + unc + slack <= window.before;
            if surely_live {
                candidates = vec![window.before.min(end - Duration::from_micros(1))];
            } else if surely_expired {
                candidates = vec![window.before.max(end + unc)];
            } else {
                candidates = vec![end - Duration::from_micros(1), end + unc];
            }
        }
        let got_text = self.show_outcome(&got, req, true)?;
        let mut wanted = Vec::new();
        for now in candidates {
            let mut next = self.model_tokens;
            let decision = machine::acquire(existing.as_ref(), req, now, || {
                next += 1;
                FencingToken::new(next)
            });
            let want_text = self.show_outcome(decision.outcome(), req, false)?;
            if want_text == got_text {
                self.log.push(format!(
                    "acquire {:?} by {}: {got_text}",
                    key.id(),
                    req.owner
                ));
                return self.apply_acquire(decision, got, next, window);
            }
            wanted.push(want_text);
        }
        Err(format!(
            "acquire {:?} by {}: store {got_text}, model {}",
            key.id(),
            req.owner,
            wanted.join(" or ")
        ))
    }

    fn apply_acquire(
        &mut self,
        decision: AcquireDecision,
        got: AcquireOutcome,
        next_token: u64,
        window: Window,
    ) -> Result<(), String> {
        match decision {
            AcquireDecision::Write(mut record, AcquireOutcome::Acquired { mut lease, .. }) => {
                let AcquireOutcome::Acquired { lease: real, .. } = got else {
                    return Err("the store acquired where the model did not".into());
                };
                let key = real.key.clone();
                if let Some(high) = self.highest.get(&key)
                    && real.token <= *high
                {
                    return Err(format!(
                        "acquire issued token {} for {:?}, not above the key's earlier token {high}",
                        real.token,
                        key.id()
                    ));
                }
                self.highest.insert(key.clone(), real.token);
                self.model_tokens = next_token;
                self.tokens.insert((key.clone(), real.token), lease.token);
                // The model's lease ends where the store's may end at the earliest.
                let ttl = lease
                    .expires_at
                    .duration_since(record.updated_at)
                    .unwrap_or_default();
                lease.expires_at = window.before + ttl;
                record.lease_expires_at = Some(lease.expires_at);
                self.uncertainty.insert(
                    key.clone(),
                    Uncertainty(
                        window
                            .after
                            .duration_since(window.before)
                            .unwrap_or_default(),
                    ),
                );
                self.model.insert(key, record);
                self.leases.push((real, lease));
                Ok(())
            }
            AcquireDecision::Write(..) => Err("the model wrote without acquiring".into()),
            _ => Ok(()),
        }
    }

    async fn finish<F>(
        &mut self,
        index: usize,
        name: &str,
        call: F,
        how: Finish<'_>,
    ) -> Result<(), String>
    where
        F: FnOnce(DynStore, Lease) -> futures::future::BoxFuture<'static, idem_core::Result<()>>,
    {
        let Some(i) = self.pick(index) else {
            self.log.push(format!("{name}: no lease yet"));
            return Ok(());
        };
        let (real, model) = self.leases[i].clone();
        let before = self.now();
        let got = call(self.shared.store.clone(), real.clone()).await;
        let expected = machine::finish(self.model.get_mut(&model.key), &model, how, before);
        if matches!(expected, Ok(Finished::Applied)) && matches!(how, Finish::Release) {
            self.uncertainty.remove(&model.key);
        }
        let got_text = self.show_result(&real.key, got.as_ref().map(|_| ()));
        let want_text = self.show_model(expected.as_ref().map(|_| ()));
        self.log.push(format!(
            "{name} lease {i} ({}): {got_text}",
            lease_text(&real)
        ));
        if got_text != want_text {
            return Err(format!("{name}: store {got_text}, model {want_text}"));
        }
        Ok(())
    }

    /// A store token as the model's token it was paired with.
    fn model_token(&self, key: &IdempotencyKey, token: FencingToken) -> Result<u64, String> {
        self.tokens
            .get(&(key.clone(), token))
            .map(|t| t.get())
            .ok_or_else(|| {
                format!(
                    "the store showed token {token} for {:?}, which no acquire of it issued",
                    key.id()
                )
            })
    }

    fn show_result(&self, key: &IdempotencyKey, got: Result<(), &Error>) -> String {
        match got {
            Ok(()) => "ok".into(),
            Err(Error::LeaseLost { why, .. }) => match why {
                LostLease::Superseded { current } => match self.model_token(key, *current) {
                    Ok(t) => format!("lease lost: superseded by #{t}"),
                    Err(e) => format!("lease lost: superseded ({e})"),
                },
                other => format!("lease lost: {other}"),
            },
            Err(other) => format!("error: {other}"),
        }
    }

    fn show_model(&self, expected: Result<(), &Error>) -> String {
        match expected {
            Ok(()) => "ok".into(),
            Err(Error::LeaseLost { why, .. }) => match why {
                LostLease::Superseded { current } => {
                    format!("lease lost: superseded by #{}", current.get())
                }
                other => format!("lease lost: {other}"),
            },
            Err(other) => format!("error: {other}"),
        }
    }

    fn show_outcome(
        &self,
        outcome: &AcquireOutcome,
        req: &AcquireRequest,
        from_store: bool,
    ) -> Result<String, String> {
        Ok(match outcome {
            AcquireOutcome::Acquired { lease, takeover } => {
                if lease.owner != req.owner || lease.key != req.key {
                    return Err(format!(
                        "acquire returned a lease of another owner or key: {lease:?}"
                    ));
                }
                format!("acquired attempt {} takeover {takeover}", lease.attempt)
            }
            AcquireOutcome::InProgress { owner, retry_after } => {
                if from_store && *retry_after > self.config().long_lease {
                    return Err(format!(
                        "retry_after {retry_after:?} is longer than any lease asked for"
                    ));
                }
                format!("in progress by {owner}")
            }
            AcquireOutcome::Replayed { result } => format!("replayed {result:?}"),
            AcquireOutcome::Conflict => "conflict".into(),
            AcquireOutcome::Exhausted {
                attempts,
                last_error,
            } => format!("exhausted after {attempts}, last error {last_error:?}"),
            AcquireOutcome::Failed { error, kind } => format!("failed {kind}: {error:?}"),
            other => format!("{other:?}"),
        })
    }

    fn show_record(&self, record: &Record, from_store: bool) -> Result<String, String> {
        let token = if from_store {
            self.model_token(&record.key, record.token)?
        } else {
            record.token.get()
        };
        let state = match &record.state {
            RecordState::InProgress => "in_progress".to_owned(),
            RecordState::Released => "released".to_owned(),
            RecordState::Completed { result } => format!("completed {result:?}"),
            RecordState::Failed { error, kind } => format!("failed {kind}: {error:?}"),
            other => format!("{other:?}"),
        };
        Ok(format!(
            "{state}, token #{token}, owner {}, attempts {}, fingerprint {}, lease end {}, retention {}",
            record.owner,
            record.attempts,
            record
                .fingerprint
                .map_or("none".to_owned(), |f| f.to_hex()[..8].to_owned()),
            if record.lease_expires_at.is_some() {
                "set"
            } else {
                "none"
            },
            if record.expires_at.is_some() {
                "set"
            } else {
                "none"
            },
        ))
    }
}

fn lease_text(lease: &Lease) -> String {
    format!(
        "{:?} by {}, token {}, attempt {}",
        lease.key.id(),
        lease.owner,
        lease.token,
        lease.attempt
    )
}
