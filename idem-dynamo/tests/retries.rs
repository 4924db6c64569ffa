//! The SDK retries a request whose answer was lost, and callers re-send after an `Unavailable`;
//! the first attempt may have taken effect. These tests lose answers on purpose (an HTTP client
//! that delivers the request, then reports a transport error instead of the answer) and check
//! what each transition, acquire included, makes of the re-sent request.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use aws_smithy_http_client::tls;
use aws_smithy_runtime_api::client::http::{
    HttpClient, HttpConnector, HttpConnectorFuture, HttpConnectorSettings, SharedHttpClient,
    SharedHttpConnector,
};
use common::EffectTable;
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Error, FailureKind, IdempotencyKey, IdempotencyStore,
    Lease, LostLease, ManualClock, Namespace, RecordState, StateKind, TransactionalStore,
};
use idem_dynamo::aws_config::{self, BehaviorVersion};
use idem_dynamo::aws_sdk_dynamodb::config::RuntimeComponents;
use idem_dynamo::aws_sdk_dynamodb::config::http::HttpRequest;
use idem_dynamo::aws_sdk_dynamodb::error::ConnectorError;
use idem_dynamo::{DynamoStore, DynamoWrites, RequestCounter};

const RETENTION: Duration = Duration::from_secs(3600);

/// How many answers to lose, after how many to deliver first; and a copy of a request kept
/// to be delivered again later.
#[derive(Debug, Default)]
struct Losses {
    skip: AtomicU32,
    lose: AtomicU32,
    /// Whether the next request is copied into `copy`.
    keep_next: std::sync::atomic::AtomicBool,
    /// A request's copy and the connector to send it with: a copy of a request that arrives
    /// late (the SDK sent it again after an attempt timed out, and the first was still on its
    /// way).
    copy: std::sync::Mutex<Option<(SharedHttpConnector, HttpRequest)>>,
}

impl Losses {
    /// Delivers the next `skip` answers, then loses the `lose` after them.
    fn arm(&self, skip: u32, lose: u32) {
        self.skip.store(skip, Ordering::SeqCst);
        self.lose.store(lose, Ordering::SeqCst);
    }

    /// Whether to lose this answer.
    fn take(&self) -> bool {
        let dec = |n: u32| n.checked_sub(1);
        if self
            .skip
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, dec)
            .is_ok()
        {
            return false;
        }
        self.lose
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, dec)
            .is_ok()
    }

    fn armed(&self) -> u32 {
        self.skip.load(Ordering::SeqCst) + self.lose.load(Ordering::SeqCst)
    }
}

/// Delivers every request; for the answers [`Losses`] says, throws the answer away and reports a
/// transport error, which the SDK retries.
#[derive(Clone, Debug)]
struct LoseAnswers {
    inner: SharedHttpClient,
    lose: Arc<Losses>,
}

#[derive(Debug)]
struct LosingConnector {
    inner: SharedHttpConnector,
    lose: Arc<Losses>,
}

impl HttpClient for LoseAnswers {
    fn http_connector(
        &self,
        settings: &HttpConnectorSettings,
        components: &RuntimeComponents,
    ) -> SharedHttpConnector {
        SharedHttpConnector::new(LosingConnector {
            inner: self.inner.http_connector(settings, components),
            lose: self.lose.clone(),
        })
    }
}

impl HttpConnector for LosingConnector {
    fn call(&self, request: HttpRequest) -> HttpConnectorFuture {
        if self.lose.keep_next.swap(false, Ordering::SeqCst) {
            let copy = request
                .try_clone()
                .expect("a request with a body in memory");
            *self.lose.copy.lock().unwrap() = Some((self.inner.clone(), copy));
        }
        let answer = self.inner.call(request);
        let lose = self.lose.clone();
        HttpConnectorFuture::new(async move {
            let response = answer.await?;
            if lose.take() {
                return Err(ConnectorError::io("answer lost on purpose".into()));
            }
            Ok(response)
        })
    }
}

