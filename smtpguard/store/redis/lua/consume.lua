-- KEYS: sends, month, user sends, user month, user tokens.  ARGV: monthly cap, hourly cap,
-- hour start, token, now, trim before, month ttl, has user cap, user monthly cap, user hourly
-- cap, username.  The cap half of reserve.lua, for store-and-forward, which checks caps at
-- delivery.
{{include lib/user_unit.lua}}

-- A token already in the window was counted by an earlier run of this call.
if redis.call('ZSCORE', KEYS[1], ARGV[4]) then return {'ok'} end
if tonumber(redis.call('GET', KEYS[2]) or '0') >= tonumber(ARGV[1]) then return {'month'} end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[6])
if redis.call('ZCOUNT', KEYS[1], ARGV[3], '+inf') >= tonumber(ARGV[2]) then
  local oldest = redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[3], '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  return {'hour', oldest[2] or false}
end
if ARGV[8] == '1' then
  local refused = USER_UNIT(KEYS[3], KEYS[4], KEYS[5], ARGV[9], ARGV[10], ARGV[3], ARGV[4], ARGV[5],
    ARGV[6], ARGV[7], ARGV[11])
  if refused then return refused end
end
redis.call('ZADD', KEYS[1], ARGV[5], ARGV[4])
redis.call('INCR', KEYS[2])
redis.call('EXPIRE', KEYS[2], ARGV[7])
return {'ok'}
