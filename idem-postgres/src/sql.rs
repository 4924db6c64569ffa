//! The SQL text of every statement, built once per store from validated, quoted names.
//!
//! User data never appears here: keys, owners, fingerprints, results and errors are always bound
//! parameters. The only values formatted into the text are the schema and table names, which
//! [`check_identifier`](crate::config::check_identifier) restricts to `[a-z0-9_]` and which are
//! double-quoted as well.
//!
//! Every statement reads the server clock once, as `clock_timestamp()` in a materialized CTE
//! (`clk`), and uses that one instant everywhere in the statement. See the crate docs for why it
//! is `clock_timestamp()` and not `now()`.

use tokio_postgres::types::Type;

use crate::config::quote;

/// Quoted names of everything the crate creates for one store.
#[derive(Clone, Debug)]
pub(crate) struct Names {
    pub(crate) schema: String,
    pub(crate) table: String,
    /// `"schema"."table"`
    pub(crate) qtable: String,
    /// `"schema"."table_token_seq"`
    pub(crate) qseq: String,
    /// `"schema"."table_migrations"`
    pub(crate) qmigrations: String,
    /// `"table_expires_at_idx"` (an index lives in its table's schema)
    pub(crate) qindex: String,
    /// `"schema"`
    pub(crate) qschema: String,
    /// `table_state_check`: the check constraint on the `state` column (the name PostgreSQL gave
    /// it in v1, kept by v2).
    pub(crate) state_check: String,
    /// `"table_state_check"`
    pub(crate) qstate_check: String,
}

impl Names {
    pub(crate) fn new(schema: &str, table: &str) -> Self {
        let q = |name: &str| format!("{}.{}", quote(schema), quote(name));
        Self {
            schema: schema.to_owned(),
            table: table.to_owned(),
            qtable: q(table),
            qseq: q(&format!("{table}_token_seq")),
            qmigrations: q(&format!("{table}_migrations")),
            qindex: quote(&format!("{table}_expires_at_idx")),
            qschema: quote(schema),
            state_check: format!("{table}_state_check"),
            qstate_check: quote(&format!("{table}_state_check")),
        }
    }
}

/// One statement: its text and the types of its parameters (so it can be prepared typed, or
/// sent with `query_typed` in one round trip on a connection without a statement cache).
#[derive(Clone, Debug)]
pub(crate) struct Stmt {
    pub(crate) sql: String,
    pub(crate) types: &'static [Type],
}

/// All statements of a store.
#[derive(Clone, Debug)]
pub(crate) struct Sql {
    pub(crate) acquire: Stmt,
    pub(crate) extend: Stmt,
    pub(crate) complete: Stmt,
    pub(crate) fail: Stmt,
    pub(crate) release: Stmt,
    pub(crate) get: Stmt,
    pub(crate) delete: Stmt,
    pub(crate) purge: Stmt,
    pub(crate) record_failure: Stmt,
    pub(crate) complete_with: Stmt,
    /// Sent right after `complete_with`, in the same transaction: fails (SQLSTATE `22P02`),
    /// aborting the transaction, unless that statement completed the record. Every later
    /// statement of the transaction then fails with `25P02` without running, and the `COMMIT`
    /// that ends the pipeline rolls back.
    pub(crate) complete_with_guard: Stmt,
}

/// The transaction-local setting through which the `complete_with` statement tells the guard
/// after it whether it completed the record.
const COMPLETE_WITH_SETTING: &str = "idem.complete_with";

/// What the setting holds when the completion did not apply (written into the statement as a
/// string literal: it must hold no quote): the guard's error message quotes it
/// (`invalid input syntax for type integer: "..."`), so the server log says why the transaction
/// was aborted.
const NOT_APPLIED: &str = "idem-postgres: the completion did not apply (lease lost, or already completed), so the \
     statements of the handler are not run";

/// The columns of a record, in the order `get` returns them.
pub(crate) const RECORD_COLUMNS: &str = "state, fingerprint, token, owner, attempts, \
     lease_expires_at, result, error, created_at, updated_at, expires_at";

/// A record is past retention when `expires_at <= now` (the reference machine's rule).
/// `live(t, now)` is the SQL condition for "not past retention".
pub(crate) fn live(alias: &str, now: &str) -> String {
    format!("({alias}.expires_at IS NULL OR {alias}.expires_at > {now})")
}

/// The contract's "a new acquisition is allowed" rule on record `a`, for a request with
/// fingerprint `fp` and attempt limit `max`, at `now`: the record is past retention, or (no
/// fingerprint conflict, attempts below the limit, and the record is released, failed
/// retryably, or in progress with an expired lease). Mirrors `idem_core::machine::acquire`.
pub(crate) fn may_acquire(a: &str, fp: &str, now: &str, max: &str) -> String {
    format!(
        "({a}.expires_at <= {now} OR (\
            ({a}.fingerprint IS NULL OR {fp} IS NULL OR {a}.fingerprint = {fp}) \
            AND {a}.attempts < {max} \
            AND ({a}.state IN ('released', 'failed_retryable') \
                OR ({a}.state = 'in_progress' AND ({a}.lease_expires_at IS NULL \
                    OR {a}.lease_expires_at <= {now})))))"
    )
}

