-- delete(KEYS[1]) -> 1 when a record (not past retention) was there, else 0
local now_us, now = clock()
local exp = redis.call('PEXPIRETIME', key)
if exp == -2 then
  return 0
end
redis.call('DEL', key)
if exp >= 0 and exp <= now then
  return 0
end
return 1
