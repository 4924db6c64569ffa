//! The commands, over any [`IdempotencyStore`]: what they read, what they change, what they
//! print.

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::time::{Duration, SystemTime};

use idem_core::{
    Clock, Cursor, Error, IdempotencyKey, IdempotencyStore, Lease, ListQuery, LostLease, MAX_PAGE,
    Namespace, Record, RecordState, Status,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{Value, json};

use crate::cli::Filters;
use crate::failure::{Code, Failure, prevail};
use crate::open::bounded;
use crate::render;

/// Rows a confirmation question shows before "... and N more".
const PREVIEW_ROWS: usize = 20;

/// What to do before a destructive step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Confirm {
    /// `--yes`: go ahead.
    Yes,
    /// Ask on the terminal (standard error), read the answer from standard input.
    Ask,
    /// No terminal to ask on and no `--yes`: refuse.
    Refuse,
}

/// Everything a command works with.
pub(crate) struct Ctx<'a> {
    pub(crate) store: &'a dyn IdempotencyStore,
    /// The bound on each store call.
    pub(crate) timeout: Duration,
    /// The clock statuses and lease ages are judged on (this machine's).
    pub(crate) clock: &'a dyn Clock,
    pub(crate) out: &'a mut dyn Write,
    pub(crate) err: &'a mut dyn Write,
    pub(crate) json: bool,
    /// Whether to draw progress bars (standard error is a terminal).
    pub(crate) progress: bool,
    pub(crate) confirm: Confirm,
}

/// What happened to one record of a destructive command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    WouldDelete,
    Deleted,
    WouldRelease,
    Released,
    /// Named on the command line but absent.
    NotFound,
    /// Gone since it was listed (deleted, or past retention).
    Gone,
    /// Changed since it was shown: in another state (same token), or no longer matching the
    /// filters.
    Changed,
    /// Its lease was renewed since it was listed (the holder is alive).
    Renewed,
    /// Another acquisition took the key over (the record carries another token).
    TakenOver,
    /// The holder finished it (completed, failed or released) meanwhile.
    Finished,
    /// Not deleted: its lease is live (a worker may be running its handler right now) and
    /// `--include-live` was not given.
    RefusedLive,
}

impl Outcome {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::WouldDelete => "would_delete",
            Self::Deleted => "deleted",
            Self::WouldRelease => "would_release",
            Self::Released => "released",
            Self::NotFound => "not_found",
            Self::Gone => "gone",
            Self::Changed => "changed",
            Self::Renewed => "renewed",
            Self::TakenOver => "taken_over",
            Self::Finished => "finished",
            Self::RefusedLive => "refused_live",
        }
    }
}

