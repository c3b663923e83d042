-- Read only. KEYS: claimed, queue, lane…  ARGV: now, limit.
-- Returns {queue size, {key, due, …} per lane}: up to `limit` due, unclaimed entries of each
-- lane, oldest first, so claim() can pick the oldest across zones.

local now, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local result = {redis.call('SCARD', KEYS[2])}
for li = 3, #KEYS do
  local found, offset = {}, 0
  while #found < 2 * limit do
    local batch = redis.call('ZRANGEBYSCORE', KEYS[li], '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', offset, limit)
    if #batch == 0 then break end
    for i = 1, #batch, 2 do
      local until_ = redis.call('ZSCORE', KEYS[1], batch[i])
      if #found < 2 * limit and (not until_ or tonumber(until_) < now) then
        found[#found + 1] = batch[i]
        found[#found + 1] = batch[i + 1]
      end
    end
    offset = offset + #batch / 2
  end
  result[#result + 1] = found
end
return result
