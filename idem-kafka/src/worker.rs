//! One partition's worker: takes its records in offset order, in batches, and resolves them in
//! order.

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use futures::future::MaybeDone;

use idem_executor::{BrokerAction, Codec, ExecutorError, Handler, Outcome, Plain, Recorder};
use rdkafka::message::Headers as _;
use rdkafka::types::RDKafkaErrorCode;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use idem_executor::broker::{self, DeadLetterInfo, Execution, Fit, LostTimeouts, Step};

use crate::dead_letter::{self, DeadLetterProducer};
use crate::flow::Flow;
use crate::message::KafkaMessage;
use crate::options::RunnerOptions;
use crate::stats::{RunnerStats, metric_names as m};

/// Everything a worker shares with the other workers of its runner.
pub(crate) struct Common<H, C, R = Plain> {
    /// The executor and the handler: every executor call goes through it.
    pub(crate) execution: Execution<H, C, R>,
    pub(crate) dead_letter: Arc<DeadLetterProducer>,
    pub(crate) in_flight: Arc<Semaphore>,
    pub(crate) options: Arc<RunnerOptions>,
    pub(crate) stats: Arc<RunnerStats>,
    /// Cancelled when the runner shuts down: finish the batches in process, start no other.
    pub(crate) drain: CancellationToken,
}

impl<H, C, R> Clone for Common<H, C, R> {
    fn clone(&self) -> Self {
        Self {
            execution: self.execution.clone(),
            dead_letter: Arc::clone(&self.dead_letter),
            in_flight: Arc::clone(&self.in_flight),
            options: Arc::clone(&self.options),
            stats: Arc::clone(&self.stats),
            drain: self.drain.clone(),
        }
    }
}

pub(crate) struct Worker<H, T, C, R = Plain> {
    pub(crate) common: Common<H, C, R>,
    pub(crate) flow: Arc<Mutex<Flow>>,
    pub(crate) records: mpsc::UnboundedReceiver<KafkaMessage>,
    /// Cancelled when the partition is revoked (or the drain timed out): the batches in process
    /// get the revoke timeout to finish (see [`Execution::try_batch`]), nothing more starts.
    pub(crate) revoke: CancellationToken,
    /// Dropped when the worker ends; the poll thread waits on it.
    pub(crate) _exited: std::sync::mpsc::Sender<()>,
    pub(crate) _result: PhantomData<fn() -> T>,
}

/// Pause before writing to the dead-letter topic again after a failed write (clamped to the
/// retry delays).
const DEAD_LETTER_RETRY_HINT: Duration = Duration::from_secs(1);

/// Retry waits shorter than this keep the partition fetching: a pause drops what the client
/// prefetched, and the refetch after the resume can wait up to `fetch.wait.max.ms` (500 ms by
/// default). The buffer bound still holds meanwhile.
const PAUSE_FROM: Duration = Duration::from_millis(500);

/// What the worker does after a record.
enum Next {
    /// The record is resolved: take the next one.
    Continue,
    /// The record is resolved but the partition was revoked meanwhile: stop.
    Stop,
    /// The record is left unresolved (revoked, or shutting down): stop.
    Abandoned,
}

