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
for first = 1, #KEYS, 1000 do
  local last = math.min(first + 999, #KEYS)
  local values = redis.call('MGET', unpack(KEYS, first, last))
  for i = first, last do
    prefetched[KEYS[i]] = values[i - first + 1]
  end
end

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

local write_one = write_value
write_value = function(v, expire_at, absent)
  if absent and CREATE_ABSENT then
    if not redis.call('SET', key, v, 'NX') then
      corrupt('the key holds no idem record (not a string)')
    end
  else
    write_one(v, expire_at)
  end
  written[key] = v
end
