-- Read only. KEYS: queue, claimed.  ARGV: zone prefix.
-- Returns {key, lane, priority, due, enqueued at, size, state ('' = no record), claimed until}…

local out = {}
for _, m in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local q = redis.call('HMGET', ARGV[1] .. 'q:' .. m, 'lane', 'prio', 'due', 'enq')
  if q[1] then
    out[#out + 1] = {m, q[1], q[2], q[3], q[4], redis.call('HSTRLEN', ARGV[1] .. 'q:' .. m, 'body'),
      redis.call('HGET', ARGV[1] .. 'ev:' .. m, 's') or '', redis.call('ZSCORE', KEYS[2], m) or ''}
  end
end
return out
