//! Differential property test: random sequences of acquire / extend / complete / fail / release
//! / time / delete / purge across several owners and keys give the same answers and leave the
//! same records on a kit store (the worked example's map) as on `MemoryStore`, the reference.
//! Tokens differ between the two (the kit's follow the clock), so they are compared by what
//! they mean: a lease is the current one or not.

// The example is written against the facade (`idem::...`), which re-exports this crate.
extern crate idem_core as idem;

#[allow(dead_code, unreachable_pub)]
#[path = "../../idem/examples/kit_memory.rs"]
mod kit_memory;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use idem_core::kit::{KitOptions, KitStore};
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Error, FailureKind, Fingerprint, IdempotencyKey,
    IdempotencyStore, Lease, LostLease, ManualClock, MemoryStore, Namespace, Record, Result,
};
use kit_memory::MapBackend;
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
        result: u8,
    },
    Fail {
        owner: usize,
        key: usize,
        kind: usize,
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
    let who = (0..OWNERS, 0..KEYS);
    prop_oneof![
        4 => (0..OWNERS, 0..KEYS, any::<bool>(), 1u32..4).prop_map(
            |(owner, key, other_payload, max_attempts)| Op::Acquire {
                owner,
                key,
                other_payload,
                max_attempts
            }
        ),
        1 => who.clone().prop_map(|(owner, key)| Op::Extend { owner, key }),
        3 => (0..OWNERS, 0..KEYS, 0u8..2).prop_map(|(owner, key, result)| Op::Complete {
            owner,
            key,
            result
        }),
        2 => (0..OWNERS, 0..KEYS, 0usize..3).prop_map(|(owner, key, kind)| Op::Fail {
            owner,
            key,
            kind
        }),
        1 => who.prop_map(|(owner, key)| Op::Release { owner, key }),
        2 => (1u64..700).prop_map(|ms| Op::Advance { ms }),
        1 => (0..KEYS).prop_map(|key| Op::Delete { key }),
        1 => Just(Op::Purge),
    ]
}

/// What an answer means, without the store's own token values.
fn shape(r: &Result<AcquireOutcome>) -> String {
    match r {
        Ok(AcquireOutcome::Acquired { lease, takeover }) => format!(
            "Acquired(attempt {}, takeover {takeover}, owner {}, until {:?})",
            lease.attempt, lease.owner, lease.expires_at
        ),
        Ok(other) => format!("{other:?}"),
        Err(e) => error_shape(e),
    }
}

fn error_shape(e: &Error) -> String {
    match e {
        Error::LeaseLost { why, .. } => match why {
            LostLease::Superseded { .. } => "LeaseLost(superseded)".into(),
            other => format!("LeaseLost({other})"),
        },
        other => format!("{other:?}"),
    }
}

fn unit_shape(r: &Result<()>) -> String {
    r.as_ref().map_or_else(error_shape, |()| "Ok".into())
}

fn record_shape(r: &Option<Record>) -> String {
    match r {
        None => "none".into(),
        Some(r) => format!(
            "{:?} attempts {} owner {} fp {:?} lease {:?} created {:?} updated {:?} expires {:?}",
            r.state,
            r.attempts,
            r.owner,
            r.fingerprint,
            r.lease_expires_at,
            r.created_at,
            r.updated_at,
            r.expires_at
        ),
    }
}

struct Pair {
    memory: MemoryStore,
    kit: KitStore<MapBackend>,
    clocks: [Arc<ManualClock>; 2],
    keys: Vec<IdempotencyKey>,
    /// The last lease each owner got for each key, on each store.
    leases: HashMap<(usize, usize), (Lease, Lease)>,
}

impl Pair {
    fn new() -> Self {
        // Whole seconds: the kit keeps microseconds, MemoryStore nanoseconds.
        let start = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let clocks = [
            Arc::new(ManualClock::new(start)),
            Arc::new(ManualClock::new(start)),
        ];
        let ns = Namespace::new("equivalence").unwrap();
        Self {
            memory: MemoryStore::with_clock(clocks[0].clone()),
            kit: KitStore::with_options(
                MapBackend::default(),
                KitOptions::default().with_clock(clocks[1].clone()),
            ),
            clocks,
            keys: (0..KEYS)
                .map(|k| ns.key(format!("k{k}")).unwrap())
                .collect(),
            leases: HashMap::new(),
        }
    }

