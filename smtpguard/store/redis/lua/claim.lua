-- KEYS: claimed, queue, lane…  ARGV: now, claimed until, total, zone prefix, claim token,
--       count per lane…
-- Takes up to each lane's count of due (score <= now), unclaimed (claimed score < now)
-- entries, oldest first, then fills up to `total` from the lanes in order; marks each claimed.
-- An entry whose record or body is gone (purged) is dropped from the queue, not handed out.
-- A claim re-run after its reply was lost gets back what its first run claimed.
-- Returns {queue size, {key, lane index, due, record, sender, recipients, content, priority}…}.

local now, prefix = tonumber(ARGV[1]), ARGV[4]
local taken, out, gone = {}, {}, {}
local function take(li, want)
  local lane, got, offset = KEYS[li + 2], 0, 0
  while got < want do
    local batch = redis.call('ZRANGEBYSCORE', lane, '-inf', ARGV[1], 'WITHSCORES',
      'LIMIT', offset, want - got)
    if #batch == 0 then break end
    for i = 1, #batch, 2 do
      local m = batch[i]
      if not taken[m] then
        local until_ = redis.call('ZSCORE', KEYS[1], m)
        -- Claimed under our own token: this call's earlier run, whose reply was lost,
        -- claimed it (DESIGN.md §11.4); it is ours, not hidden from us.
        if not until_ or tonumber(until_) < now
            or redis.call('HGET', prefix .. 'claimer', m) == ARGV[5] then
          taken[m] = true
          local rec = redis.call('HGET', prefix .. 'ev:' .. m, 'd')
          local q = redis.call('HMGET', prefix .. 'q:' .. m, 'from', 'rcpt', 'body', 'prio', 'utf8')
          if rec and q[1] then
            redis.call('ZADD', KEYS[1], ARGV[2], m)
            redis.call('HSET', prefix .. 'claimer', m, ARGV[5])
            out[#out + 1] = {m, li, batch[i + 1], rec, q[1], q[2], q[3], q[4], q[5] or '0'}
            got = got + 1
          else
            gone[#gone + 1] = {lane, m}
          end
        end
      end
    end
    offset = offset + #batch / 2
  end
  return got
end
for li = 1, #KEYS - 2 do take(li, tonumber(ARGV[li + 5])) end
local room = tonumber(ARGV[3]) - #out
for li = 1, #KEYS - 2 do
  if room <= 0 then break end
  room = room - take(li, room)
end
for _, g in ipairs(gone) do
  redis.call('ZREM', g[1], g[2])
  redis.call('ZREM', KEYS[1], g[2])
  redis.call('SREM', KEYS[2], g[2])
  redis.call('DEL', prefix .. 'q:' .. g[2])
end
return {redis.call('SCARD', KEYS[2]), out}
