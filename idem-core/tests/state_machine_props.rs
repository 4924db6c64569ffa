//! Property tests: random sequences of acquire / extend / complete / fail / release / time /
//! delete across several owners on `MemoryStore`, checking the contract's invariants after
//! every step:
//!
//! - at most one live lease per key: nobody acquires a key whose current lease is live;
//! - fencing tokens strictly increase per key, across deletes and expiry;
//! - only the newest lease of a key can change it;
//! - a completed record never changes except by retention or delete;
//! - every refused transition, and every acquire that does not acquire, leaves the record
//!   untouched.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    AcquireOutcome, AcquireRequest, Clock, FailureKind, FencingToken, Fingerprint, IdempotencyKey,
    IdempotencyStore, Lease, ManualClock, MemoryStore, Namespace, Record, RecordState, StateKind,
};
use proptest::prelude::*;

const OWNERS: usize = 3;
const KEYS: usize = 2;
const LEASE: Duration = Duration::from_millis(300);
const RETENTION: Duration = Duration::from_millis(500);

#[derive(Clone, Debug)]
enum Op {
    Acquire {
        owner: usize,
        key: usize,
        other_payload: bool,
        max_attempts: u32,
    },
    Extend {
        owner: usize,
        key: usize,
    },
    Complete {
        owner: usize,
        key: usize,
    },
    Fail {
        owner: usize,
        key: usize,
        retryable: bool,
    },
    Release {
        owner: usize,
        key: usize,
    },
    Advance {
        ms: u64,
    },
    Delete {
        key: usize,
    },
    Purge,
}

fn op() -> impl Strategy<Value = Op> {
    let owner = 0..OWNERS;
    let key = 0..KEYS;
    prop_oneof![
        4 => (owner.clone(), key.clone(), prop::bool::weighted(0.1), 1u32..4).prop_map(
            |(owner, key, other_payload, max_attempts)| Op::Acquire {
                owner,
                key,
                other_payload,
                max_attempts,
            }
        ),
        2 => (owner.clone(), key.clone()).prop_map(|(owner, key)| Op::Extend { owner, key }),
        2 => (owner.clone(), key.clone()).prop_map(|(owner, key)| Op::Complete { owner, key }),
        2 => (owner.clone(), key.clone(), any::<bool>())
            .prop_map(|(owner, key, retryable)| Op::Fail { owner, key, retryable }),
        1 => (owner, key.clone()).prop_map(|(owner, key)| Op::Release { owner, key }),
        3 => (0u64..700).prop_map(|ms| Op::Advance { ms }),
        1 => key.prop_map(|key| Op::Delete { key }),
        1 => Just(Op::Purge),
    ]
}

struct Model {
    store: MemoryStore,
    clock: Arc<ManualClock>,
    keys: Vec<IdempotencyKey>,
    leases: HashMap<(usize, usize), Lease>,
    highest_token: HashMap<usize, FencingToken>,
    completed: HashMap<usize, Record>,
}

impl Model {
    fn new() -> Self {
        let clock = Arc::new(ManualClock::default());
        let ns = Namespace::new("props").unwrap();
        Self {
            store: MemoryStore::with_clock(clock.clone()),
            clock,
            keys: (0..KEYS)
                .map(|k| ns.key(format!("k{k}")).unwrap())
                .collect(),
            leases: HashMap::new(),
            highest_token: HashMap::new(),
            completed: HashMap::new(),
        }
    }

    async fn get(&self, key: usize) -> Option<Record> {
        self.store.get(&self.keys[key]).await.unwrap()
    }

