//! Batches: `acquire_many`, `complete_many`, `fail_many` and `release_many` in ONE script call
//! per batch on one server, and one per hash slot on a Redis Cluster (those calls sent
//! concurrently). See the crate docs, "Batches".

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use futures::future::join_all;
use idem_core::{
    AcquireOutcome, AcquireRequest, BoxError, Completion, Error, Failure, IdempotencyStore, Lease,
    Result,
};
use redis::Value;
use redis::cluster_routing::Slot;

use crate::codec::{self, Fenced};
use crate::conn::{Call, map_error};
use crate::scripts::{LuaScript, build_batch};
use crate::store::RedisStore;

/// On a cluster, how many slot groups of one batch are sent together (a wave); the next wave
/// goes when the previous one answered.
const MAX_CONCURRENT_CALLS: usize = 8;

/// The batch scripts: each one the single-key script of the same transition, run once per key
/// (behind a fast path for a fresh acquire and for a completion by the lease holder).
struct BatchScripts {
    acquire: LuaScript,
    complete: LuaScript,
    fail: LuaScript,
    release: LuaScript,
}

static BATCH: LazyLock<BatchScripts> = LazyLock::new(|| BatchScripts {
    acquire: build_batch(
        "acquire_many",
        include_str!("lua/acquire.lua"),
        Some(include_str!("lua/acquire_fast.lua")),
        true,
    ),
    complete: build_batch(
        "complete_many",
        include_str!("lua/complete.lua"),
        Some(include_str!("lua/complete_fast.lua")),
        false,
    ),
    fail: build_batch("fail_many", include_str!("lua/fail.lua"), None, false),
    release: build_batch("release_many", include_str!("lua/release.lua"), None, false),
});

/// The batch scripts: `acquire_many`, `complete_many`, `fail_many`, `release_many`. Each is the
/// prelude, the single-key script of its transition wrapped as a function, and a loop that calls
/// it once per key (`KEYS[i]`), in order; an acquire of an absent key and a completion by the
/// lease holder first go to a fast path that writes the same bytes (see the crate docs,
/// "Batches"). Like
/// [`lua_scripts`](crate::lua_scripts), for tools and operators: the store loads them itself.
pub fn lua_batch_scripts() -> [&'static LuaScript; 4] {
    let b = &*BATCH;
    [&b.acquire, &b.complete, &b.fail, &b.release]
}

/// One checked item of a batch: its record's storage key and its script arguments (in the
/// single script's order).
struct Item {
    key: Vec<u8>,
    args: Vec<Vec<u8>>,
}

impl Item {
    fn new(key: Vec<u8>) -> Self {
        Self {
            key,
            args: Vec::new(),
        }
    }

    fn arg(mut self, arg: impl redis::ToRedisArgs) -> Self {
        arg.write_redis_args(&mut self.args);
        self
    }
}

/// The answer of one script call for a group of items (their indices in the batch): one reply
/// per item in an array, or the call's error.
type Answered = (Vec<usize>, Result<Value>);

/// The checked item at `i` (the groups hold only those).
fn checked(items: &[Result<Item>], i: usize) -> &Item {
    match &items[i] {
        Ok(item) => item,
        Err(_) => unreachable!("groups hold only checked items"),
    }
}

/// Whether an item's reply is the cluster's refusal of a key its node does not serve (the
/// slot moved since the map was read, no node serves it, or it is being migrated): raised at
/// the item's first read, before any write (the script's `load` may have wrapped it as
/// `IDEMCORRUPT the key holds no idem record (<refusal>)`), so the item is sent again on its
/// own to the slot's node, where the cluster's answer decides (a redirect followed, or a
/// retryable `Unavailable`), never taken for a corrupt record.
fn misplaced(reply: &Value) -> bool {
    let Value::Array(parts) = reply else {
        return false;
    };
    let [Value::Int(-1), message] = parts.as_slice() else {
        return false;
    };
    let text = match message {
        Value::BulkString(b) => String::from_utf8_lossy(b),
        Value::SimpleString(s) => s.as_str().into(),
        _ => return false,
    };
    MISPLACED.iter().any(|refusal| text.contains(refusal))
}