impl Ctx<'_> {
    async fn call<T>(&self, fut: impl Future<Output = idem_core::Result<T>>) -> Result<T, Failure> {
        bounded(self.store.name(), self.timeout, fut).await
    }

    /// As [`call`](Self::call), keeping the store's error (a timeout is `Unavailable`).
    async fn call_raw<T>(
        &self,
        fut: impl Future<Output = idem_core::Result<T>>,
    ) -> idem_core::Result<T> {
        tokio::time::timeout(self.timeout, fut)
            .await
            .unwrap_or_else(|_| Err(Error::timed_out(self.store.name(), self.timeout)))
    }

    fn line(&mut self, value: &Value) -> Result<(), Failure> {
        writeln!(self.out, "{value}")?;
        Ok(())
    }

    fn note(&mut self, text: impl std::fmt::Display) -> Result<(), Failure> {
        writeln!(self.err, "{text}")?;
        Ok(())
    }

    /// A spinner (unknown length) or a bar, on standard error when it is a terminal.
    fn progress(&self, len: Option<u64>, message: &str) -> ProgressBar {
        if !self.progress {
            return ProgressBar::hidden();
        }
        let bar = match len {
            Some(len) => ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr())
                .with_style(
                    ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} ({elapsed})")
                        .unwrap_or_else(|_| ProgressStyle::default_bar())
                        .progress_chars("=> "),
                ),
            None => ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()).with_style(
                ProgressStyle::with_template("{spinner} {msg}: {pos} records ({elapsed})")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            ),
        };
        bar.set_message(message.to_owned());
        bar.enable_steady_tick(Duration::from_millis(120));
        bar
    }

    fn ask(&mut self, question: &str) -> Result<bool, Failure> {
        match self.confirm {
            Confirm::Yes => Ok(true),
            Confirm::Refuse => Err(Failure::usage(format!(
                "refusing to {question} without confirmation: standard input is not a terminal; \
                 pass --yes to go ahead (or --dry-run to only show)"
            ))),
            Confirm::Ask => {
                write!(self.err, "{question}? [y/N] ")?;
                self.err.flush()?;
                let mut answer = String::new();
                std::io::stdin().lock().read_line(&mut answer)?;
                Ok(matches!(
                    answer.trim().to_ascii_lowercase().as_str(),
                    "y" | "yes"
                ))
            }
        }
    }

    /// Lists `query`'s records page after page until `max` records (all when `None`); returns
    /// where the listing stopped (`None`: at its end).
    async fn scan(
        &mut self,
        mut query: ListQuery,
        max: Option<u64>,
        mut each: impl FnMut(&mut Self, Record) -> Result<(), Failure>,
    ) -> Result<Option<Cursor>, Failure> {
        let bar = self.progress(None, &format!("listing {}", query.namespace.as_str()));
        let mut seen = 0u64;
        let result = loop {
            let want = max.map_or(MAX_PAGE as u64, |max| {
                max.saturating_sub(seen).min(MAX_PAGE as u64)
            });
            query.limit = usize::try_from(want).unwrap_or(MAX_PAGE);
            let page = match self.call(self.store.list(&query)).await {
                Ok(page) => page,
                Err(e) => break Err(e),
            };
            seen += page.records.len() as u64;
            bar.inc(page.records.len() as u64);
            if let Err(e) = page.records.into_iter().try_for_each(|r| each(self, r)) {
                break Err(e);
            }
            match page.next {
                Some(next) if max.is_none_or(|max| seen < max) => query.cursor = Some(next),
                next => break Ok(next),
            }
        };
        bar.finish_and_clear();
        result
    }
}

fn namespace(name: &str) -> Result<Namespace, Failure> {
    Ok(Namespace::new(name)?)
}

fn query(namespace: Namespace, filters: &Filters) -> ListQuery {
    let mut q = ListQuery::new(namespace)
        .with_statuses(filters.status.iter().copied())
        .with_max_attempts(filters.max_attempts);
    if let Some(age) = filters.older_than {
        q = q.with_min_age(age);
    }
    if let Some(owner) = &filters.owner {
        q = q.with_owner(owner.clone());
    }
    q
}

/// `idem get`.
pub(crate) async fn get(
    ctx: &mut Ctx<'_>,
    ns: &str,
    id: &str,
    max_attempts: u32,
) -> Result<(), Failure> {
    let key = namespace(ns)?.key(id)?;
    let Some(record) = ctx.call(ctx.store.get(&key)).await? else {
        return Err(Failure::not_found(format!(
            "no record {ns}/{} (never written, deleted, or past retention)",
            render::shown_id(id)
        )));
    };
    let now = ctx.clock.now();
    let status = Status::of(&record, now, max_attempts);
    if ctx.json {
        ctx.line(&render::record_json(&record, status))
    } else {
        write!(ctx.out, "{}", render::record_table(&record, status, now))?;
        Ok(())
    }
}

