//! Opening the store a URL names, setting it up, and printing what setting up would do.

use std::time::Duration;

use idem_core::{Error, IdempotencyStore, MemoryStore};
use idem_dynamo::{DynamoConfig, DynamoStore};
use idem_postgres::tokio_postgres::config::SslMode;
use idem_postgres::{DEFAULT_SCHEMA, DEFAULT_TABLE, PostgresConfig, PostgresStore};
use idem_redis::{RedisConfig, RedisStore};
use idem_sqlite::{SqliteOptions, SqliteStore};
use serde_json::{Value, json};

use crate::failure::Failure;
use crate::store_url::StoreUrl;

/// An open store, with what `migrate` needs of its concrete type.
pub(crate) enum Opened {
    Memory(MemoryStore),
    Redis(RedisStore),
    Postgres(PostgresStore),
    Dynamo(DynamoStore),
    Sqlite(SqliteStore),
}

impl Opened {
    pub(crate) fn store(&self) -> &dyn IdempotencyStore {
        match self {
            Self::Memory(s) => s,
            Self::Redis(s) => s,
            Self::Postgres(s) => s,
            Self::Dynamo(s) => s,
            Self::Sqlite(s) => s,
        }
    }
}

/// Runs `fut`, a call to the store `store`, for at most `timeout`.
pub(crate) async fn bounded<T>(
    store: &'static str,
    timeout: Duration,
    fut: impl Future<Output = idem_core::Result<T>>,
) -> Result<T, Failure> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(result) => result.map_err(Failure::from),
        Err(_) => Err(Error::timed_out(store, timeout).into()),
    }
}

/// Opens the store `url` names; every store's own timeouts are set from `timeout`, and opening
/// is bounded by it too. `create`: whether a missing SQLite file may be created (`migrate`).
pub(crate) async fn open(
    url: &StoreUrl,
    timeout: Duration,
    create: bool,
) -> Result<Opened, Failure> {
    let name = url.store_name();
    match url {
        StoreUrl::Memory => Ok(Opened::Memory(MemoryStore::new())),
        StoreUrl::Redis { url, prefix } => {
            let store = bounded(
                name,
                timeout,
                RedisStore::connect_with(url, redis_config(prefix, timeout)),
            )
            .await?;
            Ok(Opened::Redis(store))
        }
        StoreUrl::RedisCluster { nodes, prefix } => {
            let config = redis_config(prefix, timeout);
            let store = bounded(
                name,
                timeout,
                RedisStore::connect_cluster_with(nodes, config),
            )
            .await?;
            Ok(Opened::Redis(store))
        }
        StoreUrl::Postgres { url, schema, table } => {
            let config = postgres_config(url, schema.as_deref(), table.as_deref(), timeout)?;
            let store = bounded(name, timeout, PostgresStore::connect(config)).await?;
            Ok(Opened::Postgres(store))
        }
        StoreUrl::Dynamo {
            table,
            endpoint,
            region,
        } => {
            let mut config = DynamoConfig::new(table.clone())
                .with_connect_timeout(timeout.min(Duration::from_secs(1)))
                .with_attempt_timeout(timeout.min(Duration::from_secs(2)))
                .with_operation_timeout(timeout);
            if let Some(endpoint) = endpoint {
                config = config.with_endpoint_url(endpoint.clone());
            }
            if let Some(region) = region {
                config = config.with_region(region.clone());
            }
            let store = Box::pin(bounded(name, timeout, DynamoStore::connect(config))).await?;
            if store.client().config().region().is_none() {
                // The SDK would only say "missing signing region" at the first request.
                return Err(Failure::usage(
                    "no AWS region for DynamoDB: add ?region= to the URL, or set AWS_REGION \
                     (or a region in the AWS profile)",
                ));
            }
            Ok(Opened::Dynamo(store))
        }
        StoreUrl::Sqlite { path } => {
            if !create && !path.exists() {
                return Err(Failure::usage(format!(
                    "no SQLite database at {} (`idem migrate` creates it)",
                    path.display()
                )));
            }
            // A path that can never be a database file is a usage error, not an outage.
            if path.is_dir() {
                return Err(Failure::usage(format!(
                    "{} is a directory, not a SQLite database file",
                    path.display()
                )));
            }
            let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
            if create && parent.is_some_and(|p| !p.is_dir()) {
                return Err(Failure::usage(format!(
                    "no directory {} to create the SQLite database in",
                    parent.map_or_else(String::new, |p| p.display().to_string())
                )));
            }
            let options = SqliteOptions::default()
                .with_create(create)
                .with_busy_timeout(timeout)
                .with_readers(2);
            let store = bounded(name, timeout, SqliteStore::open_with(path, options)).await?;
            Ok(Opened::Sqlite(store))
        }
    }
}

fn redis_config(prefix: &Option<String>, timeout: Duration) -> RedisConfig {
    let mut config = RedisConfig::default()
        .with_connect_timeout(timeout)
        .with_response_timeout(timeout)
        .with_operation_timeout(timeout);
    if let Some(prefix) = prefix {
        config = config.with_prefix(prefix.clone());
    }
    config
}

