//! The consumer context: partition workers follow the group's assignment, and a revocation
//! releases the leases of records whose handler had not started and commits what finished
//! before the partitions move.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use idem_executor::broker;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaResult;
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::flow::Flow;
use crate::message::KafkaMessage;
use crate::options::RunnerOptions;
use crate::stats::{RunnerStats, metric_names as m};
use crate::worker::lock;

/// The runner's handle on one assigned partition and its worker.
pub(crate) struct Slot {
    pub(crate) flow: Arc<Mutex<Flow>>,
    pub(crate) records: mpsc::UnboundedSender<KafkaMessage>,
    pub(crate) revoke: CancellationToken,
    /// Disconnected once the worker ended.
    pub(crate) exited: std::sync::mpsc::Receiver<()>,
}

impl Slot {
    fn has_exited(&self) -> bool {
        matches!(
            self.exited.try_recv(),
            Err(std::sync::mpsc::TryRecvError::Disconnected)
        )
    }
}

/// Starts a worker for a newly assigned partition (type-erases the handler, result and codec).
pub(crate) trait SpawnWorker: Send + Sync + 'static {
    fn spawn(&self, topic: &str, partition: i32) -> Slot;
}

/// State shared by the poll thread and the rebalance callbacks (which run on the poll thread,
/// inside `poll`).
pub(crate) struct Shared {
    slots: Mutex<HashMap<String, HashMap<i32, Slot>>>,
    spawner: Box<dyn SpawnWorker>,
    pub(crate) options: Arc<RunnerOptions>,
    pub(crate) stats: Arc<RunnerStats>,
    /// Set while shutting down: partitions stay paused, new assignments get no worker.
    draining: AtomicBool,
}

