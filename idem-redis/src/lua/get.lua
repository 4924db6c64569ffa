-- get(KEYS[1]) -> nil when absent, a tombstone or past retention, else
-- {now_ms, expires_at_ms or -1, {field, value, ...}}
local now_us, now = clock()
local exp = redis.call('PEXPIRETIME', key)
if exp == -2 or (exp >= 0 and exp <= now) then
  return false
end
if redis.call('HEXISTS', key, 's') == 0 then
  return false
end
return {now, exp, redis.call('HGETALL', key)}
