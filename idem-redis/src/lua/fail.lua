-- fail(KEYS[1]; token, error, state, retention_ms) -> {1}, or a refusal (see `refused`)
-- `state` is the failed state to store: 3 retryable, 4 terminal, 5 result not stored.
-- Replay-safe: {1} again, changing nothing, when the record already failed with this token, this
-- error text and this state.
local state = tonumber(ARGV[3])
if state ~= FAILED_RETRYABLE and state ~= FAILED_TERMINAL and state ~= FAILED_NOT_STORED then
  return redis.error_reply('ERR idem fail: unknown failed state ' .. tostring(ARGV[3]))
end
local now_us, now = clock()
local r, found = fence(ARGV[1], now)
if r == nil then
  if replayed(found, ARGV[1], state, ARGV[2]) then
    return {1}
  end
  return refused(found)
end
r.state = state
r.lease = nil
r.updated = now
r.payload = ARGV[2]
save(r, now + tonumber(ARGV[4]))
return {1}
