-- get(KEYS[1]) -> nil when absent, a tombstone or past retention, else
-- {state, token, attempts, created_ms, updated_ms, lease_end_ms or -1, fingerprint or '',
--  owner, result or error, expires_at_ms or -1}
local now_us, now = clock()
local r = load()
if r == nil or r.state == TOMBSTONE then
  return false
end
local exp = redis.call('PEXPIRETIME', key)
if exp >= 0 and exp <= now then
  return false
end
return {r.state, r.token, r.attempts, r.created, r.updated, r.lease or -1, r.fp or '', r.owner,
  r.payload, exp}
