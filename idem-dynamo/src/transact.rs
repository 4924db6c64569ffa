//! Transactional effects: the handler's writes and the completion in one `TransactWriteItems`
//! ([`TransactionalStore`] for [`DynamoStore`]).

use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_dynamodb::config::http::HttpResponse;
use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::types::{
    AttributeValue, CancellationReason, ConditionCheck, Delete, Put,
    ReturnValuesOnConditionCheckFailure, TransactWriteItem, Update,
};
use bytes::Bytes;
use idem_core::machine::Finish;
use idem_core::{Error, FencingToken, IdempotencyStore, Lease, Result, TransactionalStore};
use sha2::{Digest, Sha256};

use crate::STORE;
use crate::error::{SdkFailure, is_retryable_code};
use crate::expr;
use crate::item::{Item, attr, partition_key, s};
use crate::store::{DynamoStore, complete_values, fence_values, refused};

/// The most actions one `TransactWriteItems` request may carry (a DynamoDB service limit).
pub const MAX_TRANSACT_ITEMS: usize = 100;

/// The most writes one [`DynamoWrites`] may carry: [`MAX_TRANSACT_ITEMS`] less one, the
/// completion's own `Update`.
pub const MAX_WRITES: usize = MAX_TRANSACT_ITEMS - 1;

/// The operation name in errors and in the [`RequestCounter`](crate::RequestCounter).
const OPERATION: &str = "TransactWriteItems";

/// Longest `ClientRequestToken` DynamoDB accepts.
const CLIENT_TOKEN_LEN: usize = 36;

/// The writes a handler commits with its completion on a [`DynamoStore`]: the `Put`, `Update`,
/// `Delete` and `ConditionCheck` actions of the one `TransactWriteItems` request that
/// [`complete_with`](TransactionalStore::complete_with) sends, in this order, followed by the
/// completion's own `Update` of the record.
///
/// Each action is the SDK's own type, built with its builder, on any table of the account and
/// region (the store's table included, but never the record's own item). Put user data in
/// `expression_attribute_values` and refer to it as `:name` in the expressions, never by
/// formatting it into an expression.
///
/// ```
/// use idem_dynamo::DynamoWrites;
/// use idem_dynamo::aws_sdk_dynamodb::types::{AttributeValue, ConditionCheck, Put, Update};
///
/// # fn demo(order: &str, amount_cents: u64) -> Result<DynamoWrites, Box<dyn std::error::Error>> {
/// let writes = DynamoWrites::new()
///     // The payment, written once: the condition refuses a second one.
///     .put(
///         Put::builder()
///             .table_name("payments")
///             .item("pk", AttributeValue::S(order.to_owned()))
///             .item("amount", AttributeValue::N(amount_cents.to_string()))
///             .condition_expression("attribute_not_exists(#pk)")
///             .expression_attribute_names("#pk", "pk")
///             .build()?,
///     )
///     // A counter, with the amount as an expression value.
///     .update(
///         Update::builder()
///             .table_name("totals")
///             .key("pk", AttributeValue::S("day".to_owned()))
///             .update_expression("ADD #sum :amount")
///             .expression_attribute_names("#sum", "sum")
///             .expression_attribute_values(":amount", AttributeValue::N(amount_cents.to_string()))
///             .build()?,
///     )
///     // The order must still be open: otherwise the whole completion is refused with
///     // `Error::EffectRefused { index: 2, .. }` and nothing is written.
///     .condition_check(
///         ConditionCheck::builder()
///             .table_name("orders")
///             .key("pk", AttributeValue::S(order.to_owned()))
///             .condition_expression("#status = :open")
///             .expression_attribute_names("#status", "status")
///             .expression_attribute_values(":open", AttributeValue::S("open".to_owned()))
///             .build()?,
///     );
/// assert_eq!(writes.len(), 3);
/// # Ok(writes) }
/// # demo("order-42", 1250).unwrap();
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DynamoWrites {
    items: Vec<TransactWriteItem>,
}

