//! The scenarios C01-C24 and C26 of the contract, one `pub async fn` each.
//!
//! Every scenario panics with a message naming the broken rule and the value it got.

use std::collections::{HashMap, VecDeque};
use std::fmt::Debug;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use idem_core::{
    AcquireOutcome, AcquireRequest, Error, FailureKind, FencingToken, Fingerprint, IdempotencyKey,
    Lease, ListQuery, LostLease, MAX_ID_LEN, Namespace, Record, RecordState, Result, StateKind,
    Status,
};
use rand::Rng;
use rand::seq::SliceRandom;

use crate::{Harness, Ledger};

const A: &str = "worker-a";
const B: &str = "worker-b";
const C: &str = "worker-c";

/// Timestamps may be rounded by a backend (milliseconds in Redis): compare within this.
const TIME_TOLERANCE: Duration = Duration::from_millis(5);

fn payload_fp() -> Fingerprint {
    Fingerprint::of("payload")
}

/// A request with the long lease (which never expires during a scenario).
fn request(h: &Harness, key: &IdempotencyKey, owner: &str) -> AcquireRequest {
    AcquireRequest::new(key.clone(), owner)
        .with_fingerprint(payload_fp())
        .with_lease_ttl(h.config().long_lease_ttl)
        .with_max_attempts(5)
}

/// A request with the short lease (which scenarios let expire).
fn short_request(h: &Harness, key: &IdempotencyKey, owner: &str) -> AcquireRequest {
    request(h, key, owner).with_lease_ttl(h.config().lease_ttl)
}

async fn acquire(h: &Harness, req: &AcquireRequest) -> AcquireOutcome {
    h.store()
        .acquire(req)
        .await
        .unwrap_or_else(|e| panic!("acquire of {} failed: {e:?}", req.key))
}

async fn acquired(h: &Harness, req: &AcquireRequest) -> (Lease, bool) {
    match acquire(h, req).await {
        AcquireOutcome::Acquired { lease, takeover } => (lease, takeover),
        other => panic!("acquire of {} should be Acquired, got {other:?}", req.key),
    }
}

async fn get(h: &Harness, key: &IdempotencyKey) -> Option<Record> {
    h.store()
        .get(key)
        .await
        .unwrap_or_else(|e| panic!("get of {key} failed: {e:?}"))
}

async fn must_get(h: &Harness, key: &IdempotencyKey) -> Record {
    get(h, key)
        .await
        .unwrap_or_else(|| panic!("record of {key} should exist"))
}

async fn complete(h: &Harness, lease: &Lease, result: impl Into<Bytes>) {
    h.store()
        .complete(lease, result.into(), h.config().retention)
        .await
        .unwrap_or_else(|e| panic!("complete of {} failed: {e:?}", lease.key));
}

async fn fail(h: &Harness, lease: &Lease, error: &str, retryable: bool) {
    h.store()
        .fail(lease, error, kind_of(retryable), h.config().retention)
        .await
        .unwrap_or_else(|e| panic!("fail of {} failed: {e:?}", lease.key));
}

fn kind_of(retryable: bool) -> FailureKind {
    if retryable {
        FailureKind::Retryable
    } else {
        FailureKind::Terminal
    }
}

fn close(a: SystemTime, b: SystemTime, tolerance: Duration) -> bool {
    match a.duration_since(b) {
        Ok(d) => d <= tolerance,
        Err(e) => e.duration() <= tolerance,
    }
}

#[track_caller]
fn assert_lease_lost<T: Debug>(
    what: &str,
    r: Result<T>,
    presented: FencingToken,
    current: Option<FencingToken>,
) {
    let expected = match current {
        Some(current) => LostLease::Superseded { current },
        None => LostLease::Gone,
    };
    match r {
        Err(Error::LeaseLost {
            presented: p, why, ..
        }) => {
            assert_eq!(
                p, presented,
                "{what}: LeaseLost should name the presented token"
            );
            assert_eq!(
                why, expected,
                "{what}: LeaseLost should say what the store found"
            );
        }
        other => panic!("{what} with a stale token should be LeaseLost, got {other:?}"),
    }
}

/// Checks a record is unchanged, with timestamps compared within [`TIME_TOLERANCE`].
#[track_caller]
fn assert_unchanged(what: &str, before: &Option<Record>, after: &Option<Record>) {
    assert_eq!(before, after, "{what} must leave the record untouched");
}

/// C01: a fresh key is acquired with attempt 1, no takeover, and the record shows it.
pub async fn c01_fresh_acquire(h: &Harness) {
    let ns = h.namespace();
    let key = h.key(&ns, "order-1");
    assert_eq!(get(h, &key).await, None, "C01: a fresh key has no record");
    let (lease, takeover) = acquired(h, &request(h, &key, A)).await;
    assert!(!takeover, "C01: a fresh acquire is not a takeover");
    assert_eq!(lease.attempt, 1, "C01: first attempt");
    assert_eq!(lease.owner, A);
    assert_eq!(lease.key, key);
    let record = must_get(h, &key).await;
    assert_eq!(record.state, RecordState::InProgress, "C01: {record:?}");
    assert_eq!(
        record.token, lease.token,
        "C01: record carries the lease's token"
    );
    assert_eq!(record.attempts, 1);
    assert_eq!(record.owner, A);
    assert_eq!(record.fingerprint, Some(payload_fp()));
    assert_eq!(
        record.expires_at, None,
        "C01: no retention while in progress"
    );
    let lease_end = record.lease_expires_at.expect("C01: lease expiry recorded");
    assert!(
        close(lease_end, lease.expires_at, TIME_TOLERANCE),
        "C01: record lease end {lease_end:?} vs lease {:?}",
        lease.expires_at
    );
}

/// C02: 64 concurrent acquires of one key: exactly one wins, the rest see it in progress; over
/// many keys.
pub async fn c02_race_one_winner(h: &Harness) {
    const RACERS: usize = 64;
    let ns = h.namespace();
    for k in 0..h.config().race_keys {
        let key = h.key(&ns, &format!("race-{k}"));
        let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
        let tasks: Vec<_> = (0..RACERS)
            .map(|i| {
                let store = h.store().clone();
                let req = request(h, &key, &format!("racer-{i}"));
                let barrier = barrier.clone();
                tokio::spawn(async move {
                    barrier.wait().await;
                    store.acquire(&req).await
                })
            })
            .collect();
        let mut winners = Vec::new();
        let mut busy_owners = Vec::new();
        for task in futures::future::join_all(tasks).await {
            match task.expect("racer task") {
                Ok(AcquireOutcome::Acquired { lease, .. }) => winners.push(lease),
                Ok(AcquireOutcome::InProgress { owner, .. }) => busy_owners.push(owner),
                other => panic!("C02: racer got {other:?}"),
            }
        }
        assert_eq!(
            winners.len(),
            1,
            "C02: exactly one of {RACERS} concurrent acquires of {key} must win, got {winners:?}"
        );
        let winner = &winners[0];
        assert!(
            busy_owners.iter().all(|o| *o == winner.owner),
            "C02: losers must see the winner {} as owner, got {busy_owners:?}",
            winner.owner
        );
        let record = must_get(h, &key).await;
        assert_eq!(record.token, winner.token, "C02: the winner's token stands");
        assert_eq!(record.attempts, 1, "C02: one attempt counted");
    }
}

/// C03: a completed key replays its result byte for byte, to every duplicate.
pub async fn c03_replay_byte_identical(h: &Harness) {
    let ns = h.namespace();
    let big: Vec<u8> = (0..64 * 1024).map(|i| (i * 7 % 256) as u8).collect();
    let results: Vec<Vec<u8>> = vec![
        Vec::new(),
        vec![0, 255, 0, 1, 128, 0],
        "ünïcödé \"quoted\" 'single' \n\r\t".as_bytes().to_vec(),
        br#"{"amount":100,"currency":"EUR"}"#.to_vec(),
        big,
    ];
    for (i, result) in results.into_iter().enumerate() {
        let key = h.key(&ns, &format!("replay-{i}"));
        let (lease, _) = acquired(h, &request(h, &key, A)).await;
        complete(h, &lease, result.clone()).await;
        for owner in [B, C, A] {
            match acquire(h, &request(h, &key, owner)).await {
                AcquireOutcome::Replayed { result: got } => assert!(
                    got[..] == result[..],
                    "C03: replay of result {i} must be byte-identical ({} vs {} bytes)",
                    got.len(),
                    result.len()
                ),
                other => panic!("C03: duplicate of a completed key should replay, got {other:?}"),
            }
        }
    }
}

/// C04: a different fingerprint conflicts in every state and leaves the record untouched; a
/// missing fingerprint on either side never conflicts.
pub async fn c04_conflict_in_every_state(h: &Harness) {
    let ns = h.namespace();
    let other_fp = Fingerprint::of("another payload");

    let in_progress = h.key(&ns, "in-progress");
    acquired(h, &request(h, &in_progress, A)).await;

    let completed = h.key(&ns, "completed");
    let (lease, _) = acquired(h, &request(h, &completed, A)).await;
    complete(h, &lease, "done").await;

    let failed_retryable = h.key(&ns, "failed-retryable");
    let (lease, _) = acquired(h, &request(h, &failed_retryable, A)).await;
    fail(h, &lease, "transient", true).await;

    let failed_terminal = h.key(&ns, "failed-terminal");
    let (lease, _) = acquired(h, &request(h, &failed_terminal, A)).await;
    fail(h, &lease, "declined", false).await;

    let released = h.key(&ns, "released");
    let (lease, _) = acquired(h, &request(h, &released, A)).await;
    h.store().release(&lease).await.expect("release");

    let expired_lease = h.key(&ns, "expired-lease");
    acquired(h, &short_request(h, &expired_lease, A)).await;
    h.config().time.pass(h.config().lease_ttl).await;

    for key in [
        &in_progress,
        &completed,
        &failed_retryable,
        &failed_terminal,
        &released,
        &expired_lease,
    ] {
        let before = get(h, key).await;
        let req = request(h, key, B).with_fingerprint(other_fp);
        let out = acquire(h, &req).await;
        assert_eq!(
            out,
            AcquireOutcome::Conflict,
            "C04: a different fingerprint on {key} must conflict"
        );
        assert_unchanged("C04: a conflict", &before, &get(h, key).await);
    }

    // Without a fingerprint on the request, the completed key replays instead of conflicting.
    let out = acquire(h, &request(h, &completed, B).with_fingerprint(None)).await;
    assert!(
        matches!(out, AcquireOutcome::Replayed { .. }),
        "C04: a request without fingerprint never conflicts, got {out:?}"
    );
    // A record stored without fingerprint never conflicts either.
    let opted_out = h.key(&ns, "opted-out");
    let (lease, _) = acquired(h, &request(h, &opted_out, A).with_fingerprint(None)).await;
    complete(h, &lease, "x").await;
    let out = acquire(h, &request(h, &opted_out, B).with_fingerprint(other_fp)).await;
    assert!(
        matches!(out, AcquireOutcome::Replayed { .. }),
        "C04: a record without fingerprint never conflicts, got {out:?}"
    );
}

