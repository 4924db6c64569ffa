//! Batches: `acquire_many`, `complete_many`, `fail_many` and `release_many` as ONE statement
//! per batch over parameter arrays (`unnest`), with the single statements' rules row by row.
//! See the crate docs, "Batches".
//!
//! Each batch statement is its single-key statement (`sql.rs`) applied to every row of
//! `unnest($n::...[])`: the same clock CTE, the same `may_acquire` and fence conditions, the
//! same replay test and the same columns back, one row per item (`ord`), so the single calls'
//! classification (`acquire_outcome`, `fenced_outcome`) reads each row unchanged. A statement
//! cannot change one row twice, so a key that appears again in a batch goes to a later round:
//! round `k` holds the `k`-th occurrence of each key, and rounds run one after the other, which
//! gives the items of one key in batch order, as single calls made in order would.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::future::join_all;
use idem_core::{
    AcquireOutcome, AcquireRequest, Completion, Error, Failure, IdempotencyKey, IdempotencyStore,
    Lease, Result,
};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use crate::error::{is_serialization_failure, is_untranslatable, sqlstate};
use crate::sql::{Names, Stmt, live, may_acquire};
use crate::store::{PostgresStore, acquire_outcome, failed_state, fenced_outcome, micros};

/// The batch statements of a store.
#[derive(Clone, Debug)]
pub(crate) struct BatchSql {
    acquire: Stmt,
    complete: Stmt,
    fail: Stmt,
    release: Stmt,
}

