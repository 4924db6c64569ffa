-- complete(KEYS[1]; token, result, retention_ms) -> {1} or {0, current_token or -1}
local now_us, now = clock()
local s, current = fence(ARGV[1], now)
if s == nil then
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
