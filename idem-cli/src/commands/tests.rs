//! The commands in-process, on a `MemoryStore` with a manual clock: paging, counting, and the
//! races `release-stuck` and `delete` must survive.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, FailureKind, IdempotencyKey, Lease, Limits, ManualClock,
    MemoryStore, Page, SystemClock,
};
use serde_json::Value;

use super::*;
use crate::cli::Filters;

const LONG: Duration = Duration::from_secs(86_400);

fn ns() -> Namespace {
    Namespace::new("orders").unwrap()
}

fn filters(status: &[Status]) -> Filters {
    Filters {
        status: status.to_vec(),
        older_than: None,
        owner: None,
        max_attempts: 5,
    }
}

/// What a command printed and how it ended.
struct Ran {
    out: String,
    err: String,
    result: Result<(), Failure>,
}

impl Ran {
    fn json(&self) -> Vec<Value> {
        self.out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    }

    fn ok(self) -> Self {
        if let Err(e) = &self.result {
            panic!("{e:?}\nout: {}\nerr: {}", self.out, self.err);
        }
        self
    }
}

async fn run<F>(
    store: &dyn IdempotencyStore,
    clock: &dyn Clock,
    json: bool,
    confirm: Confirm,
    f: F,
) -> Ran
where
    F: AsyncFnOnce(&mut Ctx<'_>) -> Result<(), Failure>,
{
    let mut out = Vec::new();
    let mut err = Vec::new();
    let mut ctx = Ctx {
        store,
        timeout: Duration::from_secs(5),
        clock,
        out: &mut out,
        err: &mut err,
        json,
        progress: false,
        confirm,
    };
    let result = f(&mut ctx).await;
    Ran {
        out: String::from_utf8(out).unwrap(),
        err: String::from_utf8(err).unwrap(),
        result,
    }
}

async fn acquire(store: &dyn IdempotencyStore, id: &str, owner: &str, ttl: Duration) -> Lease {
    let req = AcquireRequest::new(ns().key(id).unwrap(), owner).with_lease_ttl(ttl);
    match store.acquire(&req).await.unwrap() {
        AcquireOutcome::Acquired { lease, .. } => lease,
        other => panic!("{id}: {other:?}"),
    }
}

/// A store with a record in every status; returns the clock and the stuck lease.
async fn populated() -> (Arc<ManualClock>, MemoryStore, Lease) {
    let clock = Arc::new(ManualClock::new(
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
    ));
    let store = MemoryStore::with_clock(clock.clone());
    let done = acquire(&store, "done", "w1", LONG).await;
    store
        .complete(&done, Bytes::from_static(b"ok"), LONG)
        .await
        .unwrap();
    let bin = acquire(&store, "bin", "w1", LONG).await;
    store
        .complete(&bin, Bytes::from_static(&[0, 0xff]), LONG)
        .await
        .unwrap();
    let term = acquire(&store, "terminal", "w2", LONG).await;
    store
        .fail(&term, "card declined", FailureKind::Terminal, LONG)
        .await
        .unwrap();
    let retry = acquire(&store, "retryable", "w2", LONG).await;
    store
        .fail(&retry, "timeout", FailureKind::Retryable, LONG)
        .await
        .unwrap();
    let stuck = acquire(&store, "stuck", "w3", Duration::from_secs(30)).await;
    clock.advance(Duration::from_secs(600));
    acquire(&store, "live", "w4", Duration::from_secs(300)).await;
    (clock, store, stuck)
}

#[tokio::test]
async fn get_shows_every_field_and_the_result_as_text_or_hex() {
    let (clock, store, _) = populated().await;
    let ran = run(&store, &*clock, true, Confirm::Refuse, async |ctx| {
        get(ctx, "orders", "bin", 5).await
    })
    .await
    .ok();
    let record = &ran.json()[0];
    assert_eq!(record["result"], "00ff");
    assert_eq!(record["result_encoding"], "hex");
    assert_eq!(record["result_len"], 2);
    assert_eq!(record["status"], "completed");
    let ran = run(&store, &*clock, false, Confirm::Refuse, async |ctx| {
        get(ctx, "orders", "terminal", 5).await
    })
    .await
    .ok();
    for needle in [
        "card declined",
        "failed_terminal",
        "terminal",
        "w2",
        "expires_at",
    ] {
        assert!(ran.out.contains(needle), "{needle}: {}", ran.out);
    }
    let ran = run(&store, &*clock, false, Confirm::Refuse, async |ctx| {
        get(ctx, "orders", "nope", 5).await
    })
    .await;
    assert_eq!(ran.result.unwrap_err().code, Code::NotFound);
}

#[tokio::test]
async fn list_pages_with_the_cursor_and_filters_by_status() {
    let (clock, store, _) = populated().await;
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let f = filters(&[]);
        let c = cursor.take();
        let ran = run(&store, &*clock, true, Confirm::Refuse, async |ctx| {
            list(ctx, "orders", &f, Some(2), c).await
        })
        .await
        .ok();
        let lines = ran.json();
        for line in &lines {
            match line.get("next_cursor") {
                Some(next) => cursor = Some(next.as_str().unwrap().to_owned()),
                None => seen.push(line["id"].as_str().unwrap().to_owned()),
            }
        }
        assert!(
            lines.iter().filter(|l| l.get("id").is_some()).count() <= 2,
            "{lines:?}"
        );
        if cursor.is_none() {
            break;
        }
    }
    seen.sort();
    assert_eq!(
        seen,
        ["bin", "done", "live", "retryable", "stuck", "terminal"]
    );

    let f = filters(&[Status::LeaseExpired, Status::FailedTerminal]);
    let ran = run(&store, &*clock, false, Confirm::Refuse, async |ctx| {
        list(ctx, "orders", &f, None, None).await
    })
    .await
    .ok();
    let rows: Vec<&str> = ran.out.lines().skip(1).collect();
    assert_eq!(rows.len(), 2, "{}", ran.out);
    assert!(ran.out.contains("lease expired 9m 30s ago"), "{}", ran.out);
    assert!(
        rows.iter().any(|r| r.starts_with("terminal ")),
        "{}",
        ran.out
    );
}

