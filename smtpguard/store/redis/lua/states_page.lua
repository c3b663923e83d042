-- The upgrade of one page of a zone's index (KEYS[1] 'sg:{zone}:idx') into the per-state
-- sets and the smtpguard-id lookups, read and written in one step, so a record written
-- meanwhile is never put in a state it has left.  ARGV: score, offset, count.  Returns
-- {last score, members with that score in the page} or {} when the page is empty.

local prefix = string.sub(KEYS[1], 1, -4)
local page = redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], '+inf', 'WITHSCORES', 'LIMIT', ARGV[2], ARGV[3])
if #page == 0 then return {} end
local last, same = nil, 0
for i = 1, #page, 2 do
  local member, score = page[i], page[i + 1]
  local fields = redis.call('HMGET', prefix .. 'ev:' .. member, 's', 'sid', 'd')
  if fields[1] then
    redis.call('ZADD', prefix .. 'st:' .. fields[1], score, member)
    local sid = fields[2]
    if not sid and fields[3] then sid = cjson.decode(fields[3])['sg_id'] end
    if sid and sid ~= '' then redis.call('HSET', prefix .. 'ids', 's:' .. sid, member) end
  end
  if score == last then same = same + 1 else last, same = score, 1 end
end
return {last, same}
