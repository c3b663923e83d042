-- KEYS: event ids (zset), the record's events (list), the zone's suppression hash, its
-- change counter.  ARGV: member (source NUL id), received at, event JSON, address ('' none),
-- suppression entry JSON.  Returns 1 when applied, 0 when this event was applied before.
-- A record keeps its newest 500 events.

if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('RPUSH', KEYS[2], ARGV[3])
redis.call('LTRIM', KEYS[2], -500, -1)
if ARGV[4] ~= '' and redis.call('HSETNX', KEYS[3], ARGV[4], ARGV[5]) == 1 then
  redis.call('INCR', KEYS[4])
end
return 1
