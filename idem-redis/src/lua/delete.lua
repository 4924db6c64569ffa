-- delete(KEYS[1]) -> 1 when a record (not past retention, not a tombstone) was there, else 0.
-- The record is replaced by a tombstone holding only its token, {t = token}, which expires after
-- 7 days (604800000 ms): the next acquire then issues a token above the deleted one even if the
-- server clock stepped back meanwhile. Every script treats a tombstone as an absent record.
local now_us, now = clock()
local exp = redis.call('PEXPIRETIME', key)
if exp == -2 then
  return 0
end
if exp >= 0 and exp <= now then
  redis.call('DEL', key)
  return 0
end
local h = redis.call('HMGET', key, 't', 's')
if h[1] and not h[2] then
  return 0
end
redis.call('DEL', key)
if tonumber(h[1]) ~= nil then
  redis.call('HSET', key, 't', h[1])
  redis.call('PEXPIRE', key, 604800000)
end
return 1