impl DynamoWrites {
    /// No writes (a transactional completion with nothing else in it).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a `Put` (a whole item, optionally under a condition).
    pub fn put(self, put: Put) -> Self {
        self.item(TransactWriteItem::builder().put(put).build())
    }

    /// Adds an `Update` (an update expression on one item, optionally under a condition).
    pub fn update(self, update: Update) -> Self {
        self.item(TransactWriteItem::builder().update(update).build())
    }

    /// Adds a `Delete` (optionally under a condition).
    pub fn delete(self, delete: Delete) -> Self {
        self.item(TransactWriteItem::builder().delete(delete).build())
    }

    /// Adds a `ConditionCheck`: a condition on an item that is not written.
    pub fn condition_check(self, check: ConditionCheck) -> Self {
        self.item(TransactWriteItem::builder().condition_check(check).build())
    }

    /// Adds an action built as the SDK's [`TransactWriteItem`]; it must hold exactly one of
    /// `put`, `update`, `delete` and `condition_check`, or the completion is refused with
    /// [`Error::InvalidInput`].
    pub fn item(mut self, item: TransactWriteItem) -> Self {
        self.items.push(item);
        self
    }

    /// How many actions there are.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The actions, in order.
    pub fn items(&self) -> &[TransactWriteItem] {
        &self.items
    }

    /// The actions, in order.
    pub fn into_items(self) -> Vec<TransactWriteItem> {
        self.items
    }

    /// What [`complete_with`](TransactionalStore::complete_with) checks before sending, for
    /// the record `pk` in `table`: at most [`MAX_WRITES`] actions, each holding exactly one
    /// action, none on the record's own item.
    fn check(&self, table: &str, pk: &str) -> Result<()> {
        let invalid = |reason: String| Error::invalid("writes", reason);
        if self.items.len() > MAX_WRITES {
            return Err(invalid(format!(
                "{} writes; one completion carries at most {MAX_WRITES} (DynamoDB's \
                 {MAX_TRANSACT_ITEMS} actions per TransactWriteItems, less the completion's own)",
                self.items.len()
            )));
        }
        for (index, item) in self.items.iter().enumerate() {
            let (target, key) = target(item).map_err(|actions| {
                invalid(format!(
                    "write {index} holds {actions} actions; each holds exactly one of Put, \
                     Update, Delete and ConditionCheck"
                ))
            })?;
            let own_key = matches!(key.get(attr::PK), Some(AttributeValue::S(v)) if v == pk);
            if own_key && table_name(target) == table_name(table) {
                return Err(invalid(format!(
                    "write {index} is on the record's own item (table {table:?}, {} {pk:?}): \
                     the completion writes that item, and one transaction cannot write an item \
                     twice",
                    attr::PK
                )));
            }
        }
        Ok(())
    }
}

impl From<Vec<TransactWriteItem>> for DynamoWrites {
    fn from(items: Vec<TransactWriteItem>) -> Self {
        Self { items }
    }
}

impl FromIterator<TransactWriteItem> for DynamoWrites {
    fn from_iter<I: IntoIterator<Item = TransactWriteItem>>(iter: I) -> Self {
        Self {
            items: iter.into_iter().collect(),
        }
    }
}

impl Extend<TransactWriteItem> for DynamoWrites {
    fn extend<I: IntoIterator<Item = TransactWriteItem>>(&mut self, iter: I) {
        self.items.extend(iter);
    }
}

/// The table and key (a `Put`'s whole item) of an action, or how many actions it holds when
/// that is not exactly one.
fn target(item: &TransactWriteItem) -> std::result::Result<(&str, &Item), usize> {
    let targets = [
        item.put.as_ref().map(|a| (a.table_name.as_str(), &a.item)),
        item.update
            .as_ref()
            .map(|a| (a.table_name.as_str(), &a.key)),
        item.delete
            .as_ref()
            .map(|a| (a.table_name.as_str(), &a.key)),
        item.condition_check
            .as_ref()
            .map(|a| (a.table_name.as_str(), &a.key)),
    ];
    let mut set = targets.into_iter().flatten();
    match (set.next(), set.next()) {
        (Some(one), None) => Ok(one),
        (None, _) => Err(0),
        (Some(_), Some(_)) => Err(2 + set.count()),
    }
}

