-- release(KEYS[1]; token) -> {1} or {0, current_token or -1}
-- Replay-safe: {1} again when the record already is released with this token.
-- The attempt is given back: attempts - 1 (never below 0), state released.
local now_us, now = clock()
local s, current, done = fence(ARGV[1], now)
if s == nil then
  -- A replay of this very release (the first run's reply was lost): already done.
  if done ~= nil and done % 10 == 1 then
    return {1}
  end
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