impl<H, T, C, R> Worker<H, T, C, R>
where
    H: Handler<KafkaMessage, R::Returns<T>>,
    T: Serialize + DeserializeOwned + Send + 'static,
    R::Returns<T>: Send,
    C: Codec,
    R: Recorder,
{
    pub(crate) async fn run(mut self) {
        let options = &self.common.options;
        let max_batch = options
            .max_batch
            .min(self.common.execution.max_batch())
            .max(1);
        // Batches of one record are the strict mode (one record at a time): they never overlap.
        let depth = if max_batch == 1 {
            1
        } else {
            options.max_batches_per_partition.max(1)
        };
        let mut queue = Queue {
            records: std::mem::replace(&mut self.records, mpsc::unbounded_channel().1),
            open: true,
            carry: None,
            max_batch,
        };
        // The batches started after the one in process, in offset order; their first tries go on
        // while it is processed (resolved in order, tried again where needed).
        let mut later = VecDeque::with_capacity(depth);
        loop {
            if later.is_empty() {
                if self.revoke.is_cancelled() || self.common.drain.is_cancelled() {
                    return;
                }
                let first = match queue.carry.take() {
                    Some(entry) => entry,
                    None => tokio::select! {
                        biased;
                        () = self.revoke.cancelled() => return,
                        () = self.common.drain.cancelled() => return,
                        msg = queue.records.recv() => match msg {
                            Some(msg) => self.entry(msg),
                            None => return,
                        },
                    },
                };
                // Its slot is taken before any later batch can take one.
                let permit = tokio::select! {
                    biased;
                    () = self.revoke.cancelled() => None,
                    () = self.common.drain.cancelled() => None,
                    permit = Arc::clone(&self.common.in_flight).acquire_owned() => permit.ok(),
                };
                let Some(permit) = permit else {
                    // The record taken is left unresolved (counted abandoned with the other
                    // records of the partition's buffer at the revocation).
                    return;
                };
                let (batch, keys) = queue.gather(|msg| self.verdict(msg), first, &[]);
                later.push_back(self.start(batch, keys, permit));
            }
            let Some(mut head) = later.pop_front() else {
                continue;
            };
            let head_keys = std::mem::take(&mut head.keys);
            // Batches start on the records already waiting, then on those that arrive while
            // this one is processed.
            while later.len() + 1 < depth
                && !self.revoke.is_cancelled()
                && !self.common.drain.is_cancelled()
            {
                let Some(first) = queue.next_waiting(|msg| self.verdict(msg)) else {
                    break;
                };
                let Some((batch, keys, permit)) = self.later(&mut queue, first, &head_keys, &later)
                else {
                    break;
                };
                later.push_back(self.start(batch, keys, permit));
            }
            let mut processed = std::pin::pin!(async {
                (&mut head.first).await;
                let Some((batch, steps)) = head.first.as_mut().take_output() else {
                    return Next::Abandoned;
                };
                let span = tracing::debug_span!(
                    "idem_kafka_batch",
                    topic = batch.msgs[0].topic(),
                    partition = batch.msgs[0].partition(),
                    offset = batch.msgs[0].offset(),
                    records = batch.msgs.len()
                );
                self.process(&batch, steps).instrument(span).await
            });
            let mut later_done = later.is_empty();
            let next = loop {
                let room = queue.open
                    && queue.carry.is_none()
                    && later.len() + 1 < depth
                    && !self.revoke.is_cancelled()
                    && !self.common.drain.is_cancelled();
                let event = tokio::select! {
                    biased;
                    next = &mut processed => Event::Processed(next),
                    () = all_done(&mut later), if !later_done => Event::LaterDone,
                    msg = queue.records.recv(), if room => Event::Record(msg),
                };
                match event {
                    Event::Processed(next) => break next,
                    Event::LaterDone => later_done = true,
                    Event::Record(None) => queue.open = false,
                    Event::Record(Some(msg)) => {
                        let first = self.entry(msg);
                        if let Some((batch, keys, permit)) =
                            self.later(&mut queue, first, &head_keys, &later)
                        {
                            later.push_back(self.start(batch, keys, permit));
                            later_done = false;
                        }
                    }
                }
            };
            match next {
                // A revocation after the batch was resolved: the batches started after it are
                // processed as they stand (their records resolved in order up to the first that
                // is not), and nothing else starts.
                Next::Continue | Next::Stop => {}
                Next::Abandoned => {
                    // The batches after an unresolved record are not resolved either: their
                    // tries end (all at once: each sees the revocation and its own deadline),
                    // their released leases are counted.
                    all_done(&mut later).await;
                    for mut batch in later {
                        if let Some((_, steps)) = batch.first.as_mut().take_output() {
                            self.count_released(&steps);
                        }
                    }
                    return;
                }
            }
        }
    }

    /// A batch to start after the one in process (whose keys are `head`) and the `later` ones:
    /// `first` and the records waiting after it, their keys, and a free slot. `None` when the
    /// partition is revoked or the runner shuts down, when the key of `first` is held by a batch
    /// in process, or when no slot is free: `first` then waits in the queue for the next batch.
    fn later(
        &self,
        queue: &mut Queue,
        first: Entry,
        head: &HashSet<String>,
        later: &VecDeque<Started<impl Future>>,
    ) -> Option<(Batch, HashSet<String>, OwnedSemaphorePermit)> {
        let held: Vec<&HashSet<String>> = std::iter::once(head)
            .chain(later.iter().map(|s| &s.keys))
            .collect();
        if self.revoke.is_cancelled() || self.common.drain.is_cancelled() || first.is_held(&held) {
            queue.carry = Some(first);
            return None;
        }
        let Ok(permit) = Arc::clone(&self.common.in_flight).try_acquire_owned() else {
            queue.carry = Some(first);
            return None;
        };
        let (batch, keys) = queue.gather(|msg| self.verdict(msg), first, &held);
        Some((batch, keys, permit))
    }

    /// The record as the worker takes it: with its [`Verdict`].
    fn entry(&self, msg: KafkaMessage) -> Entry {
        let key = self.verdict(&msg);
        Entry { msg, key }
    }

    /// Reads the record's key id, once, before the record goes into a batch; an error when
    /// the record cannot be handed to the executor: its headers are refused
    /// ([`KafkaMessage::invalid_headers`]), or the key source panicked (a
    /// [`KeySource::from_fn`](idem_executor::KeySource::from_fn) closure: the executor calls it
    /// outside the handler's guard, and the panic would kill the worker, then the runner, on
    /// this record after every restart).
    fn verdict(&self, msg: &KafkaMessage) -> Verdict {
        if let Some(reason) = msg.invalid_headers() {
            return Err(format!("headers not read: {reason}"));
        }
        catch_unwind(AssertUnwindSafe(|| self.common.execution.key_id(msg))).map_err(|panic| {
            let panic = panic_text(panic.as_ref());
            tracing::error!(
                topic = msg.topic(),
                partition = msg.partition(),
                offset = msg.offset(),
                %panic,
                "the key source panicked on the record: it is dead-lettered as invalid_message"
            );
            format!("the key source panicked: {panic}")
        })
    }

    /// Starts the first try of `batch`, on `permit`.
    fn start(
        &self,
        batch: Batch,
        keys: HashSet<String>,
        permit: OwnedSemaphorePermit,
    ) -> Started<impl Future<Output = FirstTry<T>> + use<H, T, C, R>> {
        let common = &self.common;
        Started {
            keys,
            first: Box::pin(futures::future::maybe_done(first_try(
                common.execution.clone(),
                batch,
                permit,
                self.revoke.clone(),
                self.timeouts(),
            ))),
        }
    }

    fn timeouts(&self) -> LostTimeouts {
        LostTimeouts {
            orphan: self.common.options.revoke_timeout,
            release: self.common.options.release_timeout,
        }
    }

    /// Counts the leases the steps released.
    fn count_released(&self, steps: &[Step<T>]) {
        for step in steps {
            if let Step::Abandoned {
                lease_released: true,
            } = step
            {
                RunnerStats::count(&self.common.stats.released, m::RELEASED);
            }
        }
    }

    /// Processes a batch of records (in offset order) until every one is resolved or the worker
    /// must stop. Records are resolved in order: the first one that is not (busy key, retryable
    /// failure, store error) is tried again after a pause together with the unresolved records
    /// after it, up to the first one whose own retry is not due yet: a record whose attempt
    /// failed is tried again after its own delay, never at the pace of a busy key before it
    /// (which would spend its attempts in milliseconds). A record that reached a final outcome
    /// in a try (executed, replayed, passed through, or to be dead-lettered) keeps it until its
    /// turn comes and is never handed to the executor again: a record passed through (no key,
    /// or the store failing under `FailOpen`) has no store entry to replay, and would run its
    /// handler again.
    ///
    /// `first` holds the steps of the batch's first try.
    async fn process(&self, batch: &Batch, first: Vec<Step<T>>) -> Next {
        let common = &self.common;
        let Batch { msgs: batch, keys } = batch;
        let mut first = Some(first);
        let mut start = 0;
        // Backoff on a busy key, for the record at `start`.
        let mut busy = BusyWait::default();
        // The outcome of each record after `start` that a try gave it: kept when final (acked or
        // to be dead-lettered) until the record is resolved in its turn; the others are dropped
        // after each try, and the record is tried again.
        let mut steps: Vec<Option<Step<T>>> =
            std::iter::repeat_with(|| None).take(batch.len()).collect();
        // When each record whose attempt did not resolve it (a retryable failure, a lost lease,
        // a store error) may be tried again; none for the others (a busy key's wait is the
        // record's at the head, `busy`).
        let mut due: Vec<Option<Instant>> = vec![None; batch.len()];
        // The records the next try covers: the unresolved ones from `start` to `end`.
        let mut end = batch.len();
        loop {
            let tried: Vec<usize> = (start..end).filter(|&i| steps[i].is_none()).collect();
            let new = match first.take() {
                Some(steps) => steps,
                None => {
                    let permit = tokio::select! {
                        biased;
                        () = self.revoke.cancelled() => return Next::Abandoned,
                        () = common.drain.cancelled() => return Next::Abandoned,
                        permit = common.in_flight.acquire() => match permit {
                            Ok(permit) => permit,
                            Err(_) => return Next::Abandoned,
                        },
                    };
                    let msgs: Vec<KafkaMessage> = tried.iter().map(|&i| batch[i].clone()).collect();
                    let new = common
                        .execution
                        .try_batch(&msgs, &self.revoke, self.timeouts())
                        .await;
                    drop(permit);
                    new
                }
            };
            let revoked = self.revoke.is_cancelled();
            self.count_released(&new);
            let now = Instant::now();
            for (&at, step) in tried.iter().zip(new) {
                if let Step::Done { result, .. } = &step {
                    due[at] = match (BrokerAction::of(result), result) {
                        (BrokerAction::Ack | BrokerAction::DeadLetter { .. }, _)
                        | (_, Ok(Outcome::InProgress { .. })) => None,
                        (BrokerAction::Retry { after }, _) => {
                            Some(now + common.options.retry_delay(after))
                        }
                        _ => Some(now + common.options.min_retry_delay),
                    };
                }
                steps[at] = Some(step);
            }
            let mut delay = None;
            // Resolves the records in order, from `start`, while their outcomes are final.
            while let Some(step) = steps.get_mut(start).and_then(Option::take) {
                // Only a revocation abandons a record (its lease released, or the whole batch
                // dropped past the revoke timeout): the records before it are resolved.
                let Step::Done { result, attempt } = step else {
                    return Next::Abandoned;
                };
                let msg = &batch[start];
                let key = keys[start].as_ref().ok().and_then(Option::as_deref);
                match BrokerAction::of(&result) {
                    BrokerAction::Ack => {
                        match &result {
                            Ok(Outcome::Executed(_)) => {
                                RunnerStats::count(&common.stats.executed, m::EXECUTED);
                            }
                            Ok(Outcome::Replayed(_)) => {
                                RunnerStats::count(&common.stats.replayed, m::REPLAYED);
                            }
                            _ => RunnerStats::bump(&common.stats.acked_other),
                        }
                        // Resolved even when revoked meanwhile: the revocation commits it.
                        self.resolved(msg);
                        tracing::debug!(
                            offset = msg.offset(),
                            outcome = broker::outcome_name(&result),
                            "resolved"
                        );
                        start += 1;
                    }
                    _ if revoked => return Next::Abandoned,
                    BrokerAction::DeadLetter { reason, error } => {
                        let info = broker::classify(&result, reason, error, attempt);
                        drop(result);
                        // The outcome is final: only the dead-letter write is tried again, never
                        // the executor call (which, for an un-deduplicated record, would run the
                        // handler again).
                        match self.dead_letter_until_written(msg, key, &info).await {
                            Next::Continue => start += 1,
                            other => return other,
                        }
                    }
                    BrokerAction::Retry { after } => {
                        tracing::debug!(
                            offset = msg.offset(),
                            outcome = broker::outcome_name(&result),
                            hint = ?after,
                            "not resolved: pausing before trying it again"
                        );
                        delay = Some(match &result {
                            Ok(Outcome::InProgress { retry_after, .. }) => {
                                busy.delay(&common.options, start, *retry_after)
                            }
                            _ => wait_until(due[start], now),
                        });
                        break;
                    }
                    _ => {
                        delay = Some(wait_until(due[start], now));
                        break;
                    }
                }
            }
            // The records after the first unresolved one that are not final either are tried
            // again (a later try's outcome replaces theirs).
            for step in &mut steps[start..] {
                if step.as_ref().is_some_and(|step| !is_final(step)) {
                    *step = None;
                }
            }
            let delay = match delay {
                Some(delay) => delay,
                // Every record tried is resolved.
                None if start == batch.len() => {
                    return if revoked { Next::Stop } else { Next::Continue };
                }
                // The rest were left out of the try, their retries not due: the next waits for
                // its own.
                None if revoked => return Next::Abandoned,
                None => wait_until(due[start], now),
            };
            if !delay.is_zero() && !self.pause_before_retry(delay).await {
                return Next::Abandoned;
            }
            // The head's retry is due; the try ends before the first record whose own is not.
            let now = Instant::now();
            end = (start + 1..batch.len())
                .find(|&i| due[i].is_some_and(|at| at > now))
                .unwrap_or(batch.len());
        }
    }

    /// Writes the record to the dead-letter topic until the write succeeds, pausing the partition
    /// between tries; stops (abandoning the record) on revocation or shutdown.
    async fn dead_letter_until_written(
        &self,
        msg: &KafkaMessage,
        key_id: Option<&str>,
        info: &DeadLetterInfo,
    ) -> Next {
        // Kept between tries: a form refused as too large is not tried again.
        let mut fit = Fit::first(msg.headers().is_some_and(|h| h.count() > 0));
        loop {
            match self.dead_letter(msg, key_id, info, &mut fit).await {
                Ok(()) => return Next::Continue,
                Err(()) if self.revoke.is_cancelled() => return Next::Abandoned,
                Err(()) => {}
            }
            let delay = self.common.options.retry_delay(DEAD_LETTER_RETRY_HINT);
            if !self.pause_before_retry(delay).await {
                return Next::Abandoned;
            }
        }
    }

    /// Waits `delay` before a retry, with the partition paused when the wait is long (from
    /// [`PAUSE_FROM`]). `false` when the worker must stop instead
    /// (revoked or shutting down).
    async fn pause_before_retry(&self, delay: Duration) -> bool {
        let common = &self.common;
        if common.drain.is_cancelled() || self.revoke.is_cancelled() {
            return false;
        }
        RunnerStats::count(&common.stats.retries, m::RETRIES);
        let pause = delay >= PAUSE_FROM;
        if pause {
            lock(&self.flow).set_retry_wait(true);
        }
        let slept = tokio::select! {
            biased;
            () = self.revoke.cancelled() => false,
            () = common.drain.cancelled() => false,
            () = tokio::time::sleep(delay) => true,
        };
        if pause {
            lock(&self.flow).set_retry_wait(false);
        }
        slept
    }

    /// Writes the record (whose key id is `key_id`) to the dead-letter topic, in the form `fit`
    /// and smaller ones while it is refused as too large (`fit` is left at the last form tried);
    /// on success it is resolved.
    async fn dead_letter(
        &self,
        msg: &KafkaMessage,
        key_id: Option<&str>,
        info: &DeadLetterInfo,
        fit: &mut Fit,
    ) -> Result<(), ()> {
        let common = &self.common;
        let attempts = common.execution.dead_letter_attempts(info, key_id).await;
        // Smaller each time the record is refused as too large (by the producer's own
        // `message.max.bytes` or the broker's).
        let send = async {
            loop {
                let headers = dead_letter::headers(msg, info, attempts, key_id, *fit);
                let sent = common.dead_letter.send(msg, headers).await;
                match (fit.smaller(), &sent) {
                    (Some(smaller), Err(e))
                        if e.rdkafka_error_code()
                            == Some(RDKafkaErrorCode::MessageSizeTooLarge) =>
                    {
                        if smaller == Fit::Compact {
                            tracing::warn!(error = %e, "the dead letter is too large with the runner's headers: writing it with the error, the key and the dropped names cut short");
                        } else {
                            tracing::warn!(error = %e, "the dead letter is too large with the original headers: writing it with the runner's only, naming the others");
                        }
                        *fit = smaller;
                    }
                    _ => break sent,
                }
            }
        };
        let sent = tokio::select! {
            biased;
            () = self.revoke.cancelled() => return Err(()),
            sent = send => sent,
        };
        match sent {
            Ok(topic) => {
                RunnerStats::bump(&common.stats.dead_lettered);
                metrics::counter!(m::DEAD_LETTERED, "reason" => info.reason.as_str()).increment(1);
                tracing::warn!(
                    reason = info.reason.as_str(),
                    error = %broker::header_text(&info.error),
                    attempts = ?attempts,
                    key = key_id.map(broker::header_text).as_deref(),
                    dead_letter_topic = %topic,
                    "record dead-lettered"
                );
                self.resolved(msg);
                Ok(())
            }
            Err(e) => {
                tracing::error!(error = %e, "dead-letter write failed; pausing the partition and trying again");
                Err(())
            }
        }
    }

    fn resolved(&self, msg: &KafkaMessage) {
        lock(&self.flow).resolved(msg.offset(), msg.size());
    }
}

