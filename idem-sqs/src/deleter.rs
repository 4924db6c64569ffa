//! Batched deletes: every message acknowledged (or dead-lettered) is deleted with
//! `DeleteMessageBatch`, up to 10 per call and up to `max_delete_calls` calls at once. When no
//! call is in flight a delete goes out at once; otherwise it waits for the next call, with the
//! others that came in meanwhile, and only a full batch of 10 opens another call: batches grow
//! with the load, never with a timer, and a loaded server gets full batches. Each call waits at
//! most the runner's `call_timeout`: a call that never answered would hold every later partial
//! batch.

use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::DeleteMessageBatchRequestEntry;
use tokio::sync::{Notify, Semaphore, mpsc, oneshot};

use crate::call;
use crate::options::MAX_BATCH;
use crate::stats::{RunnerStats, metric_names as m};

/// Tries of one batch call that failed as a whole (network, throttling) before its deletes are
/// reported failed.
const CALL_TRIES: u32 = 3;

struct Request {
    receipt: String,
    done: oneshot::Sender<Result<(), String>>,
}

/// The handle the message tasks delete through.
#[derive(Clone)]
pub(crate) struct Deleter {
    tx: mpsc::UnboundedSender<Request>,
}

impl Deleter {
    /// Starts the delete loop on the current runtime; it ends once every handle is dropped and
    /// the deletes asked for are sent.
    pub(crate) fn start(
        client: Client,
        queue_url: String,
        max_calls: usize,
        call_timeout: Duration,
        stats: Arc<RunnerStats>,
    ) -> (Self, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(client, queue_url, max_calls, call_timeout, stats, rx));
        (Self { tx }, task)
    }

    /// Deletes the message with this receipt handle; `Err` with SQS's reason when it could not.
    pub(crate) async fn delete(&self, receipt: &str) -> Result<(), String> {
        let (done, rx) = oneshot::channel();
        self.tx
            .send(Request {
                receipt: receipt.to_owned(),
                done,
            })
            .map_err(|_| "the runner is stopping".to_owned())?;
        rx.await
            .unwrap_or_else(|_| Err("the delete loop ended".to_owned()))
    }
}

async fn run(
    client: Client,
    queue_url: String,
    max_calls: usize,
    call_timeout: Duration,
    stats: Arc<RunnerStats>,
    mut rx: mpsc::UnboundedReceiver<Request>,
) {
    let calls = Arc::new(Semaphore::new(max_calls));
    // Signalled when a call ends (a signal sent while nobody waits is kept for the next wait).
    let call_ended = Arc::new(Notify::new());
    let queue_url: Arc<str> = queue_url.into();
    let idle = |calls: &Semaphore| calls.available_permits() == max_calls;
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        let mut open = true;
        loop {
            while batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(request) => batch.push(request),
                    Err(_) => break,
                }
            }
            // A full batch takes a call of its own; a partial one goes when no call is in flight
            // (at once when idle), so that the deletes arriving meanwhile join it.
            if batch.len() == MAX_BATCH || idle(&calls) || !open {
                break;
            }
            tokio::select! {
                request = rx.recv() => match request {
                    Some(request) => batch.push(request),
                    None => open = false,
                },
                () = call_ended.notified() => {}
            }
        }
        let Ok(permit) = Arc::clone(&calls).acquire_owned().await else {
            break;
        };
        let (client, queue_url, stats, call_ended) = (
            client.clone(),
            Arc::clone(&queue_url),
            Arc::clone(&stats),
            Arc::clone(&call_ended),
        );
        tokio::spawn(async move {
            send(&client, &queue_url, call_timeout, &stats, batch).await;
            drop(permit);
            call_ended.notify_one();
        });
        if !open {
            break;
        }
    }
    // Every handle is gone: wait for the calls in flight.
    let _ = calls.acquire_many(max_calls as u32).await;
}

/// One `DeleteMessageBatch` for `batch`, answered entry by entry.
async fn send(
    client: &Client,
    queue_url: &str,
    call_timeout: Duration,
    stats: &RunnerStats,
    batch: Vec<Request>,
) {
    let entries: Vec<DeleteMessageBatchRequestEntry> = batch
        .iter()
        .enumerate()
        .map(|(i, r)| {
            DeleteMessageBatchRequestEntry::builder()
                .id(i.to_string())
                .receipt_handle(&r.receipt)
                .build()
                .expect("id and receipt handle are set")
        })
        .collect();
    let mut outcome = Err(String::new());
    for attempt in 1..=CALL_TRIES {
        RunnerStats::bump(&stats.delete_calls);
        let request = client
            .delete_message_batch()
            .queue_url(queue_url)
            .set_entries(Some(entries.clone()))
            .send();
        match call::bounded(call_timeout, request).await {
            Ok(out) => {
                outcome = Ok(out);
                break;
            }
            Err(e) => {
                tracing::warn!(error = %e, attempt, "DeleteMessageBatch failed");
                outcome = Err(e.to_string());
                if attempt < CALL_TRIES {
                    tokio::time::sleep(Duration::from_millis(100) * attempt).await;
                }
            }
        }
    }
    match outcome {
        Ok(out) => {
            let mut answers: Vec<Option<Result<(), String>>> = vec![None; batch.len()];
            for ok in out.successful() {
                if let Some(slot) = ok
                    .id()
                    .parse::<usize>()
                    .ok()
                    .and_then(|i| answers.get_mut(i))
                {
                    *slot = Some(Ok(()));
                }
            }
            for failed in out.failed() {
                if let Some(slot) = failed
                    .id()
                    .parse::<usize>()
                    .ok()
                    .and_then(|i| answers.get_mut(i))
                {
                    *slot = Some(Err(format!(
                        "{}: {}",
                        failed.code(),
                        failed.message().unwrap_or_default()
                    )));
                }
            }
            for (request, answer) in batch.into_iter().zip(answers) {
                let answer = answer
                    .unwrap_or_else(|| Err("DeleteMessageBatch did not answer for it".into()));
                account(stats, &answer);
                let _ = request.done.send(answer);
            }
        }
        Err(e) => {
            for request in batch {
                let answer = Err(e.clone());
                account(stats, &answer);
                let _ = request.done.send(answer);
            }
        }
    }
}

fn account(stats: &RunnerStats, answer: &Result<(), String>) {
    match answer {
        Ok(()) => RunnerStats::count(&stats.deleted, m::DELETED, 1),
        Err(_) => RunnerStats::count(&stats.delete_failures, m::DELETE_FAILURES, 1),
    }
}
