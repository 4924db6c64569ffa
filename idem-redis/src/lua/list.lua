-- list(ARGV: scan cursor, MATCH pattern, COUNT) -> {next cursor, now_ms, {key, entry, ...}}
-- One SCAN step on this node, and every key it returned with its entry: 0 when there is nothing
-- to list (a tombstone, or a record past retention), the record as get.lua returns it, or a
-- string `IDEMCORRUPT <why>` for a value that is not a record. Reads only (flags no-writes);
-- the keys are those SCAN found on this node, in any slot of it (allow-cross-slot-keys).
local _, now = clock()
local step = redis.call('SCAN', ARGV[1], 'MATCH', ARGV[2], 'COUNT', ARGV[3])
local out = {}
for _, k in ipairs(step[2]) do
  key = k
  local ok, r = pcall(load)
  local entry = 0
  if not ok then
    if type(r) == 'table' and r.err then
      entry = r.err
    else
      entry = 'IDEMCORRUPT ' .. tostring(r)
    end
  elseif r ~= nil and r.state ~= TOMBSTONE then
    local exp = redis.call('PEXPIRETIME', key)
    if exp < 0 or exp > now then
      entry = {r.state, r.token, r.attempts, r.created, r.updated, r.lease or -1, r.fp or '',
        r.owner, r.payload, exp}
    end
  end
  out[#out + 1] = k
  out[#out + 1] = entry
end
return {step[1], now, out}