/// What the worker read from a record before handing it to the executor
/// ([`Worker::verdict`]): its key id (`None` when it has none), or why it cannot be handed to
/// the executor; such a record is dead-lettered as `invalid_message` in its turn.
type Verdict = Result<Option<String>, String>;

/// A record taken from the partition's channel, with its [`Verdict`].
struct Entry {
    msg: KafkaMessage,
    key: Verdict,
}

impl Entry {
    /// Whether one of the `held` key sets holds its key.
    fn is_held(&self, held: &[&HashSet<String>]) -> bool {
        matches!(&self.key, Ok(Some(k)) if held.iter().any(|keys| keys.contains(k)))
    }
}

/// A batch of a partition's records, in offset order, with the [`Verdict`] of each.
pub(crate) struct Batch {
    msgs: Vec<KafkaMessage>,
    keys: Vec<Verdict>,
}

/// The partition's records not in a batch yet.
struct Queue {
    records: mpsc::UnboundedReceiver<KafkaMessage>,
    /// False once the channel is closed (the partition is gone).
    open: bool,
    /// A record taken from the channel that could not start a batch yet (its key is held by a
    /// batch in process, or no slot was free): it starts the next one.
    carry: Option<Entry>,
    max_batch: usize,
}

impl Queue {
    /// The record to start the next batch with, when one waits already (`verdict` reads it).
    fn next_waiting(&mut self, verdict: impl Fn(&KafkaMessage) -> Verdict) -> Option<Entry> {
        self.carry.take().or_else(|| {
            let msg = self.records.try_recv().ok()?;
            let key = verdict(&msg);
            Some(Entry { msg, key })
        })
    }

