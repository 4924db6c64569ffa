//! The kit's own rules, on the worked example's backend (`idem/examples/kit_memory.rs`) wrapped in a
//! backend that counts calls and injects faults: what each call costs, lost replies recognised,
//! conflicts bounded, tombstones keeping tokens rising, input checked before any call, foreign
//! values refused, the backend's clock used, a missing scan.

// The example is written against the facade (`idem::...`), which re-exports this crate.
extern crate idem_core as idem;

#[allow(dead_code, unreachable_pub)]
#[path = "../../idem/examples/kit_memory.rs"]
mod kit_memory;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use idem_core::kit::{
    Cas, CasBackend, Contended, KitOptions, KitStore, Scanned, Stored, Versioned, decode, encode,
    storage_key,
};
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Completion, Error, Failure, FailureKind, FencingToken,
    IdempotencyKey, IdempotencyStore, Lease, ListQuery, LostLease, ManualClock, Namespace,
    RecordState, Result, StateKind,
};
use kit_memory::MapBackend;
use proptest::prelude::*;

const RETENTION: Duration = Duration::from_secs(60);

/// Counts calls and injects faults into the next `store` calls.
#[derive(Debug, Default)]
struct Probe {
    inner: MapBackend,
    loads: AtomicU32,
    stores: AtomicU32,
    deletes: AtomicU32,
    /// The next n stores write, then answer `Unavailable` (a lost reply).
    lose_reply: AtomicU32,
    /// The next n stores answer `Unavailable` without writing.
    fail_before: AtomicU32,
    /// The next n stores answer `Conflict` without writing.
    conflict: AtomicU32,
    /// The next n loads answer `Unavailable`.
    fail_load: AtomicU32,
    /// The next n faults injected into `store` make the load after them fail.
    then_fail_load: AtomicU32,
    /// Written just before the next `store` runs: another writer's value.
    intrude: std::sync::Mutex<Option<(Vec<u8>, Bytes)>>,
    /// The backend's clock, when set.
    clock: Option<Arc<ManualClock>>,
    /// Whether `scan` is offered.
    scans: bool,
}

#[derive(Debug, thiserror::Error)]
#[error("injected: {0}")]
struct Injected(&'static str);

fn take(n: &AtomicU32) -> bool {
    n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
        .is_ok()
}

#[async_trait]
impl CasBackend for Probe {
    type Version = u64;
    fn name(&self) -> &'static str {
        "probe"
    }
    async fn load(&self, key: &[u8]) -> Result<Option<Versioned<u64>>> {
        self.loads.fetch_add(1, Ordering::SeqCst);
        if take(&self.fail_load) {
            return Err(Error::unavailable("probe", Injected("load")));
        }
        self.inner.load(key).await
    }
    async fn store(&self, key: &[u8], value: Bytes, expected: Option<&u64>) -> Result<Cas> {
        self.stores.fetch_add(1, Ordering::SeqCst);
        let intruder = self.intrude.lock().unwrap().take();
        if let Some((k, v)) = intruder {
            self.inner.store(&k, v, None).await?;
        }
        if take(&self.conflict) {
            return Ok(Cas::Conflict);
        }
        if take(&self.fail_before) {
            if take(&self.then_fail_load) {
                self.fail_load.store(1, Ordering::SeqCst);
            }
            return Err(Error::unavailable("probe", Injected("before the write")));
        }
        let done = self.inner.store(key, value, expected).await?;
        if take(&self.lose_reply) {
            return Err(Error::unavailable("probe", Injected("reply lost")));
        }
        Ok(done)
    }
    async fn delete(&self, key: &[u8], expected: &u64) -> Result<Cas> {
        self.deletes.fetch_add(1, Ordering::SeqCst);
        self.inner.delete(key, expected).await
    }
    async fn now(&self) -> Result<Option<SystemTime>> {
        Ok(self.clock.as_ref().map(|c| idem_core::Clock::now(&**c)))
    }
    async fn scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<Scanned<u64>>> {
        if !self.scans {
            return Err(Error::Unsupported {
                store: "probe",
                operation: "scan",
            });
        }
        self.inner.scan(prefix, after, limit).await
    }
}

impl Probe {
    fn calls(&self) -> (u32, u32) {
        (
            self.loads.load(Ordering::SeqCst),
            self.stores.load(Ordering::SeqCst),
        )
    }
}

