//! Observability: one tracing span per message, counters through the `metrics` facade, and a
//! log line per outcome.

use tracing::{Span, field};

use crate::Executor;
use crate::error::ExecutorError;
use crate::metric_names::Counter;
use crate::outcome::Outcome;

impl<C, R> Executor<C, R> {
    /// The span of one message; `key`, `attempt`, `token` and `outcome` are recorded as they
    /// become known.
    pub(super) fn span(&self) -> Span {
        tracing::info_span!(
            "idem",
            namespace = %self.inner.namespace,
            key = field::Empty,
            attempt = field::Empty,
            token = field::Empty,
            outcome = field::Empty,
        )
    }

    /// Increments `counter` (labelled with the namespace).
    pub(super) fn count(&self, counter: Counter) {
        self.inner.counters.increment(counter);
    }

    /// Records the outcome on the span, counts it and logs it.
    pub(super) fn observe<T>(&self, result: &Result<Outcome<T>, ExecutorError>, span: &Span) {
        match result {
            Ok(outcome) => {
                let name = outcome.name();
                span.record("outcome", name);
                let counter = match outcome {
                    Outcome::Executed(_) => Some(Counter::Executed),
                    Outcome::Replayed(_) => Some(Counter::Replayed),
                    Outcome::InProgress { .. } => Some(Counter::InProgress),
                    Outcome::Conflict => Some(Counter::Conflicts),
                    Outcome::Exhausted { .. } => Some(Counter::Exhausted),
                    Outcome::Failed { .. } => Some(Counter::Failed),
                    Outcome::ResultNotStored { .. } => Some(Counter::ResultNotStored),
                    Outcome::LeaseLost { .. } => Some(Counter::LeaseLost),
                    Outcome::NotDeduplicated { .. } => Some(Counter::NotDeduplicated),
                    Outcome::NotCommitted { .. } => Some(Counter::NotCommitted),
                    // Counted as `RETRYABLE_FAILURES` when recorded.
                    Outcome::Retry { .. } => None,
                };
                if let Some(counter) = counter {
                    self.count(counter);
                }
                match outcome {
                    Outcome::Executed(_) | Outcome::Replayed(_) | Outcome::InProgress { .. } => {
                        tracing::debug!(outcome = name, "message processed");
                    }
                    Outcome::Retry { error, .. } => {
                        tracing::warn!(outcome = name, %error, "handler failed, will retry");
                    }
                    Outcome::Exhausted { last_error, .. } => {
                        tracing::warn!(
                            outcome = name,
                            last_error,
                            "poison message: attempts exhausted"
                        );
                    }
                    Outcome::Failed { error } => {
                        tracing::warn!(outcome = name, %error, "terminal failure");
                    }
                    Outcome::ResultNotStored { error } => {
                        tracing::error!(
                            outcome = name,
                            %error,
                            "the handler's effect was applied but its result is not stored"
                        );
                    }
                    Outcome::NotCommitted {
                        refusal,
                        kind,
                        error,
                        ..
                    } => {
                        tracing::warn!(
                            outcome = name,
                            refusal = refusal.name(),
                            kind = kind.name(),
                            %error,
                            "the transactional commit was refused: nothing committed"
                        );
                    }
                    _ => tracing::warn!(outcome = name, "message processed"),
                }
            }
            Err(e) => {
                span.record("outcome", "error");
                tracing::warn!(error = %e, "message not processed");
            }
        }
    }
}
