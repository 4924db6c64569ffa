//! [`DynamoStore`]: the store trait on conditional `UpdateItem` requests.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use aws_config::{BehaviorVersion, SdkConfig};
use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::config::http::HttpResponse;
use aws_sdk_dynamodb::config::retry::RetryConfig;
use aws_sdk_dynamodb::config::timeout::TimeoutConfig;
use aws_sdk_dynamodb::config::{Credentials, Region};
use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{ReturnValue, ReturnValuesOnConditionCheckFailure};
use bytes::Bytes;
use idem_core::machine::{self, AcquireDecision, Finish};
use idem_core::{
    AcquireOutcome, AcquireRequest, Clock, Completion, Error, Failure, FailureKind, FencingToken,
    IdempotencyKey, IdempotencyStore, Lease, Limits, ListQuery, Page, Record, RecordState, Result,
    StateKind, check_lease_ttl,
};

use crate::STORE;
use crate::batch::run_batch;
use crate::config::DynamoConfig;
use crate::counter::RequestCounter;
use crate::error::map_sdk_error;
use crate::expr;
use crate::item::{
    Decoder, Item, attr, b, fingerprint_value, from_micros, is_tombstone, micros, n, null,
    partition_key, s, state, ttl_seconds,
};

/// How long a tombstone left by `delete` is kept (DynamoDB's TTL removes it after that): a week.
const TOMBSTONE_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

/// How many conditional writes one acquire may send before giving up. Two are enough unless other
/// writers keep changing the item in between.
const MAX_ACQUIRE_ROUNDS: usize = 4;

/// The [`IdempotencyStore`] on Amazon DynamoDB: one item per key, one conditional `UpdateItem`
/// per transition. See the [crate docs](crate) for the item layout, the clock and the tokens.
///
/// Cloning is cheap and shares the client and the [`RequestCounter`].
#[derive(Clone)]
pub struct DynamoStore {
    client: Client,
    table: Arc<str>,
    limits: Limits,
    clock: Arc<dyn Clock>,
    requests: RequestCounter,
}

impl fmt::Debug for DynamoStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DynamoStore")
            .field("table", &self.table)
            .field("limits", &self.limits)
            .field("clock", &self.clock)
            .finish_non_exhaustive()
    }
}

/// What a conditional update did.
enum Written {
    /// The condition held; the attributes asked for with `ReturnValues`.
    Applied(Item),
    /// The condition failed; the item as it was (absent when there was none).
    Refused(Option<Item>),
}

/// Why an acquire gave up: other writers kept changing the item (contention). Surfaces as the
/// source of a retryable [`Error::Unavailable`].
#[derive(Debug, thiserror::Error)]
#[error("acquire did not settle after {MAX_ACQUIRE_ROUNDS} conditional writes")]
struct AcquireDidNotSettle;

impl DynamoStore {
    /// Connects with the standard AWS configuration (environment, profile, default credential
    /// chain) overridden by `config`. No request is sent: use
    /// [`create_table_if_missing`](Self::create_table_if_missing) to check the table exists.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for bad options.
    pub async fn connect(config: DynamoConfig) -> Result<Self> {
        config.validate()?;
        let mut loader = aws_config::defaults(BehaviorVersion::latest());
        if let Some(region) = &config.region {
            loader = loader.region(Region::new(region.clone()));
        }
        if let Some((id, secret)) = &config.static_credentials {
            loader = loader.credentials_provider(static_credentials(id, secret));
        }
        let sdk = loader.load().await;
        Self::from_sdk_config(&sdk, config)
    }