/// A store (on `clock` when given, with `max_attempts` per request) whose HTTP client loses the
/// answers the returned [`Losses`] arms; `None` (the test skips) without a server.
async fn losing_store_with(
    clock: Option<Arc<ManualClock>>,
    max_attempts: u32,
) -> Option<(DynamoStore, Arc<Losses>)> {
    // The table exists once a normal store made it.
    common::store().await?;
    let sdk = aws_config::defaults(BehaviorVersion::latest())
        .region(aws_config::Region::new("us-east-1"))
        .load()
        .await;
    let lose = Arc::new(Losses::default());
    // The HTTP client the SDK uses by default, wrapped.
    let inner = aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(
            tls::rustls_provider::CryptoMode::AwsLc,
        ))
        .build_https();
    let client = LoseAnswers {
        inner,
        lose: lose.clone(),
    };
    let sdk = sdk.into_builder().http_client(client).build();
    let mut config = common::config(common::table()).with_max_attempts(max_attempts);
    if let Some(clock) = clock {
        config = config.with_clock(clock);
    }
    let store = DynamoStore::from_sdk_config(&sdk, config).unwrap();
    Some((store, lose))
}

/// [`losing_store_with`] the default three attempts: the SDK re-sends a lost answer's request.
async fn losing_store(clock: Option<Arc<ManualClock>>) -> Option<(DynamoStore, Arc<Losses>)> {
    losing_store_with(clock, 3).await
}

fn key(id: &str) -> IdempotencyKey {
    Namespace::new(format!("retry-{}", uuid::Uuid::new_v4().simple()))
        .unwrap()
        .key(id)
        .unwrap()
}

async fn lease(store: &DynamoStore, key: &IdempotencyKey) -> Lease {
    lease_with(store, &AcquireRequest::new(key.clone(), "a")).await
}