/// `idem list`.
pub(crate) async fn list(
    ctx: &mut Ctx<'_>,
    ns: &str,
    filters: &Filters,
    limit: Option<u64>,
    cursor: Option<String>,
) -> Result<(), Failure> {
    let max_attempts = filters.max_attempts;
    let query = query(namespace(ns)?, filters).with_cursor(cursor.map(Cursor::new));
    let mut rows = Vec::new();
    let next = ctx
        .scan(query, limit, |ctx, record| {
            let now = ctx.clock.now();
            let status = Status::of(&record, now, max_attempts);
            if ctx.json {
                ctx.line(&render::record_json(&record, status))
            } else {
                rows.push(render::list_row(&record, status, now));
                Ok(())
            }
        })
        .await?;
    if !ctx.json {
        if rows.is_empty() {
            ctx.note(format!("no matching records in namespace {ns}"))?;
        } else {
            write!(ctx.out, "{}", render::list_table(rows))?;
        }
    }
    if let Some(next) = next {
        if ctx.json {
            ctx.line(&json!({"next_cursor": next.as_str()}))?;
        } else {
            ctx.note(format!(
                "more records follow: add --cursor '{}' (with the same filters), or use --all",
                next.as_str().replace('\'', "'\\''")
            ))?;
        }
    }
    Ok(())
}

/// `idem stats`.
pub(crate) async fn stats(
    ctx: &mut Ctx<'_>,
    namespaces: &[String],
    max_attempts: u32,
) -> Result<(), Failure> {
    let namespaces: Vec<Namespace> = namespaces
        .iter()
        .map(|n| namespace(n))
        .collect::<Result<_, _>>()?;
    let mut table = render::table(
        &["NAMESPACE"]
            .into_iter()
            .chain(Status::ALL.map(Status::name))
            .chain(["total"])
            .collect::<Vec<_>>(),
    );
    for ns in namespaces {
        let mut counts: BTreeMap<Status, u64> = Status::ALL.into_iter().map(|s| (s, 0)).collect();
        let query = ListQuery::new(ns.clone()).with_max_attempts(max_attempts);
        ctx.scan(query, None, |ctx, record| {
            let status = Status::of(&record, ctx.clock.now(), max_attempts);
            *counts.entry(status).or_default() += 1;
            Ok(())
        })
        .await?;
        let total: u64 = counts.values().sum();
        if ctx.json {
            let mut line = serde_json::Map::new();
            line.insert("namespace".into(), ns.as_str().into());
            for (status, n) in &counts {
                line.insert(status.name().into(), (*n).into());
            }
            line.insert("total".into(), total.into());
            ctx.line(&Value::Object(line))?;
        } else {
            let mut row = vec![ns.as_str().to_owned()];
            row.extend(counts.values().map(u64::to_string));
            row.push(total.to_string());
            table.add_row(row);
        }
    }
    if !ctx.json {
        for i in 1..=Status::ALL.len() + 1 {
            render::right_align(&mut table, i);
        }
        write!(ctx.out, "{}", render::lines(&table))?;
    }
    Ok(())
}

/// Prints what a destructive command did (or would do), one row or line per record, with
/// the record's status (judged with the consumers' `max_attempts`), which tells a live lease
/// (`in_progress`) from an expired one (`lease_expired`).
fn report(ctx: &mut Ctx<'_>, done: &[(Record, Outcome)], max_attempts: u32) -> Result<(), Failure> {
    let now = ctx.clock.now();
    if ctx.json {
        for (record, outcome) in done {
            let status = Status::of(record, now, max_attempts);
            let mut value = render::record_json(record, status);
            if let Value::Object(map) = &mut value {
                map.insert("outcome".into(), outcome.name().into());
            }
            ctx.line(&value)?;
        }
        return Ok(());
    }
    if done.is_empty() {
        return Ok(());
    }
    let rows = done
        .iter()
        .map(|(record, outcome)| (record, outcome.name()));
    write!(ctx.out, "{}", outcome_table(rows, now, max_attempts))?;
    Ok(())
}

