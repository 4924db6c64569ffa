//! The store-error policy: fail closed (the default) or fail open.

use std::future::Future;

use crate::Executor;
use crate::config::StoreErrorPolicy;
use crate::error::{ExecutorError, StoreStage};
use crate::metric_names::Counter;
use crate::outcome::{Outcome, PassThroughReason};
use idem_core::{Error, IdempotencyKey};

impl<C, R> Executor<C, R> {
    /// Applies the store-error policy to `error`, met at `stage`. `fail_open` builds the outcome
    /// when failing open (running the handler, at [`StoreStage::Acquire`]).
    pub(super) async fn store_error<T, G, GFut>(
        &self,
        stage: StoreStage,
        error: Error,
        key: &IdempotencyKey,
        fail_open: G,
    ) -> Result<Outcome<T>, ExecutorError>
    where
        G: FnOnce(PassThroughReason) -> GFut,
        GFut: Future<Output = Outcome<T>>,
    {
        self.count(Counter::StoreErrors);
        let handler_ran = stage != StoreStage::Acquire;
        match self.inner.config.store_errors {
            StoreErrorPolicy::FailOpen => {
                tracing::warn!(
                    %stage,
                    error = %error,
                    key = key.id(),
                    "store error: failing open, the message is not deduplicated"
                );
                Ok(fail_open(PassThroughReason::StoreError {
                    stage,
                    source: error,
                })
                .await)
            }
            StoreErrorPolicy::FailClosed => {
                tracing::warn!(
                    %stage,
                    error = %error,
                    key = key.id(),
                    handler_ran,
                    "store error: failing closed"
                );
                Err(ExecutorError::Store {
                    stage,
                    handler_ran,
                    retry_after: self.inner.config.retry_delay,
                    source: error,
                })
            }
        }
    }

    /// The outcome of a lost lease.
    pub(super) fn lease_lost<T>(&self) -> Outcome<T> {
        Outcome::LeaseLost {
            retry_after: self.inner.config.retry_delay,
        }
    }
}