/// C05: a live lease makes others wait: `InProgress` with the owner and a retry-after no longer
/// than the lease; the record is untouched.
pub async fn c05_busy_with_retry_after(h: &Harness) {
    let ns = h.namespace();
    let key = h.key(&ns, "busy");
    // The long lease: on a slow store (DynamoDB on LocalStack under load) three calls can take
    // longer than the short one, which would then expire between them.
    let lease_ttl = h.config().long_lease_ttl;
    acquired(h, &request(h, &key, A)).await;
    let before = get(h, &key).await;
    match acquire(h, &request(h, &key, B)).await {
        AcquireOutcome::InProgress { owner, retry_after } => {
            assert_eq!(owner, A, "C05: busy names the holder");
            assert!(
                retry_after > Duration::ZERO && retry_after <= lease_ttl,
                "C05: retry_after {retry_after:?} must be within the lease {lease_ttl:?}"
            );
        }
        other => panic!("C05: a held key should be InProgress, got {other:?}"),
    }
    assert_unchanged("C05: a busy acquire", &before, &get(h, &key).await);
}

/// Acquires with a short lease as A, lets it expire and takes it over as B.
async fn takeover(h: &Harness, key: &IdempotencyKey) -> (Lease, Lease) {
    let (a, _) = acquired(h, &short_request(h, key, A)).await;
    h.config().time.pass(h.config().lease_ttl).await;
    let (b, takeover) = acquired(h, &short_request(h, key, B)).await;
    assert!(takeover, "C06: acquiring an expired lease is a takeover");
    (a, b)
}

/// C06: after a holder crashes and its lease expires, another worker takes over with a higher
/// token and the next attempt number.
pub async fn c06_crash_takeover(h: &Harness) {
    let ns = h.namespace();
    let key = h.key(&ns, "crash");
    let (a, b) = takeover(h, &key).await;
    assert!(
        b.token > a.token,
        "C06: a takeover must issue a higher token ({} then {})",
        a.token,
        b.token
    );
    assert_eq!(b.attempt, 2, "C06: a takeover is attempt n+1");
    let record = must_get(h, &key).await;
    assert_eq!(record.token, b.token);
    assert_eq!(record.owner, B);
    assert_eq!(record.attempts, 2);
    assert_eq!(record.state, RecordState::InProgress);
}

/// C07: the holder that lost its lease (a zombie) can no longer extend, complete, fail or
/// release, and each refusal leaves the new holder's record intact.
pub async fn c07_zombie_fenced(h: &Harness) {
    let ns = h.namespace();
    let key = h.key(&ns, "zombie");
    let (a, b) = takeover(h, &key).await;
    let store = h.store();
    let retention = h.config().retention;
    let before = get(h, &key).await;
    let current = Some(b.token);
    assert_lease_lost(
        "C07 extend",
        store.extend(&a, h.config().lease_ttl).await,
        a.token,
        current,
    );
    assert_unchanged("C07: a refused extend", &before, &get(h, &key).await);
    assert_lease_lost(
        "C07 complete",
        store
            .complete(&a, Bytes::from_static(b"zombie"), retention)
            .await,
        a.token,
        current,
    );
    assert_unchanged("C07: a refused complete", &before, &get(h, &key).await);
    assert_lease_lost(
        "C07 fail",
        store
            .fail(&a, "zombie", FailureKind::Retryable, retention)
            .await,
        a.token,
        current,
    );
    assert_unchanged("C07: a refused fail", &before, &get(h, &key).await);
    assert_lease_lost("C07 release", store.release(&a).await, a.token, current);
    assert_unchanged("C07: a refused release", &before, &get(h, &key).await);

    // The rightful holder still finishes, and the zombie cannot overwrite the result afterwards.
    complete(h, &b, "rightful").await;
    assert_lease_lost(
        "C07 complete after the holder completed",
        store
            .complete(&a, Bytes::from_static(b"zombie"), retention)
            .await,
        a.token,
        current,
    );
    match acquire(h, &request(h, &key, C)).await {
        AcquireOutcome::Replayed { result } => assert_eq!(&result[..], b"rightful"),
        other => panic!("C07: expected the rightful result, got {other:?}"),
    }
}

/// C08: heartbeats keep a lease alive well past its first expiry.
pub async fn c08_heartbeat_keeps_lease(h: &Harness) {
    let ns = h.namespace();
    let key = h.key(&ns, "heartbeat");
    let ttl = h.config().lease_ttl;
    let (mut lease, _) = acquired(h, &short_request(h, &key, A)).await;
    let first_expiry = lease.expires_at;
    // Six heartbeats a third of a lease apart: twice the lease in all.
    for beat in 0..6 {
        h.config().time.pass_exact(ttl / 3).await;
        let extended = h
            .store()
            .extend(&lease, ttl)
            .await
            .unwrap_or_else(|e| panic!("C08: heartbeat {beat} failed: {e:?}"));
        assert_eq!(
            extended.token, lease.token,
            "C08: a heartbeat keeps the token"
        );
        assert!(
            extended.expires_at >= lease.expires_at,
            "C08: never shortens"
        );
        lease = extended;
    }
    assert!(
        lease.expires_at > first_expiry + ttl,
        "C08: the lease should now end well after its first expiry"
    );
    // The store keeps what the heartbeats set.
    let stored = get(h, &key).await.expect("C08: the record is there");
    assert!(
        stored
            .lease_expires_at
            .is_some_and(|at| at > first_expiry + ttl),
        "C08: the store must keep the heartbeated expiry, got {:?}",
        stored.lease_expires_at
    );
    // A last, long heartbeat: B's acquire below then meets the lease held however slow the
    // server is (with a short one, a request slower than a lease would let it lapse), and still
    // well past the first expiry.
    lease = h
        .store()
        .extend(&lease, h.config().long_lease_ttl)
        .await
        .expect("C08: the last heartbeat");
    match acquire(h, &short_request(h, &key, B)).await {
        AcquireOutcome::InProgress { owner, .. } => assert_eq!(owner, A),
        other => panic!("C08: a heartbeated lease must stay held, got {other:?}"),
    }
    complete(h, &lease, "ok").await;
    assert!(matches!(
        acquire(h, &request(h, &key, B)).await,
        AcquireOutcome::Replayed { .. }
    ));
}

/// C09: a retryable failure lets the next acquire run the work again as attempt 2.
pub async fn c09_retryable_failure_reacquires(h: &Harness) {
    let ns = h.namespace();
    let key = h.key(&ns, "retryable");
    let (a, _) = acquired(h, &request(h, &key, A)).await;
    fail(h, &a, "timeout talking to the bank", true).await;
    let record = must_get(h, &key).await;
    assert_eq!(
        record.state,
        RecordState::Failed {
            error: "timeout talking to the bank".into(),
            kind: FailureKind::Retryable
        }
    );
    assert_eq!(record.attempts, 1);
    let (b, takeover) = acquired(h, &request(h, &key, B)).await;
    assert!(
        !takeover,
        "C09: re-acquiring a failed key is not a takeover"
    );
    assert_eq!(b.attempt, 2, "C09: the retry is attempt 2");
    assert!(b.token > a.token, "C09: a retry gets a higher token");
}

/// C10: failures and crashes both count; at the maximum the key is `Exhausted`, for every later
/// acquire, and the record is not changed by them.
pub async fn c10_poison_exhausted(h: &Harness) {
    let ns = h.namespace();
    for (id, last_crashes) in [("poison-fail", false), ("poison-crash", true)] {
        let key = h.key(&ns, id);
        let req = |owner: &str| short_request(h, &key, owner).with_max_attempts(3);
        let (first, _) = acquired(h, &req(A)).await;
        fail(h, &first, "e1", true).await;
        let (second, _) = acquired(h, &req(B)).await;
        assert_eq!(second.attempt, 2);
        // The second attempt crashes: its lease expires.
        h.config().time.pass(h.config().lease_ttl).await;
        let (third, takeover) = acquired(h, &req(C)).await;
        assert!(takeover);
        assert_eq!(third.attempt, 3, "C10: a crash counts as an attempt");
        let expected_error = if last_crashes {
            h.config().time.pass(h.config().lease_ttl).await;
            None
        } else {
            fail(h, &third, "e3", true).await;
            Some("e3".to_owned())
        };
        let before = get(h, &key).await;
        for _ in 0..3 {
            let out = acquire(h, &req(A)).await;
            assert_eq!(
                out,
                AcquireOutcome::Exhausted {
                    attempts: 3,
                    last_error: expected_error.clone()
                },
                "C10: {id} must be exhausted after 3 attempts, every time"
            );
        }
        assert_unchanged("C10: an exhausted acquire", &before, &get(h, &key).await);
    }
}

