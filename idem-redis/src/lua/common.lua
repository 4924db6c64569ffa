-- Shared prelude of every idem script (the Rust side puts it after the `#!lua` line and before
-- the script's own body).
--
-- One hash per key, KEYS[1]. Fields (see the crate docs for the full layout):
--   t  fencing token, an integer (microseconds of the server clock when issued, or previous + 1)
--   s  attempts * 10 + state (0 in progress, 1 released, 2 completed, 3 failed retryable,
--      4 failed terminal)
--   o  owner of the last acquisition
--   f  fingerprint, 32 raw bytes; absent when the caller opted out
--   c  created_at, as milliseconds BEFORE base = floor(t / 1000); absent when 0
--   u  updated_at, as milliseconds after base
--   l  lease end, as milliseconds after base; only while in progress
--   r  stored result (completed) or error (failed); absent when empty
-- The retention deadline is the key's own expiry (PEXPIREAT); in-progress and released records
-- have none. A hash holding only `t` is a tombstone left by delete (absent to every script, it
-- keeps tokens growing; it expires after 7 days). All times come from the server clock (TIME), in milliseconds.

local key = KEYS[1]

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

local function corrupt(what)
  return redis.error_reply('IDEMCORRUPT ' .. what)
end

-- Whether the key carries a retention deadline that has passed.
local function past_retention(now)
  local exp = redis.call('PEXPIRETIME', key)
  return exp >= 0 and exp <= now
end

-- The fence of every transition after acquire: the record exists (a hash without `s` is a
-- tombstone left by delete, which counts as absent), is not past retention, is in progress and
-- carries `token` (decimal text, compared as text). Returns the packed `s` value; or nil, the
-- current token (-1 when the record is absent, a tombstone or past retention) and, when the
-- record carries `token` but is no longer in progress, its packed `s` value (so that the caller
-- can recognise a replay of its own transition).
local function fence(token, now)
  local h = redis.call('HMGET', key, 't', 's')
  if h[1] == nil or h[1] == false then
    return nil, -1
  end
  local s = tonumber(h[2])
  if s == nil or past_retention(now) then
    return nil, -1
  end
  if h[1] == token then
    if s % 10 == 0 then
      return s
    end
    return nil, tonumber(h[1]), s
  end
  return nil, tonumber(h[1])
end

-- Whether the stored result or error (`r`, absent when empty) is `value`.
local function stored_is(value)
  return (redis.call('HGET', key, 'r') or '') == value
end
