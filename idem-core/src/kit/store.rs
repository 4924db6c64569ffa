//! [`KitStore`]: the state machine over a [`CasBackend`].

use std::fmt;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;

use super::codec::{self, Stored, micros, namespace_prefix, parse_storage_key, storage_key};
use super::{Cas, CasBackend, Contended, KitOptions, Versioned};
use crate::error::{Error, Result};
use crate::key::IdempotencyKey;
use crate::list::{Cursor, ListQuery, Page};
use crate::machine::{self, AcquireDecision, Finish, Finished};
use crate::record::{
    AcquireOutcome, AcquireRequest, FailureKind, FencingToken, Lease, Limits, Record,
    check_lease_ttl,
};
use crate::store::IdempotencyStore;

/// Keys one `purge_expired` scan asks for at a time.
const PURGE_PAGE: usize = 256;

/// A complete [`IdempotencyStore`] over a [`CasBackend`]: the reference state machine, the
/// record encoding, tombstones, the input checks, replays, conflict and lost-reply handling.
/// See the [module docs](super) for what each call costs and how it behaves.
///
/// Cloning is as cheap as cloning the backend (wrap it in an `Arc` to share it).
#[derive(Clone)]
pub struct KitStore<B> {
    backend: B,
    options: KitOptions,
}

impl<B: CasBackend> fmt::Debug for KitStore<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KitStore")
            .field("backend", &self.backend)
            .field("options", &self.options)
            .finish()
    }
}

/// What a decision over the loaded value asks for.
enum Step<T> {
    /// Answer `T` without writing.
    Answer(T),
    /// Write this value (conditionally on what was loaded), then answer `T`.
    Write(Bytes, T),
}

impl<B: CasBackend> KitStore<B> {
    /// A store over `backend` with the default [`KitOptions`].
    pub fn new(backend: B) -> Self {
        Self::with_options(backend, KitOptions::default())
    }

