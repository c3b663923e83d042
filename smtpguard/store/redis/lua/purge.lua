-- KEYS: index, record…  ARGV: cutoff, unsettled state…(2), key…
-- Returns {deleted, kept}: kept counts old entries left in place (in_flight, queued).

local deleted, kept = 0, 0
local cutoff = tonumber(ARGV[1])
local prefix = string.sub(KEYS[1], 1, -4)  -- 'sg:{zone}:' from 'sg:{zone}:idx'

for i = 2, #KEYS do
  local member = ARGV[i + 2]
  local score = redis.call('ZSCORE', KEYS[1], member)
  if score and tonumber(score) < cutoff then
    local s = redis.call('HGET', KEYS[i], 's')
    if not s then
      redis.call('ZREM', KEYS[1], member)
    elseif s == ARGV[2] or s == ARGV[3] then
      kept = kept + 1
    else
      local indexed = redis.call('HMGET', KEYS[i], 'mid', 'uid', 'sid')
      redis.call('ZREM', prefix .. 'st:' .. s, member)
      for n, kind in ipairs({'m:', 'u:', 's:'}) do
        local id = indexed[n]
        if id and id ~= '' and redis.call('HGET', prefix .. 'ids', kind .. id) == member then
          redis.call('HDEL', prefix .. 'ids', kind .. id)
        end
      end
      redis.call('DEL', prefix .. 'pev:' .. member)
      redis.call('DEL', KEYS[i])
      redis.call('ZREM', KEYS[1], member)
      -- A store-and-forward entry kept for the operator (unknown, failed) goes with it.
      local entry = prefix .. 'q:' .. member
      local lane = redis.call('HGET', entry, 'lane')
      if lane then redis.call('ZREM', prefix .. 'lane:' .. lane, member) end
      redis.call('DEL', entry)
      redis.call('ZREM', prefix .. 'claimed', member)
      redis.call('HDEL', prefix .. 'claimer', member)
      redis.call('SREM', prefix .. 'queue', member)
      deleted = deleted + 1
    end
  end
end
return {deleted, kept}