#[tokio::test]
async fn stats_count_every_status() {
    let (clock, store, _) = populated().await;
    let names = vec!["orders".to_owned(), "empty".to_owned()];
    let ran = run(&store, &*clock, true, Confirm::Refuse, async |ctx| {
        stats(ctx, &names, 5).await
    })
    .await
    .ok();
    let lines = ran.json();
    assert_eq!(lines[0]["namespace"], "orders");
    assert_eq!(lines[0]["completed"], 2);
    assert_eq!(lines[0]["failed_terminal"], 1);
    assert_eq!(lines[0]["failed_retryable"], 1);
    assert_eq!(lines[0]["lease_expired"], 1);
    assert_eq!(lines[0]["in_progress"], 1);
    assert_eq!(lines[0]["total"], 6);
    assert_eq!(lines[1]["total"], 0);
    // With at most one attempt, the retryable failure and the stuck lease are exhausted.
    let ran = run(&store, &*clock, true, Confirm::Refuse, async |ctx| {
        stats(ctx, &names[..1], 1).await
    })
    .await
    .ok();
    assert_eq!(ran.json()[0]["exhausted"], 2);
}

#[tokio::test]
async fn release_stuck_releases_only_leases_expired_long_enough() {
    let (clock, store, stuck) = populated().await;
    // Its lease ended 570 s ago: not "older than" 10 minutes.
    let ran = run(&store, &*clock, true, Confirm::Yes, async |ctx| {
        release_stuck(ctx, "orders", Duration::from_secs(600), None, 5, false).await
    })
    .await
    .ok();
    assert!(ran.out.is_empty(), "{}", ran.out);
    // Refused without confirmation, and nothing changes.
    let ran = run(&store, &*clock, true, Confirm::Refuse, async |ctx| {
        release_stuck(ctx, "orders", Duration::from_secs(60), None, 5, false).await
    })
    .await;
    assert_eq!(ran.result.unwrap_err().code, Code::Usage);
    let ran = run(&store, &*clock, true, Confirm::Refuse, async |ctx| {
        release_stuck(ctx, "orders", Duration::from_secs(60), None, 5, true).await
    })
    .await
    .ok();
    assert_eq!(ran.json()[0]["outcome"], "would_release");
    assert_eq!(
        store.get(&stuck.key).await.unwrap().unwrap().state,
        RecordState::InProgress
    );
    // Another owner's filter finds nothing.
    let ran = run(&store, &*clock, true, Confirm::Yes, async |ctx| {
        release_stuck(ctx, "orders", Duration::from_secs(60), Some("w4"), 5, false).await
    })
    .await
    .ok();
    assert!(ran.out.is_empty(), "{}", ran.out);

    let ran = run(&store, &*clock, true, Confirm::Yes, async |ctx| {
        release_stuck(ctx, "orders", Duration::from_secs(60), None, 5, false).await
    })
    .await
    .ok();
    let lines = ran.json();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["id"], "stuck");
    assert_eq!(lines[0]["outcome"], "released");
    // The record's fields in their usual order (with its status), the outcome last.
    let fields: Vec<&str> = lines[0]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        fields[..4],
        ["namespace", "id", "status", "state"],
        "{fields:?}"
    );
    assert_eq!(
        fields[fields.len() - 2..],
        ["failure_kind", "outcome"],
        "{fields:?}"
    );
    let after = store.get(&stuck.key).await.unwrap().unwrap();
    assert_eq!(after.state, RecordState::Released);
    let live = store
        .get(&ns().key("live").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        live.state,
        RecordState::InProgress,
        "the live lease is untouched"
    );
}

