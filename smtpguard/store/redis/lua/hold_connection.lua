-- One connection slot: KEYS[1] the provider's sorted set holder → lease end.  ARGV: now,
-- holder, until, limit.  Expired leases are dropped first (a crashed instance's slots).

redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local keep = math.ceil((tonumber(ARGV[3]) - tonumber(ARGV[1]) + 60) * 1000)
if redis.call('ZSCORE', KEYS[1], ARGV[2]) then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
  redis.call('PEXPIRE', KEYS[1], keep)
  return 1
end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
redis.call('PEXPIRE', KEYS[1], keep)
return 1
