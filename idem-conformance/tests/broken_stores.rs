//! The suite can fail: stores with one deliberate bug each make the scenarios that guard that
//! rule fail, while the same store without the bug passes them.
//!
//! `FlawedStore` runs the reference state machine (`idem_core::machine`) with one rule broken.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::future::BoxFuture;
use idem_conformance::effects::{EffectProbe, c25_transactional_effects};
use idem_conformance::{Config, Harness, scenarios};
use idem_core::machine::{self, AcquireDecision, Finish};
use idem_core::{
    AcquireOutcome, AcquireRequest, Clock, Cursor, DynStore, FailureKind, FencingToken,
    IdempotencyKey, IdempotencyStore, Lease, ListQuery, ManualClock, MemoryStore, Page, Record,
    RecordState, Result, StateKind, SystemClock, TransactionalStore,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bug {
    /// No bug: the control.
    None,
    /// `complete` does not check the token.
    CompleteSkipsTokenCheck,
    /// `acquire` reads, yields, then writes: not atomic.
    NonAtomicAcquire,
    /// `acquire` ignores the fingerprint.
    IgnoresFingerprint,
    /// A takeover keeps the old token.
    TakeoverKeepsToken,
    /// A finishing transition re-sent after it took effect is refused (v1 Memory, PostgreSQL and
    /// DynamoDB did this).
    ReplayRefused,
    /// Any finishing transition with the record's token on a finished record answers `Ok`, even
    /// with other result bytes or another error.
    ReplayIgnoresArguments,
    /// An error text's NUL becomes U+FFFD instead of being refused (v1 PostgreSQL did this).
    ReplacesNul,
    /// Characters outside the Basic Multilingual Plane become U+FFFD (a 3-byte UTF-8 column).
    DropsAstralCharacters,
    /// A retryable failure outlives its retention at acquire: the next acquire counts on from
    /// its attempts instead of starting fresh (`get` still reads it absent).
    RetryableOutlivesRetention,
    /// `acquire_many` takes over keys whose lease is live (it judges leases on a stale clock).
    BatchSkipsBusyCheck,
    /// `acquire_many` decides every key first and writes afterwards: racing batches both win.
    NonAtomicBatch,
    /// `list` ignores the namespace.
    ListIgnoresNamespace,
    /// `list` ends after its first page.
    ListDropsCursor,
    /// A transactional completion applies the handler's writes before it checks the lease.
    EffectBeforeFence,
    /// A re-sent transactional completion applies the handler's writes again.
    EffectOnReplay,
    /// After a refused transition the store reads the record back to tell a replay from a stale
    /// call: a second round trip.
    ReadsAfterRefusal,
    /// `extend` answers the longer lease but does not store it: the record keeps its first
    /// expiry.
    ExtendNotStored,
}

#[derive(Debug)]
struct FlawedStore {
    bug: Bug,
    records: Mutex<HashMap<IdempotencyKey, Record>>,
    tokens: AtomicU64,
    clock: Arc<dyn Clock>,
    /// Round trips a server-backed store would make: one per call, plus the bugs' extra ones.
    requests: AtomicU64,
    /// What transactional completions wrote.
    effects: Mutex<HashMap<String, Bytes>>,
}

impl FlawedStore {
    fn new(bug: Bug, clock: Arc<dyn Clock>) -> Self {
        Self {
            bug,
            records: Mutex::default(),
            tokens: AtomicU64::new(0),
            clock,
            requests: AtomicU64::new(0),
            effects: Mutex::default(),
        }
    }

    fn request(&self) {
        self.requests.fetch_add(1, Ordering::SeqCst);
    }

    fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }

    fn decide(&self, existing: Option<&Record>, req: &AcquireRequest) -> AcquireDecision {
        let now = self.clock.now();
        let mut existing = existing.cloned();
        if self.bug == Bug::IgnoresFingerprint
            && let Some(r) = existing.as_mut()
        {
            r.fingerprint = None;
        }
        if self.bug == Bug::RetryableOutlivesRetention
            && let Some(r) = existing.as_mut()
            && r.state.kind() == StateKind::Failed(FailureKind::Retryable)
        {
            r.expires_at = None;
        }
        let next = || FencingToken::new(self.tokens.fetch_add(1, Ordering::SeqCst) + 1);
        let decision = machine::acquire(existing.as_ref(), req, now, next);
        match (self.bug, decision, existing) {
            (
                Bug::TakeoverKeepsToken,
                AcquireDecision::Write(
                    mut record,
                    AcquireOutcome::Acquired {
                        mut lease,
                        takeover: true,
                    },
                ),
                Some(old),
            ) => {
                record.token = old.token;
                lease.token = old.token;
                AcquireDecision::Write(
                    record,
                    AcquireOutcome::Acquired {
                        lease,
                        takeover: true,
                    },
                )
            }
            (_, decision, _) => decision,
        }
    }

    fn fenced<T>(&self, lease: &Lease, apply: impl FnOnce(&mut Record) -> T) -> Result<T> {
        let mut records = self.records.lock().unwrap();
        let now = self.clock.now();
        let record = machine::check_fence(records.get_mut(&lease.key), lease, now)?;
        Ok(apply(record))
    }

    /// A finishing transition by the reference rules, or with this store's bug.
    fn finish(&self, lease: &Lease, how: Finish<'_>) -> Result<()> {
        self.request();
        let mut records = self.records.lock().unwrap();
        let now = self.clock.now();
        let existing = records.get_mut(&lease.key);
        match self.bug {
            Bug::ReplayRefused => {
                let record = machine::check_fence(existing, lease, now)?;
                machine::finish(Some(record), lease, how, now).map(drop)
            }
            Bug::ReplayIgnoresArguments => match existing {
                Some(r) if r.token == lease.token && r.state != RecordState::InProgress => Ok(()),
                other => machine::finish(other, lease, how, now).map(drop),
            },
            Bug::ReadsAfterRefusal => {
                let result = machine::finish(existing, lease, how, now).map(drop);
                if result.is_err() {
                    self.request();
                }
                result
            }
            _ => machine::finish(existing, lease, how, now).map(drop),
        }
    }
}