/// What happens to the store between the command's listing and its actions.
enum Race {
    /// Another worker takes the key over right after the command read it again.
    TakeOverAfterGet(AcquireRequest),
    /// The holder renews its lease right after the command read it again.
    ExtendAfterGet(Lease),
    /// The holder renews its lease right after the listing.
    ExtendAfterList(Lease),
    /// The holder completes the record right after the command read it.
    CompleteAfterGet(Lease),
}

/// A `MemoryStore` on which one race happens at the chosen moment.
struct Racy {
    inner: MemoryStore,
    race: Mutex<Option<Race>>,
    /// How many deletes succeed before every later one fails (`None`: none fails).
    deletes_before_failing: Mutex<Option<usize>>,
}

impl std::fmt::Debug for Racy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Racy")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl Racy {
    fn new(inner: MemoryStore, race: Race) -> Self {
        Self {
            inner,
            race: Mutex::new(Some(race)),
            deletes_before_failing: Mutex::new(None),
        }
    }

    /// A store on which no race happens and the delete after the first `n` fails.
    fn failing_deletes_after(inner: MemoryStore, n: usize) -> Self {
        Self {
            inner,
            race: Mutex::new(None),
            deletes_before_failing: Mutex::new(Some(n)),
        }
    }

    /// The race due at this moment (after a listing, or after a read), if any.
    fn take(&self, after_list: bool) -> Option<Race> {
        let mut slot = self.race.lock().unwrap();
        let is_list_race = matches!(*slot, Some(Race::ExtendAfterList(_)));
        if slot.is_some() && is_list_race == after_list {
            slot.take()
        } else {
            None
        }
    }

    async fn happen(&self, race: Race) {
        match race {
            Race::TakeOverAfterGet(req) => {
                let outcome = self.inner.acquire(&req).await.unwrap();
                assert!(
                    matches!(outcome, AcquireOutcome::Acquired { .. }),
                    "{outcome:?}"
                );
            }
            Race::ExtendAfterGet(lease) | Race::ExtendAfterList(lease) => {
                self.inner
                    .extend(&lease, Duration::from_secs(300))
                    .await
                    .unwrap();
            }
            Race::CompleteAfterGet(lease) => {
                self.inner
                    .complete(&lease, Bytes::from_static(b"charged"), LONG)
                    .await
                    .unwrap();
            }
        }
    }
}

