-- extend(KEYS[1]; token, ttl_ms) -> {1, lease_expires_at_ms}, or a refusal (see `refused`)
-- Not a finishing transition: with the caller's token on a record no longer in progress it is
-- refused like any other stale call.
local now_us, now = clock()
local r, found = fence(ARGV[1], now)
if r == nil then
  return refused(found)
end
local ttl = tonumber(ARGV[2])
r.lease = now + ttl
r.updated = now
save(r)
return {1, now + ttl}
