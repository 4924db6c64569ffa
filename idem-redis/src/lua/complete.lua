-- complete(KEYS[1]; token, result, retention_ms) -> {1}, or a refusal (see `refused`)
-- Replay-safe: {1} again, changing nothing, when the record already is completed with this token
-- and these result bytes.
local now_us, now = clock()
local r, found = fence(ARGV[1], now)
if r == nil then
  if replayed(found, ARGV[1], COMPLETED, ARGV[2]) then
    return {1}
  end
  return refused(found)
end
r.state = COMPLETED
r.lease = nil
r.updated = now
r.payload = ARGV[2]
save(r, now + tonumber(ARGV[3]))
return {1}
