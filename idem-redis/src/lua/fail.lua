-- fail(KEYS[1]; token, error, retryable 0/1, retention_ms) -> {1} or {0, current_token or -1}
-- Replay-safe: {1} again when the record already failed with this token, error and flag.
local now_us, now = clock()
local state = 4
if ARGV[3] == '1' then
  state = 3
end
local s, current, done = fence(ARGV[1], now)
if s == nil then
  -- A replay of this very failure (the first run's reply was lost): already done.
  if done ~= nil and done % 10 == state and stored_is(ARGV[2]) then
    return {1}
  end
  return {0, current}
end
local base = math.floor(tonumber(ARGV[1]) / 1000)
redis.call('HDEL', key, 'l')
if ARGV[2] == '' then
  redis.call('HSET', key, 's', int(s + state), 'u', int(now - base))
else
  redis.call('HSET', key, 's', int(s + state), 'u', int(now - base), 'r', ARGV[2])
end
redis.call('PEXPIREAT', key, int(now + tonumber(ARGV[4])))
return {1}
