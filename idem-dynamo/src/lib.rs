//! The `idem` store on Amazon DynamoDB: one item per key, one conditional `UpdateItem` per
//! transition, and a duplicate answered by the same single request that tried to acquire.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_core::{AcquireOutcome, AcquireRequest, Bytes, IdempotencyStore, Namespace};
//! use idem_dynamo::{DynamoConfig, DynamoStore};
//!
//! # async fn run() -> idem_core::Result<()> {
//! let store = DynamoStore::connect(DynamoConfig::new("idem")).await?;
//! let key = Namespace::new("payments")?.key("order-42")?;
//! match store.acquire(&AcquireRequest::new(key, "worker-1")).await? {
//!     AcquireOutcome::Acquired { lease, .. } => {
//!         // ... do the work, fencing downstream writes with lease.token ...
//!         store
//!             .complete(&lease, Bytes::from_static(b"ok"), Duration::from_secs(86_400))
//!             .await?;
//!     }
//!     AcquireOutcome::Replayed { result } => println!("duplicate: {result:?}"),
//!     other => println!("not now: {}", other.name()),
//! }
//! # Ok(()) }
//! ```
//!
//! # Requests
//!
//! Every transition is one conditional `UpdateItem` whose condition is the contract's rule. When
//! the condition fails, DynamoDB sends the item back in the same answer
//! (`ReturnValuesOnConditionCheckFailure = ALL_OLD`), and the store classifies it with
//! [`idem_core::machine`] without another request. There is no read on any of these paths;
//! [`DynamoStore::requests`] counts the requests actually sent, and the crate's tests assert these
//! figures:
//!
//! | path | requests |
//! |---|---|
//! | fresh message: acquire + complete | 2 `UpdateItem` |
//! | duplicate (replay), busy, conflict, exhausted, terminal failure | 1 `UpdateItem` |
//! | takeover of an expired lease, re-acquire after release or a retryable failure | 1 `UpdateItem` |
//! | record past retention (completed or failed terminally) | 1 `UpdateItem` |
//! | extend, complete, fail, release | 1 `UpdateItem` each |
//! | record failed *retryably* and past retention | 2 `UpdateItem` (see below) |
//! | `get` / `delete` (operators) | 1 `GetItem` / 1 `UpdateItem` (a tombstone, see below) |
//!
//! The SDK's own retries (throttling, timeouts, 5xx) are extra requests and are counted too.
//!
//! ## How one update expression covers every acquire row
//!
//! An update expression cannot branch on time, only on whether an attribute exists
//! (`if_not_exists`). So the item keeps `attempts`, `created_us` and `fingerprint` only while the
//! record can be acquired again (in progress, released, failed retryable); completion and
//! terminal failure move them to `final_attempts`, `final_created_us` and `final_fingerprint`.
//! The acquire expression sets `attempts = if_not_exists(attempts, 0) + 1`,
//! `created_us = if_not_exists(created_us, now)`, `fingerprint = if_not_exists(fingerprint, :fp)`
//! and removes the `final_*` attributes, which gives a fresh record for a missing item or a
//! finished one past retention, and a re-acquired record (attempt n + 1, original fingerprint and
//! creation time) for the others; the condition lets it write only in the rows of the contract
//! table that write.
//!
//! The one row this cannot cover is a record that failed *retryably* and then passed its
//! retention without being retried: it still has its live attributes, yet must start over at
//! attempt 1. The first request is refused, its `ALL_OLD` item shows the case, and a second
//! conditional write compare-and-swaps the token it saw to re-create the record fresh. That is a
//! rare path (a retryable failure nobody retried within the retention).
//!
//! # Item layout
//!
//! | attribute | type | present |
//! |---|---|---|
//! | `pk` (partition key) | S | always: `{namespace}:{id}`. Namespaces are limited to `[A-Za-z0-9._-]`, so the first `:` separates them from the id and keys never collide; the id is stored as sent |
//! | `namespace`, `id` | S | always but in a tombstone, for operators (and for a global secondary index if you want one) |
//! | `state` | S | always but in a tombstone: `in_progress`, `released`, `completed`, `failed_retryable`, `failed_terminal` |
//! | `token` | N | always: the current fencing token |
//! | `owner` | S | always but in a tombstone: the last owner that acquired the key |
//! | `attempts`, `created_us`, `fingerprint` | N, N, B or NULL | while the record can be acquired again |
//! | `final_attempts`, `final_created_us`, `final_fingerprint` | N, N, B or NULL | once completed or failed terminally |
//! | `lease_expires_us` | N | while in progress |
//! | `updated_us` | N | always but in a tombstone |
//! | `expires_us` | N | once completed or failed: the retention deadline |
//! | `ttl` | N | with `expires_us`: the same deadline in epoch seconds, the table's TTL attribute; in a tombstone, a week after the delete |
//! | `result` | B | when completed |
//! | `error` | S | when failed |
//! | `acq_id` | S | once acquired: a random id of the `acquire` call that wrote the acquisition |
//! | `acq_prev` | S | once acquired: the state before that acquisition (`absent` when there was none) |
//!
//! A **tombstone** is what [`delete`](idem_core::IdempotencyStore::delete) leaves: `pk`, `token`
//! and `ttl` only. Every operation treats an item without `state` as absent (`get` returns
//! `None`, `delete` returns `false`, fenced transitions fail with
//! [`LeaseLost`](idem_core::Error::LeaseLost) and no current token), and the next acquire creates
//! a fresh record (attempt 1) whose token is the tombstone's plus one. The tombstone's `ttl` is
//! set 7 days after the delete (on the deleting client's clock), after which DynamoDB's TTL
//! removes it.
//!
//! Times are microseconds since the Unix epoch. A fingerprint stored as NULL means the caller
//! opted out: such a record never conflicts.
//!
//! # The table
//!
//! One table, partition key `pk` of type string, no sort key, TTL enabled on `ttl`. On-demand
//! billing suits most consumers; provisioned capacity works as well (throttling surfaces as a
//! retryable [`Error::Unavailable`](idem_core::Error::Unavailable)).
//! [`DynamoStore::create_table_if_missing`] creates it for tests and development. For
//! infrastructure as code:
//!
//! ```text
//! # AWS CLI
//! aws dynamodb create-table --table-name idem \
//!     --attribute-definitions AttributeName=pk,AttributeType=S \
//!     --key-schema AttributeName=pk,KeyType=HASH --billing-mode PAY_PER_REQUEST
//! aws dynamodb update-time-to-live --table-name idem \
//!     --time-to-live-specification Enabled=true,AttributeName=ttl
//!
//! # CloudFormation
//! IdemTable:
//!   Type: AWS::DynamoDB::Table
//!   Properties:
//!     TableName: idem
//!     BillingMode: PAY_PER_REQUEST
//!     AttributeDefinitions: [{ AttributeName: pk, AttributeType: S }]
//!     KeySchema: [{ AttributeName: pk, KeyType: HASH }]
//!     TimeToLiveSpecification: { AttributeName: ttl, Enabled: true }
//!
//! # Terraform
//! resource "aws_dynamodb_table" "idem" {
//!   name         = "idem"
//!   billing_mode = "PAY_PER_REQUEST"
//!   hash_key     = "pk"
//!   attribute {
//!     name = "pk"
//!     type = "S"
//!   }
//!   ttl {
//!     attribute_name = "ttl"
//!     enabled        = true
//!   }
//! }
//! ```
//!
//! The store needs `dynamodb:UpdateItem` (every transition, and `delete`) and
//! `dynamodb:GetItem` (`get`) on the table; the helper also needs `CreateTable`,
//! `DescribeTable`, `DescribeTimeToLive` and `UpdateTimeToLive`.
//!
//! # Clock and skew
//!
//! DynamoDB has no server clock that a condition could read, so leases and retention are judged
//! on the **client's clock** ([`DynamoConfig::clock`], the system clock by default): each request
//! carries the client's "now" and the condition compares the stored deadlines with it.
//!
//! The assumption: the clocks of all consumers sharing a table agree to within a small skew `ε`
//! (NTP or the Amazon Time Sync Service keep it to milliseconds), and leases are much longer
//! than `ε`. What skew does:
//!
//! - A consumer whose clock runs `ε` ahead sees other leases expire `ε` early and may take one
//!   over while its holder still believes it has `ε` left. Fencing makes that safe: the old
//!   holder's `complete`/`fail`/`extend`/`release` are refused with
//!   [`LeaseLost`](idem_core::Error::LeaseLost), and downstream writes fenced by token refuse its
//!   stale token. For *leases*, skew costs duplicate *work*, never a duplicate *effect*.
//!   Heartbeats at a fraction of the lease keep a live holder well clear of this.
//! - For *retention* it is worse: skew **can** cause a duplicate effect. Retention ends `ε`
//!   early for a consumer whose clock runs `ε` ahead, and a completed (or terminally failed)
//!   record then counts as absent for it. If `ε` exceeds the retention that record has left,
//!   that consumer acquires the key afresh with a legitimately higher token and runs the work a
//!   second time; fencing cannot catch this, because nothing about the new lease is stale.
//!   Choose a retention much longer than any plausible skew (hours or days against skew of
//!   milliseconds to seconds) and longer than the window in which duplicates can arrive, and
//!   keep the clocks synchronised.
//! - `retry_after` reported for a busy key is measured on the asking consumer's clock.
//!
//! # Fencing tokens
//!
//! While the item exists, every acquisition sets `token = token + 1` inside the conditional
//! update (atomic, no read). An operator [`delete`](idem_core::IdempotencyStore::delete) keeps
//! the item as a tombstone holding the token, so a key re-created after a delete counts on from
//! it, whatever the clocks say. Only when there is no item at all (first use of a key, or after
//! DynamoDB's TTL removed a record past retention or a tombstone a week old) does the token
//! start at the client clock in microseconds plus one. Tokens are therefore strictly increasing
//! per key as long as the clock of the client that re-creates a key is not behind the clock of
//! the client that created it by more than the time between that creation and the re-creation
//! (less one microsecond per acquisition in between): after a TTL deletion the margin is at
//! least the retention, or a week after a delete. A separate,
//! never-deleted counter item per key would drop that assumption but cost a second request on
//! every acquire, which this crate does not pay.
//!
//! # Retention
//!
//! `complete` and `fail` store the retention deadline twice: `expires_us`, which every condition
//! and read checks (a record past it is treated as absent, whatever DynamoDB's TTL has done),
//! and `ttl` in epoch seconds, so that DynamoDB deletes the item eventually (typically within
//! days; TTL deletes are free). [`purge_expired`](idem_core::IdempotencyStore::purge_expired) is
//! therefore a no-op. Records in progress or released carry no deadline and are kept until they
//! finish or an operator deletes them (which leaves a tombstone for a week, see the item layout).
//!
//! # Limits
//!
//! A DynamoDB item holds at most 400 KB. Results are capped at [`MAX_RESULT_LEN`] (350 KiB) and
//! error messages at [`idem_core::DEFAULT_MAX_ERROR_LEN`] (configurable up to [`MAX_ERROR_LEN`]);
//! a larger one is refused with [`Error::ResultTooLarge`](idem_core::Error::ResultTooLarge) or
//! [`Error::InvalidInput`](idem_core::Error::InvalidInput) before any request is sent. Every
//! other input (owner, lease, retention, attempts) is validated before sending as well.
//!
//! # Errors and timeouts
//!
//! Timeouts, transport failures, unreadable answers, throttling
//! (`ProvisionedThroughputExceededException`, `ThrottlingException`), `RequestLimitExceeded` and
//! 5xx answers are [`Error::Unavailable`](idem_core::Error::Unavailable) (retryable); a missing
//! table, validation errors and denied access are [`Error::Backend`](idem_core::Error::Backend);
//! an item that does not decode is [`Error::CorruptRecord`](idem_core::Error::CorruptRecord).
//! The SDK error is kept as the `source`. The defaults of [`DynamoConfig`] (1 s to connect, 2 s
//! per attempt, 3 attempts with short back-off, 4 s per operation) make an unreachable endpoint
//! fail within a few seconds.
//!
//! When the SDK retries a fenced transition whose first attempt did take effect (the answer was
//! lost), the retry's condition fails; the store recognises its own earlier write in the
//! returned item (same token, same outcome) and reports success. Acquire does the same: each
//! `acquire` call writes a random `acq_id` (and the state it replaced, `acq_prev`) with its
//! acquisition, and when a retried request is refused by an item in progress under that
//! `acq_id`, the call reports [`Acquired`](idem_core::AcquireOutcome::Acquired) with the lease
//! its first attempt wrote (token, attempt, lease deadline and `takeover` as stored): no attempt
//! is counted twice. An acquire that keeps losing races against other writers gives up after a
//! few conditional writes with a retryable [`Error::Unavailable`](idem_core::Error::Unavailable).
//!
//! # Testing against DynamoDB Local or LocalStack
//!
//! The crate's tests (the whole `idem-conformance` suite, the request counts) and its bench run
//! against the endpoint in `IDEM_DYNAMO_ENDPOINT` (default `http://127.0.0.1:8000`, where
//! `scripts/services.sh dynamo` starts Amazon's DynamoDB Local), with dummy credentials, region
//! `us-east-1` and a fresh random table per run. They never skip: a missing server is a failure.
//! To run the same tests against LocalStack:
//!
//! ```text
//! IDEM_DYNAMO_ENDPOINT=http://localhost:4566 cargo test -p idem-dynamo
//! ```
//!
//! In an application, the standard `AWS_ENDPOINT_URL_DYNAMODB` (or `AWS_ENDPOINT_URL`)
//! variable or [`DynamoConfig::with_endpoint_url`] points the store at them.

mod config;
mod counter;
mod error;
mod expr;
mod item;
mod store;
mod table;

pub use config::{DEFAULT_TABLE, DynamoConfig, MAX_ERROR_LEN, MAX_RESULT_LEN};
pub use counter::RequestCounter;
pub use store::DynamoStore;

/// The SDK crates this store is built on, re-exported so that callers building an
/// [`SdkConfig`](aws_config::SdkConfig) for [`DynamoStore::from_sdk_config`] use the same versions.
pub use {aws_config, aws_sdk_dynamodb};

/// The store's name in errors and metrics.
pub(crate) const STORE: &str = "dynamo";