/// C11: a terminal failure is replayed and the work never runs again.
pub async fn c11_terminal_failure_replayed(h: &Harness) {
    let ns = h.namespace();
    let key = h.key(&ns, "terminal");
    let (a, _) = acquired(h, &request(h, &key, A)).await;
    fail(h, &a, "card declined", false).await;
    let before = get(h, &key).await;
    for owner in [B, C] {
        let out = acquire(h, &request(h, &key, owner).with_max_attempts(100)).await;
        assert_eq!(
            out,
            AcquireOutcome::Failed {
                error: "card declined".into(),
                kind: FailureKind::Terminal,
            },
            "C11: a terminal failure is replayed"
        );
    }
    assert_unchanged("C11: a replayed failure", &before, &get(h, &key).await);
}

/// C12: a release gives the key back at once and does not count an attempt.
pub async fn c12_release_does_not_count(h: &Harness) {
    let ns = h.namespace();
    let key = h.key(&ns, "release");
    let req = |owner: &str| request(h, &key, owner).with_max_attempts(1);
    let (a, _) = acquired(h, &req(A)).await;
    h.store().release(&a).await.expect("C12: release");
    let record = must_get(h, &key).await;
    assert_eq!(record.state, RecordState::Released, "C12: {record:?}");
    assert_eq!(record.attempts, 0, "C12: a released attempt is not counted");
    let (b, takeover) = acquired(h, &req(B)).await;
    assert!(
        !takeover,
        "C12: re-acquiring a released key is not a takeover"
    );
    assert_eq!(b.attempt, 1, "C12: the released attempt was not counted");
    assert!(b.token > a.token, "C12: a higher token after release");
    assert_lease_lost(
        "C12 complete by the releaser",
        h.store()
            .complete(&a, Bytes::from_static(b"late"), h.config().retention)
            .await,
        a.token,
        Some(b.token),
    );
    h.store().release(&b).await.expect("C12: second release");
    let (c, _) = acquired(h, &req(C)).await;
    assert_eq!(c.attempt, 1, "C12: releases never exhaust a key");
}

/// C13: a record past retention is gone, whatever it finished as (completed, failed retryable,
/// failed terminal, result not stored): it reads absent, a re-sent finishing transition and an
/// `extend` of its lease are refused as gone, `delete` finds nothing, and the next acquire is
/// fresh (attempt 1, no takeover, no conflict even with another fingerprint) with a token still
/// higher than every earlier one.
pub async fn c13_retention_expiry(h: &Harness) {
    let ns = h.namespace();
    let retention = h.config().short_retention;
    let kinds: [(&str, Option<FailureKind>); 4] = [
        ("retention-completed", None),
        ("retention-retryable", Some(FailureKind::Retryable)),
        ("retention-terminal", Some(FailureKind::Terminal)),
        ("retention-not-stored", Some(FailureKind::ResultNotStored)),
    ];
    // Each kind on two keys: one the finishing transitions and the acquire meet past retention,
    // one `delete` meets first (a delete leaves nothing behind, so it would hide what an
    // acquire finds).
    let mut finished = Vec::new();
    for (id, kind) in kinds {
        for deleted in [false, true] {
            let key = h.key(
                &ns,
                &format!("{id}-{}", if deleted { "deleted" } else { "kept" }),
            );
            let (a, _) = acquired(h, &request(h, &key, A)).await;
            let finishing = Instant::now();
            match kind {
                None => h
                    .store()
                    .complete(&a, Bytes::from_static(b"old"), retention)
                    .await
                    .expect("complete"),
                Some(kind) => h
                    .store()
                    .fail(&a, "declined", kind, retention)
                    .await
                    .expect("fail"),
            }
            // Kept until retention. (A read that comes back later than a retention after the
            // finishing transition began may find the record gone: a slow server, not a bug.)
            let read = get(h, &key).await;
            assert!(
                read.is_some()
                    || (!h.config().time.is_manual() && finishing.elapsed() >= retention),
                "C13: {id} kept until retention"
            );
            finished.push((id, kind, deleted, key, a));
        }
    }
    h.config().time.pass(retention).await;
    for (id, kind, deleted, key, a) in finished {
        assert_eq!(
            get(h, &key).await,
            None,
            "C13: {id} past retention reads absent"
        );
        if deleted {
            assert!(
                !h.store().delete(&key).await.expect("delete"),
                "C13: {id} past retention leaves nothing to delete"
            );
        } else {
            let resent = match kind {
                None => {
                    h.store()
                        .complete(&a, Bytes::from_static(b"old"), retention)
                        .await
                }
                Some(kind) => h.store().fail(&a, "declined", kind, retention).await,
            };
            assert_lease_lost(
                &format!("C13: {id} finishing again past retention"),
                resent,
                a.token,
                None,
            );
            assert_lease_lost(
                &format!("C13: {id} extend past retention"),
                h.store().extend(&a, h.config().lease_ttl).await,
                a.token,
                None,
            );
        }
        let other = request(h, &key, B).with_fingerprint(Fingerprint::of("another payload"));
        let (b, takeover) = acquired(h, &other).await;
        assert!(!takeover, "C13: {id} a fresh acquire is no takeover");
        assert_eq!(b.attempt, 1, "C13: {id} a fresh acquire after retention");
        assert!(
            b.token > a.token,
            "C13: {id} tokens stay increasing after expiry ({} then {})",
            a.token,
            b.token
        );
        assert_eq!(
            must_get(h, &key).await.fingerprint,
            Some(Fingerprint::of("another payload")),
            "C13: {id} the fresh record carries the new fingerprint"
        );
    }
}

/// C14: an operator delete removes the record; the holder is fenced out and the next acquire is
/// fresh with a higher token.
pub async fn c14_operator_delete(h: &Harness) {
    let ns = h.namespace();
    let key = h.key(&ns, "delete");
    let (a, _) = acquired(h, &request(h, &key, A)).await;
    complete(h, &a, "x").await;
    assert!(
        h.store().delete(&key).await.expect("delete"),
        "C14: deleted"
    );
    assert_eq!(get(h, &key).await, None);
    assert!(
        !h.store().delete(&key).await.expect("delete"),
        "C14: nothing left"
    );
    let (b, _) = acquired(h, &request(h, &key, B)).await;
    assert_eq!(b.attempt, 1);
    assert!(
        b.token > a.token,
        "C14: tokens stay increasing after delete"
    );
    // Deleting an in-progress record fences its holder out.
    assert!(h.store().delete(&key).await.expect("delete"));
    assert_lease_lost(
        "C14 complete after delete",
        h.store()
            .complete(&b, Bytes::from_static(b"late"), h.config().retention)
            .await,
        b.token,
        None,
    );
    assert_eq!(
        get(h, &key).await,
        None,
        "C14: a refused complete writes nothing"
    );
    let (c, _) = acquired(h, &request(h, &key, C)).await;
    assert!(c.token > b.token);
}

/// C15: the same id in two namespaces is two independent keys.
pub async fn c15_namespaces_isolated(h: &Harness) {
    let (ns1, ns2) = (h.namespace(), h.namespace());
    let (k1, k2) = (h.key(&ns1, "evt-42"), h.key(&ns2, "evt-42"));
    let (l1, _) = acquired(h, &request(h, &k1, A)).await;
    let (l2, _) = acquired(h, &request(h, &k2, B)).await;
    complete(h, &l1, "one").await;
    assert_eq!(must_get(h, &k2).await.state, RecordState::InProgress);
    complete(h, &l2, "two").await;
    for (key, expected) in [(&k1, "one"), (&k2, "two")] {
        match acquire(h, &request(h, key, C)).await {
            AcquireOutcome::Replayed { result } => assert_eq!(&result[..], expected.as_bytes()),
            other => panic!("C15: {key} should replay {expected}, got {other:?}"),
        }
    }
    assert!(h.store().delete(&k1).await.expect("delete"));
    assert!(
        get(h, &k2).await.is_some(),
        "C15: a delete stays in its namespace"
    );
}

#[track_caller]
fn assert_invalid<T: Debug>(what: &str, r: Result<T>, field: &str) {
    match r {
        Err(Error::InvalidInput { field: f, .. }) => assert_eq!(f, field, "{what}"),
        other => panic!("{what} should be InvalidInput({field}), got {other:?}"),
    }
}

/// C16: bad input is a typed error and writes nothing.
pub async fn c16_bad_input_rejected(h: &Harness) {
    let ns = h.namespace();
    assert_invalid("C16 empty key", ns.key(""), "key");
    assert_invalid(
        "C16 oversized key",
        ns.key("k".repeat(MAX_ID_LEN + 1)),
        "key",
    );
    let store = h.store();
    let key = h.key(&ns, "bad-input");

    let bad_requests = [
        (request(h, &key, ""), "owner"),
        (request(h, &key, &"o".repeat(1024)), "owner"),
        (
            request(h, &key, A).with_lease_ttl(Duration::ZERO),
            "lease_ttl",
        ),
        (request(h, &key, A).with_max_attempts(0), "max_attempts"),
    ];
    for (req, field) in bad_requests {
        assert_invalid("C16 acquire", store.acquire(&req).await, field);
        assert_eq!(
            get(h, &key).await,
            None,
            "C16: a rejected acquire writes nothing"
        );
    }

    let (lease, _) = acquired(h, &request(h, &key, A)).await;
    let before = get(h, &key).await;
    let limits = store.limits();
    let too_big = Bytes::from(vec![b'x'; limits.max_result_len + 1]);
    match store.complete(&lease, too_big, h.config().retention).await {
        Err(Error::ResultTooLarge { len, max }) => {
            assert_eq!(
                (len, max),
                (limits.max_result_len + 1, limits.max_result_len)
            );
        }
        other => panic!("C16: an oversized result should be ResultTooLarge, got {other:?}"),
    }
    assert_unchanged("C16: an oversized result", &before, &get(h, &key).await);
    let long_error = "e".repeat(limits.max_error_len + 1);
    assert_invalid(
        "C16 oversized error",
        store
            .fail(
                &lease,
                &long_error,
                FailureKind::Retryable,
                h.config().retention,
            )
            .await,
        "error",
    );
    assert_unchanged("C16: an oversized error", &before, &get(h, &key).await);
    assert_invalid(
        "C16 zero retention",
        store
            .complete(&lease, Bytes::from_static(b"x"), Duration::ZERO)
            .await,
        "retention",
    );
    assert_unchanged("C16: a zero retention", &before, &get(h, &key).await);
    assert_invalid(
        "C16 zero heartbeat",
        store.extend(&lease, Duration::ZERO).await,
        "lease_ttl",
    );
    assert_unchanged("C16: a zero heartbeat", &before, &get(h, &key).await);
    // The largest accepted result is accepted.
    let max = Bytes::from(vec![b'y'; limits.max_result_len]);
    store
        .complete(&lease, max.clone(), h.config().retention)
        .await
        .expect("C16: a result at the limit is accepted");
    match acquire(h, &request(h, &key, B)).await {
        AcquireOutcome::Replayed { result } => assert_eq!(result, max),
        other => panic!("C16: {other:?}"),
    }
}

