-- fail(KEYS[1]; token, error, retryable 0/1, retention_ms)
--   -> {1} or {0, current_token or -1}
-- Replay-safe: {1} again when the record already failed with this token, error and flag.
local now_us, now = clock()
local state = 4
if ARGV[3] == '1' then
  state = 3
end
local r, current, done = fence(ARGV[1], now)
if r == nil then
  -- A replay of this very failure (the first run's reply was lost): already done.
  if done ~= nil and done.state == state and done.payload == ARGV[2] then
    return {1}
  end
  return {0, current}
end
r.state = state
r.lease = nil
r.updated = now
r.payload = ARGV[2]
save(r, now + tonumber(ARGV[4]))
return {1}