    /// A store over `backend` with `options`.
    pub fn with_options(backend: B, options: KitOptions) -> Self {
        Self { backend, options }
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The options.
    pub fn options(&self) -> &KitOptions {
        &self.options
    }

    async fn now(&self) -> Result<SystemTime> {
        let now = match self.backend.now().await? {
            Some(now) => now,
            None => self.options.clock.now(),
        };
        crate::clock::checked(self.backend.name(), now)
    }

    fn decode(
        &self,
        key: &IdempotencyKey,
        loaded: &Option<Versioned<B::Version>>,
    ) -> Result<Option<Stored>> {
        loaded
            .as_ref()
            .map(|v| codec::decode(self.backend.name(), key, &v.value))
            .transpose()
    }

    /// Loads `key`, lets `decide` choose from what it holds, and writes what it asks for
    /// conditionally on the loaded version: again from a fresh load after a conflict, and after
    /// an ambiguous write unless the reload shows the bytes written.
    async fn update<T>(
        &self,
        key: &IdempotencyKey,
        mut decide: impl FnMut(Option<&Stored>, SystemTime) -> Result<Step<T>> + Send,
    ) -> Result<T>
    where
        T: Send,
    {
        let raw = storage_key(key);
        let now = self.now().await?;
        let mut loaded = self.backend.load(&raw).await?;
        let (mut conflicts, mut ambiguous) = (0u32, 0u32);
        loop {
            let stored = self.decode(key, &loaded)?;
            let (value, answer) = match decide(stored.as_ref(), now)? {
                Step::Answer(answer) => return Ok(answer),
                Step::Write(value, answer) => (value, answer),
            };
            let expected = loaded.as_ref().map(|v| &v.version);
            match self.backend.store(&raw, value.clone(), expected).await {
                Ok(Cas::Written) => return Ok(answer),
                Ok(Cas::Conflict) => {
                    conflicts += 1;
                    if conflicts > self.options.max_conflicts {
                        return Err(Error::unavailable(
                            self.backend.name(),
                            Contended { conflicts },
                        ));
                    }
                    loaded = self.backend.load(&raw).await?;
                }
                Err(e @ Error::Unavailable { .. }) => {
                    ambiguous += 1;
                    if ambiguous > self.options.max_ambiguous {
                        return Err(e);
                    }
                    // The write may have happened: look.
                    loaded = match self.backend.load(&raw).await {
                        Ok(reloaded) => reloaded,
                        Err(_) => return Err(e),
                    };
                    if loaded.as_ref().is_some_and(|v| v.value == value) {
                        return Ok(answer);
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn finish(&self, lease: &Lease, how: Finish<'_>) -> Result<()> {
        self.update(&lease.key, |stored, now| {
            let mut record = stored.and_then(Stored::record).cloned();
            match machine::finish(record.as_mut(), lease, how, now)? {
                Finished::Applied => {
                    let record = record.expect("an applied finish had a record");
                    Ok(Step::Write(codec::encode(&Stored::Record(record)), ()))
                }
                Finished::Replayed => Ok(Step::Answer(())),
            }
        })
        .await
    }
}

/// How far, in microseconds, a new token is put past `max(previous + 1, now)`: at random below
/// this (2^20 µs, about one second).
pub(crate) const TOKEN_SPREAD: u64 = 1 << 20;

/// `max(previous + 1, now in microseconds)`, plus a random `0..TOKEN_SPREAD`: strictly above
/// the token the key holds (live, past retention or a tombstone), and above every earlier token
/// once the key's value is gone, as long as the clock has not stepped back by more than the
/// tombstone time.
///
/// The random part is what makes the check after an ambiguous write sound (`update`: the key
/// holding exactly the bytes written means the write happened): without it, two acquisitions
/// of a key by one owner in the same microsecond write equal bytes, and one whose write failed
/// would take the other's record for its own and answer `Acquired` too, both holders passing
/// the fence. With it they differ but once in 2^20 such coincidences.
///
/// `None` when no such token fits in 64 bits (a token or a clock near the end of the range: a
/// foreign value or a broken clock; real tokens are about 2^51). Reusing the largest token
/// instead would give a new holder the token of the one it took over, and both would pass the
/// fence.
fn next_token(
    store: &'static str,
    previous: Option<FencingToken>,
    now: SystemTime,
) -> Result<Option<FencingToken>> {
    // 2^20 is a power of two, so the low bits of a uniform u64 are uniform below it.
    let random = getrandom::u64()
        .map_err(|e| Error::backend(store, format!("no random number for a new token: {e}")))?;
    Ok(next_token_from(previous, now, random % TOKEN_SPREAD))
}

/// [`next_token`] with its random part given.
fn next_token_from(
    previous: Option<FencingToken>,
    now: SystemTime,
    spread: u64,
) -> Option<FencingToken> {
    let after = match previous {
        Some(t) => t.get().checked_add(1)?,
        None => 1,
    };
    after
        .max(micros(now))
        .checked_add(spread)
        .map(FencingToken::new)
}

#[async_trait]
impl<B: CasBackend> IdempotencyStore for KitStore<B> {
    fn name(&self) -> &'static str {
        self.backend.name()
    }

    fn limits(&self) -> Limits {
        self.options.limits
    }

    async fn acquire(&self, req: &AcquireRequest) -> Result<AcquireOutcome> {
        req.validate()?;
        self.update(&req.key, |stored, now| {
            let previous = stored.map(Stored::token);
            let record = stored.and_then(Stored::record);
            let token = next_token(self.backend.name(), previous, now)?;
            let mut short = false;
            let decision = machine::acquire(record, req, now, || {
                token.unwrap_or_else(|| {
                    short = true;
                    FencingToken::new(u64::MAX)
                })
            });
            if short {
                return Err(Error::corrupt(
                    self.backend.name(),
                    req.key.to_string(),
                    format!(
                        "its fencing token ({}) or the clock is at the end of the 64-bit range: \
                         no higher token exists to give a new holder",
                        previous.map_or(0, FencingToken::get)
                    ),
                ));
            }
            match decision {
                AcquireDecision::Write(record, mut outcome) => {
                    if let AcquireOutcome::Acquired { lease, .. } = &mut outcome {
                        lease.expires_at = codec::stored_time(lease.expires_at);
                    }
                    Ok(Step::Write(codec::encode(&Stored::Record(record)), outcome))
                }
                AcquireDecision::Keep(outcome) => Ok(Step::Answer(outcome)),
            }
        })
        .await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Lease> {
        check_lease_ttl(ttl)?;
        self.update(&lease.key, |stored, now| {
            let mut record = stored.and_then(Stored::record).cloned();
            let live = machine::check_fence(record.as_mut(), lease, now)?;
            let mut extended = machine::extend(live, lease, ttl, now);
            extended.expires_at = codec::stored_time(extended.expires_at);
            let value = codec::encode(&Stored::Record(live.clone()));
            Ok(Step::Write(value, extended))
        })
        .await
    }

    async fn complete(&self, lease: &Lease, result: Bytes, retention: Duration) -> Result<()> {
        self.options.limits.check_complete(&result, retention)?;
        self.finish(
            lease,
            Finish::Complete {
                result: &result,
                retention,
            },
        )
        .await
    }

    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        self.options.limits.check_fail(error, retention)?;
        self.finish(
            lease,
            Finish::Fail {
                error,
                kind,
                retention,
            },
        )
        .await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.finish(lease, Finish::Release).await
    }

    /// One `load`.
    async fn get(&self, key: &IdempotencyKey) -> Result<Option<Record>> {
        let now = self.now().await?;
        let loaded = self.backend.load(&storage_key(key)).await?;
        Ok(match self.decode(key, &loaded)? {
            Some(Stored::Record(r)) if !r.is_expired(now) => Some(r),
            _ => None,
        })
    }

    /// One `load` plus one `store`: the record becomes a tombstone holding its token (see the
    /// [module docs](super)). A record past retention or a tombstone is left as it is
    /// (`false`).
    async fn delete(&self, key: &IdempotencyKey) -> Result<bool> {
        self.update(key, |stored, now| match stored {
            Some(Stored::Record(r)) if !r.is_expired(now) => Ok(Step::Write(
                codec::encode(&Stored::Tombstone(r.token)),
                true,
            )),
            _ => Ok(Step::Answer(false)),
        })
        .await
    }

    /// One [`scan`](CasBackend::scan) of the namespace's keys from the cursor, `limit` keys
    /// long (it asks for one more, to give a cursor only when a key follows), filtered here: a page may hold fewer records than the limit (tombstones, records
    /// past retention and records that do not match are skipped) while more follow. Keys come in
    /// byte order; the cursor is the last key scanned, in hexadecimal. A value that does not
    /// decode fails the page with [`Error::CorruptRecord`].
    async fn list(&self, query: &ListQuery) -> Result<Page> {
        query.validate()?;
        let name = self.backend.name();
        let prefix = namespace_prefix(&query.namespace);
        let after = match &query.cursor {
            None => None,
            Some(c) => Some(
                hex::decode(c.as_str())
                    .ok()
                    .filter(|raw| raw.starts_with(&prefix))
                    .ok_or_else(|| Error::invalid("cursor", "is not a cursor of this listing"))?,
            ),
        };
        let now = self.now().await?;
        // One key more than the page reads: the cursor is given only when a key follows.
        let mut scanned = match self
            .backend
            .scan(&prefix, after.as_deref(), query.limit + 1)
            .await
        {
            Err(Error::Unsupported { .. }) => {
                return Err(Error::Unsupported {
                    store: name,
                    operation: "list",
                });
            }
            other => other?,
        };
        let more = scanned.len() > query.limit;
        scanned.truncate(query.limit);
        let next = more
            .then(|| scanned.last().map(|s| Cursor::new(hex::encode(&s.key))))
            .flatten();
        let mut records = Vec::new();
        for entry in scanned {
            let key = parse_storage_key(name, &entry.key)?;
            if key.namespace() != &query.namespace {
                continue;
            }
            if let Stored::Record(r) = codec::decode(name, &key, &entry.value.value)?
                && !r.is_expired(now)
                && query.matches(&r, now)
            {
                records.push(r);
            }
        }
        Ok(Page::new(records, next))
    }

    /// Scans every key ([`scan`](CasBackend::scan) with an empty prefix, in pages): a record
    /// past retention becomes a tombstone, and a tombstone or a record past retention whose
    /// token the clock passed by [`KitOptions::tombstone_ttl`] is removed; each counts. A key
    /// that changes meanwhile (a conflict) or does not decode is skipped. O(keys held). Without
    /// `scan`, answers `Ok(0)`.
    async fn purge_expired(&self, limit: usize) -> Result<u64> {
        if limit == 0 {
            return Ok(0);
        }
        let name = self.backend.name();
        let now = self.now().await?;
        let aged = |token: FencingToken| {
            micros(now).saturating_sub(token.get())
                >= u64::try_from(self.options.tombstone_ttl.as_micros()).unwrap_or(u64::MAX)
        };
        let mut purged = 0usize;
        let mut after: Option<Vec<u8>> = None;
        loop {
            let page = match self.backend.scan(&[], after.as_deref(), PURGE_PAGE).await {
                Err(Error::Unsupported { .. }) => return Ok(purged as u64),
                other => other?,
            };
            let full = page.len() >= PURGE_PAGE;
            after = page.last().map(|s| s.key.clone());
            for entry in page {
                let Ok(key) = parse_storage_key(name, &entry.key) else {
                    continue;
                };
                let Ok(stored) = codec::decode(name, &key, &entry.value.value) else {
                    continue;
                };
                let expired = match &stored {
                    Stored::Record(r) => r.is_expired(now),
                    Stored::Tombstone(_) => true,
                };
                if !expired {
                    continue;
                }
                let version = &entry.value.version;
                let done = if aged(stored.token()) {
                    self.backend.delete(&entry.key, version).await?
                } else if let Stored::Record(r) = &stored {
                    let tombstone = codec::encode(&Stored::Tombstone(r.token));
                    self.backend
                        .store(&entry.key, tombstone, Some(version))
                        .await?
                } else {
                    continue; // a tombstone still needed
                };
                if done == Cas::Written {
                    purged += 1;
                    if purged >= limit {
                        return Ok(purged as u64);
                    }
                }
            }
            if !full {
                return Ok(purged as u64);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_rise_over_the_previous_and_follow_the_clock() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_micros(1_000);
        let token = |previous: Option<u64>, now, spread| {
            next_token_from(previous.map(FencingToken::new), now, spread)
                .unwrap()
                .get()
        };
        assert_eq!(token(None, t, 0), 1_000);
        assert_eq!(token(Some(5), t, 0), 1_000);
        assert_eq!(token(Some(1_000), t, 0), 1_001);
        assert_eq!(token(Some(9_999), t, 0), 10_000);
        assert_eq!(token(None, SystemTime::UNIX_EPOCH, 0), 1);
        assert_eq!(token(Some(9_999), t, 7), 10_007);
        assert_eq!(token(Some(u64::MAX - 8), t, 7), u64::MAX);
        let none = |previous: Option<u64>, now, spread| {
            next_token_from(previous.map(FencingToken::new), now, spread)
        };
        assert_eq!(none(Some(u64::MAX - 1), t, 7), None, "no saturation");
        assert_eq!(none(Some(u64::MAX), t, 0), None);
        let end = SystemTime::UNIX_EPOCH + Duration::from_micros(u64::MAX - 3);
        assert_eq!(none(None, end, 7), None, "a clock at the end of the range");
    }

    #[test]
    fn two_acquisitions_in_one_microsecond_get_different_tokens() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let tokens: std::collections::HashSet<u64> = (0..64)
            .map(|_| next_token("t", None, t).unwrap().unwrap().get())
            .collect();
        // 64 draws of 2^20 collide with a chance of about 1 in 500: more than one equal pair
        // would be a broken spread.
        assert!(tokens.len() >= 63, "{} distinct of 64", tokens.len());
        let base = micros(t);
        assert!(
            tokens
                .iter()
                .all(|&k| (base..base + TOKEN_SPREAD).contains(&k))
        );
    }
}