/// What Redis says when a script touches an undeclared key its node cannot serve now: another
/// node's, an unassigned slot's, a slot being migrated, or any while the cluster is down.
const MISPLACED: [&str; 4] = [
    "non local key",
    "slot not served",
    "during rehashing of the slot",
    "cluster is down",
];

/// Adds the arguments of the items of `group` to a batch call (see `lua/batch.lua`): how many
/// each item has, which of them every item of the group shares (a `1` per shared position, a `0`
/// per own one), the shared values once, then each item's own values, after its key when
/// `inline` (no declared keys). The owner, lease and attempts of an acquire batch, for instance,
/// travel once per call instead of once per item.
fn add_args<'a>(
    call: &mut Call<'a>,
    per_item: usize,
    items: &'a [Result<Item>],
    group: &[usize],
    inline: bool,
) {
    let first = checked(items, group[0]);
    let shared: Vec<bool> = (0..per_item)
        .map(|j| {
            group[1..]
                .iter()
                .all(|&i| checked(items, i).args[j] == first.args[j])
        })
        .collect();
    call.arg(per_item);
    let mask: String = shared.iter().map(|&s| if s { '1' } else { '0' }).collect();
    call.arg(mask);
    for (arg, _) in first.args.iter().zip(&shared).filter(|(_, s)| **s) {
        call.arg_ref(arg);
    }
    for &i in group {
        let item = checked(items, i);
        debug_assert_eq!(item.args.len(), per_item);
        if inline {
            call.arg_ref(&item.key);
        }
        for (arg, _) in item.args.iter().zip(&shared).filter(|(_, s)| !**s) {
            call.arg_ref(arg);
        }
    }
}

impl RedisStore {
    /// Runs `script` over the checked items: one call with declared keys for all of them on one
    /// server; on a cluster, one call per primary (its items of every slot passed as
    /// arguments, which the script's `allow-cross-slot-keys` flag allows), all primaries at
    /// once, by the slot map the store last read. Items the map placed on the wrong primary
    /// (refused before they wrote), and the items of a call to a primary that refused it
    /// unrun, go again in one call per hash slot (declared keys, routed and redirected by the
    /// driver; sent concurrently, in waves of [`MAX_CONCURRENT_CALLS`]), and the map is read
    /// again for the next batch, as it is after a primary did not answer in time (it may have
    /// been failed over). Items that failed their checks keep their error and are not
    /// sent. Returns each item's reply, or its error.
    ///
    /// When every call fails, that is the batch's error. When some calls of a cluster batch
    /// fail and others answer, the items of a failed call get its error (each a copy; the
    /// first keeps the original) and the others their replies.
    async fn run_batch(
        &self,
        script: &LuaScript,
        per_item: usize,
        items: Vec<Result<Item>>,
    ) -> Result<Vec<Result<Value>>> {
        let valid: Vec<usize> = (0..items.len()).filter(|&i| items[i].is_ok()).collect();
        let mut answered: Vec<Answered> = Vec::new();
        if valid.is_empty() {
        } else if !self.is_cluster() {
            answered.push(self.slot_call(script, per_item, &items, valid).await);
        } else {
            let mut rest = self
                .by_primary(script, per_item, &items, valid, &mut answered)
                .await;
            rest.sort_unstable();
            let mut groups: Vec<Vec<usize>> = Vec::new();
            let mut by_slot: HashMap<Slot, usize> = HashMap::new();
            for i in rest {
                let slot = Slot::for_key(&checked(&items, i).key);
                let g = *by_slot.entry(slot).or_insert_with(|| {
                    groups.push(Vec::new());
                    groups.len() - 1
                });
                groups[g].push(i);
            }
            let mut groups = groups.into_iter();
            loop {
                let wave: Vec<_> = groups.by_ref().take(MAX_CONCURRENT_CALLS).collect();
                if wave.is_empty() {
                    break;
                }
                let calls = wave
                    .into_iter()
                    .map(|group| self.slot_call(script, per_item, &items, group));
                answered.extend(join_all(calls).await);
            }
        }

        if !answered.is_empty() && answered.iter().all(|(_, reply)| reply.is_err()) {
            let first = answered
                .into_iter()
                .next()
                .and_then(|(_, reply)| reply.err());
            return Err(first.expect("a failed call"));
        }
        let mut out: Vec<Option<Result<Value>>> = Vec::with_capacity(items.len());
        for item in items {
            out.push(item.err().map(Err));
        }
        for (group, reply) in answered {
            match reply {
                Ok(Value::Array(values)) if values.len() == group.len() => {
                    for (i, value) in group.into_iter().zip(values) {
                        out[i] = Some(Ok(value));
                    }
                }
                // One compact reply for every item (see `lua/batch.lua`).
                Ok(Value::Int(n)) => {
                    for i in group {
                        out[i] = Some(Ok(Value::Int(n)));
                    }
                }
                Ok(other) => {
                    let reason = format!(
                        "a batch of {} keys answered {other:?}, not one reply per key",
                        group.len()
                    );
                    for i in group {
                        out[i] = Some(Err(Error::backend(self.name(), reason.clone())));
                    }
                }
                Err(e) => {
                    let n = group.len();
                    for (i, e) in group.into_iter().zip(spread(self.name(), e, n)) {
                        out[i] = Some(Err(e));
                    }
                }
            }
        }
        Ok(out
            .into_iter()
            .map(|r| r.expect("every item has a result"))
            .collect())
    }

