-- acquire(KEYS[1]; owner, lease_ms, max_attempts, fingerprint or '')
-- Replies, first element is the kind:
--   {0, token, attempt, lease_expires_at_ms, takeover 0/1}   acquired
--   {1, owner, retry_after_ms}                               in progress
--   {2, result}                                              replayed
--   {3}                                                      conflict
--   {4, attempts, has_error 0/1, error}                      exhausted
--   {5, error, state}                                        failed terminally (state 4
--                                                            terminal, 5 result not stored)
local owner = ARGV[1]
local lease = tonumber(ARGV[2])
local max_attempts = tonumber(ARGV[3])
local fp = ARGV[4]
local now_us, now = clock()
local r = load()

-- Tokens only grow: previous + 1, or the server clock in microseconds when that is higher (which
-- keeps them growing after the key expired). `previous` is also the token a delete left in its
-- tombstone, so tokens keep growing after a delete whatever the clock did.
local function next_token()
  if r ~= nil and r.token + 1 > now_us then
    return r.token + 1
  end
  return now_us
end

if r == nil or r.state == TOMBSTONE or past_retention(now) then
  local t = next_token()
  local fresh = {state = IN_PROGRESS, token = t, attempts = 1, updated = now, created = now,
    lease = now + lease, owner = owner, payload = ''}
  if fp ~= '' then
    fresh.fp = fp
  end
  save(fresh, nil, r == nil)
  return {0, t, 1, now + lease, 0}
end

if r.fp ~= nil and fp ~= '' and r.fp ~= fp then
  return {3}
end

local state = r.state
local attempts = r.attempts

-- The next attempt: a new token, the caller as owner, a new lease; the fingerprint and the
-- creation time stay, a stored error and a retention deadline go.
local function reacquire(takeover)
  local t = next_token()
  r.token = t
  r.tok = nil
  r.state = IN_PROGRESS
  r.attempts = attempts + 1
  r.owner = owner
  r.updated = now
  r.lease = now + lease
  r.payload = ''
  save(r)
  return {0, t, attempts + 1, now + lease, takeover and 1 or 0}
end

if state == IN_PROGRESS then
  if r.lease > now then
    return {1, r.owner, r.lease - now}
  end
  if attempts < max_attempts then
    return reacquire(true)
  end
  return {4, attempts, 0, ''}
elseif state == RELEASED then
  if attempts < max_attempts then
    return reacquire(false)
  end
  return {4, attempts, 0, ''}
elseif state == COMPLETED then
  return {2, r.payload}
elseif state == FAILED_RETRYABLE then
  if attempts < max_attempts then
    return reacquire(false)
  end
  return {4, attempts, 1, r.payload}
end
-- FAILED_TERMINAL or FAILED_NOT_STORED (load refuses any other state).
return {5, r.payload, state}
