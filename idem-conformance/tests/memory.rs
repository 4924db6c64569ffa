//! The whole suite on `MemoryStore`, once on a manual clock (no sleeping) and once on the system
//! clock (the real-time paths the server backends take).

use std::sync::Arc;

use idem_conformance::{Config, Harness};
use idem_core::{DynStore, ManualClock, MemoryStore};

fn with_unreachable(harness: Harness) -> Harness {
    harness.with_unreachable(|| async {
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