#[async_trait]
impl IdempotencyStore for Racy {
    fn name(&self) -> &'static str {
        "racy"
    }
    fn limits(&self) -> Limits {
        self.inner.limits()
    }
    async fn acquire(&self, req: &AcquireRequest) -> idem_core::Result<AcquireOutcome> {
        self.inner.acquire(req).await
    }
    async fn extend(&self, lease: &Lease, ttl: Duration) -> idem_core::Result<Lease> {
        self.inner.extend(lease, ttl).await
    }
    async fn complete(
        &self,
        lease: &Lease,
        result: Bytes,
        retention: Duration,
    ) -> idem_core::Result<()> {
        self.inner.complete(lease, result, retention).await
    }
    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> idem_core::Result<()> {
        self.inner.fail(lease, error, kind, retention).await
    }
    async fn release(&self, lease: &Lease) -> idem_core::Result<()> {
        self.inner.release(lease).await
    }
    async fn get(&self, key: &IdempotencyKey) -> idem_core::Result<Option<Record>> {
        let record = self.inner.get(key).await;
        if let Some(race) = self.take(false) {
            self.happen(race).await;
        }
        record
    }
    async fn delete(&self, key: &IdempotencyKey) -> idem_core::Result<bool> {
        let fail = match &mut *self.deletes_before_failing.lock().unwrap() {
            Some(0) => true,
            Some(n) => {
                *n -= 1;
                false
            }
            None => false,
        };
        if fail {
            return Err(Error::unavailable("racy", "connection reset by peer"));
        }
        self.inner.delete(key).await
    }
    async fn list(&self, query: &ListQuery) -> idem_core::Result<Page> {
        let page = self.inner.list(query).await;
        if let Some(race) = self.take(true) {
            self.happen(race).await;
        }
        page
    }
    async fn purge_expired(&self, limit: usize) -> idem_core::Result<u64> {
        self.inner.purge_expired(limit).await
    }
}

async fn release_with(store: &Racy, clock: &ManualClock) -> Vec<Value> {
    run(store, clock, true, Confirm::Yes, async |ctx| {
        release_stuck(ctx, "orders", Duration::from_secs(60), None, 5, false).await
    })
    .await
    .ok()
    .json()
}

#[tokio::test]
async fn a_key_taken_over_during_release_stuck_is_never_released() {
    let (clock, inner, stuck) = populated().await;
    let takeover = AcquireRequest::new(stuck.key.clone(), "w9");
    let store = Racy::new(inner, Race::TakeOverAfterGet(takeover));
    let lines = release_with(&store, &clock).await;
    assert_eq!(lines[0]["outcome"], "taken_over", "{lines:?}");
    let after = store.get(&stuck.key).await.unwrap().unwrap();
    assert_eq!(after.state, RecordState::InProgress);
    assert_eq!(after.owner, "w9");
    assert!(after.token > stuck.token);
}

#[tokio::test]
async fn a_lease_renewed_after_the_listing_is_left_alone() {
    let (clock, inner, stuck) = populated().await;
    let store = Racy::new(inner, Race::ExtendAfterList(stuck.clone()));
    let lines = release_with(&store, &clock).await;
    assert_eq!(lines[0]["outcome"], "renewed", "{lines:?}");
    let after = store.get(&stuck.key).await.unwrap().unwrap();
    assert_eq!(after.state, RecordState::InProgress);
    assert_eq!(after.token, stuck.token);
}

#[tokio::test]
async fn a_holder_that_revives_at_the_last_moment_is_fenced() {
    // The documented window: the holder renews between the command's last read and its
    // release. The release goes through, and the holder can no longer finish the record.
    let (clock, inner, stuck) = populated().await;
    let store = Racy::new(inner, Race::ExtendAfterGet(stuck.clone()));
    let lines = release_with(&store, &clock).await;
    assert_eq!(lines[0]["outcome"], "released", "{lines:?}");
    let late = store
        .complete(&stuck, Bytes::from_static(b"late"), LONG)
        .await;
    assert!(matches!(late, Err(Error::LeaseLost { .. })), "{late:?}");
}

#[tokio::test]
async fn filtered_delete_skips_records_that_changed_since_the_listing() {
    let (clock, inner, stuck) = populated().await;
    let takeover = AcquireRequest::new(stuck.key.clone(), "w9");
    let store = Racy::new(inner, Race::TakeOverAfterGet(takeover));
    // The take-over happens after the read again, so the listed record still matches then:
    // a delete is not fenced, and the operator asked for the key to go.
    let f = filters(&[Status::LeaseExpired]);
    let ran = run(&store, &*clock, true, Confirm::Yes, async |ctx| {
        delete_matching(ctx, "orders", &f, false, false).await
    })
    .await
    .ok();
    assert_eq!(ran.json()[0]["outcome"], "deleted");

    let (clock, inner, stuck) = populated().await;
    let store = Racy::new(inner, Race::ExtendAfterList(stuck.clone()));
    let ran = run(&store, &*clock, true, Confirm::Yes, async |ctx| {
        delete_matching(ctx, "orders", &f, false, false).await
    })
    .await
    .ok();
    assert_eq!(ran.json()[0]["outcome"], "changed", "{}", ran.out);
    assert!(
        store.get(&stuck.key).await.unwrap().is_some(),
        "the renewed lease stays"
    );
}

