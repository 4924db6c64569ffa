-- extend(KEYS[1]; token, ttl_ms) -> {1, lease_expires_at_ms} or {0, current_token or -1}
local now_us, now = clock()
local r, current = fence(ARGV[1], now)
if r == nil then
  return {0, current}
end
local ttl = tonumber(ARGV[2])
r.lease = now + ttl
r.updated = now
save(r)
return {1, now + ttl}