    /// The batch that starts with `first`: the records waiting after it (`verdict` reads
    /// each), up to `max_batch`, ending before the first one whose key a batch in process holds
    /// (`held`) or an earlier record of this batch has (that record is kept for the next
    /// batch), and the keys of its records. So a key has one record per batch: a later one runs
    /// once the batch of the earlier one is resolved, as in the strict mode, and not right after
    /// an attempt that failed (which would spend the next attempt at once, the retry delay
    /// skipped).
    fn gather(
        &mut self,
        verdict: impl Fn(&KafkaMessage) -> Verdict,
        first: Entry,
        held: &[&HashSet<String>],
    ) -> (Batch, HashSet<String>) {
        let mut keys = HashSet::new();
        let mut batch = Batch {
            msgs: Vec::with_capacity(self.max_batch),
            keys: Vec::with_capacity(self.max_batch),
        };
        let mut next = Some(first);
        while let Some(entry) = next.take() {
            if let Ok(Some(k)) = &entry.key {
                keys.insert(k.clone());
            }
            batch.msgs.push(entry.msg);
            batch.keys.push(entry.key);
            if batch.msgs.len() >= self.max_batch {
                break;
            }
            let Ok(msg) = self.records.try_recv() else {
                break;
            };
            let entry = Entry {
                key: verdict(&msg),
                msg,
            };
            if entry.is_held(&[&keys]) || entry.is_held(held) {
                self.carry = Some(entry);
                break;
            }
            next = Some(entry);
        }
        (batch, keys)
    }
}