impl Sql {
    pub(crate) fn new(n: &Names) -> Self {
        let t = &n.qtable;
        // The regclass literal for nextval: the quoted, validated name inside a string literal.
        let seq = format!("'{}'", n.qseq);

        // Acquire: one statement. `old` is the record as this statement's snapshot sees it (with
        // its physical address `ctid`); `up` inserts a fresh record or overwrites the existing
        // one when the contract allows a new acquisition. The overwrite is also conditional on the
        // row it locked being exactly the version `old` read (`r.ctid = old.tid`): so when `up`
        // wrote nothing, `old` is a consistent view and the caller classifies the outcome from
        // it (replay, busy, conflict, exhausted, failed) without a second query. Only when a
        // concurrent writer changed the row between the snapshot and the lock do both disagree;
        // the caller then runs the statement again (see `store.rs`).
        //
        // `set_config('lock_timeout', $7, true)` bounds the wait on a row locked by an open
        // transaction (a holder in in-transaction mode); it is transaction-local, so in autocommit
        // it lasts for this statement only. `clk` is materialized and is the row source of the
        // INSERT, so it runs before any lock is requested.
        //
        // Token order: the overwrite draws its token with its own `nextval` in `DO UPDATE SET`,
        // which runs only once the row lock is held. A token drawn before a wait (the INSERT's
        // `nextval` is evaluated before the conflict check) could be older than the token of a
        // transactional holder that held the lock meanwhile, handed its token to an external
        // system and rolled back; drawn after the lock, the new token is greater than every
        // token any earlier holder of the row could have seen. (The INSERT's value is then
        // unused: the sequence has a gap, which is allowed.) The remaining property of the
        // insert path: a fresh row keeps the token drawn before the insert, so when the insert
        // waited on a concurrent transaction inserting the same key, which then rolled back, the
        // new record's token can be smaller than the rolled-back (never committed) one. Tokens
        // of committed records still strictly increase per key.
        //
        // `up` returns `(xmax = 0) AS inserted`: true for a freshly inserted row, false for an
        // overwritten one (whose new version carries this transaction's lock in `xmax`), so the
        // caller can tell a takeover from an insert even when a concurrent delete removed the
        // record `old` saw.
        //
        // Params: $1 namespace, $2 id, $3 fingerprint, $4 owner, $5 lease (µs), $6 max attempts,
        // $7 lock timeout (ms, as text).
        let gone = "r.expires_at <= excluded.created_at";
        let acquire = format!(
            "WITH clk AS MATERIALIZED (\
                SELECT clock_timestamp() AS now, set_config('lock_timeout', $7::text, true) AS lt), \
             old AS MATERIALIZED (\
                SELECT t.ctid AS tid, {RECORD_COLUMNS}, {old_may} AS may_acquire FROM {t} t, clk \
                WHERE t.namespace = $1::text AND t.id = $2::text), \
             up AS (\
                INSERT INTO {t} AS r (namespace, id, state, fingerprint, token, owner, attempts, \
                    lease_expires_at, result, error, created_at, updated_at, expires_at) \
                SELECT $1::text, $2::text, 'in_progress', $3::bytea, nextval({seq}), $4::text, 1, \
                    clk.now + $5::bigint * interval '1 microsecond', NULL, NULL, clk.now, clk.now, NULL \
                FROM clk \
                WHERE NOT EXISTS (SELECT FROM old) OR (SELECT old.may_acquire FROM old) \
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
                WHERE r.ctid = (SELECT old.tid FROM old) AND {new_may} \
                RETURNING r.token, r.attempts, r.lease_expires_at, (r.xmax = 0) AS inserted) \
             SELECT clk.now, up.token AS new_token, up.attempts AS new_attempts, \
                up.lease_expires_at AS new_lease_expires_at, up.inserted AS new_inserted, \
                old.tid IS NOT NULL AS found, \
                old.state, old.fingerprint, old.token, old.owner, old.attempts, \
                old.lease_expires_at, old.result, old.error, old.created_at, old.updated_at, \
                old.expires_at \
             FROM clk LEFT JOIN old ON true LEFT JOIN up ON true",
            old_may = may_acquire("t", "$3::bytea", "clk.now", "$6::bigint"),
            new_may = may_acquire(
                "r",
                "excluded.fingerprint",
                "excluded.created_at",
                "$6::bigint"
            ),
        );