#[tokio::test]
async fn delete_by_id_and_by_filter() {
    let (clock, store, _) = populated().await;
    let ids = vec!["done".to_owned(), "missing".to_owned()];
    let ran = run(&store, &*clock, true, Confirm::Refuse, async |ctx| {
        delete_ids(ctx, "orders", &ids, 5, false, false).await
    })
    .await;
    assert_eq!(
        ran.result.as_ref().unwrap_err().code,
        Code::Usage,
        "{}",
        ran.err
    );
    let ran = run(&store, &*clock, true, Confirm::Yes, async |ctx| {
        delete_ids(ctx, "orders", &ids, 5, false, false).await
    })
    .await;
    assert_eq!(ran.result.as_ref().unwrap_err().code, Code::NotFound);
    let lines = ran.json();
    assert_eq!(lines[0]["id"], "done");
    assert_eq!(lines[0]["outcome"], "deleted");
    assert_eq!(lines[1]["id"], "missing");
    assert_eq!(lines[1]["outcome"], "not_found");

    let none = filters(&[]);
    let ran = run(&store, &*clock, true, Confirm::Yes, async |ctx| {
        delete_matching(ctx, "orders", &none, false, true).await
    })
    .await;
    assert_eq!(
        ran.result.unwrap_err().code,
        Code::Usage,
        "no filter, no delete"
    );

    let f = filters(&[Status::FailedTerminal, Status::FailedRetryable]);
    let ran = run(&store, &*clock, false, Confirm::Yes, async |ctx| {
        delete_matching(ctx, "orders", &f, false, true).await
    })
    .await
    .ok();
    assert_eq!(ran.out.matches("would_delete").count(), 2, "{}", ran.out);
    let ran = run(&store, &*clock, false, Confirm::Yes, async |ctx| {
        delete_matching(ctx, "orders", &f, false, false).await
    })
    .await
    .ok();
    assert_eq!(ran.out.matches("deleted").count(), 2, "{}", ran.out);
    assert_eq!(ran.err.trim(), "2 deleted");
    assert!(
        store
            .get(&ns().key("terminal").unwrap())
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn purge_removes_expired_records_in_batches() {
    let (clock, store, _) = populated().await;
    clock.advance(LONG * 2);
    let ran = run(&store, &*clock, true, Confirm::Refuse, async |ctx| {
        purge(ctx, 1, None).await
    })
    .await
    .ok();
    assert_eq!(ran.json()[0]["purged"], 4);
    let ran = run(&store, &*clock, false, Confirm::Refuse, async |ctx| {
        purge(ctx, 10, None).await
    })
    .await
    .ok();
    assert_eq!(ran.out, "purged 0 expired records\n");
}

#[tokio::test]
async fn a_store_without_a_listing_is_a_usage_error() {
    #[derive(Debug)]
    struct NoList(MemoryStore);
    #[async_trait]
    impl IdempotencyStore for NoList {
        fn name(&self) -> &'static str {
            "nolist"
        }
        async fn acquire(&self, req: &AcquireRequest) -> idem_core::Result<AcquireOutcome> {
            self.0.acquire(req).await
        }
        async fn extend(&self, lease: &Lease, ttl: Duration) -> idem_core::Result<Lease> {
            self.0.extend(lease, ttl).await
        }
        async fn complete(
            &self,
            lease: &Lease,
            result: Bytes,
            retention: Duration,
        ) -> idem_core::Result<()> {
            self.0.complete(lease, result, retention).await
        }
        async fn fail(
            &self,
            lease: &Lease,
            error: &str,
            kind: FailureKind,
            retention: Duration,
        ) -> idem_core::Result<()> {
            self.0.fail(lease, error, kind, retention).await
        }
        async fn release(&self, lease: &Lease) -> idem_core::Result<()> {
            self.0.release(lease).await
        }
        async fn get(&self, key: &IdempotencyKey) -> idem_core::Result<Option<Record>> {
            self.0.get(key).await
        }
        async fn delete(&self, key: &IdempotencyKey) -> idem_core::Result<bool> {
            self.0.delete(key).await
        }
        async fn purge_expired(&self, limit: usize) -> idem_core::Result<u64> {
            self.0.purge_expired(limit).await
        }
    }
    let store = NoList(MemoryStore::new());
    let f = filters(&[]);
    let ran = run(&store, &SystemClock, false, Confirm::Refuse, async |ctx| {
        list(ctx, "orders", &f, Some(5), None).await
    })
    .await;
    let failure = ran.result.unwrap_err();
    assert_eq!(failure.code, Code::Usage);
    assert!(
        failure
            .message()
            .contains("nolist store does not support list"),
        "{failure:?}"
    );
}

#[tokio::test]
async fn a_store_that_does_not_answer_is_unavailable_within_the_timeout() {
    #[derive(Debug)]
    struct Hangs;
    #[async_trait]
    impl IdempotencyStore for Hangs {
        fn name(&self) -> &'static str {
            "hangs"
        }
        async fn acquire(&self, _: &AcquireRequest) -> idem_core::Result<AcquireOutcome> {
            std::future::pending().await
        }
        async fn extend(&self, _: &Lease, _: Duration) -> idem_core::Result<Lease> {
            std::future::pending().await
        }
        async fn complete(&self, _: &Lease, _: Bytes, _: Duration) -> idem_core::Result<()> {
            std::future::pending().await
        }
        async fn fail(
            &self,
            _: &Lease,
            _: &str,
            _: FailureKind,
            _: Duration,
        ) -> idem_core::Result<()> {
            std::future::pending().await
        }
        async fn release(&self, _: &Lease) -> idem_core::Result<()> {
            std::future::pending().await
        }
        async fn get(&self, _: &IdempotencyKey) -> idem_core::Result<Option<Record>> {
            std::future::pending().await
        }
        async fn delete(&self, _: &IdempotencyKey) -> idem_core::Result<bool> {
            std::future::pending().await
        }
        async fn purge_expired(&self, _: usize) -> idem_core::Result<u64> {
            std::future::pending().await
        }
    }
    let mut out = Vec::new();
    let mut err = Vec::new();
    let mut ctx = Ctx {
        store: &Hangs,
        timeout: Duration::from_millis(100),
        clock: &SystemClock,
        out: &mut out,
        err: &mut err,
        json: false,
        progress: false,
        confirm: Confirm::Refuse,
    };
    let started = std::time::Instant::now();
    let failure = get(&mut ctx, "orders", "x", 5).await.unwrap_err();
    assert_eq!(failure.code, Code::Unavailable);
    assert!(
        failure.message().contains("hangs store unavailable"),
        "{failure:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn delete_by_id_skips_a_record_changed_after_it_was_shown() {
    // A live worker takes the crashed worker's key over while the operator reads the preview:
    // its record (a new token) stays, and the output names it, not the record shown.
    let (clock, inner, stuck) = populated().await;
    let takeover = AcquireRequest::new(stuck.key.clone(), "w9");
    let store = Racy::new(inner, Race::TakeOverAfterGet(takeover));
    let ids = vec!["stuck".to_owned()];
    let ran = run(&store, &*clock, true, Confirm::Yes, async |ctx| {
        delete_ids(ctx, "orders", &ids, 5, false, false).await
    })
    .await
    .ok();
    let after = store
        .get(&stuck.key)
        .await
        .unwrap()
        .expect("the live record stays");
    assert_eq!(after.owner, "w9");
    assert!(after.token > stuck.token);
    let lines = ran.json();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["outcome"], "taken_over", "{lines:?}");
    assert_eq!(lines[0]["owner"], "w9");
    assert_eq!(lines[0]["token"], after.token.get());
    assert_eq!(lines[0]["status"], "in_progress");
    assert_eq!(ran.err.trim(), "1 taken_over");

    // The holder comes back and completes the record between the preview and the delete: same
    // token, another state.
    let (clock, inner, stuck) = populated().await;
    let store = Racy::new(inner, Race::CompleteAfterGet(stuck.clone()));
    let ran = run(&store, &*clock, true, Confirm::Yes, async |ctx| {
        delete_ids(ctx, "orders", &ids, 5, false, false).await
    })
    .await
    .ok();
    let lines = ran.json();
    assert_eq!(lines[0]["outcome"], "changed", "{lines:?}");
    assert_eq!(lines[0]["state"], "completed");
    let after = store
        .get(&stuck.key)
        .await
        .unwrap()
        .expect("the completed record stays");
    assert_eq!(after.token, stuck.token);
    assert!(matches!(after.state, RecordState::Completed { .. }));

    // Nothing changed: deleted, and the record reported is the one read just before.
    let (clock, store, stuck) = populated().await;
    let ran = run(&store, &*clock, true, Confirm::Yes, async |ctx| {
        delete_ids(ctx, "orders", &ids, 5, false, false).await
    })
    .await
    .ok();
    let lines = ran.json();
    assert_eq!(lines[0]["outcome"], "deleted", "{lines:?}");
    assert_eq!(lines[0]["token"], stuck.token.get());
    assert!(store.get(&stuck.key).await.unwrap().is_none());
}