/// A table's name, from its name or its ARN (`arn:aws:dynamodb:region:account:table/name`).
/// One transaction stays in one account and region, so the name alone tells tables apart.
fn table_name(table: &str) -> &str {
    table.rsplit_once(":table/").map_or(table, |(_, name)| name)
}

/// The `ClientRequestToken` of one completion request: 36 hex digits of a SHA-256 over the
/// record's key, the lease's token, the SHA-256 of the result and the clock reading the request
/// carries (`now_us`, which the completion writes).
///
/// The SDK's own retries after a lost answer send the identical request with this token, and
/// DynamoDB answers one that already committed with success without applying it again (for 10
/// minutes). A caller's re-send is a new request (a new clock reading, so other parameters): were
/// the token the same, DynamoDB would refuse it with `IdempotentParameterMismatch` and a second
/// request would be needed; with its own token the completion's condition decides it in one.
fn client_request_token(pk: &str, token: FencingToken, result: &[u8], now_us: u64) -> String {
    let digest = Sha256::new()
        .chain_update(b"idem-dynamo complete_with 1\0")
        .chain_update((pk.len() as u64).to_be_bytes())
        .chain_update(pk.as_bytes())
        .chain_update(token.get().to_be_bytes())
        .chain_update(Sha256::digest(result))
        .chain_update(now_us.to_be_bytes())
        .finalize();
    let mut hex = String::with_capacity(CLIENT_TOKEN_LEN);
    for byte in &digest[..CLIENT_TOKEN_LEN / 2] {
        hex.push_str(&format!("{byte:02x}"));
    }
    hex
}

/// Cancellation reason codes worth sending the transaction again for.
const TRANSIENT_REASONS: &[&str] = &[
    "TransactionConflict",
    "ThrottlingError",
    "ProvisionedThroughputExceeded",
    "RequestLimitExceeded",
];

const CONDITION_FAILED: &str = "ConditionalCheckFailed";
/// The cancellation reason of an action that failed validation as it was applied.
const VALIDATION_ERROR: &str = "ValidationError";
/// The error code of a request refused by validation before any action was applied.
const VALIDATION_EXCEPTION: &str = "ValidationException";

/// The code DynamoDB answers for a table that does not exist.
const RESOURCE_NOT_FOUND: &str = "ResourceNotFoundException";

/// What a cancelled transaction's reasons say, the completion being the last action.
#[derive(Debug, PartialEq)]
enum Cancellation {
    /// The completion's condition failed; the record's item as it was (`ALL_OLD`).
    Completion(Option<Item>),
    /// The handler's write `index` had its own condition fail.
    Refused { index: usize, reason: String },
    /// A conflict with another write in flight, or throttling.
    Transient,
    /// The handler's write `index` failed DynamoDB's validation while it was applied (an item
    /// over 400 KB, an operand of the wrong type): every try would fail the same way.
    Invalid { index: usize, reason: String },
    /// Anything else: a validation error of the completion's own action, an item collection
    /// too large, reasons missing.
    Other,
}

