//! One heartbeat task per executor, extending the leases of every handler in flight.
//!
//! A task (and a timer) per message would cost about a microsecond per message; a shared one
//! costs a map insertion and removal. The task is spawned on the Tokio runtime of the first
//! handler that needs it (and again if that runtime went away), holds only a weak reference to
//! the executor, and ends when the executor is dropped.
//!
//! Each lease in flight is a [`LeaseState`] shared with the executor and the handler's context:
//! a successful extension moves its local deadline on, a lost lease cancels it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use futures::future::join_all;
use metrics::SharedString;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::lease::LeaseState;
use crate::metric_names as m;
use idem_core::{DynStore, Error, LostLease, StateKind};

/// The leases in flight of one executor.
pub(crate) struct Heartbeats {
    store: DynStore,
    ttl: Duration,
    every: Duration,
    ns_label: SharedString,
    state: Mutex<State>,
    wake: Arc<Notify>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    entries: HashMap<u64, Entry>,
    ticker: Option<JoinHandle<()>>,
}

struct Entry {
    state: Arc<LeaseState>,
    due: Instant,
}

/// Keeps a lease heartbeating until dropped.
pub(crate) struct Registration<'a> {
    heartbeats: &'a Arc<Heartbeats>,
    id: u64,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.heartbeats.lock().entries.remove(&self.id);
    }
}

impl Heartbeats {
    pub(crate) fn new(
        store: DynStore,
        ttl: Duration,
        every: Duration,
        ns_label: SharedString,
    ) -> Self {
        Self {
            store,
            ttl,
            every,
            ns_label,
            state: Mutex::default(),
            wake: Arc::new(Notify::new()),
        }
    }

    /// The store the leases are extended on.
    pub(crate) fn store(&self) -> &DynStore {
        &self.store
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section is a single map operation or a scan: a panic cannot leave the
        // state half-updated.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Heartbeats the lease every interval from now until the registration is dropped; moves its
    /// deadline on after every successful extension; cancels it if the store reports the lease
    /// lost. Must be called within a Tokio runtime.
    pub(crate) fn register<'a>(self: &'a Arc<Self>, lease: Arc<LeaseState>) -> Registration<'a> {
        let mut state = self.lock();
        let id = state.next_id;
        state.next_id += 1;
        let was_empty = state.entries.is_empty();
        state.entries.insert(
            id,
            Entry {
                state: lease,
                due: Instant::now() + self.every,
            },
        );
        if state.ticker.as_ref().is_none_or(JoinHandle::is_finished) {
            state.ticker = Some(tokio::spawn(ticker(
                Arc::downgrade(self),
                self.wake.clone(),
            )));
        } else if was_empty {
            self.wake.notify_one();
        }
        Registration {
            heartbeats: self,
            id,
        }
    }

    /// The earliest due time, or `None` when nothing is registered.
    fn next_due(&self) -> Option<Instant> {
        self.lock().entries.values().map(|e| e.due).min()
    }

    /// Extends every due lease (concurrently), then reschedules or cancels each.
    async fn beat(&self) {
        let now = Instant::now();
        let due: Vec<(u64, Arc<LeaseState>)> = self
            .lock()
            .entries
            .iter()
            .filter(|(_, e)| e.due <= now)
            .map(|(id, e)| (*id, Arc::clone(&e.state)))
            .collect();
        if due.is_empty() {
            return;
        }
        // Taken before any request is sent: the store starts each new lease after it.
        let sent = Instant::now();
        let results = join_all(
            due.iter()
                .map(|(_, state)| self.store.extend(&state.lease, self.ttl)),
        )
        .await;
        let now = Instant::now();
        let next = now + self.every;
        // A failed heartbeat is tried again after half an interval: with the interval at its
        // largest (half the lease) that is three quarters of the lease after the last success,
        // before the local deadline (nine tenths); a full interval would come after it, and
        // one failure would cancel the handler.
        let retry = now + self.every / 2;
        let mut state = self.lock();
        for ((id, held), result) in due.into_iter().zip(results) {
            let lease = &held.lease;
            match result {
                Ok(extended) => {
                    held.extended(sent, self.ttl);
                    tracing::trace!(key = lease.key.id(), token = lease.token.get(), expires_at = ?extended.expires_at, "lease extended");
                }
                // The record is finished under this very token: only this lease's holder has
                // it (an operator's release-stuck leaves it released, and is a loss), so its
                // own completion or failure landed while this extend was on its way. Not a lost
                // lease: no warning, and nothing to cancel.
                Err(Error::LeaseLost {
                    why:
                        LostLease::NotInProgress {
                            state: StateKind::Completed | StateKind::Failed(_),
                        },
                    ..
                }) => {
                    if state.entries.remove(&id).is_some() {
                        tracing::debug!(
                            key = lease.key.id(),
                            token = lease.token.get(),
                            "heartbeat: the lease's own completion landed first"
                        );
                    }
                    continue;
                }
                Err(e) if e.is_lease_lost() => {
                    if state.entries.remove(&id).is_some() {
                        tracing::warn!(key = lease.key.id(), token = lease.token.get(), error = %e, "heartbeat: lease lost, cancelling the handler");
                        held.cancel();
                    }
                    continue;
                }
                Err(e) => {
                    metrics::counter!(m::STORE_ERRORS, "namespace" => self.ns_label.clone())
                        .increment(1);
                    tracing::warn!(key = lease.key.id(), token = lease.token.get(), error = %e, "heartbeat failed; trying again after half an interval (the handler is cancelled at its local lease deadline)");
                    if let Some(entry) = state.entries.get_mut(&id) {
                        entry.due = retry;
                    }
                    continue;
                }
            }
            if let Some(entry) = state.entries.get_mut(&id) {
                entry.due = next;
            }
        }
    }
}

