-- The clock of a batch script: the server clock is read once per call (one `TIME`), and every
-- item of the batch is judged at that instant, as if the whole batch happened at once (Redis
-- itself judges key expiry at the script's start). It shadows the prelude's `clock` for the
-- single-key body that follows.
local batch_us, batch_ms = clock()
local function clock()
  return batch_us, batch_ms
end