/// Ids that break naive backends: quoting, wildcards, hash tags, separators, whitespace, unicode,
/// SQL and Lua metacharacters.
pub const HOSTILE_IDS: &[&str] = &[
    "'",
    "\"",
    "''",
    "'; DROP TABLE idem; --",
    "\" OR 1=1 --",
    "%",
    "%s%n%d",
    "a%b",
    "a_b",
    "*",
    "?",
    "[a-z]",
    "{",
    "}",
    "{}",
    "{tag}",
    "{tag}x",
    "x{tag}",
    "{tag}:{other}",
    ":",
    "a:b",
    "a::b",
    " ",
    "  ",
    " lead",
    "trail ",
    "tab\there",
    "new\nline",
    "\r\n",
    "\\",
    "\\\\'",
    "$1",
    "$$",
    "KEYS[1]",
    "ARGV[1]",
    "redis.call('FLUSHALL')",
    "]]..'",
    "--[[",
    "ünïcödé",
    "日本語のキー",
    "🦀🔥",
    "\u{202e}rtl",
    "NULL",
    "null",
    "0",
    "-1",
];

/// C17: hostile ids stay distinct and round-trip.
pub async fn c17_hostile_keys(h: &Harness) {
    let ns = h.namespace();
    let mut leases = Vec::new();
    for id in HOSTILE_IDS {
        let key = h.key(&ns, id);
        let (lease, takeover) = acquired(h, &request(h, &key, A)).await;
        assert!(!takeover, "C17: {id:?} must be a fresh key");
        leases.push(lease);
    }
    for lease in &leases {
        complete(h, lease, lease.key.id().as_bytes().to_vec()).await;
    }
    for id in HOSTILE_IDS {
        let key = h.key(&ns, id);
        match acquire(h, &request(h, &key, B)).await {
            AcquireOutcome::Replayed { result } => assert_eq!(
                &result[..],
                id.as_bytes(),
                "C17: {id:?} must replay its own result"
            ),
            other => panic!("C17: {id:?} should replay, got {other:?}"),
        }
        let record = must_get(h, &key).await;
        assert_eq!(record.key, key, "C17: get returns the same key");
        assert_eq!(record.key.id(), *id);
    }
    // Deleting one hostile key touches no other.
    let star = h.key(&ns, "*");
    assert!(h.store().delete(&star).await.expect("delete"));
    for id in HOSTILE_IDS.iter().filter(|id| **id != "*") {
        assert!(
            get(h, &h.key(&ns, id)).await.is_some(),
            "C17: deleting \"*\" must not touch {id:?}"
        );
    }
}

/// C18: `get` shows state, attempts, token, owner and consistent timestamps.
pub async fn c18_get_shows_record(h: &Harness) {
    let ns = h.namespace();
    let key = h.key(&ns, "inspect");
    let lease_ttl = h.config().long_lease_ttl;
    let (lease, _) = acquired(h, &request(h, &key, A)).await;
    let r1 = must_get(h, &key).await;
    assert_eq!(r1.key, key);
    assert_eq!(r1.state, RecordState::InProgress);
    assert_eq!(
        (r1.attempts, r1.token, r1.owner.as_str()),
        (1, lease.token, A)
    );
    assert!(
        close(r1.created_at, r1.updated_at, TIME_TOLERANCE),
        "C18: {r1:?}"
    );
    assert!(
        close(
            r1.lease_expires_at.expect("lease end"),
            r1.created_at + lease_ttl,
            TIME_TOLERANCE
        ),
        "C18: the lease ends lease_ttl after creation: {r1:?}"
    );
    assert_eq!(
        r1.lease_expires_at,
        Some(lease.expires_at),
        "C18: the lease acquire returned ends when the record says (times as the store keeps them)"
    );
    let wall = SystemTime::now();
    assert!(
        close(r1.created_at, wall, Duration::from_secs(600)),
        "C18: created_at {:?} is far from the wall clock {wall:?}",
        r1.created_at
    );

    h.config().time.pass_exact(Duration::from_millis(20)).await;
    let extended = h.store().extend(&lease, lease_ttl).await.expect("extend");
    let r2 = must_get(h, &key).await;
    assert!(
        r2.updated_at > r1.updated_at,
        "C18: extend moves updated_at"
    );
    assert!(r2.lease_expires_at > r1.lease_expires_at);
    assert_eq!(
        r2.lease_expires_at,
        Some(extended.expires_at),
        "C18: the lease extend returned ends when the record says"
    );
    assert_eq!(r2.created_at, r1.created_at, "C18: created_at never moves");

    let retention = h.config().retention;
    complete(h, &extended, "result").await;
    let r3 = must_get(h, &key).await;
    assert_eq!(
        r3.state,
        RecordState::Completed {
            result: Bytes::from_static(b"result")
        }
    );
    assert_eq!(r3.lease_expires_at, None, "C18: no lease once completed");
    assert_eq!(r3.created_at, r1.created_at);
    assert!(
        close(
            r3.expires_at.expect("retention deadline"),
            r3.updated_at + retention,
            TIME_TOLERANCE
        ),
        "C18: retention runs from completion: {r3:?}"
    );
    assert_eq!(
        (r3.attempts, r3.token, r3.owner.as_str()),
        (1, lease.token, A)
    );

    // A later attempt keeps the creation time of the first and reports its own owner, token and
    // update time.
    let key = h.key(&ns, "inspect-retry");
    let (first, _) = acquired(h, &request(h, &key, A)).await;
    fail(h, &first, "transient", true).await;
    let f1 = must_get(h, &key).await;
    h.config().time.pass_exact(Duration::from_millis(20)).await;
    let (second, _) = acquired(h, &request(h, &key, B)).await;
    let r4 = must_get(h, &key).await;
    assert_eq!(r4.state, RecordState::InProgress);
    assert_eq!(
        (r4.attempts, r4.token, r4.owner.as_str()),
        (2, second.token, B),
        "C18: {r4:?}"
    );
    assert_eq!(
        r4.created_at, f1.created_at,
        "C18: created_at is the first acquisition's: {r4:?} after {f1:?}"
    );
    assert!(
        r4.updated_at > f1.updated_at,
        "C18: a new attempt moves updated_at: {r4:?}"
    );
    assert_eq!(
        r4.expires_at, None,
        "C18: a record in progress has no retention deadline"
    );
}

