//! C25: transactional effects, for stores that implement
//! [`TransactionalStore`].
//!
//! A backend's test supplies an [`EffectProbe`]: how to build writes that set a named effect
//! in that store (a Redis key, a DynamoDB item, a PostgreSQL row) and how to read it back. Then:
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use idem_conformance::{Config, Harness, effects::{EffectProbe, c25_transactional_effects}};
//! # use idem_core::{MemoryStore, MemoryWrites, Bytes};
//! # struct Probe(MemoryStore);
//! # #[async_trait::async_trait]
//! # impl EffectProbe<MemoryStore> for Probe {
//! #     fn set(&self, name: &str, value: &[u8]) -> MemoryWrites { MemoryWrites::new().put(name, Bytes::copy_from_slice(value)) }
//! #     fn refused(&self, name: &str) -> Option<MemoryWrites> { None }
//! #     fn too_many(&self, name: &str) -> Option<MemoryWrites> { None }
//! #     async fn read(&self, name: &str) -> Option<Vec<u8>> { self.0.effect(name).map(|b| b.to_vec()) }
//! # }
//! #[tokio::test]
//! async fn c25() {
//!     let store = MemoryStore::new();
//!     let h = Harness::new(Arc::new(store.clone()), Config::real_time());
//!     c25_transactional_effects(&h, &store, &Probe(store.clone())).await;
//! }
//! # fn main() {}
//! ```

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::{
    AcquireOutcome, AcquireRequest, Error, LostLease, RecordState, StateKind, TransactionalStore,
};

use crate::Harness;

/// How C25 writes and reads effects in the store under test.
#[async_trait]
pub trait EffectProbe<S: TransactionalStore>: Send + Sync {
    /// Writes that set the effect `name` to `value`.
    fn set(&self, name: &str, value: &[u8]) -> S::Writes;

    /// Writes that set `name` under a condition that fails (the store must answer
    /// [`Error::EffectRefused`]), or `None` when the store's writes carry no conditions.
    fn refused(&self, name: &str) -> Option<S::Writes>;

    /// Writes the store refuses before sending (too many, or a command outside its set), or
    /// `None` when it has no such limit. Each must be refused with `InvalidInput`.
    fn too_many(&self, name: &str) -> Option<S::Writes>;

    /// The effect's current value, or `None` when it was never written.
    async fn read(&self, name: &str) -> Option<Vec<u8>>;
}

/// C25: a zombie's transactional completion writes nothing; a committed one shows the effect
/// and the completion together; a re-sent one applies nothing again; a refused write or bad
/// writes leave the record in progress and the effect unwritten.
///
/// `store` must be the store behind `h` (the same records).
pub async fn c25_transactional_effects<S: TransactionalStore>(
    h: &Harness,
    store: &S,
    probe: &dyn EffectProbe<S>,
) {
    let ns = h.namespace();
    let retention = h.config().retention;
    let effect = |id: &str| format!("{}:{id}", ns.as_str());
    let key = h.key(&ns, "tx");
    let acquire = |owner: &str, ttl| {
        let req = AcquireRequest::new(key.clone(), owner).with_lease_ttl(ttl);
        async move {
            match h.store().acquire(&req).await {
                Ok(AcquireOutcome::Acquired { lease, .. }) => lease,
                other => panic!("C25: acquire should be Acquired, got {other:?}"),
            }
        }
    };

    // A zombie: its lease expired and another worker took the key over.
    let zombie = acquire("worker-a", h.config().lease_ttl).await;
    h.config().time.pass(h.config().lease_ttl).await;
    let holder = acquire("worker-b", h.config().long_lease_ttl).await;
    let r = store
        .complete_with(
            &zombie,
            Bytes::from_static(b"zombie"),
            retention,
            probe.set(&effect("main"), b"zombie"),
        )
        .await;
    assert!(
        matches!(&r, Err(Error::LeaseLost { why: LostLease::Superseded { current }, .. }) if *current == holder.token),
        "C25: a zombie's transactional completion must be LeaseLost, got {r:?}"
    );
    assert_eq!(
        probe.read(&effect("main")).await,
        None,
        "C25: a zombie's effect must not be written"
    );

    // Bad writes and refused conditions: nothing written, the record still the holder's.
    if let Some(writes) = probe.too_many(&effect("main")) {
        let r = store
            .complete_with(&holder, Bytes::from_static(b"x"), retention, writes)
            .await;
        assert!(
            matches!(r, Err(Error::InvalidInput { .. })),
            "C25: bad writes must be InvalidInput, got {r:?}"
        );
    }
    if let Some(writes) = probe.refused(&effect("main")) {
        let r = store
            .complete_with(&holder, Bytes::from_static(b"x"), retention, writes)
            .await;
        assert!(
            matches!(r, Err(Error::EffectRefused { .. })),
            "C25: a failed condition must be EffectRefused, got {r:?}"
        );
    }
    assert_eq!(
        probe.read(&effect("main")).await,
        None,
        "C25: a refused completion writes no effect"
    );
    let record = h
        .store()
        .get(&key)
        .await
        .expect("C25: get")
        .expect("C25: the record exists");
    assert_eq!(
        (record.state.kind(), record.token),
        (StateKind::InProgress, holder.token),
        "C25: a refused completion leaves the record in progress"
    );

    // The holder commits: effect and completion together.
    store
        .complete_with(
            &holder,
            Bytes::from_static(b"receipt"),
            retention,
            probe.set(&effect("main"), b"charged"),
        )
        .await
        .unwrap_or_else(|e| panic!("C25: the holder's transactional completion failed: {e:?}"));
    assert_eq!(
        probe.read(&effect("main")).await.as_deref(),
        Some(&b"charged"[..]),
        "C25: the effect is written"
    );
    let record = h
        .store()
        .get(&key)
        .await
        .expect("C25: get")
        .expect("C25: the record exists");
    assert_eq!(
        record.state,
        RecordState::Completed {
            result: Bytes::from_static(b"receipt")
        },
        "C25: the completion is written"
    );

    // Re-sent after a lost reply: Ok, and nothing applied again.
    store
        .complete_with(
            &holder,
            Bytes::from_static(b"receipt"),
            retention,
            probe.set(&effect("main"), b"twice"),
        )
        .await
        .unwrap_or_else(|e| panic!("C25: a re-sent transactional completion must be Ok: {e:?}"));
    assert_eq!(
        probe.read(&effect("main")).await.as_deref(),
        Some(&b"charged"[..]),
        "C25: a re-sent completion applies nothing again"
    );
    let r = store
        .complete_with(
            &holder,
            Bytes::from_static(b"other"),
            retention,
            probe.set(&effect("main"), b"other"),
        )
        .await;
    assert!(
        matches!(
            r,
            Err(Error::LeaseLost {
                why: LostLease::NotInProgress {
                    state: StateKind::Completed
                },
                ..
            })
        ),
        "C25: a completion with other bytes must be LeaseLost, got {r:?}"
    );
    assert_eq!(
        probe.read(&effect("main")).await.as_deref(),
        Some(&b"charged"[..])
    );
    assert_eq!(
        h.store()
            .acquire(&AcquireRequest::new(key.clone(), "worker-c"))
            .await
            .expect("C25: acquire"),
        AcquireOutcome::Replayed {
            result: Bytes::from_static(b"receipt")
        },
        "C25: duplicates replay the transactional completion"
    );
}