/// What wakes the worker while a batch is processed.
enum Event {
    /// The batch is processed.
    Processed(Next),
    /// Every later batch's first try is done.
    LaterDone,
    /// A record arrived (`None`: the channel is closed).
    Record(Option<KafkaMessage>),
}

/// What a batch's first try gives: the batch and its steps.
type FirstTry<T> = (Batch, Vec<Step<T>>);

/// A batch of the partition whose first try is under way (or done), waiting to be processed.
pub(crate) struct Started<F: Future> {
    /// The keys of its records.
    keys: HashSet<String>,
    /// Its first try, kept once done.
    first: Pin<Box<MaybeDone<F>>>,
}

/// A batch's first try, holding `permit` (its slot) until it ends.
async fn first_try<H, T, C, R>(
    execution: Execution<H, C, R>,
    batch: Batch,
    permit: OwnedSemaphorePermit,
    revoke: CancellationToken,
    timeouts: LostTimeouts,
) -> FirstTry<T>
where
    H: Handler<KafkaMessage, R::Returns<T>>,
    T: Serialize + DeserializeOwned + Send + 'static,
    R::Returns<T>: Send,
    C: Codec,
    R: Recorder,
{
    // A record that cannot be handed to the executor gets its final outcome here: dead-lettered
    // as `invalid_message`, in its turn.
    let valid: Vec<KafkaMessage> = batch
        .msgs
        .iter()
        .zip(&batch.keys)
        .filter(|(_, key)| key.is_ok())
        .map(|(msg, _)| msg.clone())
        .collect();
    let mut tried = if valid.is_empty() {
        Vec::new()
    } else {
        execution.try_batch(&valid, &revoke, timeouts).await
    }
    .into_iter();
    drop(permit);
    let steps = batch
        .keys
        .iter()
        .map(|key| match key {
            Ok(_) => tried.next().unwrap_or(Step::Abandoned {
                lease_released: false,
            }),
            Err(reason) => Step::Done {
                result: Err(ExecutorError::InvalidMessage {
                    reason: reason.clone(),
                }),
                attempt: 0,
            },
        })
        .collect();
    (batch, steps)
}

