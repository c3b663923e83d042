-- KEYS: index, record…  ARGV: cutoff, now, unsettled state…(2), deferred, key…
-- Returns {deleted, kept}: kept counts old entries left in place (in_flight, queued, and
-- deferred with its message in its lane before its class's max_age: a live entry).

local deleted, kept = 0, 0
local cutoff, now = tonumber(ARGV[1]), tonumber(ARGV[2])
local prefix = string.sub(KEYS[1], 1, -4)  -- 'sg:{zone}:' from 'sg:{zone}:idx'

-- A deferred record whose message waits in its lane for a try (a backoff, a throttle or a
-- downtime longer than the retention) until its max_age, when a worker expires it.
local function waiting(record, member)
  if redis.call('EXISTS', prefix .. 'q:' .. member) == 0 then return false end
  local expires = cjson.decode(redis.call('HGET', record, 'd'))['expires_at']
  return expires == nil or expires == cjson.null or tonumber(expires) > now
end

for i = 2, #KEYS do
  local member = ARGV[i + 4]
  local score = redis.call('ZSCORE', KEYS[1], member)
  if score and tonumber(score) < cutoff then
    local s = redis.call('HGET', KEYS[i], 's')
    if not s then
      redis.call('ZREM', KEYS[1], member)
    elseif s == ARGV[3] or s == ARGV[4] or (s == ARGV[5] and waiting(KEYS[i], member)) then
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
