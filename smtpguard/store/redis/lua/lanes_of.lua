-- KEYS: queue, lanes.  ARGV: zone prefix.  Adds the lane of every queue entry to the set.

for _, m in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local lane = redis.call('HGET', ARGV[1] .. 'q:' .. m, 'lane')
  if lane then redis.call('SADD', KEYS[2], lane) end
end
return 0