/// Reads the cancellation reasons of a transaction of `writes` handler writes and the
/// completion. The completion's refusal comes first (a zombie writes nothing, and a replay is
/// told apart from a refusal by the record alone), then a write's failed condition, then a
/// write's failed validation, then transient causes.
fn classify(reasons: &[CancellationReason], writes: usize) -> Cancellation {
    if reasons.len() != writes + 1 {
        return Cancellation::Other;
    }
    let completion = &reasons[writes];
    if completion.code() == Some(CONDITION_FAILED) {
        return Cancellation::Completion(completion.item.clone());
    }
    // The first handler write cancelled with `code`: its index and what DynamoDB said.
    let first = |code: &str, unsaid: &str| {
        reasons[..writes]
            .iter()
            .position(|r| r.code() == Some(code))
            .map(|index| {
                let said = reasons[index].message().unwrap_or(unsaid);
                (index, format!("{code}: {said}"))
            })
    };
    if let Some((index, reason)) = first(CONDITION_FAILED, "the conditional request failed") {
        return Cancellation::Refused { index, reason };
    }
    if let Some((index, reason)) = first(VALIDATION_ERROR, "no message") {
        return Cancellation::Invalid { index, reason };
    }
    let transient = reasons
        .iter()
        .filter_map(CancellationReason::code)
        .any(|code| TRANSIENT_REASONS.contains(&code) || is_retryable_code(Some(code)));
    if transient {
        Cancellation::Transient
    } else {
        Cancellation::Other
    }
}

/// What one `TransactWriteItems` request did.
enum Sent {
    Committed,
    /// The completion's condition failed; the record's item as it was.
    CompletionRefused(Option<Item>),
    /// `IdempotentParameterMismatch`: a request with the same token but other actions
    /// committed within the idempotency window.
    Mismatch,
}

/// The error of a re-send that DynamoDB keeps answering `IdempotentParameterMismatch` although
/// it carried a token of its own: not expected.
#[derive(Debug, thiserror::Error)]
#[error("TransactWriteItems answered IdempotentParameterMismatch to a request with a fresh token")]
struct UnexpectedMismatch;

impl DynamoStore {
    /// The completion's own action: [`expr::COMPLETE_UPDATE`] under [`expr::FENCE`], returning
    /// the item as it was when the fence fails.
    fn completion_action(
        &self,
        lease: &Lease,
        pk: &str,
        result: &Bytes,
        retention: Duration,
        now_us: u64,
    ) -> Result<TransactWriteItem> {
        let mut values = complete_values(result, retention, now_us);
        values.extend(fence_values(lease, now_us));
        let expressions = [expr::COMPLETE_UPDATE, expr::FENCE];
        let update = Update::builder()
            .table_name(self.table())
            .key(attr::PK, s(pk))
            .update_expression(expr::COMPLETE_UPDATE)
            .condition_expression(expr::FENCE)
            .set_expression_attribute_names(Some(expr::names(&expressions)))
            .set_expression_attribute_values(Some(expr::values(&expressions, values)))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .build()
            .map_err(|e| Error::backend(STORE, e))?;
        Ok(TransactWriteItem::builder().update(update).build())
    }

