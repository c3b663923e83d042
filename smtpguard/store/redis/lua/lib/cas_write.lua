-- The compare-and-swap every record write starts with (put, enqueue, requeue).
-- KEYS[1] record, KEYS[2] index; ARGV[1] expected version ('' = absent), ARGV[2] version,
-- ARGV[3] state, ARGV[4] data, ARGV[5] index score, ARGV[6] key; the last three ARGV the
-- smtpguard id, message id and upstream id (lib/indexes.lua).
-- A record already equal to the one written is our own write, re-run after its reply was
-- lost: it counts as written, and what follows (idempotent) runs again.

local cur = redis.call('HMGET', KEYS[1], 'v', 'd', 's')
if cur[1] ~= ARGV[2] or cur[2] ~= ARGV[4] then
  if ARGV[1] == '' then
    if cur[1] then return {'conflict', cur[2]} end
  elseif cur[1] ~= ARGV[1] then
    return {'conflict', cur[2] or false}
  end
  redis.call('HSET', KEYS[1], 'v', ARGV[2], 's', ARGV[3], 'd', ARGV[4])
  redis.call('ZADD', KEYS[2], ARGV[5], ARGV[6])
{{include lib/indexes.lua IDX=2 MEMBER=6 STATE=3 SCORE=5}}

else
  -- Our own write, re-run: rewritten as it is, so that store.wait's WAIT covers it.
  redis.call('HSET', KEYS[1], 'v', cur[1])
end
