-- KEYS: record, paused, sends, month, index, user sends, user month, user tokens
-- ARGV: expected version ('' = absent), forced pause, has cap, monthly cap, hourly cap,
--       hour start, token, now, trim before, month ttl, version, state, data, index score, key,
--       has user cap, user monthly cap, user hourly cap, username,
--       smtpguard id, message id, upstream id
{{include lib/user_unit.lua}}

local cur = redis.call('HMGET', KEYS[1], 'v', 'd', 's')
-- This very record is there already: our own write, re-run after its reply was lost.
if cur[1] == ARGV[11] and cur[2] == ARGV[13] then
  -- Rewritten as it is: a write the replicas receive, so that a WAIT on this connection
  -- (store.wait) waits for the record, not for nothing.
  redis.call('HSET', KEYS[1], 'v', cur[1])
  return {'ok'}
end
if ARGV[1] == '' then
  if cur[1] then return {'conflict', cur[2]} end
elseif cur[1] ~= ARGV[1] then
  return {'conflict', cur[2] or false}
end
if ARGV[2] == '1' or redis.call('EXISTS', KEYS[2]) == 1 then return {'paused'} end
-- A token already in the window was counted by an earlier run of this call.
if ARGV[3] == '1' and not redis.call('ZSCORE', KEYS[3], ARGV[7]) then
  if tonumber(redis.call('GET', KEYS[4]) or '0') >= tonumber(ARGV[4]) then return {'month'} end
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[9])
  if redis.call('ZCOUNT', KEYS[3], ARGV[6], '+inf') >= tonumber(ARGV[5]) then
    local oldest = redis.call('ZRANGEBYSCORE', KEYS[3], ARGV[6], '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    return {'hour', oldest[2] or false}
  end
  if ARGV[16] == '1' then
    local refused = USER_UNIT(KEYS[6], KEYS[7], KEYS[8], ARGV[17], ARGV[18], ARGV[6], ARGV[7], ARGV[8],
      ARGV[9], ARGV[10], ARGV[19])
    if refused then return refused end
  end
  redis.call('ZADD', KEYS[3], ARGV[8], ARGV[7])
  redis.call('INCR', KEYS[4])
  redis.call('EXPIRE', KEYS[4], ARGV[10])
end
redis.call('HSET', KEYS[1], 'v', ARGV[11], 's', ARGV[12], 'd', ARGV[13])
redis.call('ZADD', KEYS[5], ARGV[14], ARGV[15])
{{include lib/indexes.lua IDX=5 MEMBER=15 STATE=12 SCORE=14}}

return {'ok'}