fn postgres_config(
    url: &str,
    schema: Option<&str>,
    table: Option<&str>,
    timeout: Duration,
) -> Result<PostgresConfig, Failure> {
    let mut config = PostgresConfig::new(url)?
        .with_schema(schema.unwrap_or(DEFAULT_SCHEMA))
        .with_table(table.unwrap_or(DEFAULT_TABLE))
        .with_pool_size(2)
        .with_connect_timeout(timeout)
        .with_pool_wait_timeout(timeout)
        .with_statement_timeout(timeout)
        .with_lock_timeout((timeout / 2).min(Duration::from_secs(1)))
        .with_application_name("idem-cli");
    if config.pg.get_ssl_mode() == SslMode::Require {
        // TLS against the Mozilla roots; without `sslmode=require` the connection is plain.
        config = config.with_tls_webpki_roots();
    }
    config.validate()?;
    Ok(config)
}

/// What `migrate --print` shows: the store's DDL, computed without connecting.
pub(crate) fn ddl(url: &StoreUrl) -> Result<String, Failure> {
    Ok(match url {
        StoreUrl::Memory => "-- memory: nothing to create\n".to_owned(),
        StoreUrl::Redis { .. } | StoreUrl::RedisCluster { .. } => {
            "-- redis: nothing to create (one key per record)\n".to_owned()
        }
        StoreUrl::Postgres { schema, table, .. } => {
            let sql = idem_postgres::ddl(
                schema.as_deref().unwrap_or(DEFAULT_SCHEMA),
                table.as_deref().unwrap_or(DEFAULT_TABLE),
            )?;
            format!("{}\n", sql.trim_end())
        }
        StoreUrl::Dynamo {
            table,
            endpoint,
            region,
        } => {
            // Checked like the store checks it, so the name is safe in a shell command.
            DynamoConfig::new(table.clone()).validate()?;
            // The URL's region and endpoint go with the commands, quoted for the shell: run as
            // printed, they create the table where the store looks for it.
            let mut place = String::new();
            for (option, value) in [("--region", region), ("--endpoint-url", endpoint)] {
                if let Some(value) = value {
                    let quoted = shlex::try_quote(value).map_err(|e| {
                        Failure::usage(format!(
                            "{option} {value:?} cannot be written for a shell: {e}"
                        ))
                    })?;
                    place.push_str(&format!(" {option} {quoted}"));
                }
            }
            format!(
                "aws dynamodb create-table{place} --table-name {table} \\\n    \
                 --attribute-definitions AttributeName=pk,AttributeType=S \\\n    \
                 --key-schema AttributeName=pk,KeyType=HASH --billing-mode PAY_PER_REQUEST\n\
                 aws dynamodb update-time-to-live{place} --table-name {table} \\\n    \
                 --time-to-live-specification Enabled=true,AttributeName=ttl\n"
            )
        }
        StoreUrl::Sqlite { .. } => {
            format!("{};\n", idem_sqlite::CREATE_TABLE.trim_end_matches(';'))
        }
    })
}

/// Sets the store up; returns what it did, as a sentence and as JSON.
pub(crate) async fn set_up(opened: &Opened, timeout: Duration) -> Result<(String, Value), Failure> {
    let name = opened.store().name();
    Ok(match opened {
        Opened::Memory(_) | Opened::Redis(_) => (
            format!("{name}: nothing to set up"),
            json!({"store": name, "changed": false}),
        ),
        Opened::Postgres(store) => {
            let report = bounded(name, timeout, store.migrate()).await?;
            let said = if report.applied.is_empty() {
                format!(
                    "postgres: {} is up to date (schema version {})",
                    store.qualified_table(),
                    report.version
                )
            } else {
                format!(
                    "postgres: {} migrated to schema version {} (applied {:?})",
                    store.qualified_table(),
                    report.version,
                    report.applied
                )
            };
            let json = json!({
                "store": name,
                "table": store.qualified_table(),
                "changed": !report.applied.is_empty(),
                "applied": report.applied,
                "version": report.version,
            });
            (said, json)
        }
        Opened::Dynamo(store) => {
            let created = bounded(name, timeout, store.create_table_if_missing()).await?;
            let said = if created {
                format!("dynamo: created table {} (TTL on `ttl`)", store.table())
            } else {
                format!("dynamo: table {} exists (TTL on `ttl`)", store.table())
            };
            (
                said,
                json!({"store": name, "table": store.table(), "changed": created}),
            )
        }
        Opened::Sqlite(store) => {
            let path = store.backend().path().display().to_string();
            let created = store.backend().created_table();
            let said = if created {
                format!("sqlite: created table {} in {path}", idem_sqlite::TABLE)
            } else {
                format!("sqlite: table {} exists in {path}", idem_sqlite::TABLE)
            };
            (
                said,
                json!({"store": name, "path": path, "table": idem_sqlite::TABLE, "changed": created}),
            )
        }
    })
}
