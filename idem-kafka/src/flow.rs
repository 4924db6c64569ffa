//! Per-partition flow state: buffered records, pause wishes and the offsets to commit.
//!
//! Shared between the poll thread (which dispatches records, applies pauses and commits) and the
//! partition's worker (which takes records, asks for a pause while it waits to retry, and marks
//! records resolved). Pure bookkeeping, no I/O: the poll thread does the Kafka calls.

/// The flow state of one assigned partition.
#[derive(Debug)]
pub(crate) struct Flow {
    /// Records dispatched to the worker and not yet resolved (waiting, or in process).
    buffered: usize,
    /// Pause the partition when this many records are buffered; resume at half.
    max_buffered: usize,
    /// The bytes of the buffered records ([`KafkaMessage::size`](crate::KafkaMessage::size)).
    bytes: usize,
    /// Pause the partition when the buffered records hold this many bytes; resume at half.
    max_bytes: usize,
    /// The buffer reached `max_buffered` or `max_bytes` and has not drained to half of both
    /// yet.
    buffer_full: bool,
    /// The worker waits to retry its current record.
    retry_wait: bool,
    /// Whether the partition is paused in the consumer (as applied by the poll thread).
    paused: bool,
    /// The last record dispatched, to check that records arrive in offset order.
    last_dispatched: Option<i64>,
    /// The next offset to commit: the offset of the last resolved record + 1.
    done: Option<i64>,
    /// The offset last committed (or being committed).
    committed: Option<i64>,
}

impl Flow {
    pub(crate) fn new(max_buffered: usize, max_bytes: usize) -> Self {
        Self {
            buffered: 0,
            max_buffered: max_buffered.max(1),
            bytes: 0,
            max_bytes: max_bytes.max(1),
            buffer_full: false,
            retry_wait: false,
            paused: false,
            last_dispatched: None,
            done: None,
            committed: None,
        }
    }

    /// A record of `size` bytes was handed to the worker. Returns `false` (and keeps nothing)
    /// when its offset is not after the previous one: a record from before a seek or a reset,
    /// which would break the in-order commit rule.
    pub(crate) fn dispatched(&mut self, offset: i64, size: usize) -> bool {
        if self.last_dispatched.is_some_and(|last| offset <= last) {
            return false;
        }
        self.last_dispatched = Some(offset);
        self.buffered += 1;
        self.bytes = self.bytes.saturating_add(size);
        if self.buffered >= self.max_buffered || self.bytes >= self.max_bytes {
            self.buffer_full = true;
        }
        true
    }

    /// A record of `size` bytes left the buffer: resolved, so it needs no more room.
    fn released(&mut self, size: usize) {
        self.buffered = self.buffered.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(size);
        if self.buffer_full
            && self.buffered <= self.max_buffered / 2
            && self.bytes <= self.max_bytes / 2
        {
            self.buffer_full = false;
        }
    }

    /// The worker starts (`true`) or stops (`false`) waiting to retry its record.
    pub(crate) fn set_retry_wait(&mut self, waiting: bool) {
        self.retry_wait = waiting;
    }

    /// Whether the partition should be paused now.
    pub(crate) fn wants_pause(&self) -> bool {
        self.buffer_full || self.retry_wait
    }

    /// `Some(true)` to pause, `Some(false)` to resume, `None` when the consumer already agrees.
    pub(crate) fn pause_change(&self) -> Option<bool> {
        let wanted = self.wants_pause();
        (wanted != self.paused).then_some(wanted)
    }

    /// The poll thread applied a pause or resume.
    pub(crate) fn set_paused(&mut self, paused: bool) {
        self.paused = paused;
    }

    /// The record at `offset` (of `size` bytes) reached a final outcome: everything up to it
    /// may be committed. Records are resolved one at a time in offset order, so this never moves
    /// past a record that is still unresolved.
    pub(crate) fn resolved(&mut self, offset: i64, size: usize) {
        debug_assert!(
            self.done.is_none_or(|done| offset >= done),
            "resolved {offset} after {:?}",
            self.done
        );
        self.done = Some(offset + 1);
        self.released(size);
    }

    /// The offset of the final commit at a revocation or shutdown: the resolved one, whether or
    /// not an asynchronous commit of it was sent (it may not have been acknowledged, and may
    /// yet fail).
    pub(crate) fn final_commit(&self) -> Option<i64> {
        self.done
    }

    /// The offset to commit, when it moved on since the last commit.
    pub(crate) fn to_commit(&self) -> Option<i64> {
        match (self.done, self.committed) {
            (Some(done), Some(committed)) if done <= committed => None,
            (done, _) => done,
        }
    }