    /// One call of `script` with the keys of `group` declared (one server, or one hash slot).
    async fn slot_call(
        &self,
        script: &LuaScript,
        per_item: usize,
        items: &[Result<Item>],
        group: Vec<usize>,
    ) -> Answered {
        let first = &checked(items, group[0]).key;
        let mut call = script.call(first);
        for &i in &group[1..] {
            call.key(&checked(items, i).key);
        }
        add_args(&mut call, per_item, items, &group, false);
        let reply = self.run(first, &call).await;
        (group, reply)
    }

    /// The cluster's calls per primary: adds their answers to `answered` and returns the items
    /// to send again per slot (misplaced by the map, or refused unrun with their call; all of
    /// `valid` when the map cannot be read).
    async fn by_primary(
        &self,
        script: &LuaScript,
        per_item: usize,
        items: &[Result<Item>],
        valid: Vec<usize>,
        answered: &mut Vec<Answered>,
    ) -> Vec<usize> {
        let Ok(map) = self.slot_map().await else {
            return valid;
        };
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); map.primaries().len()];
        let mut rest = Vec::new();
        for i in valid {
            match map.primary_of(Slot::for_key(&checked(items, i).key)) {
                Some(p) => groups[p].push(i),
                None => rest.push(i),
            }
        }
        let calls: Vec<_> = groups
            .iter()
            .enumerate()
            .filter(|(_, group)| !group.is_empty())
            .map(|(p, group)| {
                let mut call = script.keyless_call();
                add_args(&mut call, per_item, items, group, true);
                (p, call)
            })
            .collect();
        let (conn, sent) = self.conn_and_counter();
        let timeout = self.config().operation_timeout;
        let replies = join_all(
            calls
                .iter()
                .map(|(p, call)| conn.invoke_on(&map.primaries()[*p], call, timeout, sent)),
        )
        .await;
        let mut stale = false;
        for ((p, _), reply) in calls.iter().zip(replies) {
            let group = std::mem::take(&mut groups[*p]);
            match reply {
                Ok(Value::Array(values)) if values.len() == group.len() => {
                    let (mut kept, mut replies) = (Vec::new(), Vec::new());
                    for (i, value) in group.into_iter().zip(values) {
                        if misplaced(&value) {
                            stale = true;
                            rest.push(i);
                        } else {
                            kept.push(i);
                            replies.push(value);
                        }
                    }
                    if !kept.is_empty() {
                        answered.push((kept, Ok(Value::Array(replies))));
                    }
                }
                Ok(other) => answered.push((group, Ok(other))),
                Err((_, true)) => {
                    stale = true;
                    rest.extend(group);
                }
                Err((e, false)) => {
                    // A primary that does not answer in time may have been failed over (cut off
                    // by the network, its connections open): its items keep the error (they may
                    // have run), and the next batch reads the map again.
                    self.after_error(&e, Some(&map));
                    answered.push((group, Err(e)));
                }
            }
        }
        if stale || !rest.is_empty() {
            self.forget_slot_map();
        }
        rest
    }

    /// An item's own script error (`{-1, message}`, raised inside the batch and caught there):
    /// a corrupt record (at the storage key `key` gives), or another server error, mapped as a
    /// single call's error would be.
    fn item_error(&self, key: impl FnOnce() -> Vec<u8>, value: &Value) -> Option<Error> {
        let Value::Array(parts) = value else {
            return None;
        };
        if !matches!(parts.first(), Some(Value::Int(-1))) {
            return None;
        }
        let message = match parts.get(1) {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            Some(Value::SimpleString(s)) => s.clone(),
            other => format!("{other:?}"),
        };
        if let Some(reason) = message.strip_prefix("IDEMCORRUPT ") {
            return Some(Error::corrupt(
                self.name(),
                String::from_utf8_lossy(&key()),
                reason,
            ));
        }
        let (code, detail) = message
            .split_once(' ')
            .map_or((message.as_str(), None), |(c, d)| (c, Some(d.to_owned())));
        Some(map_error(
            self.name(),
            redis::make_extension_error(code.to_owned(), detail),
        ))
    }

    /// Decodes the reply of one fenced item: `Ok` when applied or replayed (the compact `1` of an
    /// item a fast path took, or the body's reply), else `LeaseLost`.
    fn fenced_item(&self, lease: &Lease, reply: Result<Value>) -> Result<()> {
        let reply = reply?;
        if reply == Value::Int(1) {
            return Ok(());
        }
        let key = || self.storage_key(&lease.key);
        if let Some(e) = self.item_error(key, &reply) {
            return Err(e);
        }
        match codec::fenced(&reply).map_err(|b| codec::corrupt(self.name(), &key(), b))? {
            Fenced::Applied(_) => Ok(()),
            Fenced::Lost(found) => Err(Error::lease_lost(lease, found)),
            Fenced::Refused { index, reason } => Err(codec::corrupt(
                self.name(),
                &key(),
                codec::Bad(format!(
                    "a plain transition answered a write refusal ({index}: {reason})"
                )),
            )),
        }
    }

    pub(crate) async fn acquire_batch(
        &self,
        reqs: &[AcquireRequest],
    ) -> Result<Vec<Result<AcquireOutcome>>> {
        self.limits().check_batch(reqs.len())?;
        let items = reqs
            .iter()
            .map(|req| {
                req.validate()?;
                let fingerprint: &[u8] = match &req.fingerprint {
                    Some(fp) => fp.as_bytes(),
                    None => &[],
                };
                Ok(Item::new(self.storage_key(&req.key))
                    .arg(req.owner.as_bytes())
                    .arg(codec::millis(req.lease_ttl))
                    .arg(req.max_attempts)
                    .arg(fingerprint))
            })
            .collect();
        let replies = self.run_batch(&BATCH.acquire, 4, items).await?;
        Ok(reqs
            .iter()
            .zip(replies)
            .map(|(req, reply)| {
                let reply = reply?;
                let key = || self.storage_key(&req.key);
                if let Some(e) = self.item_error(key, &reply) {
                    return Err(e);
                }
                match reply {
                    Value::Int(token) => codec::fast_acquired(
                        token,
                        &req.key,
                        &req.owner,
                        codec::millis(req.lease_ttl),
                    ),
                    reply => codec::acquire_outcome(&reply, &req.key, &req.owner),
                }
                .map_err(|b| codec::corrupt(self.name(), &key(), b))
            })
            .collect())
    }

    pub(crate) async fn complete_batch(
        &self,
        items: &[Completion],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        let limits = self.limits();
        limits.check_batch(items.len())?;
        let checked = items
            .iter()
            .map(|c| {
                limits.check_complete(&c.result, retention)?;
                Ok(Item::new(self.storage_key(&c.lease.key))
                    .arg(c.lease.token.get())
                    .arg(c.result.as_ref())
                    .arg(codec::millis(retention)))
            })
            .collect();
        let replies = self.run_batch(&BATCH.complete, 3, checked).await?;
        Ok(self.fenced_results(items.iter().map(|c| &c.lease), replies))
    }

    pub(crate) async fn fail_batch(
        &self,
        items: &[Failure],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        let limits = self.limits();
        limits.check_batch(items.len())?;
        let checked = items
            .iter()
            .map(|f| {
                limits.check_fail(&f.error, retention)?;
                let state = codec::failed_state(f.kind).ok_or_else(|| {
                    Error::invalid(
                        "kind",
                        format!(
                            "failure kind {} is not supported by this version of idem-redis",
                            f.kind
                        ),
                    )
                })?;
                Ok(Item::new(self.storage_key(&f.lease.key))
                    .arg(f.lease.token.get())
                    .arg(f.error.as_bytes())
                    .arg(state)
                    .arg(codec::millis(retention)))
            })
            .collect();
        let replies = self.run_batch(&BATCH.fail, 4, checked).await?;
        Ok(self.fenced_results(items.iter().map(|f| &f.lease), replies))
    }

    pub(crate) async fn release_batch(&self, leases: &[Lease]) -> Result<Vec<Result<()>>> {
        self.limits().check_batch(leases.len())?;
        let checked = leases
            .iter()
            .map(|l| Ok(Item::new(self.storage_key(&l.key)).arg(l.token.get())))
            .collect();
        let replies = self.run_batch(&BATCH.release, 1, checked).await?;
        Ok(self.fenced_results(leases.iter(), replies))
    }

    fn fenced_results<'a>(
        &self,
        leases: impl Iterator<Item = &'a Lease>,
        replies: Vec<Result<Value>>,
    ) -> Vec<Result<()>> {
        leases
            .zip(replies)
            .map(|(lease, reply)| self.fenced_item(lease, reply))
            .collect()
    }
}

