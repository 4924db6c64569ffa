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
local function fast(args)
  if peek() ~= false then
    return nil
  end
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
    write_value(FAST_HEAD .. fast_prefix .. fast_suffix, nil, true)
  else
    write_value(FAST_HEAD_FP .. fast_prefix .. fp .. fast_suffix, nil, true)
  end
  return batch_us
end
