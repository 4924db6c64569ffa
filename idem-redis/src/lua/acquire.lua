-- acquire(KEYS[1]; owner, lease_ms, max_attempts, fingerprint or '')
-- Replies, first element is the kind:
--   {0, token, attempt, lease_expires_at_ms, takeover 0/1}   acquired
--   {1, owner, retry_after_ms}                               in progress
--   {2, result}                                              replayed
--   {3}                                                      conflict
--   {4, attempts, has_error 0/1, error}                      exhausted
--   {5, error}                                               failed terminally
local owner = ARGV[1]
local lease = tonumber(ARGV[2])
local max_attempts = tonumber(ARGV[3])
local fp = ARGV[4]
local now_us, now = clock()

local h = redis.call('HMGET', key, 't', 's', 'f', 'c', 'l', 'o')
local prev = tonumber(h[1])

-- Tokens only grow: previous + 1, or the server clock in microseconds when that is higher (which
-- keeps them growing after the key expired). `previous` is also the token a delete left in its
-- tombstone, so tokens keep growing after a delete whatever the clock did.
local function next_token()
  if prev ~= nil and prev + 1 > now_us then
    return prev + 1
  end
  return now_us
end

-- A hash without a state is a tombstone (see delete): absent, but its token counts.
local live = prev ~= nil and h[2] and not past_retention(now)
if not live then
  if h[1] or h[2] then
    redis.call('DEL', key)
  end
  local t = next_token()
  local base = math.floor(t / 1000)
  local fields = {'t', int(t), 's', '10', 'o', owner, 'u', int(now - base), 'l', int(now + lease - base)}
  if fp ~= '' then
    table.insert(fields, 'f')
    table.insert(fields, fp)
  end
  -- `c` is absent when 0, as it is whenever the token is the clock (nearly always): a field less
  -- in every record.
  if base ~= now then
    table.insert(fields, 'c')
    table.insert(fields, int(base - now))
  end
  redis.call('HSET', key, unpack(fields))
  return {0, t, 1, now + lease, 0}
end

local stored_fp = h[3]
if stored_fp and fp ~= '' and stored_fp ~= fp then
  return {3}
end

local s = tonumber(h[2])
if s == nil then
  return corrupt('record without state')
end
local state = s % 10
local attempts = (s - state) / 10
local base = math.floor(prev / 1000)

local function reacquire(takeover)
  local t = next_token()
  local nb = math.floor(t / 1000)
  local created = base - (tonumber(h[4]) or 0)
  redis.call('HSET', key, 't', int(t), 's', int((attempts + 1) * 10), 'o', owner,
    'c', int(nb - created), 'u', int(now - nb), 'l', int(now + lease - nb))
  if state >= 2 then
    redis.call('HDEL', key, 'r')
    redis.call('PERSIST', key)
  end
  return {0, t, attempts + 1, now + lease, takeover and 1 or 0}
end

if state == 0 then
  local lease_end = now
  if tonumber(h[5]) ~= nil then
    lease_end = base + tonumber(h[5])
  end
  if lease_end > now then
    return {1, h[6] or '', lease_end - now}
  end
  if attempts < max_attempts then
    return reacquire(true)
  end
  return {4, attempts, 0, ''}
elseif state == 1 then
  if attempts < max_attempts then
    return reacquire(false)
  end
  return {4, attempts, 0, ''}
elseif state == 2 then
  return {2, redis.call('HGET', key, 'r') or ''}
elseif state == 3 then
  if attempts < max_attempts then
    return reacquire(false)
  end
  return {4, attempts, 1, redis.call('HGET', key, 'r') or ''}
elseif state == 4 then
  return {5, redis.call('HGET', key, 'r') or ''}
end
return corrupt('unknown state ' .. int(state))