/// C19: many workers, duplicated deliveries, random crashes and stalls past the lease, checked
/// against a fenced [`Ledger`]: exactly one effective completion per key, every key completed,
/// and the standing ledger write of each key is the completing acquisition's.
pub async fn c19_chaos_ledger(h: &Harness) {
    let cfg = h.config().clone();
    let ns = h.namespace();
    let keys: Arc<Vec<IdempotencyKey>> = Arc::new(
        (0..cfg.chaos_keys)
            .map(|i| h.key(&ns, &format!("chaos-{i}")))
            .collect(),
    );
    let mut deliveries: Vec<usize> = (0..cfg.chaos_keys)
        .flat_map(|k| std::iter::repeat_n(k, cfg.chaos_deliveries))
        .collect();
    deliveries.shuffle(&mut rand::rng());
    let total = deliveries.len();
    let queue = Arc::new(Mutex::new(VecDeque::from(deliveries)));
    let unresolved = Arc::new(AtomicUsize::new(total));
    let ledger = Arc::new(Ledger::new());
    let completions: Arc<Vec<AtomicU32>> =
        Arc::new((0..cfg.chaos_keys).map(|_| AtomicU32::new(0)).collect());
    let winners: Arc<Mutex<HashMap<usize, FencingToken>>> = Arc::default();
    let refused_completions = Arc::new(AtomicU32::new(0));

    let workers: Vec<_> = (0..cfg.chaos_workers)
        .map(|w| {
            let (store, cfg, keys, queue, unresolved, ledger, completions, winners, refused) = (
                h.store().clone(),
                cfg.clone(),
                keys.clone(),
                queue.clone(),
                unresolved.clone(),
                ledger.clone(),
                completions.clone(),
                winners.clone(),
                refused_completions.clone(),
            );
            tokio::spawn(async move {
                let owner = format!("chaos-{w}");
                let requeue = |k: usize| queue.lock().expect("queue").push_back(k);
                while unresolved.load(Ordering::SeqCst) > 0 {
                    let next = queue.lock().expect("queue").pop_front();
                    let Some(k) = next else {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        continue;
                    };
                    let key = &keys[k];
                    let req = AcquireRequest::new(key.clone(), owner.clone())
                        .with_fingerprint(Fingerprint::of(key.id()))
                        .with_lease_ttl(cfg.lease_ttl)
                        .with_max_attempts(10_000);
                    let outcome = store.acquire(&req).await.expect("C19 acquire");
                    match outcome {
                        AcquireOutcome::Acquired { lease, .. } => {
                            let dice: f64 = rand::rng().random();
                            if dice < 0.15 {
                                // Crash: the lease is dropped and the broker redelivers.
                                requeue(k);
                                continue;
                            }
                            if dice < 0.30 {
                                // Stall past the lease: a takeover may happen meanwhile.
                                cfg.time.pass(cfg.lease_ttl).await;
                            }
                            let value = lease.token.to_string();
                            ledger.write(key.id(), lease.token, value.as_bytes());
                            match store
                                .complete(&lease, Bytes::from(value), cfg.retention)
                                .await
                            {
                                Ok(()) => {
                                    completions[k].fetch_add(1, Ordering::SeqCst);
                                    winners.lock().expect("winners").insert(k, lease.token);
                                    unresolved.fetch_sub(1, Ordering::SeqCst);
                                }
                                Err(Error::LeaseLost { .. }) => {
                                    refused.fetch_add(1, Ordering::SeqCst);
                                    requeue(k);
                                }
                                Err(e) => panic!("C19 complete: {e:?}"),
                            }
                        }
                        AcquireOutcome::Replayed { .. } => {
                            unresolved.fetch_sub(1, Ordering::SeqCst);
                        }
                        AcquireOutcome::InProgress { retry_after, .. } => {
                            requeue(k);
                            cfg.time
                                .pass_exact(retry_after.min(cfg.lease_ttl / 4))
                                .await;
                        }
                        other => panic!("C19: unexpected outcome {other:?}"),
                    }
                }
            })
        })
        .collect();
    let all = futures::future::try_join_all(workers);
    match tokio::time::timeout(Duration::from_secs(120), all).await {
        Ok(joined) => {
            joined.expect("C19 worker panicked");
        }
        Err(_) => panic!(
            "C19: deliveries still unresolved after 120 s: {}",
            unresolved.load(Ordering::SeqCst)
        ),
    }

    let winners = winners.lock().expect("winners").clone();
    for (k, key) in keys.iter().enumerate() {
        let n = completions[k].load(Ordering::SeqCst);
        assert_eq!(
            n, 1,
            "C19: {key} completed {n} times; exactly one is allowed"
        );
        let winner = winners[&k];
        let record = must_get(h, key).await;
        assert_eq!(
            record.token, winner,
            "C19: the completing token stands on {key}"
        );
        let entry = ledger
            .entry(key.id())
            .unwrap_or_else(|| panic!("C19: no ledger write for {key}"));
        assert_eq!(
            entry.token,
            Some(winner),
            "C19: the standing ledger write of {key} must come from the completing acquisition"
        );
        match &record.state {
            RecordState::Completed { result } => assert_eq!(
                &result[..],
                &entry.value[..],
                "C19: stored result and ledger effect of {key} must agree"
            ),
            other => panic!("C19: {key} must end completed, got {other:?}"),
        }
    }
}

/// C20: an unreachable store answers `Unavailable` within the bound, and the work it guards is
/// not run: pointed at a port where nothing listens ([`Harness::with_unreachable`], required)
/// and, with [`Harness::with_silent`], at a server that accepts connections and never answers
/// ([`servers::silent_server`](crate::servers::silent_server)), which only the store's own
/// timeouts can end.
pub async fn c20_unreachable_store(h: &Harness) {
    if h.unreachable().is_none() {
        panic!("C20 needs Harness::with_unreachable: a store pointed at a dead endpoint");
    }
    unavailable_in_time(h, "a refused port", || h.unreachable().expect("configured")).await;
    let addr = crate::servers::silent_server();
    if h.silent(addr).is_none() {
        let _ = writeln!(
            std::io::stderr(),
            "C20: no Harness::with_silent: the store's timeouts against a server that never \
             answers are not checked"
        );
        return;
    }
    unavailable_in_time(h, "a server that never answers", || {
        h.silent(addr).expect("configured")
    })
    .await;
}

/// C20's check on one dead endpoint (`what`): building a store with `build`, an `acquire`, then
/// (on a store built again) a `get` each answer `Unavailable` within the bound, and the handler
/// the acquire guards does not run.
async fn unavailable_in_time<B>(h: &Harness, what: &str, build: B)
where
    B: Fn() -> futures::future::BoxFuture<'static, Result<idem_core::DynStore>>,
{
    let within = h.config().unavailable_within;
    let ns = h.namespace();
    let key = h.key(&ns, "unreachable");
    let req = request(h, &key, A);
    let handler_ran = AtomicBool::new(false);
    let started = Instant::now();
    let attempt = async {
        let store = build().await?;
        let outcome = store.acquire(&req).await;
        if let Ok(AcquireOutcome::Acquired { .. }) = outcome {
            handler_ran.store(true, Ordering::SeqCst);
        }
        let outcome = outcome?;
        Ok::<_, Error>((store, outcome))
    };
    match tokio::time::timeout(within, attempt).await {
        Err(_) => panic!("C20 ({what}): no answer from the unreachable store within {within:?}"),
        Ok(Ok((_, outcome))) => panic!("C20 ({what}): an unreachable store answered {outcome:?}"),
        Ok(Err(Error::Unavailable { .. })) => {}
        Ok(Err(other)) => panic!("C20 ({what}): expected Unavailable, got {other:?}"),
    }
    assert!(
        !handler_ran.load(Ordering::SeqCst),
        "C20 ({what}): the handler must not run"
    );
    assert!(started.elapsed() <= within);
    // Operator reads fail the same way.
    let read = async {
        let store = build().await?;
        store.get(&key).await
    };
    match tokio::time::timeout(within, read).await {
        Ok(Err(Error::Unavailable { .. })) => {}
        Ok(other) => {
            panic!("C20 ({what}): get on an unreachable store should be Unavailable, got {other:?}")
        }
        Err(_) => panic!("C20 ({what}): get gave no answer within {within:?}"),
    }
}

#[track_caller]
fn assert_lost_because<T: Debug>(
    what: &str,
    r: Result<T>,
    presented: FencingToken,
    why: LostLease,
) {
    match r {
        Err(Error::LeaseLost {
            presented: p,
            why: w,
            ..
        }) => {
            assert_eq!(
                p, presented,
                "{what}: LeaseLost should name the presented token"
            );
            assert_eq!(w, why, "{what}: LeaseLost should say what the store found");
        }
        other => panic!("{what} should be LeaseLost ({why}), got {other:?}"),
    }
}