impl BatchSql {
    pub(crate) fn new(n: &Names) -> Self {
        let t = &n.qtable;
        let seq = format!("'{}'", n.qseq);
        let gone = "r.expires_at <= excluded.created_at";
        // The request of the row `r` the upsert is about (keys are distinct within a round).
        let req_of_r = "FROM req q WHERE q.ns = r.namespace AND q.kid = r.id";

        // The acquire statement of `sql.rs` over arrays. Rows are inserted in key order, so
        // concurrent batches lock the rows they share in the same order (no deadlock between
        // them). Params: $1 lock timeout (ms, as text), then arrays: $2 ord, $3 namespace, $4 id,
        // $5 fingerprint (NULL elements for none), $6 owner, $7 lease (µs), $8 max attempts.
        let acquire = format!(
            "WITH clk AS MATERIALIZED (\
                SELECT clock_timestamp() AS now, set_config('lock_timeout', $1::text, true) AS lt), \
             req AS MATERIALIZED (\
                SELECT * FROM unnest($2::int4[], $3::text[], $4::text[], $5::bytea[], $6::text[], \
                    $7::int8[], $8::int8[]) AS q(ord, ns, kid, fp, own, lease_us, max_attempts)), \
             old AS MATERIALIZED (\
                SELECT q.ord, t.ctid AS tid, t.state, t.fingerprint, t.token, t.owner, t.attempts, \
                    t.lease_expires_at, t.result, t.error, t.created_at, t.updated_at, \
                    t.expires_at, {old_may} AS may_acquire \
                FROM req q CROSS JOIN clk JOIN {t} t ON t.namespace = q.ns AND t.id = q.kid), \
             up AS (\
                INSERT INTO {t} AS r (namespace, id, state, fingerprint, token, owner, attempts, \
                    lease_expires_at, result, error, created_at, updated_at, expires_at) \
                SELECT q.ns, q.kid, 'in_progress', q.fp, nextval({seq}), q.own, 1, \
                    clk.now + q.lease_us * interval '1 microsecond', NULL, NULL, clk.now, clk.now, \
                    NULL \
                FROM req q CROSS JOIN clk LEFT JOIN old o ON o.ord = q.ord \
                WHERE o.ord IS NULL OR o.may_acquire \
                ORDER BY q.ns, q.kid \
                ON CONFLICT (namespace, id) DO UPDATE SET \
                    state = 'in_progress', \
                    fingerprint = CASE WHEN {gone} THEN excluded.fingerprint ELSE r.fingerprint END, \
                    token = nextval({seq}), \
                    owner = excluded.owner, \
                    attempts = CASE WHEN {gone} THEN 1 ELSE r.attempts + 1 END, \
                    lease_expires_at = excluded.lease_expires_at, \
                    result = NULL, \
                    error = NULL, \
                    created_at = CASE WHEN {gone} THEN excluded.created_at ELSE r.created_at END, \
                    updated_at = excluded.updated_at, \
                    expires_at = NULL \
                WHERE r.ctid = (SELECT o.tid FROM old o JOIN req q ON q.ord = o.ord \
                        WHERE q.ns = r.namespace AND q.kid = r.id) \
                    AND {new_may} \
                RETURNING r.namespace AS ns, r.id AS kid, r.token, r.attempts, \
                    r.lease_expires_at, (r.xmax = 0) AS inserted) \
             SELECT q.ord, clk.now, up.token AS new_token, up.attempts AS new_attempts, \
                up.lease_expires_at AS new_lease_expires_at, up.inserted AS new_inserted, \
                o.tid IS NOT NULL AS found, \
                o.state, o.fingerprint, o.token, o.owner, o.attempts, o.lease_expires_at, \
                o.result, o.error, o.created_at, o.updated_at, o.expires_at \
             FROM req q CROSS JOIN clk LEFT JOIN old o ON o.ord = q.ord \
                LEFT JOIN up ON up.ns = q.ns AND up.kid = q.kid \
             ORDER BY q.ord",
            old_may = may_acquire("t", "q.fp", "clk.now", "q.max_attempts"),
            new_may = may_acquire(
                "r",
                "excluded.fingerprint",
                "excluded.created_at",
                &format!("(SELECT q.max_attempts {req_of_r})"),
            ),
        );

        // The fenced statements of `sql.rs` over arrays: the update guarded by token, state and
        // retention, and for rows it did not change, the record's current token and state and
        // whether it is exactly what this transition leaves (a replay).
        // `columns` are the item arrays after $1 ord, $2 namespace, $3 id, $4 token.
        let fenced = |columns: &str, names: &str, set: &str, same: &str| {
            format!(
                "WITH clk AS MATERIALIZED (SELECT clock_timestamp() AS now), \
                 req AS MATERIALIZED (\
                    SELECT * FROM unnest($1::int4[], $2::text[], $3::text[], $4::int8[]{columns}) \
                        AS q(ord, ns, kid, tok{names})), \
                 upd AS (\
                    UPDATE {t} AS r SET {set} FROM clk, req q \
                    WHERE r.namespace = q.ns AND r.id = q.kid AND r.token = q.tok \
                        AND r.state = 'in_progress' AND {live_r} \
                    RETURNING q.ord, true AS ok) \
                 SELECT q.ord, clk.now, upd.ok IS NOT NULL AS done, \
                    NULL::timestamptz AS lease_expires_at, \
                    cur.token AS current_token, cur.state AS current_state, \
                    COALESCE(cur.replayed, false) AS replayed \
                 FROM req q CROSS JOIN clk LEFT JOIN upd ON upd.ord = q.ord \
                    LEFT JOIN LATERAL (\
                        SELECT c.token, c.state, (c.token = q.tok AND {same}) AS replayed \
                        FROM {t} c \
                        WHERE c.namespace = q.ns AND c.id = q.kid AND {live_c}) cur ON true \
                 ORDER BY q.ord",
                live_r = live("r", "clk.now"),
                live_c = live("c", "clk.now"),
            )
        };
        // Arrays $1..$5 (result), then $6 retention (µs).
        let complete = fenced(
            ", $5::bytea[]",
            ", res",
            "state = 'completed', result = q.res, lease_expires_at = NULL, \
             updated_at = clk.now, expires_at = clk.now + $6::bigint * interval '1 microsecond'",
            "c.state = 'completed' AND c.result = q.res",
        );
        // Arrays $1..$6 (error, state `failed_<kind>`), then $7 retention (µs).
        let fail = fenced(
            ", $5::text[], $6::text[]",
            ", err, st",
            "state = q.st, error = q.err, lease_expires_at = NULL, updated_at = clk.now, \
             expires_at = clk.now + $7::bigint * interval '1 microsecond'",
            "c.state = q.st AND c.error COLLATE \"C\" = q.err COLLATE \"C\"",
        );
        // Arrays $1..$4.
        let release = fenced(
            "",
            "",
            "state = 'released', attempts = GREATEST(r.attempts - 1, 0), \
             lease_expires_at = NULL, updated_at = clk.now",
            "c.state = 'released'",
        );

        use Type as T;
        Self {
            acquire: Stmt {
                sql: acquire,
                types: &[
                    T::TEXT,
                    T::INT4_ARRAY,
                    T::TEXT_ARRAY,
                    T::TEXT_ARRAY,
                    T::BYTEA_ARRAY,
                    T::TEXT_ARRAY,
                    T::INT8_ARRAY,
                    T::INT8_ARRAY,
                ],
            },
            complete: Stmt {
                sql: complete,
                types: &[
                    T::INT4_ARRAY,
                    T::TEXT_ARRAY,
                    T::TEXT_ARRAY,
                    T::INT8_ARRAY,
                    T::BYTEA_ARRAY,
                    T::INT8,
                ],
            },
            fail: Stmt {
                sql: fail,
                types: &[
                    T::INT4_ARRAY,
                    T::TEXT_ARRAY,
                    T::TEXT_ARRAY,
                    T::INT8_ARRAY,
                    T::TEXT_ARRAY,
                    T::TEXT_ARRAY,
                    T::INT8,
                ],
            },
            release: Stmt {
                sql: release,
                types: &[T::INT4_ARRAY, T::TEXT_ARRAY, T::TEXT_ARRAY, T::INT8_ARRAY],
            },
        }
    }
}