#[async_trait]
impl IdempotencyStore for FlawedStore {
    fn name(&self) -> &'static str {
        "flawed"
    }

    async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome> {
        req.validate()?;
        self.request();
        if self.bug == Bug::NonAtomicAcquire {
            let existing = self.records.lock().unwrap().get(&req.key).cloned();
            tokio::time::sleep(Duration::from_millis(1)).await;
            let decision = self.decide(existing.as_ref(), req);
            return Ok(apply(&mut self.records.lock().unwrap(), req, decision));
        }
        let mut records = self.records.lock().unwrap();
        let decision = self.decide(records.get(&req.key), req);
        Ok(apply(&mut records, req, decision))
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        idem_core::check_lease_ttl(ttl)?;
        self.request();
        let now = self.clock.now();
        if self.bug == Bug::ExtendNotStored {
            return self.fenced(lease, |r| machine::extend(&mut r.clone(), lease, ttl, now));
        }
        self.fenced(lease, |r| machine::extend(r, lease, ttl, now))
    }

    async fn complete(&self, lease: &Lease, result: Bytes, retention: Duration) -> Result<()> {
        self.limits().check_complete(&result, retention)?;
        if self.bug == Bug::CompleteSkipsTokenCheck {
            self.request();
            let now = self.clock.now();
            let mut records = self.records.lock().unwrap();
            if let Some(record) = records.get_mut(&lease.key) {
                record.state = RecordState::InProgress;
                record.token = lease.token;
                let how = Finish::Complete {
                    result: &result,
                    retention,
                };
                return machine::finish(Some(record), lease, how, now).map(drop);
            }
            drop(records);
        }
        self.finish(
            lease,
            Finish::Complete {
                result: &result,
                retention,
            },
        )
    }

    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        let altered = match self.bug {
            Bug::ReplacesNul => error.replace('\0', "\u{fffd}"),
            Bug::DropsAstralCharacters => error
                .chars()
                .map(|c| if c > '\u{ffff}' { '\u{fffd}' } else { c })
                .collect(),
            _ => {
                self.limits().check_fail(error, retention)?;
                error.to_owned()
            }
        };
        idem_core::check_retention(retention)?;
        self.finish(
            lease,
            Finish::Fail {
                error: &altered,
                kind,
                retention,
            },
        )
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.finish(lease, Finish::Release)
    }

    async fn acquire_many(&self, reqs: &[AcquireRequest]) -> Result<Vec<Result<AcquireOutcome>>> {
        self.limits().check_batch(reqs.len())?;
        self.request();
        match self.bug {
            Bug::BatchSkipsBusyCheck => {
                let mut records = self.records.lock().unwrap();
                let late = self.clock.now() + Duration::from_secs(3600);
                let next = || FencingToken::new(self.tokens.fetch_add(1, Ordering::SeqCst) + 1);
                Ok(reqs
                    .iter()
                    .map(|req| {
                        req.validate()?;
                        let decision = machine::acquire(records.get(&req.key), req, late, next);
                        Ok(apply(&mut records, req, decision))
                    })
                    .collect())
            }
            Bug::NonAtomicBatch => {
                let snapshot = self.records.lock().unwrap().clone();
                tokio::time::sleep(Duration::from_millis(1)).await;
                let mut decided = Vec::new();
                for req in reqs {
                    decided.push(
                        req.validate()
                            .map(|()| self.decide(snapshot.get(&req.key), req)),
                    );
                }
                let mut records = self.records.lock().unwrap();
                Ok(reqs
                    .iter()
                    .zip(decided)
                    .map(|(req, d)| d.map(|d| apply(&mut records, req, d)))
                    .collect())
            }
            _ => {
                let mut out = Vec::new();
                for req in reqs {
                    out.push(req.validate().map(|()| {
                        let mut records = self.records.lock().unwrap();
                        let decision = self.decide(records.get(&req.key), req);
                        apply(&mut records, req, decision)
                    }));
                }
                Ok(out)
            }
        }
    }

    async fn list(&self, query: &ListQuery) -> Result<Page> {
        query.validate()?;
        self.request();
        let now = self.clock.now();
        let after = query.cursor.as_ref().map(|c| c.as_str().to_owned());
        let records = self.records.lock().unwrap();
        let mut found: Vec<Record> = records
            .values()
            .filter(|r| {
                self.bug == Bug::ListIgnoresNamespace || r.key.namespace() == &query.namespace
            })
            .filter(|r| after.as_deref().is_none_or(|a| r.key.id() > a))
            .filter(|r| !r.is_expired(now) && query.matches(r, now))
            .cloned()
            .collect();
        found.sort_by(|a, b| a.key.id().cmp(b.key.id()));
        let next = (found.len() > query.limit).then(|| {
            found.truncate(query.limit);
            Cursor::new(found[query.limit - 1].key.id())
        });
        let next = next.filter(|_| self.bug != Bug::ListDropsCursor);
        Ok(Page::new(found, next))
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        self.request();
        let now = self.clock.now();
        let records = self.records.lock().unwrap();
        Ok(records.get(key).filter(|r| !r.is_expired(now)).cloned())
    }

    async fn delete(&self, key: &IdempotencyKey) -> Result<bool> {
        self.request();
        let now = self.clock.now();
        let removed = self.records.lock().unwrap().remove(key);
        Ok(removed.is_some_and(|r| !r.is_expired(now)))
    }

    async fn purge_expired(&self, _limit: usize) -> Result<u64> {
        Ok(0)
    }
}