async fn lease_with(store: &DynamoStore, req: &AcquireRequest) -> Lease {
    match store.acquire(req).await.unwrap() {
        AcquireOutcome::Acquired { lease, .. } => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

fn sent(requests: &RequestCounter) -> u64 {
    let n = requests.get("UpdateItem");
    requests.reset();
    n
}

#[tokio::test]
async fn fenced_transitions_recognise_their_own_lost_write() {
    let Some((store, lose)) = losing_store(None).await else {
        return;
    };
    let requests = store.requests().clone();

    let completed = key("complete");
    let l = lease(&store, &completed).await;
    requests.reset();
    lose.arm(0, 1);
    store
        .complete(&l, Bytes::from_static(b"ok"), RETENTION)
        .await
        .expect("a retried complete whose first attempt landed is a success");
    assert_eq!(sent(&requests), 2, "the first attempt and the SDK's retry");
    let record = store.get(&completed).await.unwrap().unwrap();
    assert_eq!(
        record.state,
        RecordState::Completed {
            result: Bytes::from_static(b"ok")
        }
    );

    let failed = key("fail");
    let l = lease(&store, &failed).await;
    lose.arm(0, 1);
    store
        .fail(&l, "timeout", FailureKind::Retryable, RETENTION)
        .await
        .expect("a retried fail whose first attempt landed is a success");

    let released = key("release");
    let l = lease(&store, &released).await;
    lose.arm(0, 1);
    store
        .release(&l)
        .await
        .expect("a retried release whose first attempt landed is a success");
    assert_eq!(
        store.get(&released).await.unwrap().unwrap().attempts,
        0,
        "released once, not twice"
    );

    // Without any retry, the same complete is a replay too (contract v2), and another one is
    // refused saying the record is completed.
    let lease = store_lease_of(&store, &completed).await;
    requests.reset();
    store
        .complete(&lease, Bytes::from_static(b"ok"), RETENTION)
        .await
        .expect("the same completion, re-sent by the caller");
    assert_eq!(sent(&requests), 1, "one request, no read first");
    let r = store
        .complete(&lease, Bytes::from_static(b"ko"), RETENTION)
        .await;
    assert!(
        matches!(
            r,
            Err(Error::LeaseLost {
                why: LostLease::NotInProgress {
                    state: StateKind::Completed
                },
                ..
            })
        ),
        "{r:?}"
    );
}

/// A caller that re-sends after an `Unavailable` whose request did take effect (the SDK did not
/// retry: one attempt per request) gets `Ok`, and the record is what the first request wrote.
#[tokio::test]
async fn a_caller_resending_after_a_lost_answer_gets_ok() {
    let Some((store, lose)) = losing_store_with(None, 1).await else {
        return;
    };
    let requests = store.requests().clone();

    let completed = key("complete");
    let l = lease(&store, &completed).await;
    lose.arm(0, 1);
    let r = store
        .complete(&l, Bytes::from_static(b"ok"), RETENTION)
        .await;
    assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
    requests.reset();
    store
        .complete(&l, Bytes::from_static(b"ok"), RETENTION)
        .await
        .expect("the re-sent completion finds its own write");
    assert_eq!(sent(&requests), 1);
    assert_eq!(
        store.get(&completed).await.unwrap().unwrap().state,
        RecordState::Completed {
            result: Bytes::from_static(b"ok")
        }
    );

    for kind in FailureKind::ALL {
        let failed = key(&format!("fail-{kind}"));
        let l = lease(&store, &failed).await;
        lose.arm(0, 1);
        let r = store.fail(&l, "declined", kind, RETENTION).await;
        assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
        store
            .fail(&l, "declined", kind, RETENTION)
            .await
            .unwrap_or_else(|e| panic!("the re-sent {kind} failure finds its own write: {e:?}"));
        assert_eq!(
            store.get(&failed).await.unwrap().unwrap().state,
            RecordState::Failed {
                error: "declined".to_owned(),
                kind
            }
        );
    }

    let released = key("release");
    let l = lease(&store, &released).await;
    lose.arm(0, 1);
    let r = store.release(&l).await;
    assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
    store
        .release(&l)
        .await
        .expect("the re-sent release finds its own write");
    assert_eq!(
        store.get(&released).await.unwrap().unwrap().attempts,
        0,
        "released once, not twice"
    );
}

/// The lease that completed `key` (its token), to present it again.
async fn store_lease_of(store: &DynamoStore, key: &IdempotencyKey) -> Lease {
    let record = store.get(key).await.unwrap().unwrap();
    Lease {
        key: key.clone(),
        owner: record.owner,
        token: record.token,
        attempt: record.attempts,
        expires_at: record.updated_at,
    }
}

/// Acquires with the answers `arm` loses, and checks the caller got the acquisition its lost
/// attempt made: `Acquired` exactly once, the attempt counted once. Returns the lease and
/// `takeover`.
async fn acquire_with_lost_answer(
    store: &DynamoStore,
    lose: &Losses,
    arm: (u32, u32),
    req: &AcquireRequest,
) -> (Lease, bool) {
    let requests = store.requests().clone();
    requests.reset();
    lose.arm(arm.0, arm.1);
    let out = store.acquire(req).await.unwrap();
    assert_eq!(lose.armed(), 0, "the answer was lost");
    assert_eq!(
        sent(&requests),
        u64::from(arm.0 + arm.1 + 1),
        "the SDK retried the request whose answer was lost"
    );
    let AcquireOutcome::Acquired { lease, takeover } = out else {
        panic!("a retried acquire whose first attempt landed is that acquisition: {out:?}");
    };
    assert_eq!(lease.owner, req.owner);
    let record = store.get(&req.key).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::InProgress);
    assert_eq!(record.token, lease.token, "the lease is the stored one");
    assert_eq!(record.owner, req.owner);
    assert_eq!(record.attempts, lease.attempt, "the retry wrote nothing");
    assert_eq!(record.lease_expires_at, Some(lease.expires_at));
    // Exactly once: a second call, even the same owner's, finds the key busy.
    let again = store.acquire(req).await.unwrap();
    assert!(
        matches!(&again, AcquireOutcome::InProgress { owner, .. } if *owner == req.owner),
        "{again:?}"
    );
    (lease, takeover)
}

#[tokio::test]
async fn a_retried_acquire_whose_first_attempt_landed_is_acquired() {
    let Some((store, lose)) = losing_store(None).await else {
        return;
    };
    let fresh = key("acquire");
    let (lease, takeover) = acquire_with_lost_answer(
        &store,
        &lose,
        (0, 1),
        &AcquireRequest::new(fresh.clone(), "a"),
    )
    .await;
    assert_eq!((lease.attempt, takeover), (1, false), "fresh");
    // The lease is a working one.
    store
        .complete(&lease, Bytes::from_static(b"ok"), RETENTION)
        .await
        .unwrap();
    let record = store.get(&fresh).await.unwrap().unwrap();
    assert_eq!(record.attempts, 1);
}

#[tokio::test]
async fn a_late_copy_of_an_acquire_changes_nothing_once_the_acquisition_landed() {
    let Some((store, lose)) = losing_store(None).await else {
        return;
    };
    // (A release gives the attempt back; a failure counts it.)
    for (then, next_attempt) in [("released", 1), ("failed", 2)] {
        let k = key(then);
        lose.keep_next.store(true, Ordering::SeqCst);
        let lease = lease(&store, &k).await;
        match then {
            "released" => store.release(&lease).await.unwrap(),
            _ => store
                .fail(&lease, "down", FailureKind::Retryable, RETENTION)
                .await
                .unwrap(),
        }
        let before = store.get(&k).await.unwrap().unwrap();

        // The acquire's request again, as a late copy of it would arrive now.
        let (connector, copy) = lose
            .copy
            .lock()
            .unwrap()
            .take()
            .expect("the acquire's copy");
        let answer = connector.call(copy).await.expect("an answer");
        let status = answer.status();
        let body = aws_smithy_types::byte_stream::ByteStream::new(answer.into_body())
            .collect()
            .await
            .expect("the answer's body")
            .into_bytes();
        let body = String::from_utf8_lossy(&body);
        assert!(
            body.contains("ConditionalCheckFailed"),
            "{then}: the late copy must be refused, got {status} {body}"
        );
        let after = store.get(&k).await.unwrap().unwrap();
        assert_eq!(after, before, "{then}: the late copy changed the record");
        // The next delivery acquires, under a new token, with the attempts the holder left.
        let next = lease_with(&store, &AcquireRequest::new(k.clone(), "b")).await;
        assert_eq!(next.attempt, next_attempt, "{then}");
        assert!(next.token > lease.token);
    }
}

#[tokio::test]
async fn retried_takeover_reacquire_and_refresh_are_acquired() {
    let clock = Arc::new(ManualClock::default());
    let Some((store, lose)) = losing_store(Some(clock.clone())).await else {
        return;
    };
    let short = |key: &IdempotencyKey, owner: &str| {
        AcquireRequest::new(key.clone(), owner).with_lease_ttl(Duration::from_secs(1))
    };

    // Takeover of an expired lease: attempt 2, reported as a takeover.
    let expired = key("takeover");
    let a = lease_with(&store, &short(&expired, "a")).await;
    clock.advance(Duration::from_secs(2));
    let (b, takeover) =
        acquire_with_lost_answer(&store, &lose, (0, 1), &short(&expired, "b")).await;
    assert_eq!((b.attempt, takeover), (2, true));
    assert_eq!(b.token.get(), a.token.get() + 1);

    // Re-acquire after a release: the attempt was given back, so attempt 1, no takeover.
    let released = key("release");
    let a = lease_with(&store, &short(&released, "a")).await;
    store.release(&a).await.unwrap();
    let (b, takeover) =
        acquire_with_lost_answer(&store, &lose, (0, 1), &short(&released, "b")).await;
    assert_eq!((b.attempt, takeover), (1, false));
    assert_eq!(b.token.get(), a.token.get() + 1);

    // A record failed retryably and past retention is re-created by a second write: deliver
    // the first (refused) answer, lose the second's.
    let stale = key("refresh");
    let a = lease_with(&store, &short(&stale, "a")).await;
    store
        .fail(
            &a,
            "timeout",
            FailureKind::Retryable,
            Duration::from_secs(1),
        )
        .await
        .unwrap();
    clock.advance(Duration::from_secs(2));
    let (b, takeover) = acquire_with_lost_answer(&store, &lose, (1, 1), &short(&stale, "b")).await;
    assert_eq!((b.attempt, takeover), (1, false));
    assert_eq!(b.token.get(), a.token.get() + 1);
}

/// A transactional completion whose answer is lost commits once: the SDK's retry re-sends the
/// identical request (the same `ClientRequestToken`), and a caller's re-send after
/// `Unavailable` is decided by the completion's condition. Either way `Ok`, and the effect, a
/// list every application appends to, holds the token once.
#[tokio::test]
async fn a_transactional_completion_whose_answer_was_lost_applies_once() {
    let Some((store, lose)) = losing_store(None).await else {
        return;
    };
    let fx = EffectTable::new().await;
    let requests = store.requests().clone();
    let transactions = |requests: &RequestCounter| {
        let n = requests.get("TransactWriteItems");
        requests.reset();
        n
    };
    let effect = |key: &IdempotencyKey| format!("{key}/list");

    // The SDK retries.
    let k = key("tx-sdk");
    let l = lease(&store, &k).await;
    let writes = DynamoWrites::new().update(fx.append(&effect(&k), l.token.get()));
    requests.reset();
    lose.arm(0, 1);
    store
        .complete_with(&l, Bytes::from_static(b"ok"), RETENTION, writes)
        .await
        .expect("a retried transactional completion whose first attempt landed is Ok");
    assert_eq!(lose.armed(), 0, "the answer was lost");
    assert_eq!(
        transactions(&requests),
        2,
        "the first attempt and the SDK's retry"
    );
    assert_eq!(fx.tokens(&effect(&k)).await.unwrap(), vec![l.token.get()]);
    assert_eq!(
        store.get(&k).await.unwrap().unwrap().state,
        RecordState::Completed {
            result: Bytes::from_static(b"ok")
        }
    );

    // The caller re-sends (one attempt per request: the SDK does not).
    let Some((store, lose)) = losing_store_with(None, 1).await else {
        return;
    };
    let requests = store.requests().clone();
    let k = key("tx-caller");
    let l = lease(&store, &k).await;
    let writes = || DynamoWrites::new().update(fx.append(&effect(&k), l.token.get()));
    lose.arm(0, 1);
    let r = store
        .complete_with(&l, Bytes::from_static(b"ok"), RETENTION, writes())
        .await;
    assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
    requests.reset();
    store
        .complete_with(&l, Bytes::from_static(b"ok"), RETENTION, writes())
        .await
        .expect("the re-sent transactional completion finds its own commit");
    assert_eq!(transactions(&requests), 1, "decided in one request");
    assert_eq!(
        fx.tokens(&effect(&k)).await.unwrap(),
        vec![l.token.get()],
        "applied once"
    );
    // Once more, and with another result: the first is Ok again, the second refused.
    store
        .complete_with(&l, Bytes::from_static(b"ok"), RETENTION, writes())
        .await
        .unwrap();
    let r = store
        .complete_with(&l, Bytes::from_static(b"ko"), RETENTION, writes())
        .await;
    assert!(
        matches!(
            r,
            Err(Error::LeaseLost {
                why: LostLease::NotInProgress {
                    state: StateKind::Completed
                },
                ..
            })
        ),
        "{r:?}"
    );
    assert_eq!(fx.tokens(&effect(&k)).await.unwrap(), vec![l.token.get()]);
}