/// Splits item indexes into rounds: round `k` holds the `k`-th occurrence of each key, in batch
/// order. Items whose check failed (`None` key) are in no round.
fn rounds<'a>(keys: impl Iterator<Item = Option<&'a IdempotencyKey>>) -> Vec<Vec<usize>> {
    let mut seen: HashMap<&IdempotencyKey, usize> = HashMap::new();
    let mut rounds: Vec<Vec<usize>> = Vec::new();
    for (i, key) in keys.enumerate() {
        let Some(key) = key else { continue };
        let n = seen.entry(key).or_insert(0);
        if rounds.len() <= *n {
            rounds.push(Vec::new());
        }
        rounds[*n].push(i);
        *n += 1;
    }
    rounds
}

/// A batch statement that hit a lock held by an open transaction (`55P03`, the acquire's lock
/// timeout), lost a deadlock (`40P01`), lost to a concurrent writer under a stricter
/// `default_transaction_isolation` than `READ COMMITTED` (`40001`, see
/// [`is_serialization_failure`]) or carried a text the database's encoding cannot hold (`22P05`,
/// one item's key or error): its items are answered by single statements instead, so each gets
/// its own answer.
fn falls_back(e: &Error) -> bool {
    sqlstate(e).is_some_and(|c| {
        *c == SqlState::LOCK_NOT_AVAILABLE || *c == SqlState::T_R_DEADLOCK_DETECTED
    }) || is_serialization_failure(e)
        || is_untranslatable(e)
}

fn ords(round: &[usize]) -> Vec<i32> {
    (0..round.len() as i32).collect()
}

