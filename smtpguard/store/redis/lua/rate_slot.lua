-- A provider's next send slot (policy/throttle.py gcra, the same decision in Lua, with the
-- same pull-back of a time left by a longer interval): KEYS[1] holds the theoretical
-- arrival time. ARGV: now, interval, max_wait. Returns {granted,
-- wait} with wait as text (a Lua number in a reply would lose its fraction).

local now = tonumber(ARGV[1])
local interval = tonumber(ARGV[2])
local max_wait = tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or '')
local start = now
if tat and tat > now then start = tat end
local reach = now + max_wait + interval
local wait = start - now
if start > reach then
  -- pulled back (always refused then: reach is past max_wait), and kept
  start = reach
  wait = start - now
  redis.call('SET', KEYS[1], string.format('%.17g', start), 'PX', math.ceil((start - now + 60) * 1000))
end
if wait > max_wait then return {0, string.format('%.17g', wait - max_wait)} end
local nxt = start + interval
redis.call('SET', KEYS[1], string.format('%.17g', nxt), 'PX', math.ceil((nxt - now + 60) * 1000))
return {1, string.format('%.17g', wait)}
