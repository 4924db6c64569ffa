-- The prelude of a batch script, after the shared one: the clock, and how records are read and
-- written. The single-key body that follows sees these in place of the shared ones.
--
-- The clock: the server clock is read once per call (one `TIME`), and every item of the batch
-- is judged at that instant, as if the whole batch happened at once (Redis itself judges key
-- expiry at the script's start).
local batch_us, batch_ms = clock()
local function clock()
  return batch_us, batch_ms
end

-- Reads: with declared keys (one server, or one hash slot of a cluster) every record is read up
-- front with one MGET, and a record an earlier item of the batch wrote is read as it wrote it.
-- MGET answers false both for an absent key and for a key holding something other than a
-- string: an item finding false reads its key again with GET, which tells the two apart (and
-- raises IDEMCORRUPT on the latter), except in an acquire batch (CREATE_ABSENT), whose write to
-- a key it found absent is a SET NX: should the key hold something else, the SET changes
-- nothing and the item fails as corrupt, as its GET would have made it. Without declared keys
-- (a cluster primary's items of many slots, which one MGET cannot read) each item reads its
-- key with GET.
-- (One MGET per 1,000 keys: `unpack` has a bounded stack, and a store may allow larger batches.)
local prefetched, written = {}, {}
local function prefetch()
  for first = 1, #KEYS, 1000 do
    local last = math.min(first + 999, #KEYS)
    local values = redis.call('MGET', unpack(KEYS, first, last))
    for i = first, last do
      prefetched[KEYS[i]] = values[i - first + 1]
    end
  end
end
-- An acquire batch's shortcut for a call whose keys are all absent (lua/acquire_fast.lua), or
-- nil.
local all_fresh

read_value = function()
  local v = written[key]
  if v == nil then
    v = prefetched[key]
  end
  if v == nil or (v == false and not CREATE_ABSENT) then
    return redis.pcall('GET', key)
  end
  return v
end

-- What a fast path (lua/batch.lua) starts from: the key's value as the body's first read would
-- find it (false: no key, or with declared keys possibly one of another type, which an acquire's
-- SET NX then refuses), or nil when the item must go to the body. With declared keys that is
-- what an earlier item wrote or the MGET read; without (a cluster primary's items of many slots)
-- the key is read here with GET and kept, so that the body, should the fast path decline, reads
-- it from there (an absent key it reads again, as always); a read refused (a key of another
-- type, a key this node does not serve) answers nil, and the body reads the key again and
-- answers as it always does.
local function peek()
  local v = written[key]
  if v == nil then
    v = prefetched[key]
  end
  if v == nil then
    v = redis.pcall('GET', key)
    if type(v) == 'table' then
      return nil
    end
    prefetched[key] = v
  end
  return v
end

-- Writes: each item's write takes effect at once, except in an acquire batch with declared keys,
-- whose writes (none of them with an expiry) wait for the end of the call (`flush`): one
-- `MSETNX` for the keys the batch found absent and one `MSET` for the others, in place of a
-- `SET` per item. The result is the same: the value a key ends with is its last item's, and a
-- key holding another type is not overwritten (should an `MSETNX` find any key present, its keys
-- go again one `SET NX` each, and a key refused there fails its items as corrupt).
local DEFER = CREATE_ABSENT and #KEYS > 0
-- Why a key of another type is refused where an acquire would create a record.
local NOT_A_STRING = 'the key holds no idem record (not a string)'
local created, updated, deferred = {}, {}, {}
local write_one = write_value
write_value = function(v, expire_at, absent)
  if DEFER and expire_at == nil then
    if not deferred[key] then
      deferred[key] = true
      if absent then
        created[#created + 1] = key
      else
        updated[#updated + 1] = key
      end
    end
  elseif absent and CREATE_ABSENT then
    if not redis.call('SET', key, v, 'NX') then
      corrupt(NOT_A_STRING)
    end
  else
    write_one(v, expire_at)
  end
  written[key] = v
end

-- The keys whose deferred write failed, each with the error its items answer.
local failed_writes = {}

-- `command` (MSET or MSETNX) over `keys`, 500 at a time; MSETNX's refused groups go again a
-- `SET NX` per key.
local function write_all(command, keys)
  for first = 1, #keys, 500 do
    local kv = {}
    for i = first, math.min(first + 499, #keys) do
      kv[#kv + 1] = keys[i]
      kv[#kv + 1] = written[keys[i]]
    end
    local reply = redis.pcall(command, unpack(kv))
    if type(reply) == 'table' and reply.err ~= nil then
      for i = 1, #kv, 2 do
        failed_writes[kv[i]] = reply.err
      end
    elseif command == 'MSETNX' and reply == 0 then
      for i = 1, #kv, 2 do
        local one_reply = redis.pcall('SET', kv[i], kv[i + 1], 'NX')
        if type(one_reply) == 'table' and one_reply.err ~= nil then
          failed_writes[kv[i]] = one_reply.err
        elseif not one_reply then
          failed_writes[kv[i]] = 'IDEMCORRUPT ' .. NOT_A_STRING
        end
      end
    end
  end
end

-- Makes the deferred writes (nothing when there are none).
local function flush()
  write_all('MSETNX', created)
  write_all('MSET', updated)
end