#[tokio::test]
async fn a_live_lease_is_deleted_only_with_include_live() {
    let (clock, store, stuck) = populated().await;
    let live = ns().key("live").unwrap();

    // By id: the expired lease and the completed record go; the live lease stays, reported
    // with its status, and the command says so and ends with exit code 2.
    let ids = vec!["live".to_owned(), "stuck".to_owned(), "done".to_owned()];
    let ran = run(&store, &*clock, true, Confirm::Yes, async |ctx| {
        delete_ids(ctx, "orders", &ids, 5, false, false).await
    })
    .await;
    let failure = ran.result.as_ref().unwrap_err();
    assert_eq!(failure.code, Code::Usage, "{failure:?}");
    assert!(
        failure.message().contains("refused to delete 1 record")
            && failure.message().contains("--include-live"),
        "{failure:?}"
    );
    let lines = ran.json();
    let outcome = |id: &str| {
        let line = lines.iter().find(|l| l["id"] == id).unwrap();
        (line["status"].clone(), line["outcome"].clone())
    };
    assert_eq!(
        outcome("live"),
        ("in_progress".into(), "refused_live".into())
    );
    assert_eq!(outcome("stuck"), ("lease_expired".into(), "deleted".into()));
    assert_eq!(outcome("done"), ("completed".into(), "deleted".into()));
    assert_eq!(ran.err.trim(), "2 deleted, 1 refused_live", "{}", ran.err);
    assert!(store.get(&live).await.unwrap().is_some());
    assert!(store.get(&stuck.key).await.unwrap().is_none());

    // Filtered: the table shows the status; a dry run says the same.
    let f = filters(&[Status::InProgress, Status::FailedTerminal]);
    for dry_run in [true, false] {
        let ran = run(&store, &*clock, false, Confirm::Yes, async |ctx| {
            delete_matching(ctx, "orders", &f, false, dry_run).await
        })
        .await;
        assert_eq!(
            ran.result.as_ref().unwrap_err().code,
            Code::Usage,
            "{}",
            ran.err
        );
        let header: Vec<&str> = ran.out.lines().next().unwrap().split_whitespace().collect();
        assert_eq!(header[..3], ["ID", "STATUS", "STATE"], "{}", ran.out);
        let row = |id: &str| -> Vec<&str> {
            let line = ran.out.lines().find(|l| l.starts_with(&format!("{id} ")));
            line.unwrap_or_else(|| panic!("{id}: {}", ran.out))
                .split_whitespace()
                .collect()
        };
        let live_row = row("live");
        assert_eq!(live_row[1], "in_progress", "{}", ran.out);
        assert_eq!(live_row.last(), Some(&"refused_live"), "{}", ran.out);
        let terminal = row("terminal");
        let done = if dry_run { "would_delete" } else { "deleted" };
        assert_eq!(terminal.last(), Some(&done), "{}", ran.out);
    }
    assert!(store.get(&live).await.unwrap().is_some());

    // Nothing but live leases: nothing to ask, nothing deleted, exit code 2.
    let only_live = filters(&[Status::InProgress]);
    let ran = run(&store, &*clock, true, Confirm::Refuse, async |ctx| {
        delete_matching(ctx, "orders", &only_live, false, false).await
    })
    .await;
    assert_eq!(ran.result.as_ref().unwrap_err().code, Code::Usage);
    assert_eq!(ran.json()[0]["outcome"], "refused_live");
    assert!(store.get(&live).await.unwrap().is_some());

    // With --include-live it goes, with a warning.
    let ran = run(&store, &*clock, true, Confirm::Yes, async |ctx| {
        delete_matching(ctx, "orders", &only_live, true, false).await
    })
    .await
    .ok();
    assert_eq!(ran.json()[0]["outcome"], "deleted");
    assert_eq!(ran.json()[0]["status"], "in_progress");
    assert!(
        ran.err
            .contains("warning: 1 of the records to delete hold a live lease"),
        "{}",
        ran.err
    );
    assert!(store.get(&live).await.unwrap().is_none());
}

