//! The operator's listing on PostgreSQL: keyset pages over the index
//! `(namespace, state, id COLLATE "C")` (schema version 3).
//!
//! A [`Status`] is a `state` value plus conditions on the lease, the attempts and the clock, so
//! a listing reads one `state` at a time, in the order of [`StateKind::ALL`], and only the
//! states its statuses can come from: listing failed-terminal records among millions of
//! completed ones reads the failed-terminal part of the index, nothing else. Each statement
//! reads one index range (`namespace = $1 AND state = $2 AND id > $3`, in byte order), applies
//! the status, age and owner conditions, and stops at the page's limit. The cursor is the state
//! and the last id returned.
//!
//! Every value is a bound parameter; the statement's text is fixed (the same for every query).

use std::time::Duration;

use idem_core::{Cursor, Error, ListQuery, Page, Record, Result, StateKind, Status};
use tokio_postgres::Row;
use tokio_postgres::types::{FromSql, Type};

use crate::sql::{Names, RECORD_COLUMNS, Stmt};
use crate::store::{PostgresStore, decode_record};

/// The longest `min_age` applied as given (about 290 years); a longer one lists nothing older
/// than this, which no record is.
const MAX_AGE: Duration = Duration::from_secs(290 * 365 * 86_400);

/// The listing statement of a store's table. Params: `$1` namespace, `$2` state, `$3` the last id
/// listed (`''` to start), `$4` minimum age in microseconds (or NULL), `$5` owner (or NULL),
/// `$6` maximum attempts, `$7` the statuses wanted (their names; NULL for all), `$8` limit.
pub(crate) fn statement(n: &Names) -> Stmt {
    let t = &n.qtable;
    let sql = format!(
        "WITH clk AS MATERIALIZED (SELECT clock_timestamp() AS now) \
         SELECT t.id, {RECORD_COLUMNS} FROM {t} t \
         WHERE t.namespace = $1::text AND t.state = $2::text \
           AND t.id COLLATE \"C\" > $3::text COLLATE \"C\" \
           AND (t.expires_at IS NULL OR t.expires_at > (SELECT now FROM clk)) \
           AND ($4::bigint IS NULL OR t.updated_at <= (SELECT now FROM clk) - $4::bigint * interval '1 microsecond') \
           AND ($5::text IS NULL OR t.owner = $5::text) \
           AND ($7::text[] IS NULL OR (CASE \
                WHEN t.state = 'in_progress' AND t.lease_expires_at > (SELECT now FROM clk) THEN 'in_progress' \
                WHEN t.state = 'in_progress' AND t.attempts >= $6::integer THEN 'exhausted' \
                WHEN t.state = 'in_progress' THEN 'lease_expired' \
                WHEN t.state = 'released' AND t.attempts >= $6::integer THEN 'exhausted' \
                WHEN t.state = 'released' THEN 'released' \
                WHEN t.state = 'completed' THEN 'completed' \
                WHEN t.state = 'failed_retryable' AND t.attempts >= $6::integer THEN 'exhausted' \
                WHEN t.state = 'failed_retryable' THEN 'failed_retryable' \
                WHEN t.state = 'failed_terminal' THEN 'failed_terminal' \
                WHEN t.state = 'failed_result_not_stored' THEN 'result_not_stored' \
                END) = ANY($7::text[])) \
         ORDER BY t.id COLLATE \"C\" \
         LIMIT $8::bigint"
    );
    Stmt {
        sql,
        types: &[
            Type::TEXT,
            Type::TEXT,
            Type::TEXT,
            Type::INT8,
            Type::TEXT,
            Type::INT4,
            Type::TEXT_ARRAY,
            Type::INT8,
        ],
    }
}

/// The statuses a record in `state` can have.
fn statuses_of(state: StateKind) -> &'static [Status] {
    match state {
        StateKind::InProgress => &[Status::InProgress, Status::LeaseExpired, Status::Exhausted],
        StateKind::Released => &[Status::Released, Status::Exhausted],
        StateKind::Completed => &[Status::Completed],
        StateKind::Failed(idem_core::FailureKind::Retryable) => {
            &[Status::FailedRetryable, Status::Exhausted]
        }
        StateKind::Failed(idem_core::FailureKind::Terminal) => &[Status::FailedTerminal],
        StateKind::Failed(idem_core::FailureKind::ResultNotStored) => &[Status::ResultNotStored],
        // A state this version does not know: read it whatever is wanted (the statement's
        // status conditions then leave its records out unless every status is wanted).
        _ => &Status::ALL,
    }
}

