//! Creating the table (tests and development) and its definition for infrastructure as code.

use std::time::{Duration, Instant};

use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::operation::create_table::CreateTableError;
use aws_sdk_dynamodb::operation::describe_table::DescribeTableError;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType, TableStatus,
    TimeToLiveSpecification, TimeToLiveStatus,
};
use idem_core::{Error, Result};

use crate::STORE;
use crate::item::attr;
use crate::store::DynamoStore;

/// How long [`DynamoStore::create_table_if_missing`] waits for a new table to become active.
const ACTIVE_WITHIN: Duration = Duration::from_secs(120);

impl DynamoStore {
    /// Creates the table if it does not exist (partition key `pk` of type string, on-demand
    /// billing), waits until it is active, and enables TTL on the `ttl` attribute. Returns whether
    /// it created the table. Safe to call concurrently and repeatedly: an existing table is left
    /// as it is, apart from enabling TTL when that is off.
    ///
    /// Meant for tests and development; production tables belong in infrastructure as code (see
    /// the [crate docs](crate#the-table) for the definition).
    ///
    /// # Errors
    /// [`Error::Unavailable`] or [`Error::Backend`] from DynamoDB (for instance when the
    /// credentials may not create tables); [`Error::Unavailable`] with
    /// [`TimedOut`](idem_core::TimedOut) ([`Error::timed_out`]) when the table is not active
    /// within two minutes.
    pub async fn create_table_if_missing(&self) -> Result<bool> {
        let created = match self.table_status().await? {
            Some(_) => false,
            None => self.create_table().await?,
        };
        self.wait_active().await?;
        self.enable_ttl().await?;
        Ok(created)
    }

    /// The table's status, `None` when it does not exist.
    pub(crate) async fn table_status(&self) -> Result<Option<TableStatus>> {
        match self
            .client()
            .describe_table()
            .table_name(self.table())
            .send()
            .await
        {
            Ok(output) => Ok(Some(
                output
                    .table
                    .and_then(|t| t.table_status)
                    .unwrap_or_else(|| TableStatus::from("UNKNOWN")),
            )),
            Err(SdkError::ServiceError(ctx))
                if matches!(ctx.err(), DescribeTableError::ResourceNotFoundException(_)) =>
            {
                Ok(None)
            }
            Err(e) => Err(self.sdk_error("DescribeTable", e)),
        }
    }

    /// Creates the table; `false` when another caller created it first.
    async fn create_table(&self) -> Result<bool> {
        let build = |e: aws_sdk_dynamodb::error::BuildError| Error::backend(STORE, e);
        let result = self
            .client()
            .create_table()
            .table_name(self.table())
            .attribute_definitions(
                AttributeDefinition::builder()
                    .attribute_name(attr::PK)
                    .attribute_type(ScalarAttributeType::S)
                    .build()
                    .map_err(build)?,
            )
            .key_schema(
                KeySchemaElement::builder()
                    .attribute_name(attr::PK)
                    .key_type(KeyType::Hash)
                    .build()
                    .map_err(build)?,
            )
            .billing_mode(BillingMode::PayPerRequest)
            .send()
            .await;
        match result {
            Ok(_) => Ok(true),
            Err(SdkError::ServiceError(ctx))
                if matches!(ctx.err(), CreateTableError::ResourceInUseException(_)) =>
            {
                Ok(false)
            }
            Err(e) => Err(self.sdk_error("CreateTable", e)),
        }
    }

    async fn wait_active(&self) -> Result<()> {
        let start = Instant::now();
        loop {
            if self.table_status().await? == Some(TableStatus::Active) {
                return Ok(());
            }
            if start.elapsed() > ACTIVE_WITHIN {
                return Err(Error::timed_out(STORE, start.elapsed()));
            }
            // DynamoDB offers no notification: poll, as the SDK's own waiters do.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn enable_ttl(&self) -> Result<()> {
        let described = self
            .client()
            .describe_time_to_live()
            .table_name(self.table())
            .send()
            .await
            .map_err(|e| self.sdk_error("DescribeTimeToLive", e))?;
        let description = described.time_to_live_description();
        let status = description.and_then(|d| d.time_to_live_status());
        if matches!(
            status,
            Some(TimeToLiveStatus::Enabled | TimeToLiveStatus::Enabling)
        ) {
            // A table has one TTL attribute: on another one, DynamoDB never removes the
            // store's finished records and tombstones (reads still judge them expired).
            return match description.and_then(|d| d.attribute_name()) {
                Some(name) if name != attr::TTL => Err(Error::not_set_up(
                    STORE,
                    format!(
                        "time to live on attribute {:?} of table {:?} (DynamoDB's TTL is on \
                         {name:?}: it would never remove the store's expired records, which \
                         carry their expiry in {:?})",
                        attr::TTL,
                        self.table(),
                        attr::TTL
                    ),
                    format!(
                        "a table of the store's own (a table has one TTL attribute), or turn \
                         TTL off and on again on {:?}: aws dynamodb update-time-to-live \
                         --table-name {} --time-to-live-specification Enabled=true,AttributeName={}",
                        attr::TTL,
                        self.table(),
                        attr::TTL
                    ),
                )),
                _ => Ok(()),
            };
        }
        let spec = TimeToLiveSpecification::builder()
            .attribute_name(attr::TTL)
            .enabled(true)
            .build()
            .map_err(|e| Error::backend(STORE, e))?;
        match self
            .client()
            .update_time_to_live()
            .table_name(self.table())
            .time_to_live_specification(spec)
            .send()
            .await
        {
            Ok(_) => Ok(()),
            // A concurrent caller enabled it between our two requests.
            Err(SdkError::ServiceError(ctx))
                if ctx.err().code() == Some("ValidationException")
                    && ctx
                        .err()
                        .message()
                        .is_some_and(|m| m.contains("already enabled")) =>
            {
                Ok(())
            }
            Err(e) => Err(self.sdk_error("UpdateTimeToLive", e)),
        }
    }
}
