//! Counting the requests a store sends, by DynamoDB operation.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use aws_sdk_dynamodb::config::interceptors::BeforeTransmitInterceptorContextRef;
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_dynamodb::error::BoxError;
use aws_smithy_runtime_api::client::orchestrator::Metadata;

/// Counts the HTTP requests a [`DynamoStore`](crate::DynamoStore) sends, by DynamoDB operation
/// (`UpdateItem`, `GetItem`, ...).
///
/// An SDK interceptor increments it right before each request goes on the wire, so SDK retries
/// count as the separate requests they are. Cloning shares the counts.
///
/// ```
/// let counter = idem_dynamo::RequestCounter::new();
/// assert_eq!(counter.total(), 0);
/// assert_eq!(counter.get("UpdateItem"), 0);
/// ```
#[derive(Clone, Debug, Default)]
pub struct RequestCounter {
    counts: Arc<Mutex<BTreeMap<String, u64>>>,
}

impl RequestCounter {
    /// A counter at zero.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, u64>> {
        // Counts are plain integers: a poisoned lock cannot hold a half-written one.
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, operation: &str) {
        let mut counts = self.lock();
        match counts.get_mut(operation) {
            Some(count) => *count += 1,
            None => {
                counts.insert(operation.to_owned(), 1);
            }
        }
    }

    /// Requests sent for `operation` (for instance `"UpdateItem"`).
    pub fn get(&self, operation: &str) -> u64 {
        self.lock().get(operation).copied().unwrap_or(0)
    }

    /// Requests sent, all operations together.
    pub fn total(&self) -> u64 {
        self.lock().values().sum()
    }

    /// Every operation seen with its count.
    pub fn snapshot(&self) -> BTreeMap<String, u64> {
        self.lock().clone()
    }

    /// Sets every count back to zero.
    pub fn reset(&self) {
        self.lock().clear();
    }

    /// The interceptor that feeds this counter.
    pub(crate) fn interceptor(&self) -> CountRequests {
        CountRequests(self.clone())
    }
}

/// The SDK interceptor behind [`RequestCounter`].
#[derive(Debug)]
pub(crate) struct CountRequests(RequestCounter);

impl Intercept for CountRequests {
    fn name(&self) -> &'static str {
        "idem_dynamo::CountRequests"
    }

    fn read_before_transmit(
        &self,
        _context: &BeforeTransmitInterceptorContextRef<'_>,
        _runtime_components: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let operation = cfg.load::<Metadata>().map_or("unknown", Metadata::name);
        self.0.record(operation);
        Ok(())
    }
}
