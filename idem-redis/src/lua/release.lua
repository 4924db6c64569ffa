-- release(KEYS[1]; token) -> {1} or {0, current_token or -1}
-- The attempt is given back: attempts - 1 (never below 0), state released.
local now_us, now = clock()
local s, current = fence(ARGV[1], now)
if s == nil then
  return {0, current}
end
local base = math.floor(tonumber(ARGV[1]) / 1000)
local attempts = s / 10
if attempts > 0 then
  attempts = attempts - 1
end
redis.call('HDEL', key, 'l')
redis.call('HSET', key, 's', int(attempts * 10 + 1), 'u', int(now - base))
return {1}