        // Fenced transitions: one UPDATE guarded by token, state and retention. When it matches
        // nothing, the same statement reports, from its snapshot, the record's current token and
        // state (for `LeaseLost`) and whether the record is exactly what this transition leaves
        // behind under the caller's token (`replayed`: the transition was re-sent after it took
        // effect, which answers `Ok`; the rule of `idem_core::machine::Finish::is_done_in`).
        // `same` is that condition on the record `c`; texts are compared under `COLLATE "C"`,
        // that is byte for byte, whatever the database's collation.
        let fenced = |set: &str, returning: &str, same: &str, extra: &str| {
            format!(
                "WITH clk AS MATERIALIZED (SELECT clock_timestamp() AS now), \
                 upd AS (\
                    UPDATE {t} AS r SET {set} FROM clk \
                    WHERE r.namespace = $1::text AND r.id = $2::text AND r.token = $3::bigint \
                        AND r.state = 'in_progress' AND {live_r} \
                    RETURNING {returning}) \
                 SELECT clk.now, upd.ok IS NOT NULL AS done, upd.lease_expires_at, \
                    cur.token AS current_token, cur.state AS current_state, \
                    COALESCE(cur.replayed, false) AS replayed{extra} \
                 FROM clk LEFT JOIN upd ON true LEFT JOIN LATERAL (\
                    SELECT c.token, c.state, (c.token = $3::bigint AND {same}) AS replayed \
                    FROM {t} c \
                    WHERE c.namespace = $1::text AND c.id = $2::text AND {live_c}) cur ON true",
                live_r = live("r", "clk.now"),
                live_c = live("c", "clk.now"),
            )
        };
        // Params: $1 namespace, $2 id, $3 token, $4 ttl (µs).
        let extend = fenced(
            "lease_expires_at = clk.now + $4::bigint * interval '1 microsecond', \
             updated_at = clk.now",
            "true AS ok, r.lease_expires_at",
            "false",
            "",
        );
        // Params: $1 namespace, $2 id, $3 token, $4 result, $5 retention (µs).
        let complete = fenced(
            "state = 'completed', result = $4::bytea, lease_expires_at = NULL, \
             updated_at = clk.now, expires_at = clk.now + $5::bigint * interval '1 microsecond'",
            "true AS ok, NULL::timestamptz AS lease_expires_at",
            "c.state = 'completed' AND c.result = $4::bytea",
            "",
        );
        // Params: $1 namespace, $2 id, $3 token, $4 error, $5 state (`failed_<kind>`),
        // $6 retention (µs).
        let fail = fenced(
            "state = $5::text, error = $4::text, lease_expires_at = NULL, updated_at = clk.now, \
             expires_at = clk.now + $6::bigint * interval '1 microsecond'",
            "true AS ok, NULL::timestamptz AS lease_expires_at",
            "c.state = $5::text AND c.error COLLATE \"C\" = $4::text COLLATE \"C\"",
            "",
        );
        // Params: $1 namespace, $2 id, $3 token.
        let release = fenced(
            "state = 'released', attempts = GREATEST(r.attempts - 1, 0), \
             lease_expires_at = NULL, updated_at = clk.now",
            "true AS ok, NULL::timestamptz AS lease_expires_at",
            "c.state = 'released'",
            "",
        );
        // `complete_with` (the transactional completion): the `complete` statement, which also
        // arms the guard that follows it in the same transaction (`COMPLETE_WITH_GUARD`): the
        // transaction-local setting `idem.complete_with` is '1' when this statement completed the
        // record, and otherwise a text that cannot be read as an integer, so the guard fails and
        // aborts the transaction before any of the handler's statements runs.
        // Params: as `complete`.
        let complete_with = fenced(
            "state = 'completed', result = $4::bytea, lease_expires_at = NULL, \
             updated_at = clk.now, expires_at = clk.now + $5::bigint * interval '1 microsecond'",
            "true AS ok, NULL::timestamptz AS lease_expires_at",
            "c.state = 'completed' AND c.result = $4::bytea",
            &format!(
                ", set_config('{COMPLETE_WITH_SETTING}', CASE WHEN upd.ok IS NOT NULL THEN '1' \
                 ELSE '{NOT_APPLIED}' END, true) AS armed"
            ),
        );

