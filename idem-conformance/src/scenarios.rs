//! The scenarios C01-C20 of the contract, one `pub async fn` each.
//!
//! Every scenario panics with a message naming the broken rule and the value it got.

use std::collections::{HashMap, VecDeque};
use std::fmt::Debug;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use idem_core::{
    AcquireOutcome, AcquireRequest, Error, FencingToken, Fingerprint, IdempotencyKey, Lease,
    MAX_ID_LEN, Record, RecordState, Result,
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
        .fail(lease, error, retryable, h.config().retention)
        .await
        .unwrap_or_else(|e| panic!("fail of {} failed: {e:?}", lease.key));
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
    match r {
        Err(Error::LeaseLost {
            presented: p,
            current: c,
            ..
        }) => {
            assert_eq!(
                p, presented,
                "{what}: LeaseLost should name the presented token"
            );
            assert_eq!(
                c, current,
                "{what}: LeaseLost should name the current token"
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
    let lease_ttl = h.config().lease_ttl;
    acquired(h, &short_request(h, &key, A)).await;
    let before = get(h, &key).await;
    match acquire(h, &short_request(h, &key, B)).await {
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
        store.fail(&a, "zombie", true, retention).await,
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
            retryable: true
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
                error: "card declined".into()
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

/// C13: a record past retention is gone: the next acquire is fresh, with a token still higher
/// than every earlier one.
pub async fn c13_retention_expiry(h: &Harness) {
    let ns = h.namespace();
    let retention = h.config().short_retention;
    for (id, terminal) in [("retention-completed", false), ("retention-failed", true)] {
        let key = h.key(&ns, id);
        let (a, _) = acquired(h, &request(h, &key, A)).await;
        if terminal {
            h.store()
                .fail(&a, "declined", false, retention)
                .await
                .expect("fail");
        } else {
            h.store()
                .complete(&a, Bytes::from_static(b"old"), retention)
                .await
                .expect("complete");
        }
        assert!(get(h, &key).await.is_some(), "C13: kept until retention");
        h.config().time.pass(retention).await;
        assert_eq!(
            get(h, &key).await,
            None,
            "C13: {id} past retention reads absent"
        );
        let (b, takeover) = acquired(h, &request(h, &key, B)).await;
        assert!(!takeover);
        assert_eq!(b.attempt, 1, "C13: a fresh acquire after retention");
        assert!(
            b.token > a.token,
            "C13: tokens stay increasing after expiry ({} then {})",
            a.token,
            b.token
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
            .fail(&lease, &long_error, true, h.config().retention)
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
    assert!(close(
        r2.lease_expires_at.expect("lease end"),
        extended.expires_at,
        TIME_TOLERANCE
    ));
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
/// not run.
pub async fn c20_unreachable_store(h: &Harness) {
    let Some(build) = h.unreachable() else {
        panic!("C20 needs Harness::with_unreachable: a store pointed at a dead endpoint");
    };
    let within = h.config().unavailable_within;
    let ns = h.namespace();
    let key = h.key(&ns, "unreachable");
    let req = request(h, &key, A);
    let handler_ran = AtomicBool::new(false);
    let started = Instant::now();
    let attempt = async {
        let store = build.await?;
        let outcome = store.acquire(&req).await;
        if let Ok(AcquireOutcome::Acquired { .. }) = outcome {
            handler_ran.store(true, Ordering::SeqCst);
        }
        let outcome = outcome?;
        Ok::<_, Error>((store, outcome))
    };
    match tokio::time::timeout(within, attempt).await {
        Err(_) => panic!("C20: no answer from the unreachable store within {within:?}"),
        Ok(Ok((_, outcome))) => panic!("C20: an unreachable store answered {outcome:?}"),
        Ok(Err(Error::Unavailable { .. })) => {}
        Ok(Err(other)) => panic!("C20: expected Unavailable, got {other:?}"),
    }
    assert!(
        !handler_ran.load(Ordering::SeqCst),
        "C20: the handler must not run"
    );
    assert!(started.elapsed() <= within);
    // Operator reads fail the same way.
    let build = h.unreachable().expect("configured");
    let read = async {
        let store = build.await?;
        store.get(&key).await
    };
    match tokio::time::timeout(within, read).await {
        Ok(Err(Error::Unavailable { .. })) => {}
        Ok(other) => {
            panic!("C20: get on an unreachable store should be Unavailable, got {other:?}")
        }
        Err(_) => panic!("C20: get gave no answer within {within:?}"),
    }
}
