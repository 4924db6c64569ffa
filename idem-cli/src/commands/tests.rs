//! The commands in-process, on a `MemoryStore` with a manual clock: paging, counting, and the
//! races `release-stuck` and filtered `delete` must survive.

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
    // The record's fields in their usual order (no status), the outcome last.
    let fields: Vec<&str> = lines[0]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(fields[..3], ["namespace", "id", "state"], "{fields:?}");
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
}

/// A `MemoryStore` on which one race happens at the chosen moment.
struct Racy {
    inner: MemoryStore,
    race: Mutex<Option<Race>>,
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
        delete_matching(ctx, "orders", &f, false).await
    })
    .await
    .ok();
    assert_eq!(ran.json()[0]["outcome"], "deleted");

    let (clock, inner, stuck) = populated().await;
    let store = Racy::new(inner, Race::ExtendAfterList(stuck.clone()));
    let ran = run(&store, &*clock, true, Confirm::Yes, async |ctx| {
        delete_matching(ctx, "orders", &f, false).await
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
        delete_ids(ctx, "orders", &ids, false).await
    })
    .await;
    assert_eq!(
        ran.result.as_ref().unwrap_err().code,
        Code::Usage,
        "{}",
        ran.err
    );
    let ran = run(&store, &*clock, true, Confirm::Yes, async |ctx| {
        delete_ids(ctx, "orders", &ids, false).await
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
        delete_matching(ctx, "orders", &none, true).await
    })
    .await;
    assert_eq!(
        ran.result.unwrap_err().code,
        Code::Usage,
        "no filter, no delete"
    );

    let f = filters(&[Status::FailedTerminal, Status::FailedRetryable]);
    let ran = run(&store, &*clock, false, Confirm::Yes, async |ctx| {
        delete_matching(ctx, "orders", &f, true).await
    })
    .await
    .ok();
    assert_eq!(ran.out.matches("would_delete").count(), 2, "{}", ran.out);
    let ran = run(&store, &*clock, false, Confirm::Yes, async |ctx| {
        delete_matching(ctx, "orders", &f, false).await
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
