-- The loop of every batch script (acquire_many, complete_many, fail_many, release_many). The
-- Rust side builds each batch script as: the shared prelude, then the single-key script's body
-- wrapped as `local function one(ARGV) <body> end`, then this loop. So a batch runs exactly the
-- single-key logic, once per item, in order, each item seeing what the items before it wrote.
--
-- KEYS[i] is item i's record. ARGV[1] is how many arguments each item has (n); item i's
-- arguments are ARGV[2 + (i - 1) * n] .. ARGV[1 + i * n], in the single script's order.
-- Replies one element per item: the single script's own reply, or {-1, message} when that
-- item's script raised an error (a corrupt record: `IDEMCORRUPT <reason>`), which fails that
-- item only.
local per = tonumber(ARGV[1])
local out = {}
for i = 1, #KEYS do
  key = KEYS[i]
  local args = {}
  for j = 1, per do
    args[j] = ARGV[1 + (i - 1) * per + j]
  end
  local ok, reply = pcall(one, args)
  if ok then
    out[i] = reply
  elseif type(reply) == 'table' and reply.err ~= nil then
    out[i] = {-1, reply.err}
  else
    out[i] = {-1, tostring(reply)}
  end
end
return out