impl Drop for Heartbeats {
    fn drop(&mut self) {
        // Wakes the ticker so that it sees the executor gone and ends.
        self.wake.notify_one();
    }
}

/// The heartbeat task of one executor.
async fn ticker(heartbeats: Weak<Heartbeats>, wake: Arc<Notify>) {
    loop {
        let Some(next) = heartbeats.upgrade().map(|h| h.next_due()) else {
            return;
        };
        match next {
            None => wake.notified().await,
            Some(at) => {
                tokio::select! {
                    () = tokio::time::sleep_until(at) => {}
                    () = wake.notified() => {}
                }
            }
        }
        let Some(h) = heartbeats.upgrade() else {
            return;
        };
        h.beat().await;
    }
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use super::*;
    use idem_core::{
        AcquireOutcome, AcquireRequest, IdempotencyStore, ManualClock, MemoryStore, Namespace,
    };

    #[tokio::test]
    async fn extends_until_dropped_and_ends_with_the_executor() {
        let clock = Arc::new(ManualClock::new(
            SystemTime::UNIX_EPOCH + Duration::from_secs(1 << 30),
        ));
        let store = MemoryStore::with_clock(clock.clone());
        let key = Namespace::new("hb").unwrap().key("k").unwrap();
        let req = AcquireRequest::new(key.clone(), "me").with_lease_ttl(Duration::from_secs(10));
        let AcquireOutcome::Acquired { lease, .. } = store.acquire(&req).await.unwrap() else {
            panic!("not acquired")
        };
        let heartbeats = Arc::new(Heartbeats::new(
            Arc::new(store.clone()),
            Duration::from_secs(10),
            Duration::from_millis(5),
            SharedString::const_str("hb"),
        ));
        let expiry = || async {
            store
                .get(&key)
                .await
                .unwrap()
                .unwrap()
                .lease_expires_at
                .unwrap()
        };
        let first = expiry().await;
        let state = LeaseState::new(lease, Instant::now(), Duration::from_secs(10));
        let before = state.deadline();
        let registration = heartbeats.register(state.clone());
        clock.advance(Duration::from_secs(1));
        tokio::time::sleep(Duration::from_millis(30)).await;
        let extended = expiry().await;
        assert!(
            extended >= first + Duration::from_secs(1),
            "{first:?} -> {extended:?}"
        );
        assert!(state.deadline() > before, "the local deadline moves on");
        drop(registration);
        assert!(heartbeats.lock().entries.is_empty());
        clock.advance(Duration::from_secs(1));
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert_eq!(
            expiry().await,
            extended,
            "no heartbeat after the registration is dropped"
        );
        assert!(!state.is_cancelled());

        let ticker = heartbeats.lock().ticker.take().unwrap();
        drop(heartbeats);
        tokio::time::timeout(Duration::from_secs(1), ticker)
            .await
            .expect("the ticker ends with the executor")
            .unwrap();
    }
}
