//! What a scenario needs: the store, its time, and how to reach a dead copy of it.

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use idem_core::{DynStore, IdempotencyKey, ManualClock, Namespace, Result};

/// How scenarios make time pass.
#[derive(Clone, Debug)]
pub enum TimeControl {
    /// The store runs on a real clock (a server): scenarios sleep. `slack` is added to every wait
    /// for an expiry, to absorb clock granularity and scheduling.
    Real {
        /// Extra time added to every wait for an expiry.
        slack: Duration,
    },
    /// The store runs on this [`ManualClock`]: scenarios advance it and never sleep.
    Manual(Arc<ManualClock>),
}

impl TimeControl {
    /// Lets `d` pass on the store's clock (plus the slack on a real clock).
    pub async fn pass(&self, d: Duration) {
        match self {
            Self::Real { slack } => tokio::time::sleep(d + *slack).await,
            Self::Manual(clock) => {
                clock.advance(d + Duration::from_millis(1));
                tokio::task::yield_now().await;
            }
        }
    }

    /// Lets exactly `d` pass, without slack: for waits that must stay shorter than a lease.
    pub async fn pass_exact(&self, d: Duration) {
        match self {
            Self::Real { .. } => tokio::time::sleep(d).await,
            Self::Manual(clock) => {
                clock.advance(d);
                tokio::task::yield_now().await;
            }
        }
    }

    /// Whether time is manual (no sleeping).
    pub fn is_manual(&self) -> bool {
        matches!(self, Self::Manual(_))
    }
}

/// Durations and sizes the scenarios use; differences between backends are explicit here.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Config {
    /// The short lease used where a lease must expire (C05-C10, C19).
    pub lease_ttl: Duration,
    /// The long lease used where a lease must not expire during the scenario.
    pub long_lease_ttl: Duration,
    /// The short retention used where a record must expire (C13).
    pub short_retention: Duration,
    /// The retention used everywhere else.
    pub retention: Duration,
    /// How time passes for the store.
    pub time: TimeControl,
    /// C02: how many keys the 64-way race runs over.
    pub race_keys: usize,
    /// C19: keys, deliveries per key and concurrent workers.
    pub chaos_keys: usize,
    /// C19: how many times each key is delivered.
    pub chaos_deliveries: usize,
    /// C19: concurrent workers.
    pub chaos_workers: usize,
    /// C20: the bound within which an unreachable store must answer `Unavailable`.
    pub unavailable_within: Duration,
}

impl Config {
    /// For a store on a real clock (a server): 300 ms leases, 600 ms short retention.
    pub fn real_time() -> Self {
        Self {
            lease_ttl: Duration::from_millis(300),
            long_lease_ttl: Duration::from_secs(60),
            short_retention: Duration::from_millis(600),
            retention: Duration::from_secs(3600),
            time: TimeControl::Real {
                slack: Duration::from_millis(100),
            },
            race_keys: 20,
            chaos_keys: 60,
            chaos_deliveries: 3,
            chaos_workers: 16,
            unavailable_within: Duration::from_secs(5),
        }
    }

    /// For a store on `clock` (a [`MemoryStore`](idem_core::MemoryStore) or any store with an
    /// injectable clock): the same durations, passed without sleeping.
    pub fn manual_time(clock: Arc<ManualClock>) -> Self {
        Self {
            time: TimeControl::Manual(clock),
            race_keys: 50,
            chaos_keys: 200,
            ..Self::real_time()
        }
    }

    /// Sets the short lease.
    pub fn with_lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// Sets the short retention.
    pub fn with_short_retention(mut self, retention: Duration) -> Self {
        self.short_retention = retention;
        self
    }

    /// Sets the C02 key count.
    pub fn with_race_keys(mut self, keys: usize) -> Self {
        self.race_keys = keys;
        self
    }

    /// Sets the C19 sizes.
    pub fn with_chaos(mut self, keys: usize, deliveries: usize, workers: usize) -> Self {
        self.chaos_keys = keys;
        self.chaos_deliveries = deliveries;
        self.chaos_workers = workers;
        self
    }

    /// Sets the C20 bound.
    pub fn with_unavailable_within(mut self, within: Duration) -> Self {
        self.unavailable_within = within;
        self
    }
}

type UnreachableFactory = Arc<dyn Fn() -> BoxFuture<'static, Result<DynStore>> + Send + Sync>;
type SilentFactory = Arc<dyn Fn(SocketAddr) -> BoxFuture<'static, Result<DynStore>> + Send + Sync>;
type RoundTripCounter = Arc<dyn Fn() -> u64 + Send + Sync>;

