-- Shared prelude of every idem script (the Rust side puts it after the `#!lua` line and before
-- the script's own body).
--
-- One Redis string per key, KEYS[1], packed as follows (the crate docs, "Storage layout", have
-- the same table):
--   1 byte    head: 128 (format 1) + state + 8 (fingerprint) + 16 (created) + 32 (lease);
--             state 0 in progress, 1 released, 2 completed, 3 failed retryable,
--             4 failed terminal, 5 failed result not stored (terminal: the work ran, its result
--             could not be kept), 7 tombstone (left by delete: only the token follows); state 6
--             and flag 64 are reserved. A head is 128..191, never the first byte of UTF-8 text,
--             so no text value under the prefix is mistaken for a record
--   8 bytes   fencing token, unsigned big-endian
--   varint    attempts
--   zigzag    updated_at - base, in ms, where base = floor(token / 1000)
--   zigzag    base - created_at, in ms; only with flag 16 (absent when 0: on a first
--             acquisition, unless its token had to be above the clock)
--   zigzag    lease end - base, in ms; only with flag 32, which is set exactly while in progress
--   32 bytes  fingerprint; only with flag 8 (absent when the caller opted out)
--   varint    owner length in bytes, then the owner
--   the rest  stored result (completed) or error (failed); empty in other states. It has no
--             length of its own (a byte more per record): Redis keeps values whole, and a value
--             cut inside it by someone else cannot be told from a shorter result
-- varint is unsigned LEB128 (7 bits a byte, low first); zigzag stores a signed n as varint(2n)
-- when n >= 0, else varint(-2n - 1). The retention deadline is the key's own expiry (PXAT);
-- in-progress and released records have none. All times come from the server clock (TIME), in
-- milliseconds since the Unix epoch. Tokens stay below 2^53, so Lua's numbers hold them exactly;
-- the fence compares the stored token's decimal text with the caller's, character for character.

local key = KEYS[1]

local FORMAT = 128
-- States (the low 3 bits of the head byte).
local IN_PROGRESS, RELEASED, COMPLETED = 0, 1, 2
local FAILED_RETRYABLE, FAILED_TERMINAL, FAILED_NOT_STORED = 3, 4, 5
local TOMBSTONE = 7

-- Decimal text of an integer-valued number, never in exponent notation.
local function int(n)
  return string.format('%d', n)
end

-- The server clock: microseconds and milliseconds since the Unix epoch.
local function clock()
  local t = redis.call('TIME')
  local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  return us, math.floor(us / 1000)
end

-- Aborts the script with `IDEMCORRUPT <what>`, which the store reports as a corrupt record.
local function corrupt(what)
  error({err = 'IDEMCORRUPT ' .. what})
end

-- Whether the key carries a retention deadline that has passed.
local function past_retention(now)
  local exp = redis.call('PEXPIRETIME', key)
  return exp >= 0 and exp <= now
end

local byte, char, sub, floor = string.byte, string.char, string.sub, math.floor

local function varint(n)
  if n < 128 then
    return char(n)
  end
  local out = ''
  repeat
    local b = n % 128
    n = (n - b) / 128
    if n > 0 then
      b = b + 128
    end
    out = out .. char(b)
  until n == 0
  return out
end

local function zigzag(n)
  if n >= 0 then
    return varint(2 * n)
  end
  return varint(-2 * n - 1)
end

-- The varint at byte `pos` of `v`, and the position after it.
local function read_varint(v, pos)
  local b = byte(v, pos)
  if b ~= nil and b < 128 then
    return b, pos + 1
  end
  local n, scale = 0, 1
  while true do
    if b == nil then
      corrupt('record truncated in an integer')
    end
    if scale > 2 ^ 49 then
      corrupt('integer longer than 8 bytes')
    end
    pos = pos + 1
    if b < 128 then
      return n + b * scale, pos
    end
    n = n + (b - 128) * scale
    scale = scale * 128
    b = byte(v, pos)
  end
end

local function read_zigzag(v, pos)
  local z, next_pos = read_varint(v, pos)
  if z % 2 == 0 then
    return z / 2, next_pos
  end
  return -(z + 1) / 2, next_pos
end

-- How `load` reads the value at `key` (the value, false when there is none, or an error table)
-- and `save` writes it (`absent`: the caller found no key there): one GET, one SET. A batch
-- script replaces both (lua/batch_prelude.lua).
local function read_value()
  return redis.pcall('GET', key)
end

local function write_value(v, expire_at, absent)
  if expire_at == nil then
    redis.call('SET', key, v)
  else
    redis.call('SET', key, v, 'PXAT', int(expire_at))
  end
end

-- The record at `key`: nil when there is no key, else a table with `state`, `token` (a number)
-- and `tok` (its 8 stored bytes); unless it is a tombstone also `attempts`, `updated`,
-- `created`, `lease` (absolute ms; `lease` only while in progress), `fp` (nil when none),
-- `owner` and `payload`. A value that is not a record aborts the script (IDEMCORRUPT).
local function load()
  local v = read_value()
  if type(v) == 'table' then
    corrupt('the key holds no idem record (' .. tostring(v.err) .. ')')
  end
  if not v then
    return nil
  end
  local head = byte(v, 1)
  if head == nil or head < FORMAT or head >= FORMAT + 64 or #v < 9 then
    corrupt('unknown record format')
  end
  local state = head % 8
  local tok = sub(v, 2, 9)
  -- Tokens stay below 2^53 (see above): a larger one would not stay exact, nor rise by one.
  if byte(tok, 1) ~= 0 or byte(tok, 2) >= 32 then
    corrupt('token of 2^53 or more')
  end
  local token = struct.unpack('>I8', tok)
  if state == TOMBSTONE then
    if head ~= FORMAT + TOMBSTONE or #v ~= 9 then
      corrupt('malformed tombstone')
    end
    return {state = state, tok = tok, token = token}
  end
  if state > FAILED_NOT_STORED then
    corrupt('unknown state ' .. int(state))
  end
  local flags = (head - FORMAT - state) / 8
  local base = floor(token / 1000)
  local attempts, updated, created, lease, fp, n, pos
  attempts, pos = read_varint(v, 10)
  n, pos = read_zigzag(v, pos)
  updated = base + n
  created = base
  if flags % 4 >= 2 then
    n, pos = read_zigzag(v, pos)
    created = base - n
  end
  if flags >= 4 then
    n, pos = read_zigzag(v, pos)
    lease = base + n
  end
  if (state == 0) ~= (lease ~= nil) then
    corrupt('lease present in state ' .. int(state) .. ' or missing in progress')
  end
  if flags % 2 == 1 then
    fp = sub(v, pos, pos + 31)
    if #fp ~= 32 then
      corrupt('record truncated in the fingerprint')
    end
    pos = pos + 32
  end
  n, pos = read_varint(v, pos)
  local owner = sub(v, pos, pos + n - 1)
  if #owner ~= n then
    corrupt('record truncated in the owner')
  end
  local payload = sub(v, pos + n)
  if state <= 1 and payload ~= '' then
    corrupt('bytes after the owner in state ' .. int(state))
  end
  return {state = state, tok = tok, token = token, attempts = attempts, updated = updated,
    created = created, lease = lease, fp = fp, owner = owner, payload = payload}
end

-- Writes record `r` (as `load` returns it, times absolute; `tok` nil when `token` is new) at
-- `key`, with `expire_at` (ms since the epoch) as the key's expiry, or none when nil. SET drops
-- any earlier expiry. `absent`: `load` found no key there.
local function save(r, expire_at, absent)
  local base = floor(r.token / 1000)
  local head = FORMAT + r.state
  local created, lease, fp = '', '', ''
  if r.created ~= base then
    head = head + 16
    created = zigzag(base - r.created)
  end
  if r.lease ~= nil then
    head = head + 32
    lease = zigzag(r.lease - base)
  end
  if r.fp ~= nil then
    head = head + 8
    fp = r.fp
  end
  local v = char(head) .. (r.tok or struct.pack('>I8', r.token)) .. varint(r.attempts)
    .. zigzag(r.updated - base) .. created .. lease .. fp .. varint(#r.owner) .. r.owner
    .. r.payload
  write_value(v, expire_at, absent)
end

-- The fence of every transition after acquire: the record exists (a tombstone counts as
-- absent), is not past retention, is in progress and carries the token whose decimal text is
-- `token` (compared as text: exact whatever the caller sends). Returns the record; or nil and
-- what was found instead: the record, or nil when it is absent, a tombstone or past retention.
local function fence(token, now)
  local r = load()
  -- A record in progress never carries a retention deadline (`save` writes it without one), so
  -- only the others are looked up.
  if r == nil or r.state == TOMBSTONE or (r.state ~= IN_PROGRESS and past_retention(now)) then
    return nil, nil
  end
  if int(r.token) ~= token or r.state ~= IN_PROGRESS then
    return nil, r
  end
  return r
end

-- Whether `found` (what `fence` refused) is exactly what a finishing transition with `token`
-- leaves behind: the caller's token, state `state` and stored bytes `payload`. Such a call is a
-- re-send of a transition that already took effect (its reply was lost): it answers as applied
-- and changes nothing.
local function replayed(found, token, state, payload)
  return found ~= nil and found.state == state and found.payload == payload
    and int(found.token) == token
end

-- The reply of a refused transition: {0} when there is no record (absent, a tombstone or past
-- retention), else {0, token, state} of the record found, so that the caller can say whether its
-- token was superseded or the record is no longer in progress.
local function refused(found)
  if found == nil then
    return {0}
  end
  return {0, found.token, found.state}
end