fn outcome_table<'r>(
    rows: impl Iterator<Item = (&'r Record, &'r str)>,
    now: SystemTime,
    max_attempts: u32,
) -> String {
    let mut t = render::table(&[
        "ID", "STATUS", "STATE", "ATTEMPTS", "OWNER", "TOKEN", "UPDATED", "OUTCOME",
    ]);
    for (record, outcome) in rows {
        t.add_row(vec![
            render::shown_id(record.key.id()),
            Status::of(record, now, max_attempts).name().to_owned(),
            record.state.name().to_owned(),
            record.attempts.to_string(),
            render::shown_id(&record.owner),
            record.token.to_string(),
            render::relative(record.updated_at, now),
            outcome.to_owned(),
        ]);
    }
    render::right_align(&mut t, 3);
    render::lines(&t)
}

/// Shows the records about to change (and those `kept`, refused for their live lease) and
/// asks (unless `--yes`).
fn confirm(
    ctx: &mut Ctx<'_>,
    records: &[Record],
    kept: &[Record],
    verb: &str,
    ns: &str,
    max_attempts: u32,
) -> Result<bool, Failure> {
    if ctx.confirm == Confirm::Ask {
        let now = ctx.clock.now();
        let label = format!("to {verb}");
        let refused = Outcome::RefusedLive.name();
        let rows = records
            .iter()
            .map(|r| (r, label.as_str()))
            .chain(kept.iter().map(|r| (r, refused)))
            .take(PREVIEW_ROWS);
        write!(ctx.err, "{}", outcome_table(rows, now, max_attempts))?;
        let all = records.len() + kept.len();
        if all > PREVIEW_ROWS {
            ctx.note(format!("... and {} more", all - PREVIEW_ROWS))?;
        }
    }
    let noun = if records.len() == 1 {
        "record"
    } else {
        "records"
    };
    let yes = ctx.ask(&format!(
        "{verb} {} {noun} of namespace {ns}",
        records.len()
    ))?;
    if !yes {
        ctx.note("nothing done")?;
    }
    Ok(yes)
}

/// Tells what a destructive command did: a summary on standard error.
fn summary(ctx: &mut Ctx<'_>, done: &[(Record, Outcome)]) -> Result<(), Failure> {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for (_, outcome) in done {
        *counts.entry(outcome.name()).or_default() += 1;
    }
    if counts.is_empty() {
        return ctx.note("nothing matched");
    }
    let parts: Vec<String> = counts
        .iter()
        .map(|(name, n)| format!("{n} {name}"))
        .collect();
    ctx.note(parts.join(", "))
}

