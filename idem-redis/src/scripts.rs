//! The Lua scripts, one per transition, compiled into the binary.

use std::sync::LazyLock;

use redis::Script;

use crate::conn::Call;

const COMMON: &str = include_str!("lua/common.lua");

/// One of the store's Lua scripts, as the server runs it.
///
/// The store loads scripts by itself (`SCRIPT LOAD` when it connects, `EVAL` with the full
/// source when a node answers `NOSCRIPT`); this is for tools and operators, for instance to
/// preload them or to call one from `redis-benchmark`.
#[derive(Debug)]
#[non_exhaustive]
pub struct LuaScript {
    /// The transition it implements: `acquire`, `extend`, `complete`, `fail`, `release`, `get`,
    /// `delete` or `complete_with` (the transactional completion); or a batch of one
    /// (`acquire_many`, `complete_many`, `fail_many`, `release_many`: see
    /// [`lua_batch_scripts`](crate::lua_batch_scripts)).
    pub name: &'static str,
    /// The full source sent with `SCRIPT LOAD`.
    pub source: String,
    script: Script,
}

impl LuaScript {
    /// The SHA-1 that `EVALSHA` takes, in lower-case hex.
    pub fn sha1(&self) -> &str {
        self.script.get_hash()
    }

    /// A call of this script without declared keys, arguments to follow (a batch's items of
    /// many slots, sent to the primary serving them).
    pub(crate) fn keyless_call(&self) -> Call<'_> {
        Call::keyless(&self.script, &self.source)
    }

    /// A call of this script on `key`, arguments to follow.
    pub(crate) fn call<'a>(&'a self, key: &'a [u8]) -> Call<'a> {
        Call::new(&self.script, &self.source, key)
    }
}

/// Every script the store runs. Each touches exactly one key (`KEYS[1]`), except
/// `complete_with`, which also writes the handler's keys (`KEYS[2..]`, in the record's Cluster
/// slot).
pub(crate) struct Scripts {
    pub(crate) acquire: LuaScript,
    pub(crate) extend: LuaScript,
    pub(crate) complete: LuaScript,
    pub(crate) complete_with: LuaScript,
    pub(crate) fail: LuaScript,
    pub(crate) release: LuaScript,
    pub(crate) get: LuaScript,
    pub(crate) delete: LuaScript,
}

/// `#!lua` (Redis 7 script flags: none, so the script may write and may only touch the keys it
/// declares), then the shared prelude, then the body.
fn build(name: &'static str, body: &str) -> LuaScript {
    let source = format!("#!lua\n{COMMON}\n{body}");
    LuaScript {
        name,
        script: Script::new(&source),
        source,
    }
}

/// A batch script: the prelude, the batch prelude (`lua/batch_prelude.lua`: one `TIME` per
/// call, the records read with one `MGET`), the single-key `body` wrapped as the function `one`,
/// the transition's `fast` path (a Lua chunk defining `local function fast(args)`, or `None`),
/// then the loop of `lua/batch.lua`, which calls `fast`, then `one` when `fast` declined, once
/// per key, in order. The batch thus runs the very code of the single-key script, but for the
/// cases a fast path takes, where it writes the same bytes by a shorter way. `create_absent`:
/// the transition may create a record where there is none (acquire), which it then writes with
/// `SET NX`.
pub(crate) fn build_batch(
    name: &'static str,
    body: &str,
    fast: Option<&str>,
    create_absent: bool,
) -> LuaScript {
    let fast = fast.unwrap_or("local function fast(args) end");
    let source = format!(
        "#!lua flags=allow-cross-slot-keys\n{COMMON}\nlocal CREATE_ABSENT = {create_absent}\n{}\nlocal function one(ARGV)\n{body}\nend\n{fast}\n{}",
        include_str!("lua/batch_prelude.lua"),
        include_str!("lua/batch.lua")
    );
    LuaScript {
        name,
        script: Script::new(&source),
        source,
    }
}

pub(crate) static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    acquire: build("acquire", include_str!("lua/acquire.lua")),
    extend: build("extend", include_str!("lua/extend.lua")),
    complete: build("complete", include_str!("lua/complete.lua")),
    complete_with: build("complete_with", include_str!("lua/complete_with.lua")),
    fail: build("fail", include_str!("lua/fail.lua")),
    release: build("release", include_str!("lua/release.lua")),
    get: build("get", include_str!("lua/get.lua")),
    delete: build("delete", include_str!("lua/delete.lua")),
});

/// The store's scripts: `acquire`, `extend`, `complete`, `fail`, `release`, `get`, `delete`,
/// `complete_with`.
pub fn lua_scripts() -> [&'static LuaScript; 8] {
    let s = &*SCRIPTS;
    [
        &s.acquire,
        &s.extend,
        &s.complete,
        &s.fail,
        &s.release,
        &s.get,
        &s.delete,
        &s.complete_with,
    ]
}