/// C21: a finishing transition re-sent with the same token after it took effect (a lost reply)
/// answers `Ok` and changes nothing, whatever the store; with other arguments it is `LeaseLost`
/// saying the record is no longer in progress; stale tokens are still refused.
pub async fn c21_replayed_transitions(h: &Harness) {
    let ns = h.namespace();
    let store = h.store();
    let retention = h.config().retention;
    let not_in = |state: StateKind| LostLease::NotInProgress { state };

    // complete, replayed; then every other finish with this token is refused.
    let key = h.key(&ns, "replay-complete");
    let (a, _) = acquired(h, &request(h, &key, A)).await;
    let result = Bytes::from((0..=255u8).collect::<Vec<u8>>());
    complete(h, &a, result.clone()).await;
    let done = get(h, &key).await;
    for round in 0..2 {
        store
            .complete(&a, result.clone(), retention)
            .await
            .unwrap_or_else(|e| panic!("C21: complete replayed (round {round}) must be Ok: {e:?}"));
        assert_unchanged("C21: a replayed complete", &done, &get(h, &key).await);
    }
    let mut other = result.to_vec();
    other[255] = 0;
    assert_lost_because(
        "C21 complete with other bytes",
        store.complete(&a, Bytes::from(other), retention).await,
        a.token,
        not_in(StateKind::Completed),
    );
    assert_lost_because(
        "C21 complete with a shorter result",
        store.complete(&a, result.slice(..255), retention).await,
        a.token,
        not_in(StateKind::Completed),
    );
    assert_lost_because(
        "C21 fail after complete",
        store
            .fail(&a, "late", FailureKind::Retryable, retention)
            .await,
        a.token,
        not_in(StateKind::Completed),
    );
    assert_lost_because(
        "C21 release after complete",
        store.release(&a).await,
        a.token,
        not_in(StateKind::Completed),
    );
    assert_lost_because(
        "C21 extend after complete",
        store.extend(&a, h.config().long_lease_ttl).await,
        a.token,
        not_in(StateKind::Completed),
    );
    assert_unchanged("C21: refused transitions", &done, &get(h, &key).await);
    assert_eq!(
        acquire(h, &request(h, &key, B)).await,
        AcquireOutcome::Replayed { result },
        "C21: the completion is still replayed"
    );

    // An empty result replays too (an empty stored value is not "absent").
    let key = h.key(&ns, "replay-empty");
    let (a, _) = acquired(h, &request(h, &key, A)).await;
    complete(h, &a, Bytes::new()).await;
    store
        .complete(&a, Bytes::new(), retention)
        .await
        .unwrap_or_else(|e| panic!("C21: an empty result replayed must be Ok: {e:?}"));
    assert_lost_because(
        "C21 complete with bytes after an empty result",
        store
            .complete(&a, Bytes::from_static(b"x"), retention)
            .await,
        a.token,
        not_in(StateKind::Completed),
    );

    // fail, of every kind, replayed; another text or kind is refused.
    for kind in FailureKind::ALL {
        let key = h.key(&ns, &format!("replay-fail-{kind}"));
        let (a, _) = acquired(h, &request(h, &key, A)).await;
        let error = format!("declined ({kind})");
        store
            .fail(&a, &error, kind, retention)
            .await
            .unwrap_or_else(|e| panic!("C21: fail {kind} failed: {e:?}"));
        let failed = get(h, &key).await;
        let state = failed.as_ref().map(|r| r.state.clone());
        assert_eq!(
            state,
            Some(RecordState::Failed {
                error: error.clone(),
                kind
            }),
            "C21: the stored failure keeps its kind"
        );
        store
            .fail(&a, &error, kind, retention)
            .await
            .unwrap_or_else(|e| panic!("C21: fail {kind} replayed must be Ok: {e:?}"));
        assert_unchanged("C21: a replayed fail", &failed, &get(h, &key).await);
        for other_kind in FailureKind::ALL.into_iter().filter(|k| *k != kind) {
            assert_lost_because(
                "C21 fail with another kind",
                store.fail(&a, &error, other_kind, retention).await,
                a.token,
                not_in(StateKind::Failed(kind)),
            );
        }
        assert_lost_because(
            "C21 fail with another text",
            store.fail(&a, "declined", kind, retention).await,
            a.token,
            not_in(StateKind::Failed(kind)),
        );
        assert_lost_because(
            "C21 complete after fail",
            store
                .complete(&a, Bytes::from_static(b"x"), retention)
                .await,
            a.token,
            not_in(StateKind::Failed(kind)),
        );
        assert_unchanged("C21: refused transitions", &failed, &get(h, &key).await);
        if kind != FailureKind::Retryable {
            assert_eq!(
                acquire(h, &request(h, &key, B)).await,
                AcquireOutcome::Failed { error, kind },
                "C21: a terminal failure is replayed with its kind"
            );
        }
    }

    // release, replayed; after someone else acquires, the replay is stale.
    let key = h.key(&ns, "replay-release");
    let (a, _) = acquired(h, &request(h, &key, A)).await;
    store.release(&a).await.expect("C21: release");
    let released = get(h, &key).await;
    store
        .release(&a)
        .await
        .unwrap_or_else(|e| panic!("C21: release replayed must be Ok: {e:?}"));
    assert_unchanged("C21: a replayed release", &released, &get(h, &key).await);
    assert_lost_because(
        "C21 complete after release",
        store
            .complete(&a, Bytes::from_static(b"x"), retention)
            .await,
        a.token,
        not_in(StateKind::Released),
    );
    let (b, _) = acquired(h, &request(h, &key, B)).await;
    let before = get(h, &key).await;
    assert_lost_because(
        "C21 stale release",
        store.release(&a).await,
        a.token,
        LostLease::Superseded { current: b.token },
    );
    assert_unchanged("C21: a stale release", &before, &get(h, &key).await);

    // A replay after the key was retried by someone else is stale, even with the same text.
    let key = h.key(&ns, "replay-after-retry");
    let (a, _) = acquired(h, &request(h, &key, A)).await;
    fail(h, &a, "transient", true).await;
    let (b, _) = acquired(h, &request(h, &key, B)).await;
    let before = get(h, &key).await;
    assert_lost_because(
        "C21 stale fail replay",
        store
            .fail(&a, "transient", FailureKind::Retryable, retention)
            .await,
        a.token,
        LostLease::Superseded { current: b.token },
    );
    assert_unchanged("C21: a stale replay", &before, &get(h, &key).await);

    // A replay after the record was deleted finds nothing.
    let key = h.key(&ns, "replay-after-delete");
    let (a, _) = acquired(h, &request(h, &key, A)).await;
    complete(h, &a, "ok").await;
    assert!(store.delete(&key).await.expect("C21: delete"));
    assert_lost_because(
        "C21 replay after delete",
        store
            .complete(&a, Bytes::from_static(b"ok"), retention)
            .await,
        a.token,
        LostLease::Gone,
    );
    assert_eq!(
        get(h, &key).await,
        None,
        "C21: a refused replay writes nothing"
    );
}