#[tokio::test]
async fn a_carriage_return_in_a_result_is_not_shown_raw() {
    let (clock, store, _) = populated().await;
    // On a terminal, the `\r` would bring the second object over the first.
    let forged: &[u8] =
        b"{\"amount\":100000,\"status\":\"refunded\"}\r{\"amount\":1,\"status\":\"charged\"}";
    let lease = acquire(&store, "forged", "w1", LONG).await;
    store
        .complete(&lease, Bytes::from_static(forged), LONG)
        .await
        .unwrap();
    let crlf = "line one\r\nline two\r\n";
    let lease = acquire(&store, "crlf", "w1", LONG).await;
    store
        .complete(&lease, Bytes::from_static(crlf.as_bytes()), LONG)
        .await
        .unwrap();
    // A table cuts a result after 512 characters: here between the `\r` and the `\n`.
    let long = format!("{}\r\n{}", "a".repeat(511), "b".repeat(10));
    let lease = acquire(&store, "long", "w1", LONG).await;
    store
        .complete(&lease, Bytes::from(long.clone()), LONG)
        .await
        .unwrap();
    let shown = async |id: &str, json: bool| {
        run(&store, &*clock, json, Confirm::Refuse, async |ctx| {
            get(ctx, "orders", id, 5).await
        })
        .await
        .ok()
    };

    let record = &shown("forged", true).await.json()[0];
    assert_eq!(record["result_encoding"], "hex");
    assert_eq!(record["result"], hex::encode(forged));
    assert_eq!(record["result_len"], forged.len());
    let table = shown("forged", false).await.out;
    assert!(!table.contains('\r'), "{table:?}");
    assert!(table.contains(&hex::encode(forged)), "{table}");

    // Line breaks as `\r\n` are text: exact in JSON, without the `\r` in a table.
    let record = &shown("crlf", true).await.json()[0];
    assert_eq!(record["result_encoding"], "utf8");
    assert_eq!(record["result"], crlf);
    let table = shown("crlf", false).await.out;
    assert!(!table.contains('\r'), "{table:?}");
    assert!(
        table.contains("line one\n") && table.contains("line two"),
        "{table}"
    );
    assert_eq!(shown("long", true).await.json()[0]["result"], long);
    let table = shown("long", false).await.out;
    assert!(!table.contains('\r'), "{table:?}");
    assert!(table.contains("--json shows all"), "{table}");
}

