-- One unit of an SMTP user's own caps (DESIGN.md §16), checked after the zone's and taken
-- with it in the same script: both or neither. The user's window and month live under the
-- zone's hash tag (one Cluster slot); `utok` maps each token to "<at>|<user>", so a refund
-- naming the token alone finds the user's unit, and the purge drops entries past the window.
-- Returns a refusal ({'umonth'} or {'uhour', oldest}) or nil once counted.

local function USER_UNIT(sends, month, tokens, monthly, hourly, hour_start, token, now, trim, ttl, user)
  if tonumber(redis.call('GET', month) or '0') >= tonumber(monthly) then return {'umonth'} end
  redis.call('ZREMRANGEBYSCORE', sends, '-inf', '(' .. trim)
  if redis.call('ZCOUNT', sends, hour_start, '+inf') >= tonumber(hourly) then
    local oldest = redis.call('ZRANGEBYSCORE', sends, hour_start, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    return {'uhour', oldest[2] or false}
  end
  redis.call('ZADD', sends, now, token)
  -- No purge lists the users (one renamed or removed is never named again): the window
  -- expires by itself once no send in it can be read any more.
  redis.call('EXPIRE', sends, math.ceil(tonumber(now) - tonumber(trim)))
  redis.call('INCR', month)
  redis.call('EXPIRE', month, ttl)
  redis.call('HSET', tokens, token, now .. '|' .. user)
  return nil
end