    /// Runs a fenced transition and checks what the contract says of its result.
    async fn fenced(&mut self, owner: usize, key: usize, op: &Op) -> Result<(), TestCaseError> {
        let Some(lease) = self.leases.get(&(owner, key)).cloned() else {
            return Ok(());
        };
        let before = self.get(key).await;
        let result = match op {
            Op::Extend { .. } => self.store.extend(&lease, LEASE).await.map(|l| {
                self.leases.insert((owner, key), l);
            }),
            Op::Complete { .. } => {
                self.store
                    .complete(&lease, Bytes::from(format!("{owner}")), RETENTION)
                    .await
            }
            Op::Fail { retryable, .. } => {
                let kind = if *retryable {
                    FailureKind::Retryable
                } else {
                    FailureKind::Terminal
                };
                self.store.fail(&lease, "boom", kind, RETENTION).await
            }
            Op::Release { .. } => self.store.release(&lease).await,
            _ => unreachable!("only fenced operations come here"),
        };
        let after = self.get(key).await;
        match result {
            Ok(()) => {
                prop_assert_eq!(
                    Some(lease.token),
                    self.highest_token.get(&key).copied(),
                    "only the newest lease may change a record"
                );
                // Ok means the record shows this transition (first time or replayed).
                let shown = after.as_ref().map(|r| (r.token, r.state.kind()));
                let token = lease.token;
                match op {
                    Op::Complete { .. } => {
                        prop_assert_eq!(shown, Some((token, StateKind::Completed)));
                    }
                    Op::Release { .. } => {
                        prop_assert_eq!(shown, Some((token, StateKind::Released)));
                    }
                    Op::Fail { retryable, .. } => {
                        let ok = matches!(shown, Some((t, StateKind::Failed(k))) if t == token && k.is_retryable() == *retryable);
                        prop_assert!(ok, "fail answered Ok but the record is {:?}", after);
                    }
                    _ => {}
                }
                if matches!(op, Op::Complete { .. })
                    && before
                        .as_ref()
                        .is_some_and(|r| r.state == RecordState::InProgress)
                {
                    self.completed
                        .insert(key, after.expect("a completed record exists"));
                }
            }
            Err(e) => {
                prop_assert!(e.is_lease_lost(), "unexpected error {:?}", e);
                prop_assert_eq!(before, after, "a refused transition changed the record");
            }
        }
        Ok(())
    }

    async fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Acquire {
                owner,
                key,
                other_payload,
                max_attempts,
            } => {
                let before = self.get(key).await;
                let now = self.clock.now();
                let live_holder = before.as_ref().is_some_and(|r| {
                    r.state == RecordState::InProgress
                        && r.lease_expires_at.is_some_and(|end| end > now)
                });
                let payload = if other_payload { "other" } else { "payload" };
                let req = AcquireRequest::new(self.keys[key].clone(), format!("owner-{owner}"))
                    .with_fingerprint(Fingerprint::of(payload))
                    .with_lease_ttl(LEASE)
                    .with_max_attempts(max_attempts);
                match self.store.acquire(&req).await.unwrap() {
                    AcquireOutcome::Acquired { lease, .. } => {
                        prop_assert!(
                            !live_holder,
                            "acquired a key whose lease is live: {:?}",
                            before
                        );
                        if let Some(highest) = self.highest_token.get(&key) {
                            prop_assert!(lease.token > *highest, "token did not increase");
                        }
                        self.highest_token.insert(key, lease.token);
                        self.leases.insert((owner, key), lease);
                    }
                    _ => prop_assert_eq!(
                        before,
                        self.get(key).await,
                        "a non-acquiring acquire changed the record"
                    ),
                }
            }
            Op::Extend { owner, key }
            | Op::Complete { owner, key }
            | Op::Fail { owner, key, .. }
            | Op::Release { owner, key } => self.fenced(owner, key, op).await?,
            Op::Advance { ms } => self.clock.advance(Duration::from_millis(ms)),
            Op::Delete { key } => {
                self.store.delete(&self.keys[key]).await.unwrap();
                self.completed.remove(&key);
            }
            Op::Purge => {
                self.store.purge_expired(10).await.unwrap();
            }
        }
        // A completed record never changes except by retention (or delete, handled above).
        let now = self.clock.now();
        for (key, snapshot) in self.completed.clone() {
            let current = self.get(key).await;
            if snapshot.is_expired(now) {
                prop_assert_eq!(current, None, "a record past retention must read absent");
                self.completed.remove(&key);
            } else {
                prop_assert_eq!(current, Some(snapshot), "a completed record changed");
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn invariants_hold_for_random_histories(ops in prop::collection::vec(op(), 1..80)) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            let mut model = Model::new();
            for op in &ops {
                model.step(op).await?;
            }
            Ok::<_, TestCaseError>(())
        })?;
    }
}
