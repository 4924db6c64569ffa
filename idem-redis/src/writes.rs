//! [`RedisWrites`]: the data commands a handler commits with its completion
//! ([`TransactionalStore::complete_with`](idem_core::TransactionalStore::complete_with)).

use std::borrow::Cow;
use std::ops::Range;
use std::time::Duration;

use idem_core::{Error, MAX_RETENTION, Result};

use crate::codec;
use crate::conn::Call;

/// Most writes (commands and conditions together) one [`RedisWrites`] may carry, and most
/// field/value pairs one [`RedisWrites::xadd`] entry may carry. More is refused with
/// [`Error::InvalidInput`] (field `writes`) before anything is sent.
///
/// The bound keeps the completion script short: Redis runs a script alone, cannot stop one that
/// has written (past `busy-reply-threshold` it can only be ended with `SHUTDOWN NOSAVE`), and
/// replicates and persists it as one `MULTI`/`EXEC` block.
pub const MAX_WRITES: usize = 100;

/// The data commands a handler commits with its completion on a [`RedisStore`](crate::RedisStore),
/// in ONE `EVALSHA` of a fenced Lua script: all of them and the completion, or none.
///
/// A typed builder: only the commands below can be expressed, each with its key and arguments,
/// which travel as the script's `KEYS` and `ARGV` (never inside script text). Writes apply in
/// the order they were added.
///
/// | method | Redis command |
/// |---|---|
/// | [`set`](Self::set), [`set_expiring`](Self::set_expiring) | `SET key value [PX ms]` |
/// | [`set_if_absent`](Self::set_if_absent), [`set_if_absent_expiring`](Self::set_if_absent_expiring) | `SET key value [PX ms]`, refused when `key` exists |
/// | [`incr_by`](Self::incr_by), [`decr_by`](Self::decr_by) | `INCRBY`, `DECRBY` |
/// | [`del`](Self::del) | `DEL key` |
/// | [`expire`](Self::expire) | `PEXPIRE key ms` |
/// | [`hset`](Self::hset), [`hdel`](Self::hdel), [`hincr_by`](Self::hincr_by) | `HSET`, `HDEL`, `HINCRBY` (one field) |
/// | [`lpush`](Self::lpush), [`rpush`](Self::rpush) | `LPUSH`, `RPUSH` (one value) |
/// | [`sadd`](Self::sadd), [`srem`](Self::srem) | `SADD`, `SREM` (one member) |
/// | [`zadd`](Self::zadd), [`zincr_by`](Self::zincr_by), [`zrem`](Self::zrem) | `ZADD`, `ZINCRBY`, `ZREM` (one member) |
/// | [`xadd`](Self::xadd) | `XADD key * field value ...` |
/// | [`require_eq`](Self::require_eq), [`require_absent`](Self::require_absent) | conditions, no write |
///
/// **Conditions** ([`require_eq`](Self::require_eq), [`require_absent`](Self::require_absent) and
/// the `set_if_absent` writes) are all checked against the data as it was before the
/// completion, before anything is written; one that fails refuses the whole completion with
/// [`Error::EffectRefused`] whose `index` is its position in this list (from 0).
///
/// **No half-applied effects.** Redis does not roll a script back: a command that fails in the
/// middle (`WRONGTYPE`, an `INCRBY` on text) would leave the writes before it applied. So the
/// script first checks that every write can apply: the type of each written key (`TYPE`), and
/// the value under every counter (`INCRBY`, `DECRBY` and `HINCRBY` need an integer and must not
/// overflow 64 bits; `ZINCRBY` must not make a NaN score; `XADD` needs an entry ID left after
/// the stream's last one), following the earlier writes of the
/// same list (a `set` then an `incr_by` on the same key is checked against the value set).
/// Any write that would fail refuses the whole completion with [`Error::EffectRefused`] before
/// the first write; the record stays in progress. The check is conservative: a key emptied by an
/// earlier `hdel`/`srem`/`zrem` of the same list still counts as its old type.
///
/// **ACLs.** Redis checks ACLs command by command, inside a script too. So before the first
/// write the script also checks (`redis.acl_check_cmd`, Redis 7.0+) that the store's user may
/// run every write's command as it will run it, and the completion's own `SET` of the record; a
/// denied one refuses the whole completion with [`Error::Backend`] (the server's reply begins
/// with `NOPERM` and names the command and the write, counted from 1), nothing written, the
/// record still in progress and the lease still able to complete.
///
/// Checked before anything is sent ([`Error::InvalidInput`], field `writes`): at most
/// [`MAX_WRITES`] writes; no key equal to the record's or starting with the store's prefix
/// (records live there; with an empty prefix only the record's own key is known to be one); expiries from 1 ms to [`MAX_RETENTION`]; no NaN scores; no
/// `decr_by(i64::MIN)`; an `xadd` entry with 1 to [`MAX_WRITES`] fields; and, on a Redis Cluster,
/// every key in the record's slot (build them with
/// [`RedisStore::effect_key`](crate::RedisStore::effect_key)).
///
/// ```
/// use std::time::Duration;
/// use idem_redis::RedisWrites;
///
/// let writes = RedisWrites::new()
///     .require_absent("{idem:payments:order-42}:receipt")
///     .set_expiring("{idem:payments:order-42}:receipt", "r-981", Duration::from_secs(86_400))
///     .incr_by("{idem:payments:order-42}:charged-cents", 1250)
///     .xadd("{idem:payments:order-42}:events", [("kind", "charged"), ("cents", "1250")]);
/// assert_eq!(writes.len(), 4);
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RedisWrites {
    ops: Vec<Write>,
}