impl Shared {
    pub(crate) fn new(
        spawner: Box<dyn SpawnWorker>,
        options: Arc<RunnerOptions>,
        stats: Arc<RunnerStats>,
    ) -> Self {
        Self {
            slots: Mutex::new(HashMap::new()),
            spawner,
            options,
            stats,
            draining: AtomicBool::new(false),
        }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<String, HashMap<i32, Slot>>> {
        self.slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Hands a polled record to its partition's worker. A record of a partition without a worker
    /// (revoked meanwhile, or shutting down) is dropped: it was not committed, so the partition's
    /// next owner receives it.
    pub(crate) fn dispatch(&self, consumer: &BaseConsumer<RunnerContext>, msg: KafkaMessage) {
        let slots = self.slots();
        let Some(slot) = slots
            .get(msg.topic())
            .and_then(|partitions| partitions.get(&msg.partition()))
        else {
            tracing::debug!(
                topic = msg.topic(),
                partition = msg.partition(),
                offset = msg.offset(),
                "record of a partition without a worker dropped"
            );
            return;
        };
        let mut flow = lock(&slot.flow);
        if !flow.dispatched(msg.offset(), msg.size()) {
            tracing::warn!(
                topic = msg.topic(),
                partition = msg.partition(),
                offset = msg.offset(),
                "record at or before one already dispatched dropped (the partition was rewound?)"
            );
            return;
        }
        RunnerStats::bump(&self.stats.received);
        let (topic, partition) = (msg.topic().to_owned(), msg.partition());
        if slot.records.send(msg).is_err() {
            // The worker ended (cancelled, or it panicked): the record stays uncommitted and the
            // partition's next owner receives it.
            tracing::error!(
                topic,
                partition,
                "the partition's worker is gone: record dropped uncommitted"
            );
            return;
        }
        apply_pause(consumer, &topic, partition, &mut flow);
    }

    /// Applies the pauses and resumes the workers asked for.
    pub(crate) fn apply_pauses(&self, consumer: &BaseConsumer<RunnerContext>) {
        if self.draining.load(Ordering::Relaxed) {
            return;
        }
        for (topic, partitions) in self.slots().iter() {
            for (&partition, slot) in partitions {
                apply_pause(consumer, topic, partition, &mut lock(&slot.flow));
            }
        }
    }

    /// Commits the offsets that moved on since the last commit.
    pub(crate) fn commit(&self, consumer: &BaseConsumer<RunnerContext>, mode: CommitMode) {
        let slots = self.slots();
        let mut tpl = TopicPartitionList::new();
        let mut sent = Vec::new();
        for (topic, partitions) in slots.iter() {
            for (&partition, slot) in partitions {
                let mut flow = lock(&slot.flow);
                let Some(offset) = flow.to_commit() else {
                    continue;
                };
                if tpl
                    .add_partition_offset(topic, partition, Offset::Offset(offset))
                    .is_ok()
                {
                    flow.set_committed(offset);
                    sent.push((topic.clone(), partition, offset));
                }
            }
        }
        drop(slots);
        if tpl.count() == 0 {
            return;
        }
        RunnerStats::count(&self.stats.commits, m::COMMITS);
        if let Err(e) = consumer.commit(&tpl, mode) {
            RunnerStats::count(&self.stats.commit_failures, m::COMMIT_FAILURES);
            tracing::warn!(error = %e, offsets = ?sent, "offset commit failed; it is sent again at the next commit");
            self.commit_failed(&sent);
        } else {
            tracing::debug!(offsets = ?sent, ?mode, "offsets committed");
        }
    }

    fn commit_failed(&self, sent: &[(String, i32, i64)]) {
        let slots = self.slots();
        for (topic, partition, offset) in sent {
            if let Some(slot) = slots.get(topic).and_then(|p| p.get(partition)) {
                lock(&slot.flow).commit_failed(*offset);
            }
        }
    }

    /// Starts workers for newly assigned partitions.
    fn assign(&self, tpl: &TopicPartitionList) {
        if self.draining.load(Ordering::Relaxed) {
            return;
        }
        let mut slots = self.slots();
        for elem in tpl.elements() {
            let partitions = slots.entry(elem.topic().to_owned()).or_default();
            partitions
                .entry(elem.partition())
                .or_insert_with(|| self.spawner.spawn(elem.topic(), elem.partition()));
        }
        tracing::info!(assigned = ?list(tpl), "partitions assigned");
    }

    /// Stops the workers of revoked partitions: a record whose handler had not started yet has
    /// its lease released; a running handler gets half the revoke timeout to finish, then its
    /// context's cancellation token is cancelled and the executor drops it unless it returns in
    /// that same poll, its lease left to expire. Then what they resolved is committed synchronously, all before the partitions can
    /// be assigned elsewhere.
    fn revoke(&self, consumer: &BaseConsumer<RunnerContext>, tpl: &TopicPartitionList) {
        let removed: Vec<(String, i32, Slot)> = {
            let mut slots = self.slots();
            let mut removed = Vec::new();
            for elem in tpl.elements() {
                if let Some(partitions) = slots.get_mut(elem.topic()) {
                    if let Some(slot) = partitions.remove(&elem.partition()) {
                        removed.push((elem.topic().to_owned(), elem.partition(), slot));
                    }
                    if partitions.is_empty() {
                        slots.remove(elem.topic());
                    }
                }
            }
            removed
        };
        let lost = consumer.assignment_lost();
        tracing::info!(revoked = ?list(tpl), lost, "partitions revoked");
        self.stop(consumer, removed, !lost);
    }

    /// Cancels the workers of `slots`, waits (up to the revoke timeout) for them to end, and
    /// commits what they resolved (unless `commit` is false: the assignment was lost).
    pub(crate) fn stop(
        &self,
        consumer: &BaseConsumer<RunnerContext>,
        slots: Vec<(String, i32, Slot)>,
        commit: bool,
    ) {
        if slots.is_empty() {
            return;
        }
        for (_, _, slot) in &slots {
            slot.revoke.cancel();
        }
        let deadline = broker::instant_after(self.options.revoke_timeout);
        for (topic, partition, slot) in &slots {
            let left = deadline.saturating_duration_since(Instant::now());
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = slot.exited.recv_timeout(left)
            {
                tracing::warn!(
                    topic,
                    partition,
                    "the partition's worker did not stop within the revoke timeout; its record stays uncommitted"
                );
            }
        }
        let mut tpl = TopicPartitionList::new();
        for (topic, partition, slot) in &slots {
            let flow = lock(&slot.flow);
            // Records dispatched and not resolved (waiting, or taken by the worker and left
            // unresolved) are redelivered to the next owner.
            for _ in 0..flow_buffered(&flow) {
                RunnerStats::bump(&self.stats.abandoned);
            }
            // Even when an asynchronous commit of it was sent: unacknowledged, it may yet fail,
            // and the next owner would process again what this one resolved.
            if let Some(offset) = flow.final_commit() {
                let _ = tpl.add_partition_offset(topic, *partition, Offset::Offset(offset));
            }
        }
        if !commit || tpl.count() == 0 {
            return;
        }
        RunnerStats::count(&self.stats.commits, m::COMMITS);
        match consumer.commit(&tpl, CommitMode::Sync) {
            Ok(()) => tracing::info!(offsets = ?list(&tpl), "final offsets committed"),
            Err(e) => {
                RunnerStats::count(&self.stats.commit_failures, m::COMMIT_FAILURES);
                tracing::warn!(error = %e, offsets = ?list(&tpl), "final offset commit failed; the next owner reprocesses (and replays) those records");
            }
        }
    }

    /// Shutdown: keep partitions paused and start no new worker.
    pub(crate) fn start_draining(&self, consumer: &BaseConsumer<RunnerContext>) {
        self.draining.store(true, Ordering::Relaxed);
        match consumer.assignment() {
            Ok(assignment) if assignment.count() > 0 => {
                let _ = consumer.pause(&assignment);
            }
            _ => {}
        }
    }

    /// A partition whose worker ended although it was neither revoked nor told to stop: it
    /// died (panicked). Its partition would otherwise stay stuck (paused, or fed to nobody).
    pub(crate) fn dead_worker(&self) -> Option<(String, i32)> {
        if self.draining.load(Ordering::Relaxed) {
            return None;
        }
        self.slots().iter().find_map(|(topic, partitions)| {
            partitions
                .iter()
                .find(|(_, slot)| !slot.revoke.is_cancelled() && slot.has_exited())
                .map(|(&partition, _)| (topic.clone(), partition))
        })
    }

    /// Whether every worker ended.
    pub(crate) fn all_exited(&self) -> bool {
        self.slots()
            .values()
            .flat_map(HashMap::values)
            .all(Slot::has_exited)
    }

    /// Cancels every worker (the drain timed out).
    pub(crate) fn revoke_all(&self) {
        for slot in self.slots().values().flat_map(HashMap::values) {
            slot.revoke.cancel();
        }
    }

    /// Removes every slot.
    pub(crate) fn take_all(&self) -> Vec<(String, i32, Slot)> {
        self.slots()
            .drain()
            .flat_map(|(topic, partitions)| {
                partitions
                    .into_iter()
                    .map(move |(partition, slot)| (topic.clone(), partition, slot))
            })
            .collect()
    }
}

fn flow_buffered(flow: &Flow) -> usize {
    flow.buffered()
}

fn apply_pause(
    consumer: &BaseConsumer<RunnerContext>,
    topic: &str,
    partition: i32,
    flow: &mut Flow,
) {
    let Some(pause) = flow.pause_change() else {
        return;
    };
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, partition);
    let result = if pause {
        consumer.pause(&tpl)
    } else {
        consumer.resume(&tpl)
    };
    match result {
        Ok(()) => {
            flow.set_paused(pause);
            tracing::debug!(topic, partition, paused = pause, "partition flow changed");
        }
        Err(e) => tracing::warn!(topic, partition, pause, error = %e, "pause/resume failed"),
    }
}

fn list(tpl: &TopicPartitionList) -> Vec<String> {
    tpl.elements()
        .iter()
        .map(|e| match e.offset() {
            Offset::Offset(o) => format!("{}/{}@{o}", e.topic(), e.partition()),
            _ => format!("{}/{}", e.topic(), e.partition()),
        })
        .collect()
}

/// The rdkafka context of the runner's consumer.
pub(crate) struct RunnerContext {
    pub(crate) shared: Arc<Shared>,
}

impl ClientContext for RunnerContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => tracing::error!(target: "librdkafka", fac, "{log_message}"),
            RDKafkaLogLevel::Warning => tracing::warn!(target: "librdkafka", fac, "{log_message}"),
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", fac, "{log_message}")
            }
            RDKafkaLogLevel::Debug => tracing::debug!(target: "librdkafka", fac, "{log_message}"),
        }
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        tracing::warn!(target: "librdkafka", %error, reason, "client error");
    }
}

impl ConsumerContext for RunnerContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        RunnerStats::count(&self.shared.stats.rebalances, m::REBALANCES);
        match rebalance {
            Rebalance::Revoke(tpl) => self.shared.revoke(consumer, tpl),
            Rebalance::Assign(_) => {}
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            // A partition paused before it was revoked starts unpaused, like its new worker.
            if let Err(e) = consumer.resume(tpl) {
                tracing::debug!(error = %e, "resume of newly assigned partitions");
            }
            self.shared.assign(tpl);
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        if let Err(e) = result {
            RunnerStats::count(&self.shared.stats.commit_failures, m::COMMIT_FAILURES);
            tracing::warn!(error = %e, offsets = ?list(offsets), "asynchronous offset commit failed; it is sent again at the next commit");
            let failed: Vec<(String, i32, i64)> = offsets
                .elements()
                .iter()
                .filter_map(|e| match e.offset() {
                    Offset::Offset(o) => Some((e.topic().to_owned(), e.partition(), o)),
                    _ => None,
                })
                .collect();
            self.shared.commit_failed(&failed);
        }
    }
}
