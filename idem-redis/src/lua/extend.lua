-- extend(KEYS[1]; token, ttl_ms) -> {1, lease_expires_at_ms} or {0, current_token or -1}
local now_us, now = clock()
local s, current = fence(ARGV[1], now)
if s == nil then
  return {0, current}
end
local base = math.floor(tonumber(ARGV[1]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('HSET', key, 'l', int(now + ttl - base), 'u', int(now - base))
return {1, now + ttl}