/// The states (indexes into [`StateKind::ALL`]) a listing of `query` reads, in order.
fn states(query: &ListQuery) -> Vec<usize> {
    (0..StateKind::ALL.len())
        .filter(|&i| {
            query.statuses.is_empty()
                || statuses_of(StateKind::ALL[i])
                    .iter()
                    .any(|s| query.statuses.contains(s))
        })
        .collect()
}

/// `<state index>.<hex of the last id>`.
fn encode(state: usize, after: &str) -> Cursor {
    Cursor::new(format!("{state}.{}", hex::encode(after)))
}

fn decode(cursor: &Cursor) -> Result<(usize, String)> {
    let bad = || Error::invalid("cursor", "is not a cursor of this store");
    let (state, after) = cursor.as_str().split_once('.').ok_or_else(bad)?;
    let state: usize = state.parse().map_err(|_| bad())?;
    if state >= StateKind::ALL.len() {
        return Err(bad());
    }
    let after = String::from_utf8(hex::decode(after).map_err(|_| bad())?).map_err(|_| bad())?;
    // An id never holds NUL (nor can a `text` parameter): such a cursor was not made here.
    if after.contains('\0') {
        return Err(bad());
    }
    Ok((state, after))
}

/// The parameters of one statement.
struct Args {
    namespace: String,
    min_age_us: Option<i64>,
    owner: Option<String>,
    max_attempts: i32,
    statuses: Vec<Status>,
}

impl Args {
    fn new(query: &ListQuery) -> Self {
        Self {
            namespace: query.namespace.as_str().to_owned(),
            min_age_us: query
                .min_age
                .map(|age| crate::store::micros(age.min(MAX_AGE))),
            owner: query.owner.clone(),
            max_attempts: i32::try_from(query.max_attempts).unwrap_or(i32::MAX),
            statuses: query.statuses.clone(),
        }
    }

    /// `$7` for reading `state`: `None` (no condition on the status) when every status a record
    /// in `state` can have is wanted, so the planner sees a plain index range; else the names
    /// of the wanted statuses.
    fn statuses_for(&self, state: usize) -> Option<Vec<String>> {
        let all_wanted = self.statuses.is_empty()
            || statuses_of(StateKind::ALL[state])
                .iter()
                .all(|s| self.statuses.contains(s));
        (!all_wanted).then(|| self.statuses.iter().map(|s| s.name().to_owned()).collect())
    }
}

impl PostgresStore {
    /// One page of `query`: see [`list`](idem_core::IdempotencyStore::list) and the module
    /// docs.
    pub(crate) async fn list_page(&self, query: &ListQuery) -> Result<Page> {
        query.validate()?;
        let wanted = states(query);
        let (first, mut after) = match &query.cursor {
            Some(c) => decode(c)?,
            None => (0, String::new()),
        };
        // No owner holds NUL (nor can a `text` parameter): nothing matches.
        if query
            .owner
            .as_deref()
            .is_some_and(|owner| owner.contains('\0'))
        {
            return Ok(Page::new(Vec::new(), None));
        }
        let args = Args::new(query);
        let stmt = &self.inner.list;
        let mut records: Vec<Record> = Vec::new();
        // The state of the last record listed (where the next page resumes).
        let mut last_state = first;
        for state in wanted.into_iter().filter(|&s| s >= first) {
            if state != first {
                after.clear();
            }
            // One row more than the page has room for: the cursor is given only when a record
            // follows (on a full page, the next states are asked for one row each).
            let room = query.limit - records.len();
            let statuses = args.statuses_for(state);
            let rows = self
                .query(
                    stmt,
                    &[
                        &args.namespace,
                        &StateKind::ALL[state].name(),
                        &after,
                        &args.min_age_us,
                        &args.owner,
                        &args.max_attempts,
                        &statuses,
                        &(room as i64 + 1),
                    ],
                )
                .await?;
            for row in rows.iter().take(room) {
                records.push(self.list_record(query, row)?);
                last_state = state;
            }
            if rows.len() > room {
                let next = records.last().map(|r| encode(last_state, r.key.id()));
                return Ok(Page::new(records, next));
            }
        }
        Ok(Page::new(records, None))
    }

