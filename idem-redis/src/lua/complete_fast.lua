-- The fast path of a completion batch (see lua/batch.lua): the record is in progress with the
-- caller's token, in the form `save` writes it. The single-key body would then `load` it, pass
-- the fence (in progress, this token; an in-progress record has no retention to check) and
-- `save` it completed: the same head less the lease flag, the same token, attempts, creation
-- time, fingerprint and owner, the updated time now, no lease, the result, the retention as
-- expiry. This copies the unchanged bytes instead of decoding and encoding them. Any record it
-- does not take for certain (another state, another token, a field not as `save` writes it: a
-- varint with a needless zero byte, a creation time of zero written, bytes after the owner, a
-- value cut short) answers nil and goes to the single-key body, which decides. The batch test
-- `fast_paths_write_exactly_what_the_single_key_bodies_write` checks both give the same bytes.
--
-- Records of one acquire batch differ in their fingerprints only: the same head, token,
-- attempts, times and lease, the same owner. So once a record has been read field by field
-- and taken, the next one presented with the same token is first compared with it, as bytes,
-- outside its fingerprint: the part before the fingerprint and the part after it (the owner's
-- length and bytes, which end the record). A record equal to it there has its fields in the
-- same places with the same values, so the completed record is the same head (made once) then
-- its own fingerprint, owner and the result. Any other record is read field by field as
-- before. One such record is kept per token, since a completion batch often holds the records
-- of several acquire batches, interleaved.
--
-- Its reply is the compact form of the body's `{1}`: the number 1 (see lua/batch.lua).

-- The position after the varint at `pos` of `v` and its value, or nil when it is cut short,
-- longer than 7 bytes or not as `varint` writes it (a last byte of zero after others).
local function skip(v, pos)
  local first, n, scale = pos, 0, 1
  while true do
    local b = byte(v, pos)
    if b == nil or pos - first >= 7 then
      return nil
    end
    pos = pos + 1
    if b < 128 then
      if b == 0 and pos - first > 1 then
        return nil
      end
      return pos, n + b * scale
    end
    n = n + (b - 128) * scale
    scale = scale * 128
  end
end

local FAST_DONE = 1
local fast_retention, fast_expiry
-- Per token (its decimal text), the last record taken with it, outside its fingerprint (see
-- above): {the length of the part before the fingerprint, that part, the fingerprint's length
-- (32 or 0), the part after it, the completed record's head}.
local shapes = {}
-- The last token seen, its decimal text and its updated time's zigzag varint: an acquire batch
-- gives every record it creates the same token, so a completion batch usually meets one.
local fast_token, fast_token_text, fast_updated
-- The completed record's write, and `written` noted, as `write_value` makes them in a
-- completion batch (a SET with the expiry), with the expiry's text made once per retention.
local function write_done(done, retention)
  if retention ~= fast_retention then
    fast_retention, fast_expiry = retention, int(batch_ms + tonumber(retention))
  end
  redis.call('SET', key, done, 'PXAT', fast_expiry)
  written[key] = done
  return FAST_DONE
end

local function fast(args)
  local v = peek()
  if not v or args[2] == nil or tonumber(args[3]) == nil then
    return nil
  end
  local shape = shapes[args[1]]
  if shape ~= nil then
    local before_fp = shape[1]
    if sub(v, 1, before_fp) == shape[2] and sub(v, before_fp + shape[3] + 1) == shape[4] then
      return write_done(shape[5] .. sub(v, before_fp + 1) .. args[2], args[3])
    end
  end
  -- In progress (state 0 and the lease flag 32), flags 8 and 16 as they come; a token below
  -- 2^53 (its first byte 0, its second below 32).
  local head, t1, t2 = byte(v, 1, 3)
  if #v < 13 or head < FORMAT + 32 or head >= FORMAT + 64 or head % 8 ~= IN_PROGRESS
    or t1 ~= 0 or t2 >= 32 then
    return nil
  end
  local token = struct.unpack('>I8', sub(v, 2, 9))
  if token ~= fast_token then
    fast_token, fast_token_text = token, int(token)
    fast_updated = zigzag(batch_ms - floor(token / 1000))
  end
  if fast_token_text ~= args[1] then
    return nil
  end
  local updated_at = skip(v, 10)
  local after_updated = updated_at and skip(v, updated_at)
  if after_updated == nil then
    return nil
  end
  local lease_at = after_updated
  if head % 32 >= 16 then
    lease_at = skip(v, after_updated)
    -- A creation time of zero (one byte, 0) is not written by `save`.
    if lease_at == nil or lease_at == after_updated + 1 and byte(v, after_updated) == 0 then
      return nil
    end
  end
  local after_lease = skip(v, lease_at)
  if after_lease == nil then
    return nil
  end
  local owner_at = after_lease
  if head % 16 >= 8 then
    owner_at = owner_at + 32
  end
  -- The owner (its length, then its bytes) ends the record: an in-progress one has no payload.
  local owner_len_end, n = skip(v, owner_at)
  if owner_len_end == nil or owner_len_end + n ~= #v + 1 then
    return nil
  end
  local done_head = char(head - 32 + COMPLETED) .. sub(v, 2, updated_at - 1)
    .. fast_updated .. sub(v, after_updated, lease_at - 1)
  shapes[fast_token_text] = {after_lease - 1, sub(v, 1, after_lease - 1), owner_at - after_lease,
    sub(v, owner_at), done_head}
  return write_done(done_head .. sub(v, after_lease) .. args[2], args[3])
end
