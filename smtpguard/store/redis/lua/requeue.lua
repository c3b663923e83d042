-- KEYS: record, index, entry, claimed, queue
-- ARGV: expected version, version, state, data, index score, key, zone prefix,
--       due ('' = take the entry off the queue), smtpguard id, message id, upstream id
{{include lib/cas_write.lua}}

local lane = redis.call('HGET', KEYS[3], 'lane')
if ARGV[8] == '' then
  if lane then redis.call('ZREM', ARGV[7] .. 'lane:' .. lane, ARGV[6]) end
  redis.call('DEL', KEYS[3])
  redis.call('ZREM', KEYS[4], ARGV[6])
  redis.call('HDEL', ARGV[7] .. 'claimer', ARGV[6])
  redis.call('SREM', KEYS[5], ARGV[6])
elseif lane then
  redis.call('HSET', KEYS[3], 'due', ARGV[8])
  redis.call('ZADD', ARGV[7] .. 'lane:' .. lane, ARGV[8], ARGV[6])
  redis.call('ZREM', KEYS[4], ARGV[6])
  redis.call('HDEL', ARGV[7] .. 'claimer', ARGV[6])
end
return {'ok'}