#[derive(Clone, Debug, PartialEq)]
struct Write {
    key: Vec<u8>,
    op: Op,
}

#[derive(Clone, Debug, PartialEq)]
enum Op {
    Set {
        value: Vec<u8>,
        ttl: Option<Duration>,
        if_absent: bool,
    },
    IncrBy(i64),
    DecrBy(i64),
    Del,
    Expire(Duration),
    HSet(Vec<u8>, Vec<u8>),
    HDel(Vec<u8>),
    HIncrBy(Vec<u8>, i64),
    LPush(Vec<u8>),
    RPush(Vec<u8>),
    SAdd(Vec<u8>),
    SRem(Vec<u8>),
    ZAdd(f64, Vec<u8>),
    ZIncrBy(f64, Vec<u8>),
    ZRem(Vec<u8>),
    XAdd(Vec<(Vec<u8>, Vec<u8>)>),
    RequireEq(Vec<u8>),
    RequireAbsent,
}

impl RedisWrites {
    /// No writes: [`complete_with`](idem_core::TransactionalStore::complete_with) then does what
    /// `complete` does.
    pub fn new() -> Self {
        Self::default()
    }

    fn push(mut self, key: impl Into<Vec<u8>>, op: Op) -> Self {
        self.ops.push(Write {
            key: key.into(),
            op,
        });
        self
    }