        // Params: $1 namespace, $2 id.
        let get = format!(
            "SELECT {RECORD_COLUMNS} FROM {t} t \
             WHERE t.namespace = $1::text AND t.id = $2::text AND {}",
            live("t", "clock_timestamp()")
        );
        // Deletes whatever is there; reports whether it was a live record.
        let delete = format!(
            "DELETE FROM {t} t WHERE t.namespace = $1::text AND t.id = $2::text \
             RETURNING {} AS live",
            live("t", "clock_timestamp()")
        );
        // Bounded batch; SKIP LOCKED lets several sweepers (and acquires re-taking an expired
        // key) run at once without waiting on each other. The deadline is a stable InitPlan
        // value, so the partial index on expires_at serves the range scan.
        // Params: $1 limit.
        let purge = format!(
            "WITH clk AS MATERIALIZED (SELECT clock_timestamp() AS now) \
             DELETE FROM {t} t WHERE t.ctid IN (\
                SELECT e.ctid FROM {t} e \
                WHERE e.expires_at <= (SELECT clk.now FROM clk) \
                ORDER BY e.expires_at LIMIT $1::bigint FOR UPDATE SKIP LOCKED)"
        );
        // Transactional mode: after a handler error rolled back the acquisition, counts the
        // attempt as failed, in one statement outside that transaction, when the key is still in
        // the state that allowed the acquisition (otherwise someone else has moved it on and
        // their state stands). A fresh token, drawn in `DO UPDATE SET` after the row lock (as in
        // acquire), keeps tokens strictly increasing.
        //
        // Like acquire, it bounds its wait on a row locked by an open transaction with
        // `set_config('lock_timeout', $9, true)` (statement-local in autocommit): a lock timeout
        // (`55P03`) means someone else holds the key right now, so the attempt is definitely not
        // counted, which the caller reports as "not recorded" rather than waiting until the
        // statement timeout.
        // Params: $1 namespace, $2 id, $3 fingerprint, $4 owner, $5 error, $6 state
        // (`failed_<kind>`), $7 retention (µs), $8 max attempts, $9 lock timeout (ms, as text).
        let record_failure = format!(
            "WITH clk AS MATERIALIZED (\
                SELECT clock_timestamp() AS now, set_config('lock_timeout', $9::text, true) AS lt) \
             INSERT INTO {t} AS r (namespace, id, state, fingerprint, token, owner, attempts, \
                lease_expires_at, result, error, created_at, updated_at, expires_at) \
             SELECT $1::text, $2::text, $6::text, $3::bytea, nextval({seq}), $4::text, 1, NULL, NULL, $5::text, clk.now, clk.now, \
                clk.now + $7::bigint * interval '1 microsecond' \
             FROM clk \
             ON CONFLICT (namespace, id) DO UPDATE SET \
                state = excluded.state, \
                fingerprint = CASE WHEN {gone} THEN excluded.fingerprint ELSE r.fingerprint END, \
                token = nextval({seq}), \
                owner = excluded.owner, \
                attempts = CASE WHEN {gone} THEN 1 ELSE r.attempts + 1 END, \
                lease_expires_at = NULL, \
                result = NULL, \
                error = excluded.error, \
                created_at = CASE WHEN {gone} THEN excluded.created_at ELSE r.created_at END, \
                updated_at = excluded.updated_at, \
                expires_at = excluded.expires_at \
             WHERE {new_may} \
             RETURNING r.attempts",
            new_may = may_acquire(
                "r",
                "excluded.fingerprint",
                "excluded.created_at",
                "$8::bigint"
            ),
        );

        use Type as T;
        Self {
            acquire: Stmt {
                sql: acquire,
                types: &[
                    T::TEXT,
                    T::TEXT,
                    T::BYTEA,
                    T::TEXT,
                    T::INT8,
                    T::INT8,
                    T::TEXT,
                ],
            },
            extend: Stmt {
                sql: extend,
                types: &[T::TEXT, T::TEXT, T::INT8, T::INT8],
            },
            complete: Stmt {
                sql: complete,
                types: &[T::TEXT, T::TEXT, T::INT8, T::BYTEA, T::INT8],
            },
            fail: Stmt {
                sql: fail,
                types: &[T::TEXT, T::TEXT, T::INT8, T::TEXT, T::TEXT, T::INT8],
            },
            release: Stmt {
                sql: release,
                types: &[T::TEXT, T::TEXT, T::INT8],
            },
            get: Stmt {
                sql: get,
                types: &[T::TEXT, T::TEXT],
            },
            delete: Stmt {
                sql: delete,
                types: &[T::TEXT, T::TEXT],
            },
            purge: Stmt {
                sql: purge,
                types: &[T::INT8],
            },
            complete_with: Stmt {
                sql: complete_with,
                types: &[T::TEXT, T::TEXT, T::INT8, T::BYTEA, T::INT8],
            },
            complete_with_guard: Stmt {
                sql: format!(
                    "SELECT current_setting('{COMPLETE_WITH_SETTING}')::integer AS applied"
                ),
                types: &[],
            },
            record_failure: Stmt {
                sql: record_failure,
                types: &[
                    T::TEXT,
                    T::TEXT,
                    T::BYTEA,
                    T::TEXT,
                    T::TEXT,
                    T::TEXT,
                    T::INT8,
                    T::INT8,
                    T::TEXT,
                ],
            },
        }
    }
}
