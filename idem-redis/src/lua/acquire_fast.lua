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
local fast_owner, fast_lease, fast_prefix, fast_suffix, fast_reply
local function fast(args)
  if peek() ~= false then
    return nil
  end
  local owner, lease, fp = args[1], args[2], args[4] or ''
  local ms = tonumber(lease)
  if owner == nil or ms == nil then
    return nil
  end
  if owner ~= fast_owner or lease ~= fast_lease then
    -- The token is the clock in µs, so its base (floor(token / 1000)) is `batch_ms`: the
    -- updated time is 0 from it and the creation time is not written. The lease end is
    -- computed as the body does (`now + lease`, then less the base), rounding included.
    fast_prefix = struct.pack('>I8', batch_us) .. varint(1) .. zigzag(0)
      .. zigzag((batch_ms + ms) - batch_ms)
    fast_suffix = varint(#owner) .. owner
    fast_reply = {0, batch_us, 1, batch_ms + ms, 0}
    fast_owner, fast_lease = owner, lease
  end
  if fp == '' then
    write_value(char(FORMAT + IN_PROGRESS + 32) .. fast_prefix .. fast_suffix, nil, true)
  else
    write_value(char(FORMAT + IN_PROGRESS + 40) .. fast_prefix .. fp .. fast_suffix, nil, true)
  end
  return fast_reply
end