    /// Sends one `TransactWriteItems` of `writes` handler writes followed by the completion.
    /// `token` `None` lets the SDK draw a fresh one.
    async fn transact(
        &self,
        actions: Vec<TransactWriteItem>,
        token: Option<String>,
        writes: usize,
    ) -> Result<Sent> {
        // The tables the handler's writes name besides the store's own, for telling which one
        // is missing.
        let mut others: Vec<String> = Vec::new();
        for (table, _) in actions.iter().filter_map(|a| target(a).ok()) {
            if table_name(table) != table_name(self.table()) && !others.iter().any(|o| o == table) {
                others.push(table.to_owned());
            }
        }
        let err = match self
            .client()
            .transact_write_items()
            .set_transact_items(Some(actions))
            .set_client_request_token(token)
            .send()
            .await
        {
            Ok(_) => return Ok(Sent::Committed),
            Err(err) => err,
        };
        if !others.is_empty()
            && err.as_service_error().and_then(|e| e.meta().code()) == Some(RESOURCE_NOT_FOUND)
        {
            return Err(self.missing_table(others, err).await);
        }
        let cancellation = match err.as_service_error() {
            Some(TransactWriteItemsError::IdempotentParameterMismatchException(_)) => {
                return Ok(Sent::Mismatch);
            }
            Some(TransactWriteItemsError::TransactionCanceledException(cancelled)) => {
                classify(cancelled.cancellation_reasons(), writes)
            }
            // The completion's own action is the one `complete` sends, which validates: a
            // request refused by validation is refused for the handler's writes (two actions
            // on one item, an item over 400 KB, an operand of the wrong type, a request over
            // 4 MB). Sending it again cannot help.
            Some(e) if writes > 0 && e.meta().code() == Some(VALIDATION_EXCEPTION) => {
                let said = e.meta().message().unwrap_or("no message");
                return Err(Error::invalid(
                    "writes",
                    format!("DynamoDB refused the transaction: {VALIDATION_EXCEPTION}: {said}"),
                ));
            }
            _ => return Err(self.sdk_error(OPERATION, err)),
        };
        match cancellation {
            Cancellation::Completion(old) => Ok(Sent::CompletionRefused(old)),
            Cancellation::Refused { index, reason } => Err(Error::EffectRefused {
                store: STORE,
                index,
                reason,
            }),
            Cancellation::Invalid { index, reason } => Err(Error::invalid(
                "writes",
                format!("write {index} failed DynamoDB's validation: {reason}"),
            )),
            Cancellation::Transient => {
                Err(Error::unavailable(STORE, SdkFailure::new(OPERATION, err)))
            }
            Cancellation::Other => Err(Error::backend(STORE, SdkFailure::new(OPERATION, err))),
        }
    }
}

impl DynamoStore {
    /// The error of a `TransactWriteItems` answered `ResourceNotFoundException` whose writes
    /// name tables besides the store's (`others`): the store's own table is looked up
    /// (`DescribeTable`) to say which is missing. Nothing was written either way.
    async fn missing_table(
        &self,
        others: Vec<String>,
        err: SdkError<TransactWriteItemsError, HttpResponse>,
    ) -> Error {
        let said = err
            .as_service_error()
            .and_then(|e| e.meta().message())
            .unwrap_or(RESOURCE_NOT_FOUND)
            .to_owned();
        match self.table_status().await {
            Ok(Some(_)) => Error::not_set_up(
                STORE,
                format!(
                    "a table the handler's writes name: {} ({OPERATION} answered: {said})",
                    others.join(", ")
                ),
                "create that table, or correct the table name in the writes",
            ),
            Ok(None) => self.sdk_error(OPERATION, err),
            Err(_) => Error::not_set_up(
                STORE,
                format!(
                    "table {:?} or a table the handler's writes name: {} ({OPERATION} answered: \
                     {said})",
                    self.table(),
                    others.join(", ")
                ),
                "check that these tables exist",
            ),
        }
    }
}

/// The handler's writes and the completion, sent together in one `TransactWriteItems`. See
/// "Transactional effects" in the [crate docs](crate).
#[async_trait]
impl TransactionalStore for DynamoStore {
    type Writes = DynamoWrites;