/// The text of a panic's payload.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// Polls every batch's first try; ready when all are done.
fn all_done<F: Future>(later: &mut VecDeque<Started<F>>) -> impl Future<Output = ()> + '_ {
    futures::future::poll_fn(move |cx| {
        let mut pending = false;
        for s in later.iter_mut() {
            pending |= s.first.as_mut().poll(cx).is_pending();
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
}

/// The waits before trying again a record whose key another consumer holds: exponential backoff
/// with jitter from `min_retry_delay` to `max_retry_delay`, kept while the same record waits,
/// and never past the holder's lease (`retry_after`): a holder that finishes soon is followed
/// soon, and a crashed one is taken over as soon as its lease ends.
#[derive(Default)]
struct BusyWait {
    /// The record waiting (its index in the batch) and its backoff.
    waiting: Option<(usize, ExponentialBackoff)>,
}

impl BusyWait {
    /// The next wait for the record at `at`, whose key's holder has `retry_after` of lease left.
    fn delay(&mut self, options: &RunnerOptions, at: usize, retry_after: Duration) -> Duration {
        if self
            .waiting
            .as_ref()
            .is_none_or(|(waiting, _)| *waiting != at)
        {
            let backoff = ExponentialBuilder::new()
                .with_min_delay(options.min_retry_delay)
                .with_max_delay(options.max_retry_delay)
                .with_jitter()
                .without_max_times()
                .build();
            self.waiting = Some((at, backoff));
        }
        let next = self
            .waiting
            .as_mut()
            .and_then(|(_, backoff)| backoff.next())
            .unwrap_or(options.max_retry_delay);
        next.min(retry_after + Duration::from_millis(1))
            .clamp(options.min_retry_delay, options.max_retry_delay)
    }
}

/// Whether a try's `step` is the record's final outcome: acknowledged (executed, replayed, or
/// run without deduplication) or to be dead-lettered. Such a record is never tried again.
fn is_final<T>(step: &Step<T>) -> bool {
    match step {
        Step::Done { result, .. } => matches!(
            BrokerAction::of(result),
            BrokerAction::Ack | BrokerAction::DeadLetter { .. }
        ),
        Step::Abandoned { .. } => false,
    }
}

/// How long from `now` until `due` (none: no wait).
fn wait_until(due: Option<Instant>, now: Instant) -> Duration {
    due.map_or(Duration::ZERO, |at| at.saturating_duration_since(now))
}

/// Locks a flow; a poisoned lock (a panic while holding it, which only bookkeeping does) is
/// still usable.
pub(crate) fn lock(flow: &Mutex<Flow>) -> std::sync::MutexGuard<'_, Flow> {
    flow.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_key_is_looked_at_again_from_milliseconds_up_to_the_cap() {
        let options = RunnerOptions::default();
        let min = options.min_retry_delay;
        let lease_left = Duration::from_secs(30);
        let mut busy = BusyWait::default();
        let first = busy.delay(&options, 0, lease_left);
        // Jitter adds at most the delay itself.
        assert!(first >= min && first <= min * 2, "{first:?}");
        let waits: Vec<Duration> = (0..20)
            .map(|_| busy.delay(&options, 0, lease_left))
            .collect();
        assert!(waits[3] > first, "it grows: {waits:?}");
        assert!(
            waits.iter().all(|w| *w <= options.max_retry_delay),
            "capped: {waits:?}"
        );
        assert_eq!(waits[19], options.max_retry_delay, "{waits:?}");
        // Never past the holder's lease.
        assert_eq!(
            busy.delay(&options, 0, Duration::from_millis(40)),
            Duration::from_millis(41)
        );
        // Another record starts from the shortest wait again.
        let other = busy.delay(&options, 1, lease_left);
        assert!(other <= min * 2, "{other:?}");
    }
}
