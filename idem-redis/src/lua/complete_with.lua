-- complete_with(KEYS[1] the record, KEYS[1 + i] the key of write i;
--               token, result, retention_ms, then for each write i: code, argc, argc arguments)
-- -> {1}, a refusal (see `refused`), {2, i, reason}: write i (from 1) cannot apply, or an error
-- reply `NOPERM idem complete_with: ...`: the ACL of the store's user denies one of the writes
-- (or the completion's own SET), and nothing was written.
--
-- `complete` plus the handler's writes, atomically: the fence of complete.lua, then a check that
-- the store's user may run every write (ACLs), then every condition, then a check that every
-- write can apply, and only then the writes, in order, and the completion. Redis does not roll a
-- script back, so nothing below the line "Nothing has been written above this line" may fail:
-- Redis checks ACLs command by command, so each write's command is checked with
-- `redis.acl_check_cmd` first (Redis 7.0+); every way a write command can fail on data
-- (WRONGTYPE, a counter that is not an integer or would overflow, a NaN score, a stream whose
-- entry IDs are exhausted) is checked before it, and the arguments are checked by the store
-- before sending (expiries in range, no NaN, no empty XADD).
-- Replay-safe like complete.lua: {1} again, changing nothing and writing none of the writes,
-- when the record already is completed with this token and these result bytes.
local token, result, retention = ARGV[1], ARGV[2], tonumber(ARGV[3])
local now_us, now = clock()
local r, found = fence(token, now)
if r == nil then
  if replayed(found, token, COMPLETED, result) then
    return {1}
  end
  return refused(found)
end

local writes, pos = {}, 4
while pos <= #ARGV do
  local argc = tonumber(ARGV[pos + 1])
  local w = {code = ARGV[pos], key = KEYS[#writes + 2], args = {}}
  for j = 1, argc do
    w.args[j] = ARGV[pos + 1 + j]
  end
  writes[#writes + 1] = w
  pos = pos + 2 + argc
end
if #writes ~= #KEYS - 1 or pos ~= #ARGV + 1 then
  return redis.error_reply('ERR idem complete_with: ' .. #writes .. ' writes for ' .. #KEYS - 1
    .. ' keys')
end

-- The Redis command write `w` runs, name then arguments, or nil for a condition (eq, absent),
-- which runs none, and for an unknown code (refused in 3.). The ACL check (1.) and the writes
-- (4.) both run what this builds, so the commands checked are exactly those run.
-- The other writes are the command of their code's name, the key, then this many arguments.
local ARGC = {incrby = 1, decrby = 1, del = 0, pexpire = 1, hset = 2, hdel = 1, hincrby = 2,
  lpush = 1, rpush = 1, sadd = 1, srem = 1, zadd = 2, zincrby = 2, zrem = 1}
local function command_of(w)
  local c, k, a = w.code, w.key, w.args
  if c == 'set' or c == 'setnx' then
    -- setnx: the key's absence is a condition (2.); the write is a plain SET.
    if a[2] ~= nil then
      return {'SET', k, a[1], 'PX', a[2]}
    end
    return {'SET', k, a[1]}
  elseif c == 'xadd' then
    return {'XADD', k, '*', unpack(a)}
  elseif ARGC[c] ~= nil then
    return {string.upper(c), k, unpack(a, 1, ARGC[c])}
  end
  return nil
end

-- 1. May the store's user run every write? Redis checks ACLs command by command and does not
-- roll a script back: a denied command in the middle would leave the writes before it applied,
-- and every redelivery would apply them again. So every command is checked before the first
-- write, and the completion's own SET of the record too (its value does not matter to an ACL,
-- which judges the command and its keys).
local function denied(what)
  return redis.error_reply('NOPERM idem complete_with: the store\'s user may not run ' .. what
    .. '; nothing was written')
end
for i, w in ipairs(writes) do
  w.cmd = command_of(w)
  if w.cmd ~= nil and not redis.acl_check_cmd(unpack(w.cmd)) then
    return denied(w.cmd[1] .. ' on the key of write ' .. i .. ' (counted from 1)')
  end
end
if not redis.acl_check_cmd('SET', key, result, 'PXAT', int(now + retention)) then
  return denied("SET on the record's key")
end

-- 2. Conditions, against the data as it was before this call.
for i, w in ipairs(writes) do
  local c = w.code
  if c == 'absent' or c == 'setnx' then
    if redis.call('EXISTS', w.key) == 1 then
      return {2, i, 'condition failed: the key exists'}
    end
  elseif c == 'eq' then
    local t = redis.call('TYPE', w.key).ok
    if t == 'none' then
      return {2, i, 'condition failed: the key does not exist'}
    elseif t ~= 'string' then
      return {2, i, 'condition failed: the key holds a ' .. t .. ', not a string'}
    elseif redis.call('GET', w.key) ~= w.args[1] then
      return {2, i, 'condition failed: the key holds another value'}
    end
  end
end

-- 3. Can every write apply? Each written key is followed through the list: its type (from
-- TYPE, then as the writes before change it) and the values counters add to.
--
-- 64-bit integers as Redis reads them (string2ll): "0", or an optional '-' then 1 to 19 digits
-- not starting with 0, within [-2^63, 2^63 - 1]. Lua numbers are doubles, exact only up to
-- 2^53, so an integer is held as a pair {h, l}: value = h * 1e9 + l with 0 <= l < 1e9 (both
-- exact).
local E9 = 1000000000
local function parse_int(s)
  if s == '0' then
    return {0, 0}
  end
  local neg = sub(s, 1, 1) == '-'
  local digits = neg and sub(s, 2) or s
  if #digits == 0 or #digits > 19 or not string.find(digits, '^[1-9]%d*$') then
    return nil
  end
  local h = tonumber(sub(digits, 1, -10)) or 0
  local l = tonumber(sub(digits, -9))
  if neg then
    if l == 0 then
      h, l = -h, 0
    else
      h, l = -h - 1, E9 - l
    end
  end
  -- 2^63 - 1 = 9223372036 * 1e9 + 854775807; -2^63 = -9223372037 * 1e9 + 145224192
  if h > 9223372036 or (h == 9223372036 and l > 854775807)
    or h < -9223372037 or (h == -9223372037 and l < 145224192) then
    return nil
  end
  return {h, l}
end
local function add_int(a, b)
  local h, l = a[1] + b[1], a[2] + b[2]
  if l >= E9 then
    h, l = h + 1, l - E9
  end
  if h > 9223372036 or (h == 9223372036 and l > 854775807)
    or h < -9223372037 or (h == -9223372037 and l < 145224192) then
    return nil
  end
  return {h, l}
end
local function neg_int(a)
  if a[2] == 0 then
    return {-a[1], 0}
  end
  return {-a[1] - 1, E9 - a[2]}
end
local function score(s)
  if s == 'inf' or s == '+inf' then
    return math.huge
  elseif s == '-inf' then
    return -math.huge
  end
  return tonumber(s)
end

-- What the writes before have made of each key: `type`; `fresh` when every value not in
-- `vals` is absent (the key did not exist, or was deleted or overwritten by the list), else
-- values not in `vals` are read from the server; `vals` holds the string's value (under
-- `true`), each hash field's or each sorted set member's: an int pair, a score, false when
-- absent, or {text} for a value set by the list.
local keys = {}
local function key_of(k)
  local s = keys[k]
  if s == nil then
    local t = redis.call('TYPE', k).ok
    s = {type = t, fresh = t == 'none', vals = {}}
    keys[k] = s
  end
  return s
end
-- The type each write needs its key to have (or not to exist); writes not listed take any key.
local NEEDS = {incrby = 'string', decrby = 'string', hset = 'hash', hdel = 'hash',
  hincrby = 'hash', lpush = 'list', rpush = 'list', sadd = 'set', srem = 'set', zadd = 'zset',
  zincrby = 'zset', zrem = 'zset', xadd = 'stream'}
local ANY = {set = true, setnx = true, del = true, pexpire = true, eq = true, absent = true}
-- The integer under `at` in key state `s` (`true` for a string, a field for a hash), read from
-- the server with `read` when the list has not set it: a pair, or nil when not an integer.
local function int_at(s, at, read)
  local v = s.vals[at]
  if v == nil then
    if s.fresh then
      v = false
    else
      v = read() or false
    end
    if v ~= false then
      v = {v}
    end
  end
  if v == false then
    return {0, 0}
  end
  if type(v[1]) == 'string' then
    return parse_int(v[1])
  end
  return v
end

-- How many more entries XADD '*' can add to the existing stream at `k`: the IDs left after its
-- last generated one (1000, more than a call's writes, whenever the first part is not the
-- largest 64-bit number). The parts are compared as text: Lua's numbers cannot hold them.
local MAX_PART = '18446744073709551615'
local function stream_room(k)
  local info = redis.call('XINFO', 'STREAM', k)
  local last = ''
  for j = 1, #info, 2 do
    if info[j] == 'last-generated-id' then
      last = info[j + 1]
    end
  end
  local ms, seq = string.match(last, '^(%d+)-(%d+)$')
  if ms ~= MAX_PART or #seq ~= #MAX_PART or sub(seq, 1, 17) ~= sub(MAX_PART, 1, 17) then
    return 1000
  end
  return tonumber(sub(MAX_PART, 18)) - tonumber(sub(seq, 18))
end

for i, w in ipairs(writes) do
  local c, k, a = w.code, w.key, w.args
  local needs = NEEDS[c]
  if needs == nil and not ANY[c] then
    return redis.error_reply('ERR idem complete_with: unknown write ' .. tostring(c))
  end
  local s
  if needs ~= nil then
    s = key_of(k)
    if s.type ~= 'none' and s.type ~= needs then
      return {2, i, 'WRONGTYPE: the key holds a ' .. s.type .. ', ' .. string.upper(c)
        .. ' needs a ' .. needs}
    end
  end
  if c == 'set' or c == 'setnx' then
    keys[k] = {type = 'string', fresh = true, vals = {[true] = {a[1]}}}
  elseif c == 'del' then
    keys[k] = {type = 'none', fresh = true, vals = {}}
  elseif c == 'incrby' or c == 'decrby' then
    local cur = int_at(s, true, function() return redis.call('GET', k) end)
    if cur == nil then
      return {2, i, 'the value is not an integer or out of range'}
    end
    local by = parse_int(a[1])
    if c == 'decrby' then
      by = neg_int(by)
    end
    local new = add_int(cur, by)
    if new == nil then
      return {2, i, 'increment or decrement would overflow'}
    end
    s.type = 'string'
    s.vals[true] = new
  elseif c == 'hset' then
    s.type = 'hash'
    s.vals[a[1]] = {a[2]}
  elseif c == 'hdel' then
    s.vals[a[1]] = false
  elseif c == 'hincrby' then
    local cur = int_at(s, a[1], function() return redis.call('HGET', k, a[1]) end)
    if cur == nil then
      return {2, i, 'hash value is not an integer'}
    end
    local new = add_int(cur, parse_int(a[2]))
    if new == nil then
      return {2, i, 'increment or decrement would overflow'}
    end
    s.type = 'hash'
    s.vals[a[1]] = new
  elseif c == 'zadd' or c == 'zincrby' then
    local new = score(a[1])
    if c == 'zincrby' then
      local cur = s.vals[a[2]]
      if cur == nil and not s.fresh then
        cur = score(redis.call('ZSCORE', k, a[2]) or '0')
      end
      new = (cur or 0) + new
      if new ~= new then
        return {2, i, 'resulting score is not a number (NaN)'}
      end
    end
    s.type = 'zset'
    s.vals[a[2]] = new
  elseif c == 'zrem' then
    s.vals[a[1]] = false
  elseif c == 'xadd' then
    -- XADD '*' fails once the stream's last ID is the largest there is (a stream created in
    -- this call, or found absent, starts from nothing).
    s.xadds = (s.xadds or 0) + 1
    if not s.fresh and stream_room(k) < s.xadds then
      return {2, i, 'the stream has exhausted the last possible ID'}
    end
    s.type = 'stream'
  elseif needs ~= nil and c ~= 'srem' then
    -- lpush, rpush, sadd: the key now is of that type.
    s.type = needs
  end
end

-- 4. Nothing has been written above this line. The writes, in order (the commands checked in
-- 1.), then the completion.
for _, w in ipairs(writes) do
  if w.cmd ~= nil then
    redis.call(unpack(w.cmd))
  end
end
r.state = COMPLETED
r.lease = nil
r.updated = now
r.payload = result
save(r, now + retention)
return {1}