    /// Builds the store on an existing AWS configuration; `config` still sets the table, the
    /// timeouts, the retries and the limits, and overrides endpoint, region and credentials
    /// when it has them.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for bad options.
    pub fn from_sdk_config(sdk: &SdkConfig, config: DynamoConfig) -> Result<Self> {
        config.validate()?;
        let requests = RequestCounter::new();
        let mut builder = aws_sdk_dynamodb::config::Builder::from(sdk)
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(config.connect_timeout)
                    .operation_attempt_timeout(config.attempt_timeout)
                    .operation_timeout(config.operation_timeout)
                    .build(),
            )
            .retry_config(
                RetryConfig::standard()
                    .with_max_attempts(config.max_attempts)
                    .with_initial_backoff(Duration::from_millis(50))
                    .with_max_backoff(Duration::from_secs(1)),
            )
            .interceptor(requests.interceptor());
        if let Some(url) = &config.endpoint_url {
            builder = builder.endpoint_url(url.clone());
        }
        if let Some(region) = &config.region {
            builder = builder.region(Region::new(region.clone()));
        }
        if let Some((id, secret)) = &config.static_credentials {
            builder = builder.credentials_provider(static_credentials(id, secret));
        }
        Ok(Self {
            client: Client::from_conf(builder.build()),
            table: Arc::from(config.table.as_str()),
            limits: config.limits,
            clock: config.clock,
            requests,
        })
    }

    /// The SDK client (for operator tooling; the store's own requests go through it too, so
    /// the [`RequestCounter`] counts yours as well).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The table name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The requests this store (and its clones) sent, by DynamoDB operation.
    pub fn requests(&self) -> &RequestCounter {
        &self.requests
    }

    /// Maps an SDK error of `operation` ([`map_sdk_error`]), naming this store's table and region
    /// when the table is missing.
    pub(crate) fn sdk_error<E>(
        &self,
        operation: &'static str,
        err: SdkError<E, HttpResponse>,
    ) -> Error
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let region = self.client.config().region().map(|r| r.as_ref());
        map_sdk_error(operation, &self.table, region, err)
    }

    /// The clock reading used for one operation, truncated to the microseconds that are stored.
    fn now(&self) -> (u64, SystemTime) {
        let us = micros(self.clock.now());
        (us, from_micros(us))
    }

    /// Sends one conditional `UpdateItem` on `key`.
    async fn update(
        &self,
        key: &IdempotencyKey,
        update: &str,
        condition: &str,
        values: Vec<(&'static str, aws_sdk_dynamodb::types::AttributeValue)>,
        returns: ReturnValue,
    ) -> Result<Written> {
        let expressions = [update, condition];
        let request = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(partition_key(key)))
            .update_expression(update)
            .condition_expression(condition)
            .set_expression_attribute_names(Some(expr::names(&expressions)))
            .set_expression_attribute_values(Some(expr::values(&expressions, values)))
            .return_values(returns)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        match request.send().await {
            Ok(output) => Ok(Written::Applied(output.attributes.unwrap_or_default())),
            Err(err) => match err.as_service_error() {
                Some(UpdateItemError::ConditionalCheckFailedException(refused)) => {
                    Ok(Written::Refused(refused.item.clone()))
                }
                _ => Err(self.sdk_error("UpdateItem", err)),
            },
        }
    }

    /// One fenced transition: `update` applied under [`expr::FENCE`], in one request.
    ///
    /// When the fence fails, DynamoDB returns the item as it was (`ALL_OLD`) in the same answer,
    /// and that item alone decides: when it carries the lease's token and exactly what `finish`
    /// writes (the same result bytes, the same error text and kind, released), the transition
    /// already took effect (a re-send after a lost answer, by the SDK or by the caller) and the
    /// answer is `Ok` with nothing changed; otherwise it is [`Error::LeaseLost`] saying what the
    /// item holds. `finish` is `None` for `extend`, which has nothing to replay.
    async fn fenced(
        &self,
        lease: &Lease,
        update: &str,
        now_us: u64,
        mut values: Vec<(&'static str, aws_sdk_dynamodb::types::AttributeValue)>,
        finish: Option<Finish<'_>>,
    ) -> Result<()> {
        values.extend(fence_values(lease, now_us));
        let written = self
            .update(&lease.key, update, expr::FENCE, values, ReturnValue::None)
            .await?;
        match written {
            Written::Applied(_) => Ok(()),
            Written::Refused(old) => refused(lease, old, now_us, finish),
        }
    }

    /// The clock reading used for one operation (see [`Self::now`]), in microseconds.
    pub(crate) fn now_us(&self) -> u64 {
        self.now().0
    }

    /// The clock reading used for one operation (see [`Self::now`]).
    pub(crate) fn now_time(&self) -> SystemTime {
        self.now().1
    }
}