struct Fixture {
    store: KitStore<Arc<Probe>>,
    probe: Arc<Probe>,
    clock: Arc<ManualClock>,
}

fn fixture_with(probe: Probe) -> Fixture {
    let clock = Arc::new(ManualClock::new(
        UNIX_EPOCH + Duration::from_secs(1_700_000_000),
    ));
    let probe = Arc::new(probe);
    let store = KitStore::with_options(
        probe.clone(),
        KitOptions::default().with_clock(clock.clone()),
    );
    Fixture {
        store,
        probe,
        clock,
    }
}

fn fixture() -> Fixture {
    fixture_with(Probe {
        scans: true,
        ..Probe::default()
    })
}

fn key(id: &str) -> IdempotencyKey {
    Namespace::new("kit").unwrap().key(id).unwrap()
}

fn req(id: &str, owner: &str) -> AcquireRequest {
    AcquireRequest::new(key(id), owner).with_lease_ttl(Duration::from_secs(10))
}

async fn acquired(store: &impl IdempotencyStore, req: &AcquireRequest) -> Lease {
    match store.acquire(req).await {
        Ok(AcquireOutcome::Acquired { lease, .. }) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Runs `op` and returns the loads and stores it cost.
macro_rules! cost {
    ($f:expr, $op:expr) => {{
        let (l0, s0) = $f.probe.calls();
        let out = $op;
        let (l1, s1) = $f.probe.calls();
        (out, (l1 - l0, s1 - s0))
    }};
}

#[tokio::test]
async fn each_call_costs_one_load_and_at_most_one_store() {
    let f = fixture();
    let s = &f.store;
    let (lease, c) = cost!(f, acquired(s, &req("k", "a")).await);
    assert_eq!(c, (1, 1), "acquire (fresh)");
    let (_, c) = cost!(f, s.acquire(&req("k", "b")).await.unwrap());
    assert_eq!(c, (1, 0), "acquire (busy)");
    let (lease, c) = cost!(f, s.extend(&lease, Duration::from_secs(20)).await.unwrap());
    assert_eq!(c, (1, 1), "extend");
    let (_, c) = cost!(
        f,
        s.complete(&lease, Bytes::from_static(b"r"), RETENTION)
            .await
    );
    assert_eq!(c, (1, 1), "complete");
    let (r, c) = cost!(
        f,
        s.complete(&lease, Bytes::from_static(b"r"), RETENTION)
            .await
    );
    r.unwrap();
    assert_eq!(c, (1, 0), "complete (replayed)");
    let (r, c) = cost!(f, s.release(&lease).await);
    assert!(r.unwrap_err().is_lease_lost());
    assert_eq!(c, (1, 0), "release (refused)");
    let (r, c) = cost!(f, s.acquire(&req("k", "b")).await.unwrap());
    assert!(matches!(r, AcquireOutcome::Replayed { .. }));
    assert_eq!(c, (1, 0), "acquire (duplicate)");
    let (_, c) = cost!(f, s.get(&key("k")).await.unwrap());
    assert_eq!(c, (1, 0), "get");
    let (_, c) = cost!(f, s.delete(&key("k")).await.unwrap());
    assert_eq!(c, (1, 1), "delete");
}

#[tokio::test]
async fn bad_input_touches_nothing() {
    let f = fixture();
    let s = &f.store;
    let lease = acquired(s, &req("k", "a")).await;
    let before = f.probe.calls();
    assert!(s.acquire(&req("k", "a\0b")).await.is_err());
    assert!(
        s.acquire(&req("k", "a").with_max_attempts(0))
            .await
            .is_err()
    );
    assert!(s.extend(&lease, Duration::ZERO).await.is_err());
    assert!(
        s.fail(&lease, "nul\0", FailureKind::Terminal, RETENTION)
            .await
            .is_err()
    );
    let big = Bytes::from(vec![0; s.limits().max_result_len + 1]);
    assert!(matches!(
        s.complete(&lease, big, RETENTION).await,
        Err(Error::ResultTooLarge { .. })
    ));
    assert!(
        s.complete(&lease, Bytes::new(), Duration::from_secs(u64::MAX / 4))
            .await
            .is_err()
    );
    assert_eq!(f.probe.calls(), before, "no backend call for bad input");
}

#[tokio::test]
async fn a_lost_reply_is_recognised_as_the_kits_own_write() {
    let f = fixture();
    let s = &f.store;
    f.probe.lose_reply.store(1, Ordering::SeqCst);
    let (lease, c) = cost!(f, acquired(s, &req("k", "a")).await);
    assert_eq!(c, (2, 1), "one write, one reload that finds it");
    let record = s.get(&key("k")).await.unwrap().unwrap();
    assert_eq!(
        record.token, lease.token,
        "the lease returned is the one stored"
    );

    f.probe.lose_reply.store(1, Ordering::SeqCst);
    let (r, c) = cost!(
        f,
        s.complete(&lease, Bytes::from_static(b"ok"), RETENTION)
            .await
    );
    r.unwrap();
    assert_eq!(c, (2, 1));
    assert!(matches!(
        s.get(&key("k")).await.unwrap().unwrap().state,
        RecordState::Completed { .. }
    ));
}

#[tokio::test]
async fn a_write_that_did_not_happen_is_made_again() {
    let f = fixture();
    let s = &f.store;
    f.probe.fail_before.store(2, Ordering::SeqCst);
    let (lease, c) = cost!(f, acquired(s, &req("k", "a")).await);
    assert_eq!(
        c,
        (3, 3),
        "two failed writes, each followed by a reload, then the write"
    );
    assert_eq!(s.get(&key("k")).await.unwrap().unwrap().token, lease.token);
}

#[tokio::test]
async fn ambiguous_writes_are_bounded() {
    let f = fixture();
    let s = &f.store;
    f.probe.fail_before.store(100, Ordering::SeqCst);
    let (r, c) = cost!(f, s.acquire(&req("k", "a")).await);
    assert!(
        matches!(r, Err(Error::Unavailable { store: "probe", .. })),
        "{r:?}"
    );
    let max = s.options().max_ambiguous;
    assert_eq!(c, (1 + max, 1 + max));
    f.probe.fail_before.store(0, Ordering::SeqCst);
    assert_eq!(s.get(&key("k")).await.unwrap(), None, "nothing written");

    // A reload that fails answers the write's Unavailable (the reload's own error is not it).
    f.probe.fail_before.store(1, Ordering::SeqCst);
    f.probe.then_fail_load.store(1, Ordering::SeqCst);
    let (r, c) = cost!(f, s.acquire(&req("k2", "a")).await);
    match r {
        Err(Error::Unavailable { source, .. }) => {
            assert_eq!(source.to_string(), "injected: before the write")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert_eq!(c, (2, 1));
}

#[tokio::test]
async fn conflicts_reload_and_are_bounded() {
    let f = fixture();
    let s = &f.store;
    f.probe.conflict.store(3, Ordering::SeqCst);
    let (_, c) = cost!(f, acquired(s, &req("k", "a")).await);
    assert_eq!(c, (4, 4), "each conflict reloads and decides again");

    f.probe.conflict.store(1000, Ordering::SeqCst);
    let r = s.acquire(&req("other", "a")).await;
    let max = s.options().max_conflicts;
    match r {
        Err(Error::Unavailable { source, .. }) => {
            let contended = source.downcast_ref::<Contended>().expect("Contended");
            assert_eq!(contended.conflicts, max + 1);
        }
        other => panic!("expected Unavailable(Contended), got {other:?}"),
    }
    f.probe.conflict.store(0, Ordering::SeqCst);
    assert_eq!(s.get(&key("other")).await.unwrap(), None);
}

#[tokio::test]
async fn a_racer_that_lost_the_write_sees_the_winner() {
    let f = fixture();
    let s = &f.store;
    // The winner's record, made by another store, lands between b's load and b's write.
    let other = KitStore::new(MapBackend::default());
    let a = acquired(&other, &req("k", "a")).await;
    let raw = storage_key(&key("k"));
    let winner = other.backend().load(&raw).await.unwrap().unwrap().value;
    *f.probe.intrude.lock().unwrap() = Some((raw, winner));
    let (r, c) = cost!(f, s.acquire(&req("k", "b")).await.unwrap());
    match r {
        AcquireOutcome::InProgress { owner, .. } => assert_eq!(owner, a.owner),
        other => panic!("the loser must see the winner, got {other:?}"),
    }
    assert_eq!(c, (2, 1), "load, conflicting write, reload");
    assert_eq!(s.get(&key("k")).await.unwrap().unwrap().token, a.token);
}

#[tokio::test]
async fn a_failed_write_beside_the_same_owners_acquisition_in_the_same_microsecond_is_not_taken_for_its_own()
 {
    // Two deliveries of one message, one owner (one executor), one clock reading: the other's
    // acquisition commits while this one's write fails without happening (a lock timeout). The
    // reload finds a record with this call's owner, times, fingerprint and attempt: before
    // tokens had a random part it was byte for byte what this call wrote, so it answered
    // `Acquired` with the other's token, and both ran the handler.
    for round in 0..5 {
        let f = fixture();
        let s = &f.store;
        let id = format!("k{round}");
        let other = KitStore::with_options(
            MapBackend::default(),
            KitOptions::default().with_clock(f.clock.clone()),
        );
        let theirs = acquired(&other, &req(&id, "worker")).await;
        let raw = storage_key(&key(&id));
        let value = other.backend().load(&raw).await.unwrap().unwrap().value;
        *f.probe.intrude.lock().unwrap() = Some((raw, value));
        f.probe.fail_before.store(1, Ordering::SeqCst);
        match s.acquire(&req(&id, "worker")).await.unwrap() {
            AcquireOutcome::InProgress { owner, .. } => assert_eq!(owner, "worker"),
            other => panic!("round {round}: two holders of one key: {other:?}"),
        }
        let stored = s.get(&key(&id)).await.unwrap().unwrap();
        assert_eq!(stored.token, theirs.token, "the other's record stands");
    }
}

#[tokio::test]
async fn tokens_keep_rising_after_delete_and_expiry_whatever_the_clock_does() {
    let f = fixture();
    let s = &f.store;
    let start = idem_core::Clock::now(&*f.clock);

    let a = acquired(s, &req("deleted", "a")).await;
    assert!(s.delete(&key("deleted")).await.unwrap());
    assert_eq!(
        s.get(&key("deleted")).await.unwrap(),
        None,
        "a tombstone reads as absent"
    );
    assert!(
        !s.delete(&key("deleted")).await.unwrap(),
        "nothing left to delete"
    );
    assert!(matches!(
        s.complete(&a, Bytes::new(), RETENTION).await,
        Err(Error::LeaseLost {
            why: LostLease::Gone,
            ..
        })
    ));
    f.clock.set(start - Duration::from_secs(3600)); // the clock steps back an hour
    let b = acquired(s, &req("deleted", "b")).await;
    assert_eq!(b.attempt, 1);
    assert!(b.token > a.token, "{} then {}", a.token, b.token);

    // A record past retention whose token is ahead of the clock (written when the clock was
    // a day ahead): the next token is still above it.
    f.clock.set(start);
    let a = acquired(s, &req("expired", "a")).await;
    s.complete(&a, Bytes::from_static(b"x"), Duration::from_secs(1))
        .await
        .unwrap();
    let raw = storage_key(&key("expired"));
    let loaded = f.probe.inner.load(&raw).await.unwrap().unwrap();
    let Stored::Record(mut record) = decode("probe", &key("expired"), &loaded.value).unwrap()
    else {
        panic!("a record");
    };
    let ahead = FencingToken::new(a.token.get() + 86_400_000_000);
    record.token = ahead;
    f.probe
        .inner
        .store(&raw, encode(&Stored::Record(record)), Some(&loaded.version))
        .await
        .unwrap();
    f.clock.advance(Duration::from_secs(2));
    assert_eq!(
        s.get(&key("expired")).await.unwrap(),
        None,
        "past retention"
    );
    let b = acquired(s, &req("expired", "b")).await;
    assert_eq!(b.attempt, 1, "a fresh acquisition");
    assert!(
        (ahead.get() + 1..ahead.get() + 1 + (1 << 20)).contains(&b.token.get()),
        "previous + 1 (and up to 2^20 at random), not the clock: {}",
        b.token.get()
    );
}

#[tokio::test]
async fn purge_keeps_tombstones_until_the_clock_has_passed_them() {
    let f = fixture();
    let s = &f.store;
    let start = idem_core::Clock::now(&*f.clock);
    let a = acquired(s, &req("old", "a")).await;
    s.complete(&a, Bytes::from_static(b"result"), Duration::from_secs(1))
        .await
        .unwrap();
    let live = acquired(s, &req("live", "a")).await;
    let _ = live;
    assert_eq!(s.purge_expired(10).await.unwrap(), 0, "nothing expired yet");

    f.clock.advance(Duration::from_secs(2));
    assert_eq!(s.purge_expired(10).await.unwrap(), 1, "the expired record");
    let raw = f
        .probe
        .inner
        .load(&storage_key(&key("old")))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        decode("probe", &key("old"), &raw.value).unwrap(),
        Stored::Tombstone(a.token),
        "became a tombstone"
    );
    assert_eq!(
        s.purge_expired(10).await.unwrap(),
        0,
        "the tombstone is still needed"
    );

    let ttl = s.options().tombstone_ttl;
    // (The token is up to 2^20 µs, about 1.05 s, past the acquisition's clock.)
    f.clock.set(start + ttl + Duration::from_secs(2));
    assert_eq!(
        s.purge_expired(10).await.unwrap(),
        1,
        "the tombstone's time is up"
    );
    assert_eq!(
        f.probe.inner.load(&storage_key(&key("old"))).await.unwrap(),
        None
    );
    assert!(
        s.get(&key("live")).await.unwrap().is_some(),
        "a live record stays"
    );
    let b = acquired(s, &req("old", "b")).await;
    assert!(b.token > a.token);

    // Bounded by the limit.
    for i in 0..5 {
        let l = acquired(s, &req(&format!("many-{i}"), "a")).await;
        s.complete(&l, Bytes::new(), Duration::from_secs(1))
            .await
            .unwrap();
    }
    f.clock.advance(Duration::from_secs(2));
    assert_eq!(s.purge_expired(0).await.unwrap(), 0);
    assert_eq!(s.purge_expired(2).await.unwrap(), 2);
    assert_eq!(s.purge_expired(10).await.unwrap(), 3);
}

#[tokio::test]
async fn without_scan_list_is_unsupported_and_purge_removes_nothing() {
    let f = fixture_with(Probe::default());
    let s = &f.store;
    let l = acquired(s, &req("k", "a")).await;
    s.complete(&l, Bytes::new(), Duration::from_secs(1))
        .await
        .unwrap();
    f.clock.advance(Duration::from_secs(2));
    assert!(matches!(
        s.list(&ListQuery::new(Namespace::new("kit").unwrap()))
            .await,
        Err(Error::Unsupported {
            store: "probe",
            operation: "list"
        })
    ));
    assert_eq!(s.purge_expired(10).await.unwrap(), 0);
}

#[tokio::test]
async fn foreign_values_are_corrupt_records_and_left_alone() {
    let f = fixture();
    let s = &f.store;
    let raw = storage_key(&key("foreign"));
    let foreign = Bytes::from_static(b"{\"not\":\"a record\"}");
    f.probe
        .inner
        .store(&raw, foreign.clone(), None)
        .await
        .unwrap();
    for r in [
        s.acquire(&req("foreign", "a")).await.map(drop),
        s.get(&key("foreign")).await.map(drop),
        s.delete(&key("foreign")).await.map(drop),
    ] {
        assert!(
            matches!(&r, Err(Error::CorruptRecord { store: "probe", .. })),
            "{r:?}"
        );
    }
    assert_eq!(
        f.probe.inner.load(&raw).await.unwrap().unwrap().value,
        foreign
    );
}

#[tokio::test]
async fn leases_are_judged_on_the_backends_clock_when_it_has_one() {
    let server = Arc::new(ManualClock::new(
        UNIX_EPOCH + Duration::from_secs(2_000_000_000),
    ));
    let f = fixture_with(Probe {
        clock: Some(server.clone()),
        ..Probe::default()
    });
    let s = &f.store;
    let lease = acquired(s, &req("k", "a")).await;
    assert_eq!(
        lease.expires_at,
        UNIX_EPOCH + Duration::from_secs(2_000_000_010),
        "server time + lease"
    );
    f.clock.advance(Duration::from_secs(3600)); // the client clock does not matter
    assert!(matches!(
        s.acquire(&req("k", "b")).await.unwrap(),
        AcquireOutcome::InProgress { .. }
    ));
    server.advance(Duration::from_secs(11));
    match s.acquire(&req("k", "b")).await.unwrap() {
        AcquireOutcome::Acquired { takeover, lease: b } => {
            assert!(takeover);
            assert!(b.token > lease.token);
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn refusals_say_why() {
    let f = fixture();
    let s = &f.store;
    let a = acquired(s, &req("k", "a")).await;
    s.fail(&a, "boom", FailureKind::Retryable, RETENTION)
        .await
        .unwrap();
    assert!(matches!(
        s.complete(&a, Bytes::new(), RETENTION).await,
        Err(Error::LeaseLost {
            why: LostLease::NotInProgress {
                state: StateKind::Failed(FailureKind::Retryable)
            },
            ..
        })
    ));
    let b = acquired(s, &req("k", "b")).await;
    let r = s.release(&a).await;
    assert!(
        matches!(r, Err(Error::LeaseLost { why: LostLease::Superseded { current }, .. }) if current == b.token),
        "{r:?}"
    );
    let stale = Lease {
        token: FencingToken::new(1),
        ..b.clone()
    };
    assert!(
        s.extend(&stale, Duration::from_secs(1))
            .await
            .unwrap_err()
            .is_lease_lost()
    );
}

proptest! {
    /// Decoding never panics, whatever the bytes; what decodes re-encodes to the same bytes.
    #[test]
    fn decoding_anything_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..96)) {
        if let Ok(stored) = decode("t", &key("k"), &raw) {
            prop_assert_eq!(&encode(&stored)[..], &raw[..]);
        }
    }

    /// A valid value with one byte changed decodes to something else or is refused.
    #[test]
    fn flipped_bytes_never_panic(at in 0usize..64, to in any::<u8>()) {
        let record = idem_core::Record {
            key: key("k"),
            state: RecordState::Failed { error: "e".into(), kind: FailureKind::Terminal },
            fingerprint: None,
            token: FencingToken::new(42),
            owner: "o".into(),
            attempts: 2,
            lease_expires_at: None,
            created_at: UNIX_EPOCH + Duration::from_secs(1),
            updated_at: UNIX_EPOCH + Duration::from_secs(2),
            expires_at: Some(UNIX_EPOCH + Duration::from_secs(3)),
        };
        let mut raw = encode(&Stored::Record(record)).to_vec();
        let at = at % raw.len();
        raw[at] = to;
        let _ = decode("t", &key("k"), &raw);
    }
}

/// The default batch loops stop at the first item that finds the store unavailable and answer
/// it as the whole call's `Err`, as the stores with native batches do: before, every item waited
/// out its own timeout (a batch of 100 on SQLite: up to 100 busy timeouts) and the call answered
/// `Ok` with an `Unavailable` per item.
#[tokio::test]
async fn a_default_batch_stops_at_the_first_unavailable_item() {
    let f = fixture();
    f.probe.fail_load.store(u32::MAX, Ordering::SeqCst);
    let reqs: Vec<_> = (0..10).map(|i| req(&format!("b{i}"), "o")).collect();
    let before = f.probe.calls();
    let answer = f.store.acquire_many(&reqs).await;
    assert!(
        matches!(answer, Err(Error::Unavailable { .. })),
        "the call's Err: {answer:?}"
    );
    assert_eq!(
        f.probe.calls().0 - before.0,
        1,
        "only the first item reached the backend"
    );

    // Per-item errors stay per item: an invalid lease does not stop the others.
    f.probe.fail_load.store(0, Ordering::SeqCst);
    let lease = acquired(&f.store, &req("c0", "o")).await;
    let mut forged = lease.clone();
    forged.token = FencingToken::new(lease.token.get() + 1_000_000_000);
    let items = [
        Completion::new(forged, Bytes::from_static(b"x")),
        Completion::new(lease, Bytes::from_static(b"y")),
    ];
    let answers = f.store.complete_many(&items, RETENTION).await.unwrap();
    assert!(
        answers[0].as_ref().is_err_and(Error::is_lease_lost),
        "{answers:?}"
    );
    assert!(answers[1].is_ok(), "{answers:?}");
}

/// `MemoryStore`'s outage answers a batch as the call's `Err`, as Redis and PostgreSQL do.
#[tokio::test]
async fn memory_store_outage_fails_each_batch_call_as_a_whole() {
    let store = idem_core::MemoryStore::new();
    let lease = acquired(&store, &req("m0", "o")).await;
    store.set_available(false);
    let reqs = [req("m1", "o"), req("m2", "o")];
    assert!(matches!(
        store.acquire_many(&reqs).await,
        Err(Error::Unavailable { .. })
    ));
    let completions = [Completion::new(lease.clone(), Bytes::from_static(b"r"))];
    assert!(matches!(
        store.complete_many(&completions, RETENTION).await,
        Err(Error::Unavailable { .. })
    ));
    let failures = [Failure::new(lease.clone(), "e", FailureKind::Retryable)];
    assert!(matches!(
        store.fail_many(&failures, RETENTION).await,
        Err(Error::Unavailable { .. })
    ));
    assert!(matches!(
        store.release_many(std::slice::from_ref(&lease)).await,
        Err(Error::Unavailable { .. })
    ));
    store.set_available(true);
    assert!(
        store
            .get(&lease.key)
            .await
            .unwrap()
            .is_some_and(|r| r.state.kind() == StateKind::InProgress)
    );
}

/// A key whose token is at the end of the 64-bit range (a foreign value, a broken clock) has no
/// higher token to give: the acquire is refused and nothing is written. Before, the token
/// saturated, the new holder got the old one's token, and the holder it took over from still
/// passed the fence and completed.
#[tokio::test]
async fn no_token_past_the_end_of_the_range_is_handed_out_twice() {
    let f = fixture();
    let raw = storage_key(&key("end"));
    let tombstone = encode(&Stored::Tombstone(FencingToken::new(u64::MAX - 5)));
    f.probe
        .inner
        .store(&raw, tombstone.clone(), None)
        .await
        .unwrap();
    let stores = f.probe.calls().1;
    let answer = f.store.acquire(&req("end", "o")).await;
    assert!(
        matches!(answer, Err(Error::CorruptRecord { .. })),
        "{answer:?}"
    );
    assert_eq!(f.probe.calls().1, stores, "nothing written");
    let kept = f.probe.inner.load(&raw).await.unwrap().unwrap();
    assert_eq!(kept.value, tombstone);
}

/// A clock past the year 9999 (a broken clock, a garbage server time) is a typed error before
/// anything is written, on `MemoryStore` and the kit alike. Before, the deadline it gave
/// overflowed `SystemTime` and panicked, in `MemoryStore` after the record had been changed in
/// place: the record stayed completed with no retention, outside every listing.
#[tokio::test]
async fn a_clock_past_the_year_9999_is_refused_before_anything_changes() {
    let start = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let memory_clock = Arc::new(ManualClock::new(start));
    let memory = idem_core::MemoryStore::with_clock(memory_clock.clone());
    let f = fixture();
    let memory_lease = acquired(&memory, &req("far", "o")).await;
    let kit_lease = acquired(&f.store, &req("far", "o")).await;
    // Near the end of what `SystemTime` holds on this platform, or at least past the year 9999.
    let far =
        Duration::from_secs(i64::MAX as u64 - 1_000 * 86_400) - Duration::from_secs(1_700_000_000);
    let far = if start.checked_add(far).is_some() {
        far
    } else {
        Duration::from_secs(300_000_000_000)
    };
    memory_clock.advance(far);
    f.clock.advance(far);
    let ten_years = idem_core::MAX_RETENTION;
    for (name, store, lease) in [
        ("memory", &memory as &dyn IdempotencyStore, &memory_lease),
        ("kit", &f.store as &dyn IdempotencyStore, &kit_lease),
    ] {
        let completed = store
            .complete(lease, Bytes::from_static(b"r"), ten_years)
            .await;
        assert!(
            matches!(completed, Err(Error::Backend { .. })),
            "{name}: {completed:?}"
        );
        let acquire = store.acquire(&req("other", "o")).await;
        assert!(
            matches!(acquire, Err(Error::Backend { .. })),
            "{name}: {acquire:?}"
        );
    }
    memory_clock.set(start + Duration::from_secs(1));
    f.clock.set(start + Duration::from_secs(1));
    for (name, store, lease) in [
        ("memory", &memory as &dyn IdempotencyStore, &memory_lease),
        ("kit", &f.store as &dyn IdempotencyStore, &kit_lease),
    ] {
        let record = store.get(&lease.key).await.unwrap().unwrap();
        assert_eq!(
            record.state.kind(),
            StateKind::InProgress,
            "{name}: unchanged"
        );
        assert_eq!(store.get(&key("other")).await.unwrap(), None, "{name}");
    }
}
