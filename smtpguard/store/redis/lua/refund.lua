-- KEYS: sends, month, user tokens.  ARGV: token, zone prefix, month.  Only a unit still
-- recorded is returned: idempotent. The user's unit counted with the token goes back too.

if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  if tonumber(redis.call('GET', KEYS[2]) or '0') > 0 then redis.call('DECR', KEYS[2]) end
end
local held = redis.call('HGET', KEYS[3], ARGV[1])
if held then
  redis.call('HDEL', KEYS[3], ARGV[1])
  local user = string.sub(held, string.find(held, '|', 1, true) + 1)
  if redis.call('ZREM', ARGV[2] .. 'us:' .. user, ARGV[1]) == 1 then
    local month = ARGV[2] .. 'um:' .. user .. ':' .. ARGV[3]
    if tonumber(redis.call('GET', month) or '0') > 0 then redis.call('DECR', month) end
  end
end
return 0
