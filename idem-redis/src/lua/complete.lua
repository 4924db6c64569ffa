-- complete(KEYS[1]; token, result, retention_ms) -> {1} or {0, current_token or -1}
-- Replay-safe: {1} again when the record already is completed with this token and this result.
local now_us, now = clock()
local r, current, done = fence(ARGV[1], now)
if r == nil then
  -- A replay of this very completion (the first run's reply was lost): already done.
  if done ~= nil and done.state == 2 and done.payload == ARGV[2] then
    return {1}
  end
  return {0, current}
end
r.state = 2
r.lease = nil
r.updated = now
r.payload = ARGV[2]
save(r, now + tonumber(ARGV[3]))
return {1}
