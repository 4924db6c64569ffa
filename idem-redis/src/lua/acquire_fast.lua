-- The fast path of an acquire batch (see lua/batch.lua): a key found absent (`peek`), which no
-- earlier item wrote. The single-key body would take its `r == nil` branch: a first
-- attempt, token the server clock in µs, created and updated now, the lease from now, no
-- expiry, written as created (`absent`; with declared keys that includes a key of another type,
-- which MGET reads as false: the SET NX then refuses it as the body's would). This builds the
-- same record by concatenation: what such items of the call share (the token, the times, the
-- owner's varint and bytes) is built again only when the owner or the lease differs from the
-- item before. Anything else (a record, a key an earlier item wrote, a lease that is not a
-- number) answers nil and goes to the single-key body. The batch test
-- `fast_paths_write_exactly_what_the_single_key_bodies_write` checks both give the same bytes.
-- Its reply is the compact form of the body's `{0, token, 1, lease end, 0}`: the token alone
-- (a number; see lua/batch.lua), from which the caller, who sent the lease, rebuilds the rest:
-- attempt 1, the lease end floor(token / 1000) + lease (the token's base is `batch_ms`), no
-- takeover. Converting one integer costs the server less than a table of five.
local fast_owner, fast_lease, fast_prefix, fast_suffix
-- The head of a record in progress without and with a fingerprint.
local FAST_HEAD, FAST_HEAD_FP = char(FORMAT + IN_PROGRESS + 32), char(FORMAT + IN_PROGRESS + 40)
-- The record a first attempt with the item's `args` creates, or nil when the body must decide.
local function fresh(args)
  local owner, lease, fp = args[1], args[2], args[4] or ''
  local ms = tonumber(lease)
  -- The compact reply stands for a lease of whole milliseconds, whose end the server counts
  -- exactly (below 2^53): any other lease, which the store never sends, goes to the body.
  if owner == nil or ms == nil or ms % 1 ~= 0 or ms < 0 or ms >= 2 ^ 40 then
    return nil
  end
  if owner ~= fast_owner or lease ~= fast_lease then
    -- The token is the clock in µs, so its base (floor(token / 1000)) is `batch_ms`: the
    -- updated time is 0 from it and the creation time is not written. The lease end is
    -- computed as the body does (`now + lease`, then less the base), rounding included.
    fast_prefix = struct.pack('>I8', batch_us) .. varint(1) .. zigzag(0)
      .. zigzag((batch_ms + ms) - batch_ms)
    fast_suffix = varint(#owner) .. owner
    fast_owner, fast_lease = owner, lease
  end
  if fp == '' then
    return FAST_HEAD .. fast_prefix .. fast_suffix
  end
  return FAST_HEAD_FP .. fast_prefix .. fp .. fast_suffix
end

local function fast(args)
  if peek() ~= false then
    return nil
  end
  local v = fresh(args)
  if v == nil then
    return nil
  end
  write_value(v, nil, true)
  return batch_us
end

-- The shortcut of a call with declared `keys` (KEYS), all of them distinct and absent: each
-- item's record as `fast` makes it, all written by one MSETNX, which writes them all or none
-- (none when any key exists, of whatever type). Replies the token alone, in place of one reply
-- per item: every item was acquired as `fast` answers for it (lua/batch.lua). Otherwise (a key
-- twice, an argument `fresh` declines, a key that exists, more than 500 keys, the MSETNX
-- refused) it has written nothing and answers nil, and the call goes item by item. `args`
-- holds the shared arguments, `own` the positions of the others, and ARGV[at] is the first
-- item's first own argument. The test `the_all_fresh_shortcut_writes_what_the_fast_path_writes`
-- checks both give the same bytes.
all_fresh = function(keys, args, own, at)
  if #keys > 500 then
    return nil
  end
  local seen, kv = {}, {}
  for i = 1, #keys do
    local k = keys[i]
    if seen[k] then
      return nil
    end
    seen[k] = true
    for _, j in ipairs(own) do
      args[j] = ARGV[at]
      at = at + 1
    end
    local v = fresh(args)
    if v == nil then
      return nil
    end
    kv[2 * i - 1], kv[2 * i] = k, v
  end
  -- Refused (a server out of memory, an ACL), it wrote nothing: item by item, each item then
  -- gets the error its own write meets.
  if redis.pcall('MSETNX', unpack(kv)) == 1 then
    return batch_us
  end
  return nil
end