#[async_trait]
impl TransactionalStore for FlawedStore {
    type Writes = Vec<(String, Bytes)>;

    async fn complete_with(
        &self,
        lease: &Lease,
        result: Bytes,
        retention: Duration,
        writes: Self::Writes,
    ) -> Result<()> {
        self.limits().check_complete(&result, retention)?;
        self.request();
        let mut records = self.records.lock().unwrap();
        let now = self.clock.now();
        let record = records.get_mut(&lease.key);
        let live = record
            .as_deref()
            .is_some_and(|r| r.token == lease.token && r.state == RecordState::InProgress);
        let apply = match self.bug {
            Bug::EffectBeforeFence => true,
            Bug::EffectOnReplay => record.as_deref().is_some_and(|r| r.token == lease.token),
            _ => live,
        };
        if apply {
            self.effects.lock().unwrap().extend(writes);
        }
        let how = Finish::Complete {
            result: &result,
            retention,
        };
        machine::finish(record, lease, how, now).map(drop)
    }
}

struct Probe(Arc<FlawedStore>);

#[async_trait]
impl EffectProbe<FlawedStore> for Probe {
    fn set(&self, name: &str, value: &[u8]) -> Vec<(String, Bytes)> {
        vec![(name.to_owned(), Bytes::copy_from_slice(value))]
    }

