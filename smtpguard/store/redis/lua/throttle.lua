-- Never shortens a throttle in place.  KEYS[1] the throttles hash (sg:{providers}:throttles);
-- ARGV: provider, until.

local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '')
if not cur or cur < tonumber(ARGV[2]) then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return 1