/// Runs `step` on each record with a progress bar; on a failure, reports what was done first.
async fn each_record<F>(
    ctx: &mut Ctx<'_>,
    records: Vec<Record>,
    message: &str,
    max_attempts: u32,
    mut step: F,
) -> Result<Vec<(Record, Outcome)>, Failure>
where
    F: AsyncFnMut(&mut Ctx<'_>, &Record) -> Result<(Record, Outcome), Failure>,
{
    let bar = ctx.progress(Some(records.len() as u64), message);
    let mut done = Vec::with_capacity(records.len());
    for record in &records {
        match step(ctx, record).await {
            Ok(one) => done.push(one),
            Err(e) => {
                bar.finish_and_clear();
                // Tell what was done before the failure, as far as the output lets us: the
                // summary goes to standard error even when standard output is a closed pipe,
                // and the store's failure is the one the command ends with, whatever writing
                // these did.
                let reported = report(ctx, &done, max_attempts);
                let written = prevail(reported, summary(ctx, &done));
                return Err(match written {
                    Err(w) if e.code == Code::Ok => w,
                    _ => e,
                });
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(done)
}

/// Whether `record`'s lease is live at `now`: its status is `in_progress` (not
/// `lease_expired` or `exhausted`), so its holder may be running the handler right now.
fn live(record: &Record, now: SystemTime) -> bool {
    Status::of(record, now, u32::MAX) == Status::InProgress
}

/// Why `current`, the record read again just before its delete, must not be deleted (`None`:
/// it may be): it is no longer the record the operator was `shown` (another token: taken over;
/// another state, or no longer matching the filters: changed), or its lease is live and
/// `include_live` was not given.
fn recheck(
    shown: &Record,
    current: &Record,
    still_matches: bool,
    include_live: bool,
    now: SystemTime,
) -> Option<Outcome> {
    if current.token != shown.token {
        Some(Outcome::TakenOver)
    } else if current.state != shown.state || !still_matches {
        Some(Outcome::Changed)
    } else if !include_live && live(current, now) {
        Some(Outcome::RefusedLive)
    } else {
        None
    }
}

/// Reads `shown` again and deletes it if it is still the record shown (see [`recheck`]);
/// returns the record as read again (the one deleted) and the outcome.
///
/// The store has no delete conditional on the token, so a record that changes in the one round
/// trip between this read and the delete is deleted all the same (its holder is then fenced).
async fn delete_one(
    ctx: &mut Ctx<'_>,
    shown: &Record,
    query: Option<&ListQuery>,
    include_live: bool,
) -> Result<(Record, Outcome), Failure> {
    let Some(current) = ctx.call(ctx.store.get(&shown.key)).await? else {
        return Ok((shown.clone(), Outcome::Gone));
    };
    let now = ctx.clock.now();
    let still_matches = query.is_none_or(|q| q.matches(&current, now));
    if let Some(skip) = recheck(shown, &current, still_matches, include_live, now) {
        return Ok((current, skip));
    }
    let deleted = ctx.call(ctx.store.delete(&current.key)).await?;
    let outcome = if deleted {
        Outcome::Deleted
    } else {
        Outcome::Gone
    };
    Ok((current, outcome))
}

/// What `delete` does with the records it found: shows them, asks, deletes each one still the
/// same (see [`delete_one`]), and refuses those with a live lease unless `include_live`.
/// Returns what happened to each, or `None` when the operator said no.
async fn delete_found(
    ctx: &mut Ctx<'_>,
    ns: &str,
    found: Vec<Record>,
    query: Option<&ListQuery>,
    max_attempts: u32,
    include_live: bool,
    dry_run: bool,
) -> Result<Option<Vec<(Record, Outcome)>>, Failure> {
    let now = ctx.clock.now();
    let (kept, found): (Vec<Record>, Vec<Record>) = found
        .into_iter()
        .partition(|r| !include_live && live(r, now));
    let live_ones = found.iter().filter(|r| live(r, now)).count();
    if live_ones > 0 && !dry_run {
        ctx.note(format!(
            "warning: {live_ones} of the records to delete hold a live lease (--include-live): \
             a redelivery can run their handler again while the holder may still be running it \
             (the holder is fenced only when it finishes, after its effect)"
        ))?;
    }
    let mut done: Vec<(Record, Outcome)> = if dry_run {
        found
            .into_iter()
            .map(|r| (r, Outcome::WouldDelete))
            .collect()
    } else if found.is_empty() {
        Vec::new()
    } else if !confirm(ctx, &found, &kept, "delete", ns, max_attempts)? {
        return Ok(None);
    } else {
        each_record(ctx, found, "deleting", max_attempts, async |ctx, shown| {
            delete_one(ctx, shown, query, include_live).await
        })
        .await?
    };
    done.extend(kept.into_iter().map(|r| (r, Outcome::RefusedLive)));
    Ok(Some(done))
}

/// The failure a delete ends with when it left records with a live lease alone (exit code 2,
/// as for a destructive step refused without its flag); the other records were handled.
fn refusal(done: &[(Record, Outcome)], ns: &str, dry_run: bool) -> Result<(), Failure> {
    let n = done
        .iter()
        .filter(|(_, outcome)| *outcome == Outcome::RefusedLive)
        .count();
    if n == 0 {
        return Ok(());
    }
    let (records, them) = if n == 1 {
        ("record", "it")
    } else {
        ("records", "them")
    };
    let what = if dry_run {
        "would refuse to delete"
    } else {
        "refused to delete"
    };
    Err(Failure::usage(format!(
        "{what} {n} {records} of namespace {ns} whose lease is live (in_progress: a worker may \
         be running the handler right now, and a redelivery would run it again): pass \
         --include-live to delete {them} too"
    )))
}

/// `idem delete NAMESPACE ID...`.
pub(crate) async fn delete_ids(
    ctx: &mut Ctx<'_>,
    ns: &str,
    ids: &[String],
    max_attempts: u32,
    include_live: bool,
    dry_run: bool,
) -> Result<(), Failure> {
    let namespace = namespace(ns)?;
    let keys: Vec<IdempotencyKey> = ids
        .iter()
        .map(|id| namespace.key(id))
        .collect::<Result<_, _>>()?;
    let mut present = Vec::new();
    let mut missing = Vec::new();
    for key in keys {
        match ctx.call(ctx.store.get(&key)).await? {
            Some(record) => present.push(record),
            None => missing.push(key),
        }
    }
    if !ctx.json {
        for key in &missing {
            ctx.note(format!("not found: {ns}/{}", render::shown_id(key.id())))?;
        }
    }
    let found = delete_found(ctx, ns, present, None, max_attempts, include_live, dry_run).await?;
    let done = found.unwrap_or_default();
    let mut written = report(ctx, &done, max_attempts);
    if ctx.json {
        for key in &missing {
            let line =
                json!({"namespace": ns, "id": key.id(), "outcome": Outcome::NotFound.name()});
            written = written.and_then(|()| ctx.line(&line));
        }
    }
    if !done.is_empty() {
        written = prevail(written, summary(ctx, &done));
    }
    let verdict = refusal(&done, ns, dry_run).and_then(|()| {
        if missing.is_empty() {
            Ok(())
        } else {
            Err(Failure::silent(Code::NotFound))
        }
    });
    prevail(verdict, written)
}

/// `idem delete NAMESPACE --status ...`: every record matching the filters.
pub(crate) async fn delete_matching(
    ctx: &mut Ctx<'_>,
    ns: &str,
    filters: &Filters,
    include_live: bool,
    dry_run: bool,
) -> Result<(), Failure> {
    if !filters.any() {
        return Err(Failure::usage(
            "name the ids to delete, or select records with --status, --older-than or --owner",
        ));
    }
    let query = query(namespace(ns)?, filters);
    let mut found = Vec::new();
    ctx.scan(query.clone(), None, |_, record| {
        found.push(record);
        Ok(())
    })
    .await?;
    let max_attempts = filters.max_attempts;
    let Some(done) = delete_found(
        ctx,
        ns,
        found,
        Some(&query),
        max_attempts,
        include_live,
        dry_run,
    )
    .await?
    else {
        return Ok(());
    };
    let written = prevail(report(ctx, &done, max_attempts), summary(ctx, &done));
    prevail(refusal(&done, ns, dry_run), written)
}

/// Whether `record` is in progress with a lease that ended at least `age` before `now`.
fn stuck(record: &Record, now: SystemTime, age: Duration) -> bool {
    matches!(record.state, RecordState::InProgress)
        && record
            .lease_expires_at
            .is_some_and(|end| now.duration_since(end).is_ok_and(|since| since >= age))
}

/// `idem release-stuck`.
pub(crate) async fn release_stuck(
    ctx: &mut Ctx<'_>,
    ns: &str,
    older_than: Duration,
    owner: Option<&str>,
    max_attempts: u32,
    dry_run: bool,
) -> Result<(), Failure> {
    let mut query = ListQuery::new(namespace(ns)?)
        .with_statuses([Status::LeaseExpired])
        .with_max_attempts(max_attempts)
        // A lease that ended `older_than` ago was last renewed at least that long ago.
        .with_min_age(older_than);
    if let Some(owner) = owner {
        query = query.with_owner(owner);
    }
    let mut found = Vec::new();
    ctx.scan(query, None, |ctx, record| {
        if stuck(&record, ctx.clock.now(), older_than) {
            found.push(record);
        }
        Ok(())
    })
    .await?;
    let done = if dry_run {
        found
            .into_iter()
            .map(|r| (r, Outcome::WouldRelease))
            .collect()
    } else if found.is_empty() || !confirm(ctx, &found, &[], "release", ns, max_attempts)? {
        Vec::new()
    } else {
        each_record(
            ctx,
            found,
            "releasing",
            max_attempts,
            async |ctx, listed| release_one(ctx, listed, older_than).await,
        )
        .await?
    };
    report(ctx, &done, max_attempts)?;
    summary(ctx, &done)
}

/// Releases one listed lease if it is still the same lease, still expired long enough.
async fn release_one(
    ctx: &mut Ctx<'_>,
    listed: &Record,
    older_than: Duration,
) -> Result<(Record, Outcome), Failure> {
    let Some(current) = ctx.call(ctx.store.get(&listed.key)).await? else {
        return Ok((listed.clone(), Outcome::Gone));
    };
    if current.token != listed.token {
        return Ok((current, Outcome::TakenOver));
    }
    if !matches!(current.state, RecordState::InProgress) {
        return Ok((current, Outcome::Finished));
    }
    if current.lease_expires_at != listed.lease_expires_at
        || !stuck(&current, ctx.clock.now(), older_than)
    {
        return Ok((current, Outcome::Renewed));
    }
    let Some(expires_at) = current.lease_expires_at else {
        return Ok((current, Outcome::Changed));
    };
    let lease = Lease {
        key: current.key.clone(),
        owner: current.owner.clone(),
        token: current.token,
        attempt: current.attempts,
        expires_at,
    };
    // Fenced by the token: if the key was taken over since the read above, this is refused.
    match ctx.call_raw(ctx.store.release(&lease)).await {
        Ok(()) => Ok((current, Outcome::Released)),
        Err(Error::LeaseLost { why, .. }) => {
            let outcome = match why {
                LostLease::Superseded { .. } => Outcome::TakenOver,
                LostLease::NotInProgress { .. } => Outcome::Finished,
                _ => Outcome::Gone,
            };
            Ok((current, outcome))
        }
        Err(e) => Err(e.into()),
    }
}

/// `idem purge`.
pub(crate) async fn purge(ctx: &mut Ctx<'_>, batch: u64, max: Option<u64>) -> Result<(), Failure> {
    let name = ctx.store.name();
    let bar = ctx.progress(max, "purging expired records");
    let mut purged = 0u64;
    let result = loop {
        let want = max.map_or(batch, |max| batch.min(max.saturating_sub(purged)));
        let limit = usize::try_from(want).unwrap_or(usize::MAX);
        match ctx.call(ctx.store.purge_expired(limit)).await {
            Ok(n) => {
                purged += n;
                bar.inc(n);
                if n < want || max.is_some_and(|max| purged >= max) {
                    break Ok(());
                }
            }
            Err(e) => break Err(e),
        }
    };
    bar.finish_and_clear();
    if let Err(e) = result {
        // No success-shaped report for a failed run: only what it removed before failing.
        if purged > 0 {
            ctx.note(format!(
                "purged {purged} expired records before the failure below"
            ))?;
        }
        return Err(e);
    }
    if ctx.json {
        ctx.line(&json!({"store": name, "purged": purged}))?;
    } else {
        writeln!(ctx.out, "purged {purged} expired records")?;
        if matches!(name, "redis" | "redis-cluster" | "dynamo") {
            ctx.note(format!(
                "{name} removes expired records by itself (key expiry / TTL): there is never \
                 anything to purge"
            ))?;
        }
    }
    Ok(())
}

/// Flushes standard output at the end of a command: a failure to write it (a reader gone
/// away) never hides the command's own failure.
pub(crate) fn finish(out: &mut dyn Write, result: Result<(), Failure>) -> Result<(), Failure> {
    let flushed = out.flush().map_err(Failure::from);
    prevail(result, flushed)
}

#[cfg(test)]
mod tests;