    /// `SET key value`: any previous value, of any type, and its expiry are replaced.
    pub fn set(self, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Self {
        let op = Op::Set {
            value: value.into(),
            ttl: None,
            if_absent: false,
        };
        self.push(key, op)
    }

    /// `SET key value PX ttl`: as [`set`](Self::set), expiring after `ttl` (1 ms to
    /// [`MAX_RETENTION`], whole milliseconds).
    pub fn set_expiring(
        self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        ttl: Duration,
    ) -> Self {
        let op = Op::Set {
            value: value.into(),
            ttl: Some(ttl),
            if_absent: false,
        };
        self.push(key, op)
    }

    /// `SET key value` when `key` does not exist; when it does, the whole completion is refused
    /// with [`Error::EffectRefused`] (a condition, checked before any write).
    pub fn set_if_absent(self, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Self {
        let op = Op::Set {
            value: value.into(),
            ttl: None,
            if_absent: true,
        };
        self.push(key, op)
    }

    /// [`set_if_absent`](Self::set_if_absent), expiring after `ttl` (`SET key value PX ttl`).
    pub fn set_if_absent_expiring(
        self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        ttl: Duration,
    ) -> Self {
        let op = Op::Set {
            value: value.into(),
            ttl: Some(ttl),
            if_absent: true,
        };
        self.push(key, op)
    }

    /// `INCRBY key by`. The key must be absent (counts from 0) or hold a 64-bit integer, and the
    /// sum must fit in 64 bits; otherwise the completion is refused ([`Error::EffectRefused`]).
    pub fn incr_by(self, key: impl Into<Vec<u8>>, by: i64) -> Self {
        self.push(key, Op::IncrBy(by))
    }

    /// `DECRBY key by`, checked as [`incr_by`](Self::incr_by); `by` must not be `i64::MIN`.
    pub fn decr_by(self, key: impl Into<Vec<u8>>, by: i64) -> Self {
        self.push(key, Op::DecrBy(by))
    }

    /// `DEL key` (a key that does not exist is fine).
    pub fn del(self, key: impl Into<Vec<u8>>) -> Self {
        self.push(key, Op::Del)
    }

    /// `PEXPIRE key ttl`: the key expires after `ttl` (1 ms to [`MAX_RETENTION`], whole
    /// milliseconds). A key that does not exist is left absent.
    pub fn expire(self, key: impl Into<Vec<u8>>, ttl: Duration) -> Self {
        self.push(key, Op::Expire(ttl))
    }

    /// `HSET key field value`. The key must be absent or a hash.
    pub fn hset(
        self,
        key: impl Into<Vec<u8>>,
        field: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
    ) -> Self {
        self.push(key, Op::HSet(field.into(), value.into()))
    }

    /// `HDEL key field`. The key must be absent or a hash.
    pub fn hdel(self, key: impl Into<Vec<u8>>, field: impl Into<Vec<u8>>) -> Self {
        self.push(key, Op::HDel(field.into()))
    }

    /// `HINCRBY key field by`. The key must be absent or a hash, the field absent (counts from
    /// 0) or a 64-bit integer, and the sum must fit in 64 bits.
    pub fn hincr_by(self, key: impl Into<Vec<u8>>, field: impl Into<Vec<u8>>, by: i64) -> Self {
        self.push(key, Op::HIncrBy(field.into(), by))
    }

    /// `LPUSH key value`. The key must be absent or a list.
    pub fn lpush(self, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Self {
        self.push(key, Op::LPush(value.into()))
    }

    /// `RPUSH key value`. The key must be absent or a list.
    pub fn rpush(self, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Self {
        self.push(key, Op::RPush(value.into()))
    }

    /// `SADD key member`. The key must be absent or a set.
    pub fn sadd(self, key: impl Into<Vec<u8>>, member: impl Into<Vec<u8>>) -> Self {
        self.push(key, Op::SAdd(member.into()))
    }

    /// `SREM key member`. The key must be absent or a set.
    pub fn srem(self, key: impl Into<Vec<u8>>, member: impl Into<Vec<u8>>) -> Self {
        self.push(key, Op::SRem(member.into()))
    }

    /// `ZADD key score member`. The key must be absent or a sorted set; `score` must not be NaN
    /// (infinities are fine).
    pub fn zadd(self, key: impl Into<Vec<u8>>, score: f64, member: impl Into<Vec<u8>>) -> Self {
        self.push(key, Op::ZAdd(score, member.into()))
    }

    /// `ZINCRBY key by member`. The key must be absent or a sorted set, `by` must not be NaN,
    /// and the new score must not be NaN (`inf` plus `-inf`).
    pub fn zincr_by(self, key: impl Into<Vec<u8>>, by: f64, member: impl Into<Vec<u8>>) -> Self {
        self.push(key, Op::ZIncrBy(by, member.into()))
    }

    /// `ZREM key member`. The key must be absent or a sorted set.
    pub fn zrem(self, key: impl Into<Vec<u8>>, member: impl Into<Vec<u8>>) -> Self {
        self.push(key, Op::ZRem(member.into()))
    }

    /// `XADD key * field value ...`: appends an entry (1 to [`MAX_WRITES`] fields) with an id
    /// the server picks. The key must be absent or a stream.
    pub fn xadd<F, V>(
        self,
        key: impl Into<Vec<u8>>,
        fields: impl IntoIterator<Item = (F, V)>,
    ) -> Self
    where
        F: Into<Vec<u8>>,
        V: Into<Vec<u8>>,
    {
        let fields = fields
            .into_iter()
            .map(|(f, v)| (f.into(), v.into()))
            .collect();
        self.push(key, Op::XAdd(fields))
    }

    /// A condition: `key` must hold the string `value` (a key of another type, or absent, fails
    /// it), or the whole completion is refused with [`Error::EffectRefused`]. Writes nothing.
    pub fn require_eq(self, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Self {
        self.push(key, Op::RequireEq(value.into()))
    }

    /// A condition: `key` must not exist, or the whole completion is refused with
    /// [`Error::EffectRefused`]. Writes nothing.
    pub fn require_absent(self, key: impl Into<Vec<u8>>) -> Self {
        self.push(key, Op::RequireAbsent)
    }

    /// How many writes and conditions there are.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The key of every write and condition, in order (with repeats).
    pub fn keys(&self) -> impl Iterator<Item = &[u8]> {
        self.ops.iter().map(|w| w.key.as_slice())
    }

    /// The checks that need no server: count, reserved keys, argument ranges. `record` is the
    /// record's storage key and `prefix` the store's key prefix.
    pub(crate) fn check(&self, record: &[u8], prefix: &str) -> Result<()> {
        if self.ops.len() > MAX_WRITES {
            return Err(invalid(format!(
                "{} writes, the most one completion carries is {MAX_WRITES}",
                self.ops.len()
            )));
        }
        for (index, w) in self.ops.iter().enumerate() {
            let key = String::from_utf8_lossy(&w.key);
            if w.key == record {
                return Err(invalid(format!(
                    "write {index} targets the record's own key {key:?}"
                )));
            }
            if !prefix.is_empty() && w.key.starts_with(prefix.as_bytes()) {
                return Err(invalid(format!(
                    "write {index} targets {key:?}, under the store's prefix {prefix:?} where \
                     records live"
                )));
            }
            let expiry = match &w.op {
                Op::Set { ttl: Some(ttl), .. } | Op::Expire(ttl) => Some(*ttl),
                _ => None,
            };
            if let Some(ttl) = expiry
                && (ttl < Duration::from_millis(1) || ttl > MAX_RETENTION)
            {
                return Err(invalid(format!(
                    "write {index} expires after {ttl:?}; it must be between 1ms and \
                     {MAX_RETENTION:?}"
                )));
            }
            match &w.op {
                Op::ZAdd(score, _) | Op::ZIncrBy(score, _) if score.is_nan() => {
                    return Err(invalid(format!("write {index} has a NaN score")));
                }
                Op::DecrBy(i64::MIN) => {
                    return Err(invalid(format!(
                        "write {index} decrements by i64::MIN, which Redis refuses; use incr_by"
                    )));
                }
                Op::XAdd(fields) if fields.is_empty() || fields.len() > MAX_WRITES => {
                    return Err(invalid(format!(
                        "write {index} appends a stream entry of {} fields; it must have 1 to \
                         {MAX_WRITES}",
                        fields.len()
                    )));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Adds every write to `call` (see `complete_with.lua`): its key as the next `KEYS` entry, and
    /// `code, argc, args...` to `ARGV`.
    pub(crate) fn encode<'a>(&'a self, call: &mut Call<'a>) {
        fn num(n: impl ToString) -> Cow<'static, [u8]> {
            Cow::Owned(n.to_string().into_bytes())
        }
        for w in &self.ops {
            call.key(&w.key);
            let b = |v: &'a Vec<u8>| Cow::Borrowed(v.as_slice());
            let (code, args): (&str, Vec<Cow<'a, [u8]>>) = match &w.op {
                Op::Set {
                    value,
                    ttl,
                    if_absent,
                } => {
                    let mut args = vec![b(value)];
                    args.extend(ttl.map(|t| num(codec::millis(t))));
                    (if *if_absent { "setnx" } else { "set" }, args)
                }
                Op::IncrBy(by) => ("incrby", vec![num(by)]),
                Op::DecrBy(by) => ("decrby", vec![num(by)]),
                Op::Del => ("del", vec![]),
                Op::Expire(ttl) => ("pexpire", vec![num(codec::millis(*ttl))]),
                Op::HSet(field, value) => ("hset", vec![b(field), b(value)]),
                Op::HDel(field) => ("hdel", vec![b(field)]),
                Op::HIncrBy(field, by) => ("hincrby", vec![b(field), num(by)]),
                Op::LPush(value) => ("lpush", vec![b(value)]),
                Op::RPush(value) => ("rpush", vec![b(value)]),
                Op::SAdd(member) => ("sadd", vec![b(member)]),
                Op::SRem(member) => ("srem", vec![b(member)]),
                Op::ZAdd(score, member) => ("zadd", vec![num(score_text(*score)), b(member)]),
                Op::ZIncrBy(by, member) => ("zincrby", vec![num(score_text(*by)), b(member)]),
                Op::ZRem(member) => ("zrem", vec![b(member)]),
                Op::XAdd(fields) => (
                    "xadd",
                    fields.iter().flat_map(|(f, v)| [b(f), b(v)]).collect(),
                ),
                Op::RequireEq(value) => ("eq", vec![b(value)]),
                Op::RequireAbsent => ("absent", vec![]),
            };
            call.arg(code).arg(args.len());
            for arg in &args {
                call.arg(arg.as_ref());
            }
        }
    }
}

/// A score as Redis and Lua both read it back exactly: `inf`, `-inf`, or the shortest
/// round-tripping decimal in exponent form.
fn score_text(score: f64) -> String {
    if score == f64::INFINITY {
        "inf".to_owned()
    } else if score == f64::NEG_INFINITY {
        "-inf".to_owned()
    } else {
        format!("{score:e}")
    }
}

fn invalid(reason: String) -> Error {
    Error::invalid("writes", reason)
}

/// Where the hash tag Redis Cluster hashes `key` by lies in it: the byte range between its first
/// `{` and the first `}` after it, when that range is not empty (Cluster specification, "Hash
/// tags"); the braces are the bytes just before and just after it.
pub(crate) fn hash_tag_span(key: &[u8]) -> Option<Range<usize>> {
    let open = key.iter().position(|&b| b == b'{')?;
    let len = key[open + 1..].iter().position(|&b| b == b'}')?;
    (len > 0).then(|| open + 1..open + 1 + len)
}

/// The hash tag Redis Cluster hashes `key` by (see [`hash_tag_span`]).
pub(crate) fn hash_tag(key: &[u8]) -> Option<&[u8]> {
    hash_tag_span(key).map(|span| &key[span])
}

/// A `{tag}` that puts a key in the same Cluster slot as `storage_key`: its own hash tag when it
/// has one, else the whole key when it holds no `}`; `None` when neither works (the key hashes
/// whole and holds a `}`, which would end any tag around it).
pub(crate) fn slot_tag(storage_key: &str) -> Option<String> {
    let tag = match hash_tag(storage_key.as_bytes()) {
        // The tag ends before the first `}` after a `{`: both are ASCII, so it is a char
        // boundary of the text.
        Some(tag) => std::str::from_utf8(tag).ok()?,
        // `{}` is no tag: an empty key (never a storage key) has none.
        None if storage_key.contains('}') || storage_key.is_empty() => return None,
        None => storage_key,
    };
    Some(format!("{{{tag}}}"))
}

#[cfg(test)]
mod tests {
    use redis::cluster_routing::Slot;

    use super::*;

    #[test]
    fn hash_tags_follow_the_cluster_spec() {
        assert_eq!(hash_tag(b"{user1000}.following"), Some(&b"user1000"[..]));
        assert_eq!(hash_tag(b"foo{}{bar}"), None);
        assert_eq!(hash_tag(b"foo{{bar}}zap"), Some(&b"{bar"[..]));
        assert_eq!(hash_tag(b"foo{bar}{zap}"), Some(&b"bar"[..]));
        assert_eq!(hash_tag(b"no tag"), None);
        assert_eq!(hash_tag(b"open{only"), None);
        assert_eq!(hash_tag(b"}{x}"), Some(&b"x"[..]));
        assert_eq!(hash_tag_span(b"{idem}:payments:order-42"), Some(1..5));
        assert_eq!(hash_tag_span(b"idem:payments:{alice}:m"), Some(15..20));
        assert_eq!(hash_tag_span(b"foo{}{bar}"), None);
        assert_eq!(hash_tag_span(b"foo{{bar}}zap"), Some(4..8));
    }

    /// Whatever the storage key, a key built under its slot tag lands in its slot, or there is
    /// no such tag and the key hashes whole with a `}` in it.
    #[test]
    fn slot_tags_share_the_record_slot() {
        let keys = [
            "idem:payments:order-42",
            "idem:payments:{alice}:msg-1",
            "{idem}:payments:order-42",
            "idem:p:a{b",
            "idem:p:{}x{y}",
            "idem:p:}x",
            "idem:p:{{bar}}zap",
            "idem:p:ordre-été",
            "idem:p:{été}",
            "",
        ];
        for key in keys {
            match slot_tag(key) {
                Some(tag) => {
                    for suffix in ["", ":effects", "{x}", "}"] {
                        let effect = format!("{tag}{suffix}");
                        assert_eq!(
                            Slot::for_key(&effect),
                            Slot::for_key(key),
                            "{key:?} -> {effect:?}"
                        );
                    }
                }
                None => assert!(
                    hash_tag(key.as_bytes()).is_none() && (key.contains('}') || key.is_empty()),
                    "{key:?}"
                ),
            }
        }
        assert_eq!(slot_tag("idem:p:}x"), None);
        assert_eq!(slot_tag("idem:p:{}x{y}"), None);
        assert_eq!(slot_tag("idem:p:{alice}:m").as_deref(), Some("{alice}"));
        assert_eq!(slot_tag("idem:p:k").as_deref(), Some("{idem:p:k}"));
    }

    #[test]
    fn bad_writes_are_refused_before_sending() {
        let ok = RedisWrites::new().set("{r}:a", "1");
        assert!(ok.check(b"r", "idem:").is_ok());
        let cases = [
            (0..=MAX_WRITES).fold(RedisWrites::new(), |w, i| w.del(format!("{{r}}:{i}"))),
            RedisWrites::new().set("r", "record"),
            RedisWrites::new().set("idem:ns:other", "a record"),
            RedisWrites::new().expire("{r}:a", Duration::ZERO),
            RedisWrites::new().set_expiring("{r}:a", "v", MAX_RETENTION + Duration::from_secs(1)),
            RedisWrites::new().zadd("{r}:z", f64::NAN, "m"),
            RedisWrites::new().zincr_by("{r}:z", f64::NAN, "m"),
            RedisWrites::new().decr_by("{r}:n", i64::MIN),
            RedisWrites::new().xadd("{r}:s", Vec::<(&str, &str)>::new()),
        ];
        for writes in cases {
            let r = writes.check(b"r", "idem:");
            assert!(
                matches!(
                    r,
                    Err(Error::InvalidInput {
                        field: "writes",
                        ..
                    })
                ),
                "{writes:?}: {r:?}"
            );
        }
        // An empty prefix reserves only the record's key.
        assert!(RedisWrites::new().set("x", "1").check(b"r", "").is_ok());
        assert!(
            (0..MAX_WRITES)
                .fold(RedisWrites::new(), |w, i| w.del(format!("{{r}}:{i}")))
                .check(b"r", "idem:")
                .is_ok()
        );
    }

    #[test]
    fn scores_read_back_exactly() {
        for score in [
            0.0,
            -0.0,
            1.5,
            -2.25e-300,
            1e300,
            f64::MAX,
            f64::MIN_POSITIVE,
            0.1,
        ] {
            let text = score_text(score);
            assert_eq!(
                text.parse::<f64>().unwrap().to_bits(),
                score.to_bits(),
                "{text}"
            );
        }
        assert_eq!(score_text(f64::INFINITY), "inf");
        assert_eq!(score_text(f64::NEG_INFINITY), "-inf");
    }
}