/// `n` errors for the `n` items of one failed call: the original for the first, and for the
/// others the same kind whose cause is the original's text (so each log line still tells what
/// happened).
fn spread(store: &'static str, e: Error, n: usize) -> Vec<Error> {
    if n <= 1 {
        return vec![e];
    }
    let (unavailable, text) = match &e {
        Error::Unavailable { source, .. } => (true, chain(source.as_ref())),
        Error::Backend { source, .. } => (false, chain(source.as_ref())),
        other => (false, other.to_string()),
    };
    let shared = Shared(Arc::from(text));
    let mut out = Vec::with_capacity(n);
    out.push(e);
    for _ in 1..n {
        let source: BoxError = Box::new(shared.clone());
        out.push(if unavailable {
            Error::unavailable(store, source)
        } else {
            Error::backend(store, source)
        });
    }
    out
}

/// An error and its causes, as one text.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// The cause shared by the items of one failed call of a cluster batch.
#[derive(Clone, Debug)]
struct Shared(Arc<str>);

impl std::fmt::Display for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Shared {}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(text: &str) -> Value {
        Value::Array(vec![
            Value::Int(-1),
            Value::BulkString(text.as_bytes().to_vec()),
        ])
    }

    #[test]
    fn a_refused_undeclared_key_is_misplaced_not_corrupt() {
        // Redis 7's refusals of an undeclared key a script touches, as the item's first read
        // answers them, and as the script's `load` wraps them.
        for refusal in [
            "ERR Script attempted to access a non local key in a cluster node",
            "ERR Script attempted to access a slot not served",
            "ERR Unable to execute command 'get' in script because undeclared keys were \
             accessed during rehashing of the slot",
            "ERR Script attempted to execute a command while the cluster is down",
        ] {
            assert!(misplaced(&item(refusal)), "{refusal}");
            let wrapped = format!("IDEMCORRUPT the key holds no idem record ({refusal})");
            assert!(misplaced(&item(&wrapped)), "{wrapped}");
        }
        assert!(!misplaced(&item(
            "IDEMCORRUPT unknown record format (the first byte is 9)"
        )));
        assert!(!misplaced(&Value::Array(vec![
            Value::Int(0),
            Value::Int(1)
        ])));
    }
}
