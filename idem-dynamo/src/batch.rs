//! Batches as bounded concurrent single writes.
//!
//! DynamoDB has no batched conditional write: `BatchWriteItem` takes no condition expressions,
//! and `TransactWriteItems` fails all of its items when one condition fails (and allows each
//! item once). Every transition of this store is a conditional `UpdateItem`, so a batch sends
//! the single calls, up to [`BATCH_CONCURRENCY`] at once. Items of the same key run one after
//! the other, in their batch order, so each result is the one the single calls made in order
//! would have given.

use std::collections::HashMap;
use std::future::Future;

use idem_core::Result;
use tokio::task::JoinSet;

use crate::store::DynamoStore;

/// How many single writes of one batch are in flight at most.
pub(crate) const BATCH_CONCURRENCY: usize = 16;

/// Runs `run` on every item, keys in parallel (at most [`BATCH_CONCURRENCY`] at once), the
/// items of one key (`key` of the item) in order; the results in item order.
pub(crate) async fn run_batch<T, R, F, Fut>(
    store: &DynamoStore,
    items: &[T],
    key: impl Fn(&T) -> String,
    run: F,
) -> Vec<Result<R>>
where
    T: Clone + Send + 'static,
    R: Send + 'static,
    F: Fn(DynamoStore, T) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<R>> + Send + 'static,
{
    // The items of each key, in batch order; the keys in order of first appearance.
    let mut groups: Vec<Vec<(usize, T)>> = Vec::new();
    let mut group_of: HashMap<String, usize> = HashMap::new();
    for (i, item) in items.iter().enumerate() {
        let g = *group_of.entry(key(item)).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[g].push((i, item.clone()));
    }
    let mut results: Vec<Option<Result<R>>> = (0..items.len()).map(|_| None).collect();
    let mut pending = groups.into_iter();
    let mut running = JoinSet::new();
    let spawn = |running: &mut JoinSet<Vec<(usize, Result<R>)>>, group: Vec<(usize, T)>| {
        let (store, run) = (store.clone(), run.clone());
        running.spawn(async move {
            let mut out = Vec::with_capacity(group.len());
            for (i, item) in group {
                out.push((i, run(store.clone(), item).await));
            }
            out
        });
    };
    for group in pending.by_ref().take(BATCH_CONCURRENCY) {
        spawn(&mut running, group);
    }
    while let Some(done) = running.join_next().await {
        let done = match done {
            Ok(done) => done,
            Err(err) if err.is_panic() => std::panic::resume_unwind(err.into_panic()),
            Err(err) => panic!("a batch task was cancelled: {err}"),
        };
        for (i, result) in done {
            results[i] = Some(result);
        }
        if let Some(group) = pending.next() {
            spawn(&mut running, group);
        }
    }
    results
        .into_iter()
        .map(|r| r.expect("every item of a batch has a result"))
        .collect()
}