    /// Completes `lease` and applies `writes` in one `TransactWriteItems` request: the writes
    /// in their order, then the completion (the `Update` that [`complete`] sends, under the
    /// same condition). Nothing is sent when the result or the writes are refused.
    ///
    /// # Errors
    /// - The errors of [`complete`] for the result and the retention, and
    ///   [`Error::InvalidInput`] (field `writes`) for more than [`MAX_WRITES`] writes, a
    ///   [`TransactWriteItem`] holding no action or several, or an action on the record's own
    ///   item;
    /// - [`Error::LeaseLost`] when the completion's condition fails (a stale or finished
    ///   lease), unless the record shows this very completion done (the same token and result
    ///   bytes): then `Ok`, and the writes, applied with it the first time, are not applied
    ///   again;
    /// - [`Error::EffectRefused`] when the condition of write `index` fails;
    /// - [`Error::InvalidInput`] (field `writes`) when DynamoDB refuses the writes by validation
    ///   (`ValidationException`, or a write cancelled with `ValidationError`): two actions on
    ///   one item, an item over 400 KB, an operand of the wrong type, a request over 4 MB.
    ///   Nothing is written and a re-send would be refused the same way;
    /// - [`Error::NotSetUp`] for a missing table, naming it: when the writes name other tables
    ///   and DynamoDB answers `ResourceNotFoundException`, the store's own table is looked up
    ///   (`DescribeTable`) to say which one is missing;
    /// - [`Error::Unavailable`] for a transaction conflict, throttling and the transport
    ///   failures of every request; [`Error::Backend`] for the rest.
    ///
    /// Nothing at all is written when it errs, except in the ambiguous case of
    /// [`Error::Unavailable`] after the request left, which a re-send settles.
    ///
    /// [`complete`]: IdempotencyStore::complete
    async fn complete_with(
        &self,
        lease: &Lease,
        result: Bytes,
        retention: Duration,
        writes: DynamoWrites,
    ) -> Result<()> {
        self.limits().check_complete(&result, retention)?;
        let pk = partition_key(&lease.key);
        writes.check(self.table(), &pk)?;
        let now_us = self.now_us();
        let count = writes.len();
        let actions = |writes: Vec<TransactWriteItem>| -> Result<Vec<TransactWriteItem>> {
            let mut actions = writes;
            actions.push(self.completion_action(lease, &pk, &result, retention, now_us)?);
            Ok(actions)
        };
        let token = client_request_token(&pk, lease.token, &result, now_us);
        let mut sent = self
            .transact(actions(writes.items.clone())?, Some(token), count)
            .await?;
        if let Sent::Mismatch = sent {
            // A request with the same key, token, result and clock reading (a clock that stood
            // still) but other writes committed within DynamoDB's idempotency window. Send
            // again with a fresh token: the completion's condition decides, and finds it done.
            sent = self
                .transact(actions(writes.into_items())?, None, count)
                .await?;
        }
        match sent {
            Sent::Committed => Ok(()),
            Sent::CompletionRefused(old) => refused(
                lease,
                old,
                now_us,
                Some(Finish::Complete {
                    result: &result,
                    retention,
                }),
            ),
            Sent::Mismatch => Err(Error::backend(STORE, UnexpectedMismatch)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::item::n;

    fn put(table: &str, pk: &str) -> Put {
        Put::builder()
            .table_name(table)
            .item(attr::PK, s(pk))
            .build()
            .unwrap()
    }

    fn key_of(pk: &str) -> HashMap<String, AttributeValue> {
        HashMap::from([(attr::PK.to_owned(), s(pk))])
    }

    #[test]
    fn writes_are_checked_before_sending() {
        let ok = (0..MAX_WRITES).fold(DynamoWrites::new(), |w, i| {
            w.put(put("effects", &format!("e{i}")))
        });
        ok.check("idem", "ns:k").unwrap();
        let too_many = ok.put(put("effects", "one more"));
        let r = too_many.check("idem", "ns:k");
        assert!(
            matches!(&r, Err(Error::InvalidInput { field: "writes", reason }) if reason.contains("100 writes")),
            "{r:?}"
        );

        // The record's own item, by every action and by ARN.
        let own = [
            DynamoWrites::new().put(put("idem", "ns:k")),
            DynamoWrites::new().update(
                Update::builder()
                    .table_name("arn:aws:dynamodb:us-east-1:123456789012:table/idem")
                    .set_key(Some(key_of("ns:k")))
                    .update_expression("SET #a = :b")
                    .build()
                    .unwrap(),
            ),
            DynamoWrites::new().delete(
                Delete::builder()
                    .table_name("idem")
                    .set_key(Some(key_of("ns:k")))
                    .build()
                    .unwrap(),
            ),
            DynamoWrites::new()
                .put(put("effects", "x"))
                .condition_check(
                    ConditionCheck::builder()
                        .table_name("idem")
                        .set_key(Some(key_of("ns:k")))
                        .condition_expression("attribute_exists(#pk)")
                        .build()
                        .unwrap(),
                ),
        ];
        for writes in own {
            let r = writes.check("idem", "ns:k");
            assert!(
                matches!(&r, Err(Error::InvalidInput { field: "writes", reason }) if reason.contains("own item")),
                "{r:?}"
            );
        }
        // Other keys of the same table, and the same key in another table, are fine.
        DynamoWrites::new()
            .put(put("idem", "ns:other"))
            .put(put("effects", "ns:k"))
            .check("idem", "ns:k")
            .unwrap();

        // Actions holding no action or two.
        for item in [
            TransactWriteItem::builder().build(),
            TransactWriteItem::builder()
                .put(put("effects", "a"))
                .delete(
                    Delete::builder()
                        .table_name("effects")
                        .set_key(Some(key_of("b")))
                        .build()
                        .unwrap(),
                )
                .build(),
        ] {
            let r = DynamoWrites::new().item(item).check("idem", "ns:k");
            assert!(
                matches!(&r, Err(Error::InvalidInput { field: "writes", reason }) if reason.contains("exactly one")),
                "{r:?}"
            );
        }
    }

    #[test]
    fn client_tokens_fit_and_depend_on_key_token_result_and_time() {
        let t = client_request_token("ns:k", FencingToken::new(7), b"ok", 1);
        assert_eq!(t.len(), CLIENT_TOKEN_LEN);
        assert!(t.bytes().all(|c| c.is_ascii_hexdigit()), "{t}");
        assert_eq!(
            t,
            client_request_token("ns:k", FencingToken::new(7), b"ok", 1)
        );
        for other in [
            client_request_token("ns:j", FencingToken::new(7), b"ok", 1),
            client_request_token("ns:k", FencingToken::new(8), b"ok", 1),
            client_request_token("ns:k", FencingToken::new(7), b"ko", 1),
            client_request_token("ns:k", FencingToken::new(7), b"ok", 2),
        ] {
            assert_ne!(t, other);
        }
    }

    fn reason(code: &str) -> CancellationReason {
        CancellationReason::builder()
            .code(code)
            .message(format!("{code} happened"))
            .build()
    }

    #[test]
    fn cancellation_reasons_are_mapped() {
        let old: Item = HashMap::from([(attr::TOKEN.to_owned(), n(9))]);
        let completion_failed = CancellationReason::builder()
            .code(CONDITION_FAILED)
            .set_item(Some(old.clone()))
            .build();
        // The completion's refusal wins over a write's.
        assert_eq!(
            classify(&[reason(CONDITION_FAILED), completion_failed.clone()], 1),
            Cancellation::Completion(Some(old))
        );
        assert_eq!(
            classify(
                &[reason("None"), reason(CONDITION_FAILED), reason("None")],
                2
            ),
            Cancellation::Refused {
                index: 1,
                reason: "ConditionalCheckFailed: ConditionalCheckFailed happened".to_owned()
            }
        );
        for transient in [
            "TransactionConflict",
            "ThrottlingError",
            "ProvisionedThroughputExceeded",
        ] {
            assert_eq!(
                classify(&[reason("None"), reason(transient)], 1),
                Cancellation::Transient,
                "{transient}"
            );
        }
        // A write that failed validation as it was applied: invalid, whatever else happened.
        assert_eq!(
            classify(
                &[
                    reason("None"),
                    reason("ValidationError"),
                    reason("TransactionConflict")
                ],
                2
            ),
            Cancellation::Invalid {
                index: 1,
                reason: "ValidationError: ValidationError happened".to_owned()
            }
        );
        // The completion's own action failing validation is not the handler's doing.
        assert_eq!(
            classify(&[reason("None"), reason("ValidationError")], 1),
            Cancellation::Other
        );
        assert_eq!(classify(&[reason("None")], 1), Cancellation::Other);
    }
}