/// The values [`expr::FENCE`] needs for `lease` at `now_us`.
pub(crate) fn fence_values(
    lease: &Lease,
    now_us: u64,
) -> [(&'static str, aws_sdk_dynamodb::types::AttributeValue); 3] {
    [
        ("token", n(lease.token.get())),
        ("in_progress", s(state::IN_PROGRESS)),
        ("now", n(now_us)),
    ]
}

/// The values [`expr::COMPLETE_UPDATE`] needs (without the fence's).
pub(crate) fn complete_values(
    result: &Bytes,
    retention: Duration,
    now_us: u64,
) -> Vec<(&'static str, aws_sdk_dynamodb::types::AttributeValue)> {
    let expires = retention_deadline(now_us, retention);
    vec![
        ("completed", s(state::COMPLETED)),
        ("result", b(result.to_vec())),
        ("expires", n(expires)),
        ("ttl", n(ttl_seconds(expires))),
        ("null", null()),
    ]
}

/// What a fenced transition of `lease` makes of its refusal, from the item as it was (`old`,
/// DynamoDB's `ALL_OLD`; `None` when there was none): `Ok` when the item carries the lease's
/// token and exactly what `finish` writes (the transition already took effect: a re-send after
/// a lost answer), otherwise [`Error::LeaseLost`] saying what the item holds. `finish` is
/// `None` for `extend`, which has nothing to replay.
pub(crate) fn refused(
    lease: &Lease,
    old: Option<Item>,
    now_us: u64,
    finish: Option<Finish<'_>>,
) -> Result<()> {
    let found = match old {
        None => None,
        Some(item) if is_tombstone(&item) => None,
        Some(item) => {
            let record = Decoder::new(&item, &lease.key).record()?;
            if record.is_expired(from_micros(now_us)) {
                None
            } else if record.token == lease.token
                && finish.is_some_and(|finish| finish.is_done_in(&record))
            {
                return Ok(());
            } else {
                Some((record.token, record.state.kind()))
            }
        }
    };
    Err(Error::lease_lost(lease, found))
}

fn static_credentials(id: &str, secret: &str) -> Credentials {
    Credentials::new(id, secret, None, None, "idem-dynamo-static")
}

#[async_trait]
impl IdempotencyStore for DynamoStore {
    fn name(&self) -> &'static str {
        STORE
    }

    fn limits(&self) -> Limits {
        self.limits
    }

    async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome> {
        req.validate()?;
        let lease_us = u64::try_from(req.lease_ttl.as_micros()).unwrap_or(u64::MAX);
        // Set when the item is a failed-retryable record past retention: re-create it fresh,
        // compare-and-swapped on this token.
        let mut refresh: Option<FencingToken> = None;
        // Marks the items this call writes, so that a retried request can recognise its own
        // earlier, successful attempt.
        let acq_id = uuid::Uuid::new_v4().simple().to_string();
        for _ in 0..MAX_ACQUIRE_ROUNDS {
            let (now_us, now) = self.now();
            let lease_end = now_us.saturating_add(lease_us);
            let mut values = vec![
                ("in_progress", s(state::IN_PROGRESS)),
                ("now", n(now_us)),
                ("one", n(1)),
                ("zero", n(0)),
                ("owner", s(req.owner.clone())),
                ("fp", fingerprint_value(req.fingerprint.as_ref())),
                ("lease", n(lease_end)),
                ("namespace", s(req.key.namespace().as_str())),
                ("id", s(req.key.id())),
                ("max", n(u64::from(req.max_attempts))),
                ("released", s(state::RELEASED)),
                ("failed_retryable", s(state::FAILED_RETRYABLE)),
                ("null_type", s("NULL")),
                ("acq_id", s(acq_id.as_str())),
                ("absent", s(state::ABSENT)),
            ];
            let written = match refresh.take() {
                None => {
                    let condition = expr::acquire_condition(req.fingerprint.is_some());
                    self.update(
                        &req.key,
                        expr::ACQUIRE_UPDATE,
                        &condition,
                        values,
                        ReturnValue::UpdatedOld,
                    )
                    .await?
                }
                Some(seen) => {
                    values.push(("seen", n(seen.get())));
                    match self
                        .update(
                            &req.key,
                            expr::REFRESH_UPDATE,
                            expr::REFRESH_CONDITION,
                            values,
                            ReturnValue::None,
                        )
                        .await?
                    {
                        Written::Applied(_) => {
                            return Ok(acquired(
                                req,
                                FencingToken::new(seen.get() + 1),
                                1,
                                lease_end,
                                false,
                            ));
                        }
                        refused => refused,
                    }
                }
            };
            let item = match written {
                Written::Applied(old) => {
                    // The values the update expression computed from the old item.
                    let decoder = Decoder::new(&old, &req.key);
                    let token = decoder.opt_u64(attr::TOKEN)?.unwrap_or(now_us) + 1;
                    let attempts = decoder.opt_u64(attr::ATTEMPTS)?.unwrap_or(0) + 1;
                    let takeover =
                        decoder.opt_string(attr::STATE)?.as_deref() == Some(state::IN_PROGRESS);
                    let attempt = u32::try_from(attempts).unwrap_or(u32::MAX);
                    return Ok(acquired(
                        req,
                        FencingToken::new(token),
                        attempt,
                        lease_end,
                        takeover,
                    ));
                }
                // The item vanished between the evaluation and the answer: try again.
                Written::Refused(None) => continue,
                // Another delete left a tombstone in between: absent, go again.
                Written::Refused(Some(item)) if is_tombstone(&item) => continue,
                Written::Refused(Some(item)) => item,
            };
            if let Some(outcome) = own_acquisition(&item, req, &acq_id)? {
                return Ok(outcome);
            }
            let record = Decoder::new(&item, &req.key).record()?;
            match machine::acquire(Some(&record), req, now, || record.token) {
                AcquireDecision::Keep(outcome) => return Ok(outcome),
                _ => {
                    let stale_retryable = record.is_expired(now)
                        && matches!(
                            record.state,
                            RecordState::Failed {
                                kind: FailureKind::Retryable,
                                ..
                            }
                        );
                    if stale_retryable {
                        refresh = Some(record.token);
                    }
                    // Otherwise the item changed between our two reads of the clock; go again.
                }
            }
        }
        Err(did_not_settle())
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        check_lease_ttl(ttl)?;
        let (now_us, _) = self.now();
        let lease_end = now_us.saturating_add(u64::try_from(ttl.as_micros()).unwrap_or(u64::MAX));
        self.fenced(
            lease,
            expr::EXTEND_UPDATE,
            now_us,
            vec![("lease", n(lease_end))],
            None,
        )
        .await?;
        Ok(Lease {
            expires_at: from_micros(lease_end),
            ..lease.clone()
        })
    }

    async fn complete(&self, lease: &Lease, result: Bytes, retention: Duration) -> Result<()> {
        self.limits.check_complete(&result, retention)?;
        let (now_us, _) = self.now();
        let values = complete_values(&result, retention, now_us);
        let finish = Finish::Complete {
            result: &result,
            retention,
        };
        self.fenced(lease, expr::COMPLETE_UPDATE, now_us, values, Some(finish))
            .await
    }

    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        self.limits.check_fail(error, retention)?;
        let (now_us, _) = self.now();
        let expires = retention_deadline(now_us, retention);
        // A retryable failure keeps the attributes a re-acquisition counts on; every other kind
        // is final. The `state` attribute carries the kind.
        let update = if kind.is_retryable() {
            expr::FAIL_RETRYABLE_UPDATE
        } else {
            expr::FAIL_FINAL_UPDATE
        };
        let values = vec![
            ("failed", s(StateKind::Failed(kind).name())),
            ("error", s(error)),
            ("expires", n(expires)),
            ("ttl", n(ttl_seconds(expires))),
            ("null", null()),
        ];
        let finish = Finish::Fail {
            error,
            kind,
            retention,
        };
        self.fenced(lease, update, now_us, values, Some(finish))
            .await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let (now_us, _) = self.now();
        let values = vec![("released", s(state::RELEASED)), ("one", n(1))];
        self.fenced(
            lease,
            expr::RELEASE_UPDATE,
            now_us,
            values,
            Some(Finish::Release),
        )
        .await
    }

    /// Bounded concurrent single acquires (DynamoDB has no batched conditional write; see
    /// the crate docs, "Batches"); the requests of one key run in order.
    async fn acquire_many(&self, reqs: &[AcquireRequest]) -> Result<Vec<Result<AcquireOutcome>>> {
        self.limits.check_batch(reqs.len())?;
        Ok(run_batch(
            self,
            reqs,
            |req| partition_key(&req.key),
            |store, req| async move { store.acquire(&req).await },
        )
        .await)
    }

    /// Bounded concurrent single completions; the items of one key run in order.
    async fn complete_many(
        &self,
        items: &[Completion],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        self.limits.check_batch(items.len())?;
        Ok(
            run_batch(
                self,
                items,
                |item| partition_key(&item.lease.key),
                move |store, item| async move {
                    store.complete(&item.lease, item.result, retention).await
                },
            )
            .await,
        )
    }

    /// Bounded concurrent single failures; the items of one key run in order.
    async fn fail_many(&self, items: &[Failure], retention: Duration) -> Result<Vec<Result<()>>> {
        self.limits.check_batch(items.len())?;
        Ok(run_batch(
            self,
            items,
            |item| partition_key(&item.lease.key),
            move |store, item| async move {
                store
                    .fail(&item.lease, &item.error, item.kind, retention)
                    .await
            },
        )
        .await)
    }

    /// Bounded concurrent single releases; the leases of one key run in order.
    async fn release_many(&self, leases: &[Lease]) -> Result<Vec<Result<()>>> {
        self.limits.check_batch(leases.len())?;
        Ok(run_batch(
            self,
            leases,
            |lease| partition_key(&lease.key),
            |store, lease| async move { store.release(&lease).await },
        )
        .await)
    }

    /// One page: one strongly consistent `Scan` request of up to `query.limit` items of the
    /// whole table, filtered by namespace (and state) in DynamoDB and by
    /// [`ListQuery::matches`] here, so pages may be short. Cost: O(table) over a whole
    /// listing, and read capacity for every item scanned (see the crate docs, "Listing").
    async fn list(&self, query: &ListQuery) -> Result<Page> {
        self.list_page(query).await
    }

    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        let output = self
            .client
            .get_item()
            .table_name(&*self.table)
            .key(attr::PK, s(partition_key(key)))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| self.sdk_error("GetItem", e))?;
        let Some(item) = output.item.filter(|item| !is_tombstone(item)) else {
            return Ok(None);
        };
        let (_, now) = self.now();
        let record = Decoder::new(&item, key).record()?;
        Ok((!record.is_expired(now)).then_some(record))
    }

    /// Leaves a tombstone: an `UpdateItem` that removes every attribute but the key and the
    /// token, and sets the TTL a week ahead. Every operation treats the tombstone as absent,
    /// and the next acquire takes its token on from it, so tokens stay monotonic across a
    /// delete whatever the clocks say.
    async fn delete(&self, key: &IdempotencyKey) -> Result<bool> {
        let (now_us, _) = self.now();
        let ttl = ttl_seconds(
            now_us.saturating_add(u64::try_from(TOMBSTONE_TTL.as_micros()).unwrap_or(u64::MAX)),
        );
        let written = self
            .update(
                key,
                expr::DELETE_UPDATE,
                expr::DELETE_CONDITION,
                vec![("ttl", n(ttl))],
                ReturnValue::AllOld,
            )
            .await?;
        let old = match written {
            Written::Applied(old) => old,
            // No item at all: nothing to delete, and no tombstone written.
            Written::Refused(_) => return Ok(false),
        };
        let decoder = Decoder::new(&old, key);
        if decoder.opt_u64(attr::TOKEN).is_err() {
            // A corrupt token would break every later acquire (`token + 1`): drop it, and the
            // next acquire starts from the clock as for a new key.
            self.client
                .update_item()
                .table_name(&*self.table)
                .key(attr::PK, s(partition_key(key)))
                .update_expression("REMOVE #token")
                .expression_attribute_names("#token", attr::TOKEN)
                .send()
                .await
                .map_err(|e| self.sdk_error("UpdateItem", e))?;
        }
        if old.is_empty() || is_tombstone(&old) {
            return Ok(false);
        }
        // An undecodable deadline counts as "was there".
        let expired = decoder
            .opt_u64(attr::EXPIRES)
            .ok()
            .flatten()
            .is_some_and(|at| at <= now_us);
        Ok(!expired)
    }

    /// Removes nothing: the table's TTL attribute (`ttl`) lets DynamoDB delete items past
    /// retention, and every operation already treats them as absent until then. It still asks
    /// for the table (one `DescribeTable`), so that a purge against a missing table or an
    /// endpoint that does not answer fails as any other operation would instead of answering 0.
    async fn purge_expired(&self, _limit: usize) -> Result<u64> {
        self.client()
            .describe_table()
            .table_name(self.table())
            .send()
            .await
            .map_err(|e| self.sdk_error("DescribeTable", e))?;
        Ok(0)
    }
}