    fn list_record(&self, query: &ListQuery, row: &Row) -> Result<Record> {
        let id: String = row
            .try_get("id")
            .map_err(|e| Error::corrupt(crate::error::STORE, "?", format!("column id: {e}")))?;
        let key = query.namespace.key(&id).map_err(|e| {
            Error::corrupt(
                crate::error::STORE,
                format!("{}:{id}", query.namespace),
                format!("the id is not valid: {e}"),
            )
        })?;
        decode_record(row, &key)
    }

    /// The plan PostgreSQL chooses for the first statement a listing of `query` runs, as
    /// `EXPLAIN (FORMAT JSON)` prints it (the statement is planned, not run): for checking that
    /// a listing by state reads the listing index (`<table>_list_idx`, schema version 3) and
    /// not the whole table.
    ///
    /// # Errors
    /// As [`list`](idem_core::IdempotencyStore::list).
    pub async fn explain_list(&self, query: &ListQuery) -> Result<String> {
        query.validate()?;
        let state = states(query).first().copied().unwrap_or(0);
        let args = Args::new(query);
        let explain = Stmt {
            sql: format!("EXPLAIN (FORMAT JSON) {}", self.inner.list.sql),
            types: self.inner.list.types,
        };
        let limit = query.limit as i64;
        let statuses = args.statuses_for(state);
        let rows = self
            .query(
                &explain,
                &[
                    &args.namespace,
                    &StateKind::ALL[state].name(),
                    &"",
                    &args.min_age_us,
                    &args.owner,
                    &args.max_attempts,
                    &statuses,
                    &limit,
                ],
            )
            .await?;
        let plan = rows
            .first()
            .ok_or_else(|| Error::backend(crate::error::STORE, "EXPLAIN returned no row"))?;
        let Json(text) = plan
            .try_get(0)
            .map_err(|e| Error::backend(crate::error::STORE, e))?;
        Ok(text)
    }
}

/// A `json` value as its text.
struct Json(String);

impl<'a> FromSql<'a> for Json {
    fn from_sql(
        _: &Type,
        raw: &'a [u8],
    ) -> std::result::Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(Self(std::str::from_utf8(raw)?.to_owned()))
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::JSON
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::Namespace;

    #[test]
    fn each_status_comes_from_the_states_that_can_hold_it() {
        for status in Status::ALL {
            let q = ListQuery::new(Namespace::new("ns").unwrap()).with_statuses([status]);
            let names: Vec<&str> = states(&q)
                .iter()
                .map(|&i| StateKind::ALL[i].name())
                .collect();
            let want: &[&str] = match status {
                Status::InProgress | Status::LeaseExpired => &["in_progress"],
                Status::Released => &["released"],
                Status::Completed => &["completed"],
                Status::FailedRetryable => &["failed_retryable"],
                Status::FailedTerminal => &["failed_terminal"],
                Status::ResultNotStored => &["failed_result_not_stored"],
                _ => &["in_progress", "released", "failed_retryable"],
            };
            assert_eq!(names, want, "{status}");
        }
        let all = ListQuery::new(Namespace::new("ns").unwrap());
        assert_eq!(states(&all).len(), StateKind::ALL.len());
    }

    #[test]
    fn cursors_round_trip_and_bad_ones_are_refused() {
        let c = encode(3, "order-42 é");
        assert_eq!(decode(&c).unwrap(), (3, "order-42 é".to_owned()));
        for bad in ["", "3", "x.00", "99.00", "1.zz", "1.ff", "4.00", "4.610062"] {
            assert!(
                matches!(
                    decode(&Cursor::new(bad)),
                    Err(Error::InvalidInput {
                        field: "cursor",
                        ..
                    })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_statement_names_every_status_it_computes() {
        let sql = statement(&Names::new("idem", "records")).sql;
        for status in Status::ALL {
            assert!(sql.contains(&format!("'{}'", status.name())), "{status}");
        }
    }
}
