-- KEYS: record, index, entry, claimed, queue, lane
-- ARGV: expected version ('' = absent), version, state, data, index score, key, zone prefix,
--       lane, priority, due, enqueued at, sender, recipients, content, smtputf8 ('1'/'0'),
--       smtpguard id, message id, upstream id
{{include lib/cas_write.lua}}

local old = redis.call('HGET', KEYS[3], 'lane')
if old and old ~= ARGV[8] then redis.call('ZREM', ARGV[7] .. 'lane:' .. old, ARGV[6]) end
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[3], 'lane', ARGV[8], 'prio', ARGV[9], 'due', ARGV[10], 'enq', ARGV[11],
  'from', ARGV[12], 'rcpt', ARGV[13], 'body', ARGV[14], 'utf8', ARGV[15])
redis.call('ZADD', KEYS[6], ARGV[10], ARGV[6])
redis.call('ZREM', KEYS[4], ARGV[6])
redis.call('HDEL', ARGV[7] .. 'claimer', ARGV[6])
redis.call('SADD', KEYS[5], ARGV[6])
redis.call('SADD', ARGV[7] .. 'lanes', ARGV[8])
return {'ok'}
