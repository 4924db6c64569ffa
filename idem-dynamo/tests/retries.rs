//! The SDK retries a request whose answer was lost; the first attempt may have taken effect.
//! These tests lose answers on purpose (an HTTP client that delivers the request, then reports a
//! transport error instead of the answer) and check what each transition makes of its retry.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use aws_smithy_http_client::tls;
use aws_smithy_runtime_api::client::http::{
    HttpClient, HttpConnector, HttpConnectorFuture, HttpConnectorSettings, SharedHttpClient,
    SharedHttpConnector,
};
use idem_core::{
    AcquireOutcome, AcquireRequest, Bytes, Error, IdempotencyKey, IdempotencyStore, Lease,
    Namespace, RecordState,
};
use idem_dynamo::aws_config::{self, BehaviorVersion};
use idem_dynamo::aws_sdk_dynamodb::config::RuntimeComponents;
use idem_dynamo::aws_sdk_dynamodb::config::http::HttpRequest;
use idem_dynamo::aws_sdk_dynamodb::error::ConnectorError;
use idem_dynamo::{DynamoStore, RequestCounter};

const RETENTION: Duration = Duration::from_secs(3600);

/// Delivers every request; for the next `lose` of them, throws the answer away and reports a
/// transport error, which the SDK retries.
#[derive(Clone, Debug)]
struct LoseAnswers {
    inner: SharedHttpClient,
    lose: Arc<AtomicU32>,
}

#[derive(Debug)]
struct LosingConnector {
    inner: SharedHttpConnector,
    lose: Arc<AtomicU32>,
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
        let answer = self.inner.call(request);
        let lose = self.lose.clone();
        HttpConnectorFuture::new(async move {
            let response = answer.await?;
            if lose
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(ConnectorError::io("answer lost on purpose".into()));
            }
            Ok(response)
        })
    }
}

/// A store whose HTTP client loses the answers the returned counter arms.
async fn losing_store() -> (DynamoStore, Arc<AtomicU32>) {
    // The table exists once a normal store made it.
    common::store().await;
    let sdk = aws_config::defaults(BehaviorVersion::latest())
        .region(aws_config::Region::new("us-east-1"))
        .load()
        .await;
    let lose = Arc::new(AtomicU32::new(0));
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
    let store = DynamoStore::from_sdk_config(&sdk, common::config(common::table())).unwrap();
    (store, lose)
}

fn key(id: &str) -> IdempotencyKey {
    Namespace::new(format!("retry-{}", uuid::Uuid::new_v4().simple()))
        .unwrap()
        .key(id)
        .unwrap()
}

async fn lease(store: &DynamoStore, key: &IdempotencyKey) -> Lease {
    match store
        .acquire(&AcquireRequest::new(key.clone(), "a"))
        .await
        .unwrap()
    {
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
    let (store, lose) = losing_store().await;
    let requests = store.requests().clone();

    let completed = key("complete");
    let l = lease(&store, &completed).await;
    requests.reset();
    lose.store(1, Ordering::SeqCst);
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
    lose.store(1, Ordering::SeqCst);
    store
        .fail(&l, "timeout", true, RETENTION)
        .await
        .expect("a retried fail whose first attempt landed is a success");

    let released = key("release");
    let l = lease(&store, &released).await;
    lose.store(1, Ordering::SeqCst);
    store
        .release(&l)
        .await
        .expect("a retried release whose first attempt landed is a success");
    assert_eq!(
        store.get(&released).await.unwrap().unwrap().attempts,
        0,
        "released once, not twice"
    );

    // Without a retry, a second complete is a fencing violation, as the contract says.
    let r = store
        .complete(
            &store_lease_of(&store, &completed).await,
            Bytes::from_static(b"ok"),
            RETENTION,
        )
        .await;
    assert!(matches!(r, Err(Error::LeaseLost { .. })), "{r:?}");
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

#[tokio::test]
async fn a_retried_acquire_whose_first_attempt_landed_reports_busy() {
    let (store, lose) = losing_store().await;
    let fresh = key("acquire");
    lose.store(1, Ordering::SeqCst);
    let out = store
        .acquire(&AcquireRequest::new(fresh.clone(), "a"))
        .await
        .unwrap();
    // Documented: the key is held by this very owner until the lease expires, then taken over.
    assert!(
        matches!(&out, AcquireOutcome::InProgress { owner, .. } if owner == "a"),
        "{out:?}"
    );
    let record = store.get(&fresh).await.unwrap().unwrap();
    assert_eq!(record.attempts, 1, "the retry wrote nothing");
}
