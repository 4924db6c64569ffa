//! The whole conformance suite on `SqliteStore`: once on a manual clock (no sleeping) with the
//! default `Offload::InPlace`, once on the system clock (the real-time paths) with
//! `Offload::BlockingPool`, each scenario on its own database file; and C26.

mod common;

use std::sync::Arc;

use common::{IN_PROCESS, db_path, unreachable};
use idem_conformance::{Config, Harness};
use idem_core::ManualClock;
use idem_sqlite::{Offload, SqliteOptions, SqliteStore};

mod manual_clock {
    use super::*;

    pub(super) async fn harness() -> Harness {
        let clock = Arc::new(ManualClock::default());
        let options = SqliteOptions::default().with_clock(clock.clone());
        let store = SqliteStore::open_with(db_path("manual"), options)
            .await
            .expect("open");
        Harness::new(Arc::new(store), Config::manual_time(clock))
            .in_process(IN_PROCESS)
            .with_unreachable(unreachable)
    }

    idem_conformance::conformance_tests!(harness);
}

mod system_clock {
    use super::*;

    pub(super) async fn harness() -> Harness {
        // The other way of running statements off the runtime than the manual-clock run.
        let options = SqliteOptions::default().with_offload(Offload::BlockingPool);
        let store = SqliteStore::open_with(db_path("system"), options)
            .await
            .expect("open");
        Harness::new(Arc::new(store), Config::real_time())
            .in_process(IN_PROCESS)
            .with_unreachable(unreachable)
    }

    idem_conformance::conformance_tests!(harness);
}
