-- One unit of the caps (DESIGN.md §5, §16), taken in the calling script: the zone's month
-- first, then its sliding hour, then, when `user` is given, the SMTP user's own month and
-- hour: every cap counts the unit or none does. `user` is nil or a table of the user's
-- sends, month and tokens keys, monthly and hourly caps and name. The user's window and
-- month live under the zone's hash tag (one Cluster slot); `tokens` maps each token to
-- "<at>|<user>", so a refund naming the token alone finds the user's unit, and the purge
-- drops entries past the window.
-- Returns a refusal ({'month'}, {'hour', oldest}, {'umonth'}, {'uhour', oldest}) or nil
-- once counted.

-- A month's count or a sliding hour's at its cap: the refusal, named `over_month` or
-- `over_hour`; nil while both have room.
local function REFUSED(sends, month, monthly, hourly, hour_start, trim, over_month, over_hour)
  if tonumber(redis.call('GET', month) or '0') >= tonumber(monthly) then return {over_month} end
  redis.call('ZREMRANGEBYSCORE', sends, '-inf', '(' .. trim)
  if redis.call('ZCOUNT', sends, hour_start, '+inf') >= tonumber(hourly) then
    local oldest = redis.call('ZRANGEBYSCORE', sends, hour_start, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    return {over_hour, oldest[2] or false}
  end
  return nil
end

local function CAP_UNIT(sends, month, monthly, hourly, hour_start, token, now, trim, ttl, user)
  local refused = REFUSED(sends, month, monthly, hourly, hour_start, trim, 'month', 'hour')
  if refused then return refused end
  if user then
    refused = REFUSED(user.sends, user.month, user.monthly, user.hourly, hour_start, trim, 'umonth', 'uhour')
    if refused then return refused end
    redis.call('ZADD', user.sends, now, token)
    -- No purge lists the users (one renamed or removed is never named again): the window
    -- expires by itself once no send in it can be read any more.
    redis.call('EXPIRE', user.sends, math.ceil(tonumber(now) - tonumber(trim)))
    redis.call('INCR', user.month)
    redis.call('EXPIRE', user.month, ttl)
    redis.call('HSET', user.tokens, token, now .. '|' .. user.name)
  end
  redis.call('ZADD', sends, now, token)
  redis.call('INCR', month)
  redis.call('EXPIRE', month, ttl)
  return nil
end