    fn refused(&self, _name: &str) -> Option<Vec<(String, Bytes)>> {
        None
    }

    fn too_many(&self, _name: &str) -> Option<Vec<(String, Bytes)>> {
        None
    }

    async fn read(&self, name: &str) -> Option<Vec<u8>> {
        self.0.effects.lock().unwrap().get(name).map(|b| b.to_vec())
    }
}

/// Runs C25 on a store with `bug`; returns whether it passed.
async fn passes_c25(bug: Bug) -> bool {
    tokio::spawn(async move {
        let clock = Arc::new(ManualClock::default());
        let store = Arc::new(FlawedStore::new(bug, clock.clone()));
        let h = Harness::new(store.clone(), Config::manual_time(clock));
        c25_transactional_effects(&h, &*store, &Probe(store.clone())).await;
    })
    .await
    .map_err(|e| assert!(e.is_panic(), "{e:?}"))
    .is_ok()
}

#[tokio::test]
async fn transactional_effect_bugs_are_caught() {
    assert!(
        passes_c25(Bug::None).await,
        "control: C25 must pass without a bug"
    );
    for bug in [Bug::EffectBeforeFence, Bug::EffectOnReplay] {
        assert!(!passes_c25(bug).await, "C25 must catch {bug:?}");
    }
}

fn apply(
    records: &mut HashMap<IdempotencyKey, Record>,
    req: &AcquireRequest,
    decision: AcquireDecision,
) -> AcquireOutcome {
    match decision {
        AcquireDecision::Write(record, outcome) => {
            records.insert(req.key.clone(), record);
            outcome
        }
        AcquireDecision::Keep(outcome) => outcome,
        other => panic!("unknown decision {other:?}"),
    }
}

/// The non-atomic acquire needs real concurrency and a real clock; the others run on a manual
/// clock.
fn harness(bug: Bug) -> Harness {
    let unreachable = || async {
        let dead = MemoryStore::new();
        dead.set_available(false);
        Ok(Arc::new(dead) as DynStore)
    };
    let (store, config) = if bug == Bug::NonAtomicAcquire {
        let store = Arc::new(FlawedStore::new(bug, Arc::new(SystemClock)));
        (store, Config::real_time())
    } else {
        let clock = Arc::new(ManualClock::default());
        let store = Arc::new(FlawedStore::new(bug, clock.clone()));
        (store, Config::manual_time(clock))
    };
    let counted = store.clone();
    Harness::new(store, config)
        .with_unreachable(unreachable)
        .with_round_trips(move || counted.requests())
}

type Scenario = fn(&Harness) -> BoxFuture<'_, ()>;

macro_rules! scenario {
    ($name:ident) => {
        (
            stringify!($name),
            (|h| Box::pin(scenarios::$name(h))) as Scenario,
        )
    };
}

/// Runs `scenario` on a store with `bug` in its own task; returns whether it passed.
async fn passes(bug: Bug, scenario: Scenario) -> bool {
    let h = harness(bug);
    tokio::spawn(async move { scenario(&h).await })
        .await
        .map_err(|e| assert!(e.is_panic(), "{e:?}"))
        .is_ok()
}