/// Every character an error text or owner may hold, in a text of at most `max` bytes: ASCII
/// controls and punctuation that query languages and scripts treat specially, multi-byte
/// characters of every UTF-8 length, and code points that normalisation or lossy decoding
/// would change.
fn hostile_text(max: usize) -> String {
    let mut text = String::from(
        "é€𝄞😀\u{80}\u{9f}\u{a0}\u{ad}\u{200b}\u{200d}\u{2028}\u{2029}\u{feff}\u{fffd}\u{fffe}\
         \u{ffff}\u{10ffff}e\u{301}Å\u{212b}ﬁ%s%%{}$1\\0'\"`;--",
    );
    text.extend((1u8..=0x7f).map(char::from));
    if text.len() > max {
        let mut cut = max;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    text
}

/// C22: error texts and owners with every allowed character round-trip exactly; a NUL (which
/// some stores cannot hold) is refused with `InvalidInput` before anything is written.
pub async fn c22_text_fidelity(h: &Harness) {
    let ns = h.namespace();
    let store = h.store();
    let retention = h.config().retention;
    let limits = store.limits();

    // Owners.
    let owner = hostile_text(idem_core::MAX_OWNER_LEN);
    let key = h.key(&ns, "owner");
    let (a, _) = acquired(h, &request(h, &key, &owner)).await;
    assert_eq!(a.owner, owner, "C22: the lease's owner is exact");
    assert_eq!(
        must_get(h, &key).await.owner,
        owner,
        "C22: the stored owner is exact"
    );
    match acquire(h, &request(h, &key, B)).await {
        AcquireOutcome::InProgress { owner: busy, .. } => {
            assert_eq!(busy, owner, "C22: the busy owner is exact")
        }
        other => panic!("C22: expected InProgress, got {other:?}"),
    }

    // Error texts, terminal (replayed by acquire) and retryable (exhausted by acquire).
    let error = hostile_text(limits.max_error_len);
    let key = h.key(&ns, "terminal");
    let (a, _) = acquired(h, &request(h, &key, A)).await;
    store
        .fail(&a, &error, FailureKind::Terminal, retention)
        .await
        .unwrap_or_else(|e| panic!("C22: fail with every allowed character: {e:?}"));
    assert_eq!(
        acquire(h, &request(h, &key, B)).await,
        AcquireOutcome::Failed {
            error: error.clone(),
            kind: FailureKind::Terminal
        },
        "C22: a terminal error text round-trips exactly"
    );
    let key = h.key(&ns, "exhausted");
    let (a, _) = acquired(h, &request(h, &key, A).with_max_attempts(1)).await;
    store
        .fail(&a, &error, FailureKind::Retryable, retention)
        .await
        .unwrap_or_else(|e| panic!("C22: fail with every allowed character: {e:?}"));
    assert_eq!(
        acquire(h, &request(h, &key, B).with_max_attempts(1)).await,
        AcquireOutcome::Exhausted {
            attempts: 1,
            last_error: Some(error.clone())
        },
        "C22: the last error round-trips exactly"
    );
    match must_get(h, &key).await.state {
        RecordState::Failed { error: stored, .. } => {
            assert_eq!(stored, error, "C22: get shows the exact error text")
        }
        other => panic!("C22: expected a failed record, got {other:?}"),
    }

    // Multi-byte text exactly at the limit is kept whole.
    let wide = "€".repeat(limits.max_error_len / 3);
    let key = h.key(&ns, "at-limit");
    let (a, _) = acquired(h, &request(h, &key, A)).await;
    store
        .fail(&a, &wide, FailureKind::Terminal, retention)
        .await
        .unwrap_or_else(|e| panic!("C22: fail at the limit: {e:?}"));
    assert!(
        matches!(acquire(h, &request(h, &key, B)).await, AcquireOutcome::Failed { error, .. } if error == wide),
        "C22: a text at the limit round-trips exactly"
    );

    // NUL is refused before anything is written, for error texts and owners.
    let key = h.key(&ns, "nul");
    let (a, _) = acquired(h, &request(h, &key, A)).await;
    let before = get(h, &key).await;
    for text in ["bad\0byte", "\0", "trailing\0"] {
        for kind in FailureKind::ALL {
            assert_invalid(
                "C22 NUL in an error text",
                store.fail(&a, text, kind, retention).await,
                "error",
            );
            assert_unchanged("C22: a refused error text", &before, &get(h, &key).await);
        }
    }
    complete(h, &a, "still mine").await;
    let key = h.key(&ns, "nul-owner");
    assert_invalid(
        "C22 NUL in an owner",
        store.acquire(&request(h, &key, "owner\0x")).await,
        "owner",
    );
    assert_eq!(
        get(h, &key).await,
        None,
        "C22: a refused owner writes nothing"
    );
}

/// C23: one round trip per acquire (whatever its outcome), per fenced transition (applied,
/// replayed or refused) and per duplicate, counted by the counter the backend's test supplies
/// ([`Harness::with_round_trips`]). Each operation runs once first to warm up what a client
/// loads once per connection (scripts, prepared statements, slot maps).
pub async fn c23_round_trips(h: &Harness) {
    match h.round_trips() {
        Err(why) => panic!("C23: {why}"),
        Ok(None) => return, // an in-process store: nothing to count
        Ok(Some(_)) => {}
    }
    let ns = h.namespace();
    let store = h.store();
    let retention = h.config().retention;
    let long = h.config().long_lease_ttl;

    // Warm-up: every operation once.
    let warm = h.key(&ns, "warm-up");
    let (w, _) = acquired(h, &request(h, &warm, A)).await;
    store.extend(&w, long).await.expect("C23 warm-up extend");
    store.release(&w).await.expect("C23 warm-up release");
    let (w, _) = acquired(h, &request(h, &warm, A)).await;
    fail(h, &w, "warm", true).await;
    let (w, _) = acquired(h, &request(h, &warm, A)).await;
    complete(h, &w, "warm").await;
    let _ = acquire(h, &request(h, &warm, B)).await;

    let count = || h.round_trips().expect("counter").expect("counted");
    let mut steps: Vec<(&str, u64)> = Vec::new();
    macro_rules! step {
        ($name:expr, $op:expr) => {{
            let before = count();
            let out = $op;
            steps.push(($name, count() - before));
            out
        }};
    }

    let key = h.key(&ns, "counted");
    let (a, _) = step!("acquire (fresh)", acquired(h, &request(h, &key, A)).await);
    step!("acquire (busy)", acquire(h, &request(h, &key, B)).await);
    step!(
        "acquire (conflict)",
        acquire(
            h,
            &request(h, &key, B).with_fingerprint(Fingerprint::of("other"))
        )
        .await
    );
    let a = step!("extend", store.extend(&a, long).await.expect("C23 extend"));
    step!("release", store.release(&a).await.expect("C23 release"));
    step!(
        "release (replayed)",
        store.release(&a).await.expect("C23 replay")
    );
    let (b, _) = step!(
        "acquire (after release)",
        acquired(h, &request(h, &key, B)).await
    );
    step!("fail", fail(h, &b, "transient", true).await);
    step!(
        "fail (replayed)",
        store
            .fail(&b, "transient", FailureKind::Retryable, retention)
            .await
            .expect("C23 replay")
    );
    let (c, _) = step!("acquire (retry)", acquired(h, &request(h, &key, C)).await);
    step!(
        "complete (stale, refused)",
        store
            .complete(&b, Bytes::from_static(b"zombie"), retention)
            .await
            .expect_err("C23 stale complete")
    );
    step!("complete", complete(h, &c, "done").await);
    step!(
        "complete (replayed)",
        store
            .complete(&c, Bytes::from_static(b"done"), retention)
            .await
            .expect("C23 replay")
    );
    step!(
        "acquire (duplicate)",
        acquire(h, &request(h, &key, A)).await
    );

    let wrong: Vec<_> = steps.iter().filter(|(_, n)| *n != 1).collect();
    assert!(
        wrong.is_empty(),
        "C23: every operation must take exactly one round trip; these did not: {wrong:?} \
         (all: {steps:?})"
    );
}

/// An outcome with what differs between two equivalent runs taken out (tokens, times).
fn shape(r: &Result<AcquireOutcome>) -> String {
    match r {
        Ok(AcquireOutcome::Acquired { lease, takeover }) => format!(
            "Acquired(attempt {}, takeover {takeover}, owner {})",
            lease.attempt, lease.owner
        ),
        Ok(AcquireOutcome::InProgress { owner, .. }) => format!("InProgress({owner})"),
        Ok(other) => format!("{other:?}"),
        Err(Error::InvalidInput { field, .. }) => format!("InvalidInput({field})"),
        Err(Error::LeaseLost { why, .. }) => match why {
            LostLease::Superseded { .. } => "LeaseLost(superseded)".to_owned(),
            other => format!("LeaseLost({other})"),
        },
        Err(e) => format!("Err({e})"),
    }
}

fn record_shape(r: &Option<Record>) -> String {
    match r {
        None => "none".to_owned(),
        Some(r) => format!("{:?} attempts {} owner {}", r.state, r.attempts, r.owner),
    }
}

/// Builds the C24 mix in `ns`: one key per case, in the same state in every namespace.
async fn c24_setup(h: &Harness, ns: &Namespace) {
    let store = h.store();
    let key = |id: &str| h.key(ns, id);
    let (l, _) = acquired(h, &request(h, &key("duplicate"), A)).await;
    complete(h, &l, "stored").await;
    acquired(h, &request(h, &key("busy"), B)).await;
    let (l, _) = acquired(h, &request(h, &key("conflict"), A)).await;
    complete(h, &l, "x").await;
    let (l, _) = acquired(h, &request(h, &key("exhausted"), A).with_max_attempts(1)).await;
    fail(h, &l, "gave up", true).await;
    let (l, _) = acquired(h, &request(h, &key("failed"), A)).await;
    fail(h, &l, "declined", false).await;
    let (l, _) = acquired(h, &request(h, &key("retry"), A)).await;
    fail(h, &l, "transient", true).await;
    let (l, _) = acquired(h, &request(h, &key("released"), A)).await;
    store.release(&l).await.expect("C24: release");
}

/// The C24 batch: every case, an invalid request, and one key twice.
fn c24_requests(h: &Harness, ns: &Namespace) -> Vec<AcquireRequest> {
    let key = |id: &str| h.key(ns, id);
    vec![
        request(h, &key("fresh"), C),
        request(h, &key("duplicate"), C),
        request(h, &key("busy"), C),
        request(h, &key("conflict"), C).with_fingerprint(Fingerprint::of("another payload")),
        request(h, &key("exhausted"), C).with_max_attempts(1),
        request(h, &key("failed"), C),
        request(h, &key("retry"), C),
        request(h, &key("released"), C),
        request(h, &key("bad"), ""),
        request(h, &key("twice"), C),
        request(h, &key("twice"), C),
    ]
}

/// C24: batches give exactly the single-call outcomes, in order (a mixed batch of fresh,
/// duplicate, busy, conflict, exhausted, failed, retried, released, invalid and repeated keys,
/// then completions, failures and releases with live, stale, repeated and invalid items); an
/// oversized batch of any kind is refused before anything is written; an empty batch answers
/// nothing; and concurrent batches racing over the same keys still have one winner per key.
pub async fn c24_batches_equal_singles(h: &Harness) {
    let store = h.store();
    let retention = h.config().retention;
    let (batch_ns, single_ns) = (h.namespace(), h.namespace());
    c24_setup(h, &batch_ns).await;
    c24_setup(h, &single_ns).await;

    let reqs = c24_requests(h, &batch_ns);
    let batch = store
        .acquire_many(&reqs)
        .await
        .unwrap_or_else(|e| panic!("C24: acquire_many failed: {e:?}"));
    assert_eq!(batch.len(), reqs.len(), "C24: one outcome per request");
    let mut singles = Vec::new();
    for req in c24_requests(h, &single_ns) {
        singles.push(store.acquire(&req).await);
    }
    let got: Vec<_> = batch.iter().map(shape).collect();
    let want: Vec<_> = singles.iter().map(shape).collect();
    assert_eq!(
        got, want,
        "C24: acquire_many must give the single-call outcomes, in order"
    );
    for id in [
        "fresh",
        "duplicate",
        "busy",
        "exhausted",
        "retry",
        "released",
        "twice",
        "bad",
    ] {
        assert_eq!(
            record_shape(&get(h, &h.key(&batch_ns, id)).await),
            record_shape(&get(h, &h.key(&single_ns, id)).await),
            "C24: after acquire_many, {id} must be as after the single calls"
        );
    }

    // Finishing in batches: live leases, a stale one, a repeated one.
    let leases = |outcomes: &[Result<AcquireOutcome>]| -> Vec<Lease> {
        outcomes
            .iter()
            .filter_map(|o| match o {
                Ok(AcquireOutcome::Acquired { lease, .. }) => Some(lease.clone()),
                _ => None,
            })
            .collect()
    };
    let (batch_leases, single_leases) = (leases(&batch), leases(&singles));
    assert!(
        batch_leases.len() >= 3,
        "C24: the mix acquires fresh, retry, released and twice"
    );
    let oversized_result = store.limits().max_result_len + 1;
    let stale = |lease: &Lease| Lease {
        token: FencingToken::new(lease.token.get().saturating_sub(1)),
        ..lease.clone()
    };
    let finish_mix = |ls: &[Lease]| {
        let completions = vec![
            completion(&ls[0], "done"),
            completion(&ls[0], "done"),
            completion(&stale(&ls[1]), "zombie"),
            // Invalid items: refused on their own, before anything is written for them.
            idem_core::Completion::new(ls[2].clone(), vec![b'x'; oversized_result]),
        ];
        let failures = vec![
            idem_core::Failure::new(ls[1].clone(), "boom", FailureKind::Terminal),
            idem_core::Failure::new(ls[2].clone(), "NUL \0 inside", FailureKind::Retryable),
        ];
        let releases = vec![ls[2].clone(), ls[2].clone(), stale(&ls[0])];
        (completions, failures, releases)
    };
    let (bc, bf, br) = finish_mix(&batch_leases);
    let (sc, sf, sr) = finish_mix(&single_leases);
    let batch_done = [
        store.complete_many(&bc, retention).await,
        store.fail_many(&bf, retention).await,
        store.release_many(&br).await,
    ];
    let mut single_done = Vec::new();
    for c in &sc {
        single_done.push(store.complete(&c.lease, c.result.clone(), retention).await);
    }
    for f in &sf {
        single_done.push(store.fail(&f.lease, &f.error, f.kind, retention).await);
    }
    for l in &sr {
        single_done.push(store.release(l).await);
    }
    let batch_done: Vec<_> = batch_done
        .into_iter()
        .flat_map(|r| r.unwrap_or_else(|e| panic!("C24: a finishing batch failed: {e:?}")))
        .map(|r| shape(&r.map(|()| AcquireOutcome::Conflict)))
        .collect();
    let single_done: Vec<_> = single_done
        .into_iter()
        .map(|r| shape(&r.map(|()| AcquireOutcome::Conflict)))
        .collect();
    assert_eq!(
        batch_done, single_done,
        "C24: complete_many / fail_many / release_many must give the single-call results, in order"
    );
    for id in ["fresh", "retry", "released", "twice"] {
        assert_eq!(
            record_shape(&get(h, &h.key(&batch_ns, id)).await),
            record_shape(&get(h, &h.key(&single_ns, id)).await),
            "C24: after the finishing batches, {id} must be as after the single calls"
        );
    }

    // Oversized: refused whole, nothing written.
    let max = store.limits().max_batch;
    let over_ns = h.namespace();
    let over: Vec<_> = (0..=max)
        .map(|i| request(h, &h.key(&over_ns, &format!("k{i}")), A))
        .collect();
    assert_invalid(
        "C24 oversized batch",
        store.acquire_many(&over).await,
        "batch",
    );
    assert_eq!(
        get(h, &over[0].key).await,
        None,
        "C24: an oversized batch writes nothing"
    );

    let live_key = h.key(&over_ns, "live");
    let (live, _) = acquired(h, &request(h, &live_key, A)).await;
    let before = get(h, &live_key).await;
    let too_many_completions = vec![completion(&live, "done"); max + 1];
    assert_invalid(
        "C24 oversized complete_many",
        store.complete_many(&too_many_completions, retention).await,
        "batch",
    );
    let too_many_failures =
        vec![idem_core::Failure::new(live.clone(), "boom", FailureKind::Terminal); max + 1];
    assert_invalid(
        "C24 oversized fail_many",
        store.fail_many(&too_many_failures, retention).await,
        "batch",
    );
    assert_invalid(
        "C24 oversized release_many",
        store.release_many(&vec![live.clone(); max + 1]).await,
        "batch",
    );
    assert_unchanged(
        "C24: an oversized finishing batch",
        &before,
        &get(h, &live_key).await,
    );
    // Empty batches: nothing to do, no error.
    assert!(
        store.acquire_many(&[]).await.is_ok_and(|v| v.is_empty()),
        "C24: an empty acquire_many answers no outcomes"
    );
    assert!(
        store
            .complete_many(&[], retention)
            .await
            .is_ok_and(|v| v.is_empty()),
        "C24: an empty complete_many answers no results"
    );

    // Concurrent batches over the same keys, in different orders: one winner per key.
    const RACERS: usize = 8;
    let race_ns = h.namespace();
    let keys: Vec<_> = (0..20.min(max))
        .map(|i| h.key(&race_ns, &format!("race-{i}")))
        .collect();
    let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
    let tasks: Vec<_> = (0..RACERS)
        .map(|i| {
            let store = store.clone();
            let barrier = barrier.clone();
            let mut reqs: Vec<_> = keys
                .iter()
                .map(|k| request(h, k, &format!("racer-{i}")))
                .collect();
            reqs.rotate_left(i * 3 % keys.len().max(1));
            tokio::spawn(async move {
                barrier.wait().await;
                store.acquire_many(&reqs).await
            })
        })
        .collect();
    let mut winners: HashMap<String, usize> = HashMap::new();
    for task in tasks {
        let outcomes = task
            .await
            .expect("racer")
            .expect("C24: a racing batch failed");
        for o in outcomes {
            if let Ok(AcquireOutcome::Acquired { lease, .. }) = o {
                *winners.entry(lease.key.id().to_owned()).or_default() += 1;
            }
        }
    }
    for key in &keys {
        assert_eq!(
            winners.get(key.id()).copied(),
            Some(1),
            "C24: racing batches must have exactly one winner for {key}"
        );
    }
}

fn completion(lease: &Lease, result: &'static str) -> idem_core::Completion {
    idem_core::Completion::new(lease.clone(), Bytes::from_static(result.as_bytes()))
}

/// Every page of a listing, following the cursors (bounded, so a store that never ends fails).
async fn list_all(h: &Harness, query: ListQuery) -> Vec<Record> {
    let mut query = query;
    let mut records = Vec::new();
    for _ in 0..10_000 {
        let page = h
            .store()
            .list(&query)
            .await
            .unwrap_or_else(|e| panic!("C26: list failed: {e:?}"));
        assert!(
            page.records.len() <= query.limit,
            "C26: a page holds at most the limit ({} > {})",
            page.records.len(),
            query.limit
        );
        records.extend(page.records);
        match page.next {
            None => return records,
            next => query = query.with_cursor(next),
        }
    }
    panic!("C26: the listing did not end after 10,000 pages");
}

fn ids(records: &[Record]) -> std::collections::BTreeSet<String> {
    records.iter().map(|r| r.key.id().to_owned()).collect()
}

/// C26: records are found by namespace, status, age and owner, paged: stuck leases, exhausted
/// and failed records show up under their status; another namespace never does; records past
/// retention are never listed.
pub async fn c26_listing(h: &Harness) {
    let ns = h.namespace();
    let other = h.namespace();
    let store = h.store();
    let key = |id: &str| h.key(&ns, id);

    // A listing may visit every record of the server (a Redis SCAN, a DynamoDB Scan): where the
    // server holds many records of others, one can outlast the default gap between the two
    // groups below and age the young ones. The gap is at least three such visits.
    let visit = Instant::now();
    list_all(h, ListQuery::new(ns.clone())).await;
    let aged = h
        .config()
        .short_retention
        .max(h.config().lease_ttl)
        .max(visit.elapsed() * 3);

    // Old records first: they age while the lease below expires.
    let (l, _) = acquired(h, &short_request(h, &key("lease-expired"), B)).await;
    let _ = l;
    for _ in 0..5 {
        let (l, _) = acquired(h, &request(h, &key("exhausted"), A)).await;
        fail(h, &l, "poison", true).await;
    }
    let (l, _) = acquired(h, &request(h, &key("expired"), A)).await;
    h.store()
        .complete(&l, Bytes::from_static(b"gone"), h.config().short_retention)
        .await
        .expect("C26: complete");
    let old_done = Instant::now();
    h.config().time.pass(aged).await;

    acquired(h, &request(h, &key("in-progress"), A)).await;
    let (l, _) = acquired(h, &request(h, &key("released"), A)).await;
    store.release(&l).await.expect("C26: release");
    let (l, _) = acquired(h, &request(h, &key("completed"), A)).await;
    complete(h, &l, "done").await;
    let (l, _) = acquired(h, &request(h, &key("failed-retryable"), A)).await;
    fail(h, &l, "transient", true).await;
    let (l, _) = acquired(h, &request(h, &key("failed-terminal"), A)).await;
    fail(h, &l, "declined", false).await;
    let (l, _) = acquired(h, &request(h, &key("not-stored"), A)).await;
    store
        .fail(
            &l,
            "too large",
            FailureKind::ResultNotStored,
            h.config().retention,
        )
        .await
        .expect("C26: fail");
    let (l, _) = acquired(h, &request(h, &h.key(&other, "elsewhere"), A)).await;
    complete(h, &l, "other namespace").await;

    // Age first, while the new records are young: only the records unchanged for as long as the
    // old ones have been. On a real clock that is measured now, so it holds however long the
    // young records took to write (a loaded server takes seconds); a young record ages only by
    // the listing itself, and the gap between the two groups is three listings or more. (Less
    // a few milliseconds, for stores that keep whole milliseconds.)
    let min_age = if h.config().time.is_manual() {
        aged
    } else {
        old_done.elapsed().saturating_sub(Duration::from_millis(5))
    };
    let old = list_all(h, ListQuery::new(ns.clone()).with_min_age(min_age)).await;
    assert_eq!(
        ids(&old),
        ["exhausted".to_owned(), "lease-expired".to_owned()].into(),
        "C26: only the records unchanged for {min_age:?}"
    );

    let expected = [
        ("in-progress", Status::InProgress),
        ("lease-expired", Status::LeaseExpired),
        ("released", Status::Released),
        ("completed", Status::Completed),
        ("failed-retryable", Status::FailedRetryable),
        ("failed-terminal", Status::FailedTerminal),
        ("not-stored", Status::ResultNotStored),
        ("exhausted", Status::Exhausted),
    ];
    // Everything, in small pages.
    let all = list_all(
        h,
        ListQuery::new(ns.clone())
            .with_limit(3)
            .with_max_attempts(5),
    )
    .await;
    let want: std::collections::BTreeSet<String> =
        expected.iter().map(|(id, _)| (*id).to_owned()).collect();
    assert_eq!(
        ids(&all),
        want,
        "C26: every live record of the namespace, and nothing else"
    );
    for record in &all {
        assert_eq!(record.key.namespace(), &ns, "C26: another namespace listed");
        assert_eq!(
            get(h, &record.key).await.as_ref(),
            Some(record),
            "C26: a listed record is the record get shows"
        );
    }
    // One status at a time.
    for (id, status) in expected {
        let found = list_all(h, ListQuery::new(ns.clone()).with_statuses([status])).await;
        assert_eq!(
            ids(&found),
            [id.to_owned()].into(),
            "C26: listing {status} must find exactly {id}"
        );
    }
    // Several statuses: what an operator asks at 3 a.m.
    let stuck = list_all(
        h,
        ListQuery::new(ns.clone()).with_statuses([Status::LeaseExpired, Status::Exhausted]),
    )
    .await;
    assert_eq!(
        ids(&stuck),
        ["exhausted".to_owned(), "lease-expired".to_owned()].into(),
        "C26: stuck and exhausted records"
    );
    // Owner.
    let by_b = list_all(h, ListQuery::new(ns.clone()).with_owner(B)).await;
    assert_eq!(
        ids(&by_b),
        ["lease-expired".to_owned()].into(),
        "C26: by owner"
    );
    // An owner no record can have (empty, NUL, over the length limit) finds nothing.
    for owner in [
        String::new(),
        format!("{B}\0"),
        "o".repeat(idem_core::MAX_OWNER_LEN + 1),
    ] {
        let none = list_all(h, ListQuery::new(ns.clone()).with_owner(owner.clone())).await;
        assert!(
            none.is_empty(),
            "C26: by the owner {owner:?}, which no record can have: {none:?}"
        );
    }

    // Paging over more records than a page.
    let many = h.namespace();
    for i in 0..25 {
        let (l, _) = acquired(h, &request(h, &h.key(&many, &format!("m{i:02}")), A)).await;
        complete(h, &l, "m").await;
    }
    let paged = list_all(h, ListQuery::new(many.clone()).with_limit(10)).await;
    assert_eq!(ids(&paged).len(), 25, "C26: paging finds all 25 records");
    assert!(paged.len() >= 25);

    // Bad queries.
    assert_invalid(
        "C26 zero limit",
        store.list(&ListQuery::new(ns.clone()).with_limit(0)).await,
        "limit",
    );
    assert_invalid(
        "C26 limit over the maximum",
        store
            .list(&ListQuery::new(ns.clone()).with_limit(idem_core::MAX_PAGE + 1))
            .await,
        "limit",
    );
}