    /// A commit of `offset` was sent.
    pub(crate) fn set_committed(&mut self, offset: i64) {
        self.committed = Some(offset);
    }

    /// A commit of `offset` failed: commit again at the next chance.
    pub(crate) fn commit_failed(&mut self, offset: i64) {
        if self.committed == Some(offset) {
            self.committed = None;
        }
    }

    /// Records dispatched and not resolved yet.
    pub(crate) fn buffered(&self) -> usize {
        self.buffered
    }

    /// The bytes of the records dispatched and not resolved yet.
    #[cfg(test)]
    fn buffered_bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_pauses_when_full_and_resumes_at_half() {
        let mut flow = Flow::new(4, usize::MAX);
        for offset in 0..3 {
            assert!(flow.dispatched(offset, 1));
        }
        assert_eq!(flow.pause_change(), None);
        assert!(flow.dispatched(3, 1));
        assert_eq!(flow.pause_change(), Some(true));
        flow.set_paused(true);
        flow.resolved(0, 1);
        assert_eq!(flow.pause_change(), None, "3 buffered: still above half");
        flow.resolved(1, 1);
        assert_eq!(flow.pause_change(), Some(false), "2 buffered: resume");
        flow.set_paused(false);
        assert_eq!(flow.pause_change(), None);
    }

    #[test]
    fn retry_wait_pauses_until_it_ends() {
        let mut flow = Flow::new(10, usize::MAX);
        assert!(flow.dispatched(7, 1));
        flow.set_retry_wait(true);
        assert_eq!(flow.pause_change(), Some(true));
        flow.set_paused(true);
        flow.set_retry_wait(false);
        assert_eq!(flow.pause_change(), Some(false));
    }

    #[test]
    fn out_of_order_records_are_refused() {
        let mut flow = Flow::new(10, usize::MAX);
        assert!(flow.dispatched(5, 1));
        assert!(!flow.dispatched(5, 1));
        assert!(!flow.dispatched(4, 1));
        assert!(flow.dispatched(9, 1), "gaps (compaction, markers) are fine");
    }

    #[test]
    fn commits_follow_resolved_records_only() {
        let mut flow = Flow::new(10, usize::MAX);
        assert_eq!(
            flow.to_commit(),
            None,
            "nothing resolved: nothing to commit"
        );
        flow.resolved(0, 1);
        flow.resolved(1, 1);
        assert_eq!(
            flow.to_commit(),
            Some(2),
            "the next offset after the last resolved"
        );
        flow.set_committed(2);
        assert_eq!(flow.to_commit(), None);
        flow.resolved(5, 1);
        assert_eq!(flow.to_commit(), Some(6));
        flow.set_committed(6);
        flow.commit_failed(6);
        assert_eq!(flow.to_commit(), Some(6), "a failed commit is sent again");
        flow.set_committed(6);
        flow.commit_failed(2);
        assert_eq!(
            flow.to_commit(),
            None,
            "an older failure does not undo a newer commit"
        );
    }

    #[test]
    fn buffer_pauses_at_the_byte_bound_and_resumes_at_half_of_both() {
        let mut flow = Flow::new(100, 1_000);
        assert!(flow.dispatched(0, 400));
        assert!(flow.dispatched(1, 400));
        assert_eq!(flow.pause_change(), None, "800 bytes: under the bound");
        assert!(flow.dispatched(2, 400));
        assert_eq!(flow.buffered_bytes(), 1_200);
        assert_eq!(
            flow.pause_change(),
            Some(true),
            "the record that crossed it pauses"
        );
        flow.set_paused(true);
        flow.resolved(0, 400);
        assert_eq!(flow.pause_change(), None, "800 bytes: above half");
        flow.resolved(1, 400);
        assert_eq!(flow.pause_change(), Some(false), "400 bytes: resume");
        flow.set_paused(false);
        // One record larger than the bound pauses at once.
        assert!(flow.dispatched(3, 5_000));
        assert_eq!(flow.pause_change(), Some(true));
    }

    #[test]
    fn the_final_commit_sends_the_resolved_offset_even_after_an_asynchronous_commit_of_it() {
        let mut flow = Flow::new(10, usize::MAX);
        assert_eq!(
            flow.final_commit(),
            None,
            "nothing resolved: nothing to commit"
        );
        flow.resolved(0, 1);
        flow.resolved(1, 1);
        // The periodic asynchronous commit of 2 was sent; its result is not known yet.
        flow.set_committed(2);
        assert_eq!(flow.to_commit(), None, "not sent again periodically");
        assert_eq!(
            flow.final_commit(),
            Some(2),
            "sent again synchronously at a revocation or shutdown"
        );
    }
}
