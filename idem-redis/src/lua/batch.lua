-- The loop of every batch script (acquire_many, complete_many, fail_many, release_many). The
-- Rust side builds each batch script as: the shared prelude, then the single-key script's body
-- wrapped as `local function one(ARGV) <body> end`, then this loop. So a batch runs exactly the
-- single-key logic, once per item, in order, each item seeing what the items before it wrote.
--
-- ARGV[1] is how many arguments each item has (n) and ARGV[2] which of them all items share: n
-- characters, '1' for an argument sent once for the whole call (the values of those follow, in
-- order), '0' for one each item sends. Then the items: with declared keys (one server, or one
-- hash slot of a cluster), KEYS[i] is item i's record and its own arguments follow in order;
-- without (a cluster primary's items of many slots: the script's `allow-cross-slot-keys` flag
-- lets it reach any key that primary serves), each item's record key comes first, then its own
-- arguments. The body sees all n arguments in the single script's order.
-- Each item first goes to `fast`, the transition's fast path for its commonest case (an
-- acquire of an absent key, a completion by the lease holder: lua/acquire_fast.lua,
-- lua/complete_fast.lua; the other transitions have none), which writes exactly what the body
-- would and answers its reply, or answers nil having written nothing (arguments the body would
-- fail on it leaves to the body); then, on nil, to the body.
-- Replies one element per item (or, from the all-fresh shortcut, one number standing for every
-- item's compact reply): the single script's own reply; or, for an item a fast path
-- took, the compact form of that reply (a number in place of the table: an acquire's token, of
-- a first attempt with no takeover, its lease end floor(token / 1000) plus the lease the item
-- sent; a completion's 1), which costs the server less to send; or {-1, message} when that
-- item's script raised an error (a corrupt record: `IDEMCORRUPT <reason>`; on a cluster, a key
-- this node does not serve, refused at the item's first read, before any write), which fails
-- that item only.
local per = tonumber(ARGV[1])
local shared = ARGV[2]
-- One table of arguments for every item: the shared ones set once, the others per item.
local args, own = {}, {}
local at = 3
for j = 1, per do
  if sub(shared, j, j) == '1' then
    args[j] = ARGV[at]
    at = at + 1
  else
    own[#own + 1] = j
  end
end
local inline = #KEYS == 0
local width = inline and #own + 1 or #own
local count = inline and (#ARGV - at + 1) / width or #KEYS
-- An acquire batch whose keys are all distinct and absent is written in one go (see `all_fresh`
-- in lua/acquire_fast.lua), its reply the one compact reply every item would give.
if all_fresh ~= nil and not inline then
  local reply = all_fresh(KEYS, args, own, at)
  if reply ~= nil then
    return reply
  end
end
prefetch()
local out, keys = {}, {}
for i = 1, count do
  if inline then
    key = ARGV[at]
    at = at + 1
  else
    key = KEYS[i]
  end
  keys[i] = key
  for _, j in ipairs(own) do
    args[j] = ARGV[at]
    at = at + 1
  end
  local ok, reply = pcall(fast, args)
  if ok and reply == nil then
    ok, reply = pcall(one, args)
  end
  if ok then
    out[i] = reply
  elseif type(reply) == 'table' and reply.err ~= nil then
    out[i] = {-1, reply.err}
  else
    out[i] = {-1, tostring(reply)}
  end
end
flush()
if next(failed_writes) ~= nil then
  for i = 1, count do
    local err = failed_writes[keys[i]]
    if err ~= nil then
      out[i] = {-1, err}
    end
  end
end
return out
