-- The loop of every batch script (acquire_many, complete_many, fail_many, release_many). The
-- Rust side builds each batch script as: the shared prelude, then the single-key script's body
-- wrapped as `local function one(ARGV) <body> end`, then this loop. So a batch runs exactly the
-- single-key logic, once per item, in order, each item seeing what the items before it wrote.
--
-- ARGV[1] is how many arguments each item has (n). With declared keys (one server, or one hash
-- slot of a cluster), KEYS[i] is item i's record and its arguments are ARGV[2 + (i - 1) * n] ..
-- ARGV[1 + i * n], in the single script's order. Without (a cluster primary's items of many
-- slots: the script's `allow-cross-slot-keys` flag lets it reach any key that primary serves),
-- each item's record key comes first, then its n arguments: n + 1 values per item.
-- Replies one element per item: the single script's own reply, or {-1, message} when that
-- item's script raised an error (a corrupt record: `IDEMCORRUPT <reason>`; on a cluster, a key
-- this node does not serve, refused at the item's first read, before any write), which fails
-- that item only.
local per = tonumber(ARGV[1])
local inline = #KEYS == 0
local width = inline and per + 1 or per
local count = inline and (#ARGV - 1) / width or #KEYS
local out = {}
for i = 1, count do
  local at = 1 + (i - 1) * width
  if inline then
    key = ARGV[at + 1]
    at = at + 1
  else
    key = KEYS[i]
  end
  local args = {}
  for j = 1, per do
    args[j] = ARGV[at + j]
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