/// A refused acquire: when the item is in progress under this call's `acq_id`, an earlier
/// attempt of this very call took effect (its answer was lost and the SDK sent the request
/// again), and this is that acquisition. Nothing else writes this call's random `acq_id`, and
/// every request of the call that did write returned at once, so no other case matches.
fn own_acquisition(
    item: &Item,
    req: &AcquireRequest,
    acq_id: &str,
) -> Result<Option<AcquireOutcome>> {
    let decoder = Decoder::new(item, &req.key);
    if decoder.opt_string(attr::ACQ_ID)?.as_deref() != Some(acq_id)
        || decoder.opt_string(attr::STATE)?.as_deref() != Some(state::IN_PROGRESS)
    {
        return Ok(None);
    }
    let record = decoder.record()?;
    let takeover = decoder.opt_string(attr::ACQ_PREV)?.as_deref() == Some(state::IN_PROGRESS);
    let lease_end = record.lease_expires_at.map_or(0, micros);
    Ok(Some(acquired(
        req,
        record.token,
        record.attempts,
        lease_end,
        takeover,
    )))
}

/// The error of an acquire that gave up under contention: retryable.
fn did_not_settle() -> Error {
    Error::unavailable(STORE, AcquireDidNotSettle)
}

fn retention_deadline(now_us: u64, retention: Duration) -> u64 {
    now_us.saturating_add(u64::try_from(retention.as_micros()).unwrap_or(u64::MAX))
}

fn acquired(
    req: &AcquireRequest,
    token: FencingToken,
    attempt: u32,
    lease_end_us: u64,
    takeover: bool,
) -> AcquireOutcome {
    AcquireOutcome::Acquired {
        lease: Lease {
            key: req.key.clone(),
            owner: req.owner.clone(),
            token,
            attempt,
            expires_at: from_micros(lease_end_us),
        },
        takeover,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contention_is_retryable() {
        let err = did_not_settle();
        assert!(err.is_retryable(), "{err:?}");
        assert!(
            matches!(err, Error::Unavailable { store: STORE, .. }),
            "{err:?}"
        );
    }
}