/// How C23 counts the store's round trips.
#[derive(Clone)]
enum RoundTrips {
    /// Not configured: C23 fails and says so.
    Unset,
    /// The store talks to nothing (an in-process store); C23 says so and checks nothing.
    InProcess(&'static str),
    /// Returns how many requests the store under test has sent so far.
    Counter(RoundTripCounter),
}

/// The store under test, its [`Config`], and (for C20) ways to build the same kind of store
/// pointed at an endpoint where nothing listens, and at a server that never answers.
#[derive(Clone)]
pub struct Harness {
    store: DynStore,
    config: Config,
    unreachable: Option<UnreachableFactory>,
    silent: Option<SilentFactory>,
    round_trips: RoundTrips,
}

impl fmt::Debug for Harness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Harness")
            .field("store", &self.store)
            .field("config", &self.config)
            .field("unreachable", &self.unreachable.is_some())
            .field("silent", &self.silent.is_some())
            .field(
                "round_trips",
                &match &self.round_trips {
                    RoundTrips::Unset => "unset",
                    RoundTrips::InProcess(why) => why,
                    RoundTrips::Counter(_) => "counted",
                },
            )
            .finish()
    }
}

impl Harness {
    /// A harness over `store`.
    pub fn new(store: DynStore, config: Config) -> Self {
        Self {
            store,
            config,
            unreachable: None,
            silent: None,
            round_trips: RoundTrips::Unset,
        }
    }

    /// Sets how C23 counts round trips: `counter` returns how many requests (commands, queries,
    /// API calls) the store under test has sent to its server so far. It must count only this
    /// harness's store (tests run in parallel), and a request the client retries counts again.
    /// Without it (or [`Harness::in_process`]), C23 fails and says so.
    pub fn with_round_trips(mut self, counter: impl Fn() -> u64 + Send + Sync + 'static) -> Self {
        self.round_trips = RoundTrips::Counter(Arc::new(counter));
        self
    }

    /// Declares the store in-process (it sends no requests), so C23 has nothing to count;
    /// `why` is shown in C23's output.
    pub fn in_process(mut self, why: &'static str) -> Self {
        self.round_trips = RoundTrips::InProcess(why);
        self
    }

    /// How many requests the store has sent so far: `Ok(Some(n))` with a counter,
    /// `Ok(None)` for an in-process store, `Err` with the reason when nothing was configured.
    pub fn round_trips(&self) -> std::result::Result<Option<u64>, &'static str> {
        match &self.round_trips {
            RoundTrips::Unset => Err(
                "no round-trip counter: call Harness::with_round_trips (or Harness::in_process \
                 for a store that sends no requests)",
            ),
            RoundTrips::InProcess(_) => Ok(None),
            RoundTrips::Counter(count) => Ok(Some(count())),
        }
    }

    /// Sets how C20 builds a store pointed at a dead endpoint. Building it may itself fail, as
    /// long as it fails with [`Error::Unavailable`](idem_core::Error::Unavailable) in time.
    /// Without it, C20 fails and says so: an unchecked outage path is not a pass.
    pub fn with_unreachable<F, Fut>(mut self, factory: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<DynStore>> + Send + 'static,
    {
        self.unreachable = Some(Arc::new(move || Box::pin(factory())));
        self
    }

    /// Sets how C20 builds a store pointed at `addr`, a server that accepts every connection
    /// and never answers (a peer that hangs, a network that drops replies): the store's own
    /// timeouts must turn that into [`Error::Unavailable`](idem_core::Error::Unavailable) within
    /// [`Config::unavailable_within`], where a refused port fails at once whatever they are.
    /// Without it, C20 checks the refused port only and says on standard error that the
    /// timeouts went unchecked.
    ///
    /// ```no_run
    /// # fn demo(harness: idem_conformance::Harness) -> idem_conformance::Harness {
    /// # async fn my_store(_url: String) -> idem_core::Result<idem_core::DynStore> { unimplemented!() }
    /// harness.with_silent(|addr| my_store(format!("myproto://{addr}")))
    /// # }
    /// ```
    pub fn with_silent<F, Fut>(mut self, factory: F) -> Self
    where
        F: Fn(SocketAddr) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<DynStore>> + Send + 'static,
    {
        self.silent = Some(Arc::new(move |addr| Box::pin(factory(addr))));
        self
    }

    /// Builds the store pointed at a server that never answers, at `addr`, if
    /// [`Harness::with_silent`] was called.
    pub fn silent(&self, addr: SocketAddr) -> Option<BoxFuture<'static, Result<DynStore>>> {
        self.silent.as_ref().map(|f| f(addr))
    }

    /// The store under test.
    pub fn store(&self) -> &DynStore {
        &self.store
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Builds the unreachable store, if configured.
    pub fn unreachable(&self) -> Option<BoxFuture<'static, Result<DynStore>>> {
        self.unreachable.as_ref().map(|f| f())
    }

    /// A fresh random namespace: every scenario works in its own, so runs can share a server
    /// and nothing is ever wiped.
    pub fn namespace(&self) -> Namespace {
        Namespace::new(format!("conf-{}", uuid::Uuid::new_v4().simple()))
            .expect("a generated namespace is valid")
    }

    /// A key `id` in `ns`.
    pub fn key(&self, ns: &Namespace, id: &str) -> IdempotencyKey {
        ns.key(id).expect("scenario keys are valid")
    }
}
