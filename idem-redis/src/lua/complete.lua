-- complete(KEYS[1]; token, result, retention_ms) -> {1} or {0, current_token or -1}
-- Replay-safe: {1} again when the record already is completed with this token and this result.
local now_us, now = clock()
local s, current, done = fence(ARGV[1], now)
if s == nil then
  -- A replay of this very completion (the first run's reply was lost): already done.
  if done ~= nil and done % 10 == 2 and stored_is(ARGV[2]) then
    return {1}
  end
  return {0, current}
end
local base = math.floor(tonumber(ARGV[1]) / 1000)
redis.call('HDEL', key, 'l')
if ARGV[2] == '' then
  redis.call('HSET', key, 's', int(s + 2), 'u', int(now - base))
else
  redis.call('HSET', key, 's', int(s + 2), 'u', int(now - base), 'r', ARGV[2])
end
redis.call('PEXPIREAT', key, int(now + tonumber(ARGV[3])))
return {1}