async fn check(bug: Bug, guarding: &[(&str, Scenario)]) {
    for (name, scenario) in guarding {
        assert!(
            passes(Bug::None, *scenario).await,
            "control: {name} must pass without a bug"
        );
        assert!(!passes(bug, *scenario).await, "{name} must catch {bug:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn completion_without_token_check_is_caught() {
    check(
        Bug::CompleteSkipsTokenCheck,
        &[
            scenario!(c07_zombie_fenced),
            scenario!(c12_release_does_not_count),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn non_atomic_acquire_is_caught() {
    check(Bug::NonAtomicAcquire, &[scenario!(c02_race_one_winner)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acquire_ignoring_fingerprint_is_caught() {
    check(
        Bug::IgnoresFingerprint,
        &[scenario!(c04_conflict_in_every_state)],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn takeover_keeping_the_token_is_caught() {
    check(
        Bug::TakeoverKeepsToken,
        &[scenario!(c06_crash_takeover), scenario!(c07_zombie_fenced)],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refused_replays_are_caught() {
    check(Bug::ReplayRefused, &[scenario!(c21_replayed_transitions)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replays_ignoring_their_arguments_are_caught() {
    check(
        Bug::ReplayIgnoresArguments,
        &[scenario!(c21_replayed_transitions)],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn altered_error_texts_are_caught() {
    check(Bug::ReplacesNul, &[scenario!(c22_text_fidelity)]).await;
    check(Bug::DropsAstralCharacters, &[scenario!(c22_text_fidelity)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retryable_failure_outliving_its_retention_is_caught() {
    check(
        Bug::RetryableOutlivesRetention,
        &[scenario!(c13_retention_expiry)],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_unlike_singles_are_caught() {
    check(
        Bug::BatchSkipsBusyCheck,
        &[scenario!(c24_batches_equal_singles)],
    )
    .await;
    check(Bug::NonAtomicBatch, &[scenario!(c24_batches_equal_singles)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broken_listings_are_caught() {
    check(Bug::ListIgnoresNamespace, &[scenario!(c26_listing)]).await;
    check(Bug::ListDropsCursor, &[scenario!(c26_listing)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_heartbeat_the_store_does_not_keep_is_caught() {
    check(
        Bug::ExtendNotStored,
        &[scenario!(c08_heartbeat_keeps_lease)],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_round_trip_is_caught() {
    check(Bug::ReadsAfterRefusal, &[scenario!(c23_round_trips)]).await;
}

/// The control store passes the whole suite, so each failure above comes from its one bug.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn control_store_passes_every_scenario() {
    let all = [
        scenario!(c01_fresh_acquire),
        scenario!(c02_race_one_winner),
        scenario!(c03_replay_byte_identical),
        scenario!(c04_conflict_in_every_state),
        scenario!(c05_busy_with_retry_after),
        scenario!(c06_crash_takeover),
        scenario!(c07_zombie_fenced),
        scenario!(c08_heartbeat_keeps_lease),
        scenario!(c09_retryable_failure_reacquires),
        scenario!(c10_poison_exhausted),
        scenario!(c11_terminal_failure_replayed),
        scenario!(c12_release_does_not_count),
        scenario!(c13_retention_expiry),
        scenario!(c14_operator_delete),
        scenario!(c15_namespaces_isolated),
        scenario!(c16_bad_input_rejected),
        scenario!(c17_hostile_keys),
        scenario!(c18_get_shows_record),
        scenario!(c19_chaos_ledger),
        scenario!(c20_unreachable_store),
        scenario!(c21_replayed_transitions),
        scenario!(c22_text_fidelity),
        scenario!(c23_round_trips),
        scenario!(c24_batches_equal_singles),
        scenario!(c26_listing),
    ];
    assert_eq!(
        all.len(),
        idem_conformance::SCENARIOS.len(),
        "every scenario"
    );
    for (name, scenario) in all {
        assert!(
            passes(Bug::None, scenario).await,
            "control store fails {name}"
        );
    }
}

struct Appended(Arc<FlawedStore>);

#[async_trait]
impl idem_conformance::outage::Effects<FlawedStore> for Appended {
    fn apply(&self, key: &IdempotencyKey, token: FencingToken) -> Vec<(String, Bytes)> {
        vec![(format!("{key}/{token}"), Bytes::new())]
    }

    async fn applied(&self, key: &IdempotencyKey) -> Result<Vec<FencingToken>> {
        let prefix = format!("{key}/");
        let effects = self.0.effects.lock().unwrap();
        Ok(effects
            .keys()
            .filter_map(|k| k.strip_prefix(&prefix))
            .map(|t| FencingToken::new(t.parse().unwrap()))
            .collect())
    }
}

struct NoOutage;

#[async_trait]
impl idem_conformance::outage::Outage for NoOutage {
    async fn kill(&self) {}
    async fn restart(&self) {}
}

/// The outage driver counts what a store that applies effects before its fence lets through.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn outage_driver_counts_zombie_effects() {
    use idem_conformance::outage::{EffectPath, OutagePlan, run};
    let plan = OutagePlan::default()
        .with_keys(300)
        .with_lease_ttl(Duration::from_millis(50))
        .with_down_for(Duration::from_millis(1));
    for (bug, broken) in [(Bug::None, false), (Bug::EffectBeforeFence, true)] {
        let store = Arc::new(FlawedStore::new(bug, Arc::new(SystemClock)));
        let report = run(
            &plan,
            EffectPath::Transactional,
            store.clone(),
            Arc::new(NoOutage),
            Arc::new(Appended(store)),
        )
        .await;
        assert_eq!(report.lost_keys, 0, "{bug:?}: {report:?}");
        let counted = report.duplicate_effects + report.zombie_writes;
        assert_eq!(counted > 0, broken, "{bug:?}: {report:?}");
    }
}

/// A store built by connecting to `addr` and waiting for the server's greeting: within `limit`
/// (then `Unavailable`), or, with `None`, for as long as it takes, as a client without timeouts
/// does.
async fn greeted_store(addr: std::net::SocketAddr, limit: Option<Duration>) -> Result<DynStore> {
    use tokio::io::AsyncReadExt;
    let greeting = async {
        let mut conn = tokio::net::TcpStream::connect(addr).await?;
        let mut byte = [0u8; 1];
        conn.read_exact(&mut byte).await?;
        Ok::<_, std::io::Error>(())
    };
    let greeted = match limit {
        Some(limit) => tokio::time::timeout(limit, greeting)
            .await
            .map_err(|_| idem_core::Error::unavailable("greeted", "no greeting in time"))?,
        None => greeting.await,
    };
    greeted.map_err(|e| idem_core::Error::unavailable("greeted", e))?;
    Ok(Arc::new(MemoryStore::new()) as DynStore)
}

/// C20 against a server that accepts and never answers: a store that waits for it without a
/// timeout fails C20 (where a refused port alone would let it pass); the same store with one
/// passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_without_timeouts_is_caught_by_a_server_that_never_answers() {
    let c20 = |limit: Option<Duration>| async move {
        let unreachable = || async {
            let dead = MemoryStore::new();
            dead.set_available(false);
            Ok(Arc::new(dead) as DynStore)
        };
        let config = Config::real_time().with_unavailable_within(Duration::from_millis(800));
        let h = Harness::new(Arc::new(MemoryStore::new()), config)
            .with_unreachable(unreachable)
            .with_silent(move |addr| greeted_store(addr, limit));
        tokio::spawn(async move { scenarios::c20_unreachable_store(&h).await })
            .await
            .map_err(|e| assert!(e.is_panic(), "{e:?}"))
            .is_ok()
    };
    assert!(
        c20(Some(Duration::from_millis(200))).await,
        "control: a store with a timeout passes C20"
    );
    assert!(
        !c20(None).await,
        "C20 must catch a store that waits for a silent server without a timeout"
    );
}
