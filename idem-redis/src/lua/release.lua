-- release(KEYS[1]; token) -> {1} or {0, current_token or -1}
-- Replay-safe: {1} again when the record already is released with this token.
-- The attempt is given back: attempts - 1 (never below 0), state released.
local now_us, now = clock()
local r, current, done = fence(ARGV[1], now)
if r == nil then
  -- A replay of this very release (the first run's reply was lost): already done.
  if done ~= nil and done.state == 1 then
    return {1}
  end
  return {0, current}
end
if r.attempts > 0 then
  r.attempts = r.attempts - 1
end
r.state = 1
r.lease = nil
r.updated = now
save(r)
return {1}