    async fn apply(&mut self, op: &Op) -> (String, String) {
        match *op {
            Op::Acquire {
                owner,
                key,
                other_payload,
                max_attempts,
            } => {
                let payload = if other_payload { "b" } else { "a" };
                let req = AcquireRequest::new(self.keys[key].clone(), format!("owner-{owner}"))
                    .with_fingerprint(Fingerprint::of(payload))
                    .with_lease_ttl(LEASE)
                    .with_max_attempts(max_attempts);
                let m = self.memory.acquire(&req).await;
                let k = self.kit.acquire(&req).await;
                if let (
                    Ok(AcquireOutcome::Acquired { lease: ml, .. }),
                    Ok(AcquireOutcome::Acquired { lease: kl, .. }),
                ) = (&m, &k)
                {
                    self.leases.insert((owner, key), (ml.clone(), kl.clone()));
                }
                (shape(&m), shape(&k))
            }
            Op::Extend { owner, key } => match self.leases.get(&(owner, key)).cloned() {
                None => ("no lease".into(), "no lease".into()),
                Some((ml, kl)) => {
                    let m = self.memory.extend(&ml, LEASE).await;
                    let k = self.kit.extend(&kl, LEASE).await;
                    if let (Ok(m), Ok(k)) = (&m, &k) {
                        self.leases.insert((owner, key), (m.clone(), k.clone()));
                    }
                    let s = |r: &Result<Lease>| {
                        r.as_ref()
                            .map_or_else(error_shape, |l| format!("until {:?}", l.expires_at))
                    };
                    (s(&m), s(&k))
                }
            },
            Op::Complete { owner, key, result } => match self.leases.get(&(owner, key)).cloned() {
                None => ("no lease".into(), "no lease".into()),
                Some((ml, kl)) => {
                    let result = Bytes::from(vec![result; 3]);
                    let m = self.memory.complete(&ml, result.clone(), RETENTION).await;
                    let k = self.kit.complete(&kl, result, RETENTION).await;
                    (unit_shape(&m), unit_shape(&k))
                }
            },
            Op::Fail { owner, key, kind } => match self.leases.get(&(owner, key)).cloned() {
                None => ("no lease".into(), "no lease".into()),
                Some((ml, kl)) => {
                    let kind = FailureKind::ALL[kind];
                    let m = self.memory.fail(&ml, "boom", kind, RETENTION).await;
                    let k = self.kit.fail(&kl, "boom", kind, RETENTION).await;
                    (unit_shape(&m), unit_shape(&k))
                }
            },
            Op::Release { owner, key } => match self.leases.get(&(owner, key)).cloned() {
                None => ("no lease".into(), "no lease".into()),
                Some((ml, kl)) => {
                    let m = self.memory.release(&ml).await;
                    let k = self.kit.release(&kl).await;
                    (unit_shape(&m), unit_shape(&k))
                }
            },
            Op::Advance { ms } => {
                for c in &self.clocks {
                    c.advance(Duration::from_millis(ms));
                }
                (String::new(), String::new())
            }
            Op::Delete { key } => {
                let m = self.memory.delete(&self.keys[key]).await;
                let k = self.kit.delete(&self.keys[key]).await;
                (format!("{m:?}"), format!("{k:?}"))
            }
            Op::Purge => {
                // The counts differ by design (the kit leaves tombstones); what reads back may not.
                self.memory.purge_expired(10).await.unwrap();
                self.kit.purge_expired(10).await.unwrap();
                (String::new(), String::new())
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn a_kit_store_answers_as_the_reference_does(ops in proptest::collection::vec(op(), 1..60)) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            let mut pair = Pair::new();
            let mut tokens: Vec<Vec<u64>> = vec![Vec::new(); KEYS];
            for (i, op) in ops.iter().enumerate() {
                let (m, k) = pair.apply(op).await;
                prop_assert_eq!(&m, &k, "step {} {:?}", i, op);
                for (key, seen) in pair.keys.iter().zip(tokens.iter_mut()) {
                    let m = pair.memory.get(key).await.unwrap();
                    let k = pair.kit.get(key).await.unwrap();
                    prop_assert_eq!(record_shape(&m), record_shape(&k), "step {} {:?}, {}", i, op, key);
                    if let Some(r) = k
                        && seen.last() != Some(&r.token.get())
                    {
                        seen.push(r.token.get());
                    }
                }
            }
            for t in &tokens {
                prop_assert!(t.windows(2).all(|w| w[0] < w[1]), "kit tokens rise: {:?}", t);
            }
            Ok(())
        })?;
    }
}