/// Standard output whose reader went away (`idem ... | head -1`).
struct ClosedPipe;

impl Write for ClosedPipe {
    fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
        Err(std::io::ErrorKind::BrokenPipe.into())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Err(std::io::ErrorKind::BrokenPipe.into())
    }
}

#[tokio::test]
async fn a_store_failure_is_not_hidden_by_a_closed_pipe() {
    for json in [true, false] {
        // The first delete goes through (and is reported), the second fails.
        let (clock, inner, _) = populated().await;
        let store = Racy::failing_deletes_after(inner, 1);
        let f = filters(&[Status::Completed]);
        let mut out = ClosedPipe;
        let mut err = Vec::new();
        let mut ctx = Ctx {
            store: &store,
            timeout: Duration::from_secs(5),
            clock: &*clock,
            out: &mut out,
            err: &mut err,
            json,
            progress: false,
            confirm: Confirm::Yes,
        };
        let failure = delete_matching(&mut ctx, "orders", &f, false, false)
            .await
            .unwrap_err();
        assert_eq!(failure.code, Code::Unavailable, "json {json}: {failure:?}");
        assert!(
            failure.message().contains("connection reset"),
            "{failure:?}"
        );
        // Standard error still tells what was done before the failure.
        let err = String::from_utf8(err).unwrap();
        assert_eq!(err.trim(), "1 deleted", "json {json}");
    }
    // The flush at the end of a command, likewise.
    let failure = finish(
        &mut ClosedPipe,
        Err(Failure::from(Error::backend("racy", "server error"))),
    )
    .unwrap_err();
    assert_eq!(failure.code, Code::Store, "{failure:?}");
    let quiet = finish(&mut ClosedPipe, Ok(())).unwrap_err();
    assert_eq!(quiet.code, Code::Ok, "a closed pipe alone ends quietly");
}
