//! The acquire, with the optional bounded wait while another worker holds the key.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use tokio::time::Instant;

use crate::Executor;
use crate::config::InProgressWait;
use idem_core::{AcquireOutcome, AcquireRequest, Error};

impl<C, R> Executor<C, R> {
    /// Acquire, with the optional bounded wait while another worker holds the key. Also gives
    /// the instant the last acquire was sent (a lease it grants starts after it).
    pub(super) async fn acquire(
        &self,
        req: &AcquireRequest,
    ) -> Result<(AcquireOutcome, Instant), Error> {
        let sent = Instant::now();
        let outcome = self.inner.store.acquire(req).await?;
        self.waited(req, outcome, sent).await
    }

    /// What an acquire sent at `sent` answered, after the optional bounded wait when it is
    /// [`AcquireOutcome::InProgress`].
    pub(super) async fn waited(
        &self,
        req: &AcquireRequest,
        outcome: AcquireOutcome,
        sent: Instant,
    ) -> Result<(AcquireOutcome, Instant), Error> {
        match self.inner.config.in_progress_wait {
            Some(wait) if matches!(outcome, AcquireOutcome::InProgress { .. }) => {
                // Boxed: the waiting loop stays out of the state of every other call.
                Box::pin(self.wait_while_in_progress(req, wait, outcome, sent)).await
            }
            _ => Ok((outcome, sent)),
        }
    }

    /// Polls the store with backoff while the key is in progress, for at most `wait.max_wait`.
    async fn wait_while_in_progress(
        &self,
        req: &AcquireRequest,
        wait: InProgressWait,
        mut outcome: AcquireOutcome,
        mut sent: Instant,
    ) -> Result<(AcquireOutcome, Instant), Error> {
        // `None`: no instant is that far away (`Duration::MAX`): no deadline.
        let deadline = Instant::now().checked_add(wait.max_wait);
        let mut delays = ExponentialBuilder::new()
            .with_min_delay(wait.min_delay)
            .with_max_delay(wait.max_delay)
            .with_jitter()
            .without_max_times()
            .build();
        while let AcquireOutcome::InProgress { retry_after, .. } = &outcome {
            let now = Instant::now();
            if deadline.is_some_and(|deadline| now >= deadline) {
                break;
            }
            // Never sleep past the holder's lease: a crashed holder is taken over at once.
            let delay = delays
                .next()
                .unwrap_or(wait.max_delay)
                .min(wait.max_delay)
                .min(*retry_after + Duration::from_millis(1))
                .min(deadline.map_or(Duration::MAX, |deadline| deadline - now));
            tokio::time::sleep(delay).await;
            let polled = Instant::now();
            match self.inner.store.acquire(req).await {
                Ok(next) => (outcome, sent) = (next, polled),
                // The key was in progress at the last answer, and an error says nothing
                // against that: the wait ends with that answer. Passed up, the error would be a
                // store failure as if the key had never been seen, and `FailOpen` would run the
                // handler beside the holder known to run it.
                Err(e) => {
                    tracing::warn!(error = %e, "the store failed while the key was waited on in progress; answering in progress");
                    break;
                }
            }
        }
        Ok((outcome, sent))
    }
}
