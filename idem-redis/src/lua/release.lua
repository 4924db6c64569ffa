-- release(KEYS[1]; token) -> {1}, or a refusal (see `refused`)
-- The attempt is given back: attempts - 1 (never below 0), state released.
-- Replay-safe: {1} again, changing nothing, when the record already is released with this token.
local now_us, now = clock()
local r, found = fence(ARGV[1], now)
if r == nil then
  if replayed(found, ARGV[1], RELEASED, '') then
    return {1}
  end
  return refused(found)
end
if r.attempts > 0 then
  r.attempts = r.attempts - 1
end
r.state = RELEASED
r.lease = nil
r.updated = now
save(r)
return {1}
