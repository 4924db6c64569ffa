//! The whole suite on `MemoryStore`, once on a manual clock (no sleeping) and once on the system
//! clock (the real-time paths the server backends take).

use std::sync::Arc;

use idem_conformance::{Config, Harness};
use idem_core::{DynStore, ManualClock, MemoryStore};

fn with_unreachable(harness: Harness) -> Harness {
    harness
        .in_process("MemoryStore sends no requests")
        .with_unreachable(|| async {
            let dead = MemoryStore::new();
            dead.set_available(false);
            Ok(Arc::new(dead) as DynStore)
        })
}

mod manual_clock {
    use super::*;

    async fn harness() -> Harness {
        let clock = Arc::new(ManualClock::default());
        let store = MemoryStore::with_clock(clock.clone());
        with_unreachable(Harness::new(Arc::new(store), Config::manual_time(clock)))
    }

    idem_conformance::conformance_tests!(harness);
}

mod system_clock {
    use super::*;

    async fn harness() -> Harness {
        with_unreachable(Harness::new(
            Arc::new(MemoryStore::new()),
            Config::real_time(),
        ))
    }

    idem_conformance::conformance_tests!(harness);
}

/// C25 on `MemoryStore`'s effect map (`MemoryWrites`).
mod transactional {
    use async_trait::async_trait;
    use idem_conformance::effects::{EffectProbe, c25_transactional_effects};
    use idem_core::{Bytes, MAX_MEMORY_WRITES, MemoryWrites};

    use super::*;

    struct Probe(MemoryStore);

    #[async_trait]
    impl EffectProbe<MemoryStore> for Probe {
        fn set(&self, name: &str, value: &[u8]) -> MemoryWrites {
            MemoryWrites::new().put(name, Bytes::copy_from_slice(value))
        }

        fn refused(&self, name: &str) -> Option<MemoryWrites> {
            let absent = format!("{name}:never-written");
            Some(
                MemoryWrites::new()
                    .put(name, Bytes::from_static(b"refused"))
                    .expect(absent, Some(Bytes::from_static(b"something"))),
            )
        }

        fn too_many(&self, name: &str) -> Option<MemoryWrites> {
            let writes = (0..=MAX_MEMORY_WRITES).fold(MemoryWrites::new(), |w, i| {
                w.put(format!("{name}:{i}"), Bytes::new())
            });
            Some(writes.put(name, Bytes::from_static(b"too many")))
        }

        async fn read(&self, name: &str) -> Option<Vec<u8>> {
            self.0.effect(name).map(|b| b.to_vec())
        }
    }

    #[tokio::test]
    async fn c25_transactional_effects_manual_clock() {
        let clock = Arc::new(ManualClock::default());
        let store = MemoryStore::with_clock(clock.clone());
        let h = Harness::new(Arc::new(store.clone()), Config::manual_time(clock));
        c25_transactional_effects(&h, &store, &Probe(store.clone())).await;
    }

    #[tokio::test]
    async fn c25_transactional_effects_system_clock() {
        let store = MemoryStore::new();
        let h = Harness::new(Arc::new(store.clone()), Config::real_time());
        c25_transactional_effects(&h, &store, &Probe(store.clone())).await;
    }
}

/// The outage driver on `MemoryStore`, its outage simulated with `set_available`.
mod outage {
    use std::time::Duration;

    use async_trait::async_trait;
    use idem_conformance::outage::{Effects, Outage, OutagePlan, run_both};
    use idem_core::{FencingToken, IdempotencyKey, MemoryWrites, Result};

    use super::*;

    struct Switch(MemoryStore);

    #[async_trait]
    impl Outage for Switch {
        async fn kill(&self) {
            self.0.set_available(false);
        }
        async fn restart(&self) {
            self.0.set_available(true);
        }
    }

    struct Appended(MemoryStore);

    #[async_trait]
    impl Effects<MemoryStore> for Appended {
        fn apply(&self, key: &IdempotencyKey, token: FencingToken) -> MemoryWrites {
            MemoryWrites::new().put(format!("{key}/{token}"), token.get().to_string())
        }

        async fn applied(&self, key: &IdempotencyKey) -> Result<Vec<FencingToken>> {
            let found = self.0.effects_with_prefix(&format!("{key}/"));
            Ok(found
                .into_iter()
                .map(|(_, v)| FencingToken::new(std::str::from_utf8(&v).unwrap().parse().unwrap()))
                .collect())
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn store_outages_duplicate_nothing_on_the_transactional_path() {
        let store = MemoryStore::new();
        // Short leases and outages: the same shape as the server runs, in a few seconds.
        let plan = OutagePlan::default()
            .with_keys(2_000)
            .with_lease_ttl(Duration::from_millis(100))
            .with_down_for(Duration::from_millis(300));
        let (_, outside) = run_both(
            "memory",
            &plan,
            Arc::new(store.clone()),
            Arc::new(Switch(store.clone())),
            Arc::new(Appended(store)),
        )
        .await;
        // Crashes after the handler ran duplicate an effect written outside the store.
        assert!(outside.duplicate_effects > 0, "{outside:?}");
    }
}