impl PostgresStore {
    pub(crate) async fn acquire_batch(
        &self,
        reqs: &[AcquireRequest],
    ) -> Result<Vec<Result<AcquireOutcome>>> {
        self.limits().check_batch(reqs.len())?;
        let mut out: Vec<Option<Result<AcquireOutcome>>> =
            reqs.iter().map(|r| r.validate().err().map(Err)).collect();
        let rounds = rounds(
            reqs.iter()
                .zip(&out)
                .map(|(r, o)| o.is_none().then_some(&r.key)),
        );
        for round in rounds {
            let items: Vec<&AcquireRequest> = round.iter().map(|&i| &reqs[i]).collect();
            let ord = ords(&round);
            let ns: Vec<&str> = items.iter().map(|r| r.key.namespace().as_str()).collect();
            let id: Vec<&str> = items.iter().map(|r| r.key.id()).collect();
            let fp: Vec<Option<&[u8]>> = items
                .iter()
                .map(|r| r.fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
                .collect();
            let owner: Vec<&str> = items.iter().map(|r| r.owner.as_str()).collect();
            let lease: Vec<i64> = items.iter().map(|r| micros(r.lease_ttl)).collect();
            let max: Vec<i64> = items.iter().map(|r| i64::from(r.max_attempts)).collect();
            let params: [&(dyn ToSql + Sync); 8] = [
                &self.inner.lock_timeout_ms,
                &ord,
                &ns,
                &id,
                &fp,
                &owner,
                &lease,
                &max,
            ];
            let rows = match self.query(&self.inner.batch.acquire, &params).await {
                Ok(rows) => rows,
                Err(e) if falls_back(&e) => {
                    let singles = join_all(items.iter().map(|r| self.acquire(r))).await;
                    for (&i, r) in round.iter().zip(singles) {
                        out[i] = Some(r);
                    }
                    continue;
                }
                Err(e) => return Err(e),
            };
            let mut again = Vec::new();
            for (k, &i) in round.iter().enumerate() {
                let row = rows
                    .iter()
                    .find(|row| row.try_get::<_, i32>("ord").ok() == Some(k as i32));
                match acquire_outcome(row, &reqs[i]) {
                    Ok(Some(outcome)) => out[i] = Some(Ok(outcome)),
                    // The record changed between the statement's snapshot and its row lock: the
                    // single statement runs again for this key, as a single call would.
                    Ok(None) => again.push(i),
                    Err(e) => out[i] = Some(Err(e)),
                }
            }
            let singles = join_all(again.iter().map(|&i| self.acquire(&reqs[i]))).await;
            for (&i, r) in again.iter().zip(singles) {
                out[i] = Some(r);
            }
        }
        Ok(out
            .into_iter()
            .map(|r| r.expect("every item has an outcome"))
            .collect())
    }

    pub(crate) async fn complete_batch(
        &self,
        items: &[Completion],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        let limits = self.limits();
        limits.check_batch(items.len())?;
        let checks = items
            .iter()
            .map(|c| limits.check_complete(&c.result, retention).err())
            .collect();
        let retention_us = micros(retention);
        self.fenced_batch(
            items.iter().map(|c| &c.lease).collect(),
            checks,
            |round| {
                let res: Vec<&[u8]> = round.iter().map(|&i| &items[i].result[..]).collect();
                (
                    vec![Box::new(res) as Box<dyn ToSql + Send + Sync + '_>],
                    &self.inner.batch.complete,
                )
            },
            Some(&retention_us),
            |i| {
                let c = &items[i];
                let result: Bytes = c.result.clone();
                Box::pin(async move { self.complete(&c.lease, result, retention).await })
            },
        )
        .await
    }

    pub(crate) async fn fail_batch(
        &self,
        items: &[Failure],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        let limits = self.limits();
        limits.check_batch(items.len())?;
        let checks = items
            .iter()
            .map(|f| limits.check_fail(&f.error, retention).err())
            .collect();
        let retention_us = micros(retention);
        self.fenced_batch(
            items.iter().map(|f| &f.lease).collect(),
            checks,
            |round| {
                let err: Vec<&str> = round.iter().map(|&i| items[i].error.as_str()).collect();
                let st: Vec<&str> = round.iter().map(|&i| failed_state(items[i].kind)).collect();
                (
                    vec![
                        Box::new(err) as Box<dyn ToSql + Send + Sync + '_>,
                        Box::new(st) as Box<dyn ToSql + Send + Sync + '_>,
                    ],
                    &self.inner.batch.fail,
                )
            },
            Some(&retention_us),
            |i| {
                let f = &items[i];
                Box::pin(async move { self.fail(&f.lease, &f.error, f.kind, retention).await })
            },
        )
        .await
    }

    pub(crate) async fn release_batch(&self, leases: &[Lease]) -> Result<Vec<Result<()>>> {
        self.limits().check_batch(leases.len())?;
        self.fenced_batch(
            leases.iter().collect(),
            leases.iter().map(|_| None).collect(),
            |_| (Vec::new(), &self.inner.batch.release),
            None,
            |i| {
                let l = &leases[i];
                Box::pin(async move { self.release(l).await })
            },
        )
        .await
    }

    /// Runs a fenced batch: items whose check failed keep that error; the others go, round by
    /// round, to the batch statement `stmt` that `extra` gives with its per-item arrays, followed
    /// by `tail` (the retention, when the statement has one). An item whose row shows its lease
    /// still current although the update did not apply (a concurrent writer got in between),
    /// and every item of a round whose statement hit a lock or deadlock, is answered by its
    /// single call (`single`), as `fenced` does.
    async fn fenced_batch<'s, X, S>(
        &'s self,
        leases: Vec<&Lease>,
        checks: Vec<Option<Error>>,
        extra: X,
        tail: Option<&(dyn ToSql + Sync)>,
        single: S,
    ) -> Result<Vec<Result<()>>>
    where
        X: Fn(&[usize]) -> (Vec<Box<dyn ToSql + Send + Sync + 's>>, &'s Stmt),
        S: Fn(usize) -> std::pin::Pin<Box<dyn Future<Output = Result<()>> + Send + 's>>,
    {
        let mut out: Vec<Option<Result<()>>> = checks.into_iter().map(|e| e.map(Err)).collect();
        let rounds = rounds(
            leases
                .iter()
                .zip(&out)
                .map(|(l, o)| o.is_none().then_some(&l.key)),
        );
        for round in rounds {
            let ord = ords(&round);
            let ns: Vec<&str> = round
                .iter()
                .map(|&i| leases[i].key.namespace().as_str())
                .collect();
            let id: Vec<&str> = round.iter().map(|&i| leases[i].key.id()).collect();
            let tok: Vec<i64> = round
                .iter()
                .map(|&i| leases[i].token.get() as i64)
                .collect();
            let (arrays, stmt) = extra(&round);
            let mut params: Vec<&(dyn ToSql + Sync)> = vec![&ord, &ns, &id, &tok];
            params.extend(arrays.iter().map(|a| a.as_ref() as &(dyn ToSql + Sync)));
            params.extend(tail);
            let rows = match self.query(stmt, &params).await {
                Ok(rows) => rows,
                Err(e) if falls_back(&e) => {
                    let singles = join_all(round.iter().map(|&i| single(i))).await;
                    for (&i, r) in round.iter().zip(singles) {
                        out[i] = Some(r);
                    }
                    continue;
                }
                Err(e) => return Err(e),
            };
            let mut again = Vec::new();
            for (k, &i) in round.iter().enumerate() {
                let row = rows
                    .iter()
                    .find(|row| row.try_get::<_, i32>("ord").ok() == Some(k as i32));
                match fenced_outcome(row, leases[i]) {
                    Ok(Some(done)) => out[i] = Some(done.map(|_: Option<SystemTime>| ())),
                    Ok(None) => again.push(i),
                    Err(e) => out[i] = Some(Err(e)),
                }
            }
            let singles = join_all(again.iter().map(|&i| single(i))).await;
            for (&i, r) in again.iter().zip(singles) {
                out[i] = Some(r);
            }
        }
        Ok(out
            .into_iter()
            .map(|r| r.expect("every item has a result"))
            .collect())
    }
}
