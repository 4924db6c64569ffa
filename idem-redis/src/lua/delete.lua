-- delete(KEYS[1]) -> 1 when a record (not past retention, not a tombstone) was there, else 0.
-- The record is replaced by a tombstone holding only its token (head byte 135, then the 8 token
-- bytes), which expires after 7 days (604800000 ms): the next acquire then issues a token above
-- the deleted one even if the server clock stepped back meanwhile. Every script treats a
-- tombstone as an absent record.
local now_us, now = clock()
local exp = redis.call('PEXPIRETIME', key)
if exp == -2 then
  return 0
end
if exp >= 0 and exp <= now then
  -- Past retention: absent. Redis drops the key itself within the millisecond.
  return 0
end
local r = load()
if r.state == TOMBSTONE then
  return 0
end
redis.call('SET', key, string.char(FORMAT + TOMBSTONE) .. r.tok, 'PX', 604800000)
return 1
