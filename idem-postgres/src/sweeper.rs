//! The retention sweeper: deletes records past their retention deadline in bounded batches.
//!
//! Records past retention are already treated as absent by every operation; the sweeper only
//! reclaims their space. Each batch is one `DELETE ... WHERE ctid IN (SELECT ... LIMIT n FOR
//! UPDATE SKIP LOCKED)`, so batches are short transactions, and several sweepers (one per
//! consumer process, say) never wait on each other or on an acquire that is re-taking an expired
//! key.

use std::time::Duration;

use idem_core::{IdempotencyStore, Result};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::store::PostgresStore;

/// How a [`Sweeper`] runs.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SweeperConfig {
    /// Pause between sweeps. Default 60 s.
    pub interval: Duration,
    /// Records deleted per statement. Default 1,000.
    pub batch: usize,
    /// Most batches per sweep (bounds one sweep's work; the next sweep continues). Default 100.
    pub max_batches: usize,
}

impl Default for SweeperConfig {
    /// Every 60 s, batches of 1,000, at most 100 batches per sweep.
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(60),
            batch: 1_000,
            max_batches: 100,
        }
    }
}

impl SweeperConfig {
    /// Sets the pause between sweeps.
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Sets the batch size.
    pub fn with_batch(mut self, batch: usize) -> Self {
        self.batch = batch;
        self
    }

    /// Sets the most batches per sweep.
    pub fn with_max_batches(mut self, max_batches: usize) -> Self {
        self.max_batches = max_batches;
        self
    }
}

/// A background task that purges expired records periodically; see [`PostgresStore::spawn_sweeper`].
///
/// Dropping the handle stops the task (at its next await point); [`Sweeper::shutdown`] stops it
/// and waits for it.
#[derive(Debug)]
pub struct Sweeper {
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<u64>>,
}

impl Sweeper {
    /// Stops the sweeper and waits for it; returns how many records it purged in all.
    pub async fn shutdown(mut self) -> u64 {
        let _ = self.stop.send(true);
        match self.task.take() {
            Some(task) => task.await.unwrap_or(0),
            None => 0,
        }
    }

    /// Whether the task has ended.
    pub fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(JoinHandle::is_finished)
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

impl PostgresStore {
    /// Deletes records past retention in batches of `batch` until a batch comes back short or
    /// `max_batches` ran; returns how many were deleted.
    ///
    /// # Errors
    /// As [`purge_expired`](IdempotencyStore::purge_expired).
    pub async fn sweep(&self, batch: usize, max_batches: usize) -> Result<u64> {
        let mut total = 0;
        for _ in 0..max_batches {
            let n = self.purge_expired(batch).await?;
            total += n;
            if n < batch as u64 {
                break;
            }
        }
        Ok(total)
    }

    /// Starts a tokio task that runs [`sweep`](Self::sweep) every `config.interval` (the first
    /// sweep right away). Errors are logged with `tracing` and the next sweep runs as planned.
    /// Must be called inside a tokio runtime.
    pub fn spawn_sweeper(&self, config: SweeperConfig) -> Sweeper {
        let (stop, mut stopped) = watch::channel(false);
        let store = self.clone();
        let task = tokio::spawn(async move {
            let mut purged = 0u64;
            loop {
                match store
                    .sweep(config.batch.max(1), config.max_batches.max(1))
                    .await
                {
                    Ok(n) => {
                        purged += n;
                        if n > 0 {
                            tracing::debug!(
                                purged = n,
                                table = store.qualified_table(),
                                "idem sweep"
                            );
                        }
                    }
                    Err(error) => {
                        tracing::warn!(%error, table = store.qualified_table(), "idem sweep failed");
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(config.interval) => {}
                    _ = stopped.changed() => break,
                }
                if *stopped.borrow() {
                    break;
                }
            }
            purged
        });
        Sweeper {
            stop,
            task: Some(task),
        }
    }
}
