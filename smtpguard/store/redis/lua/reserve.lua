-- KEYS: record, paused, sends, month, index, user sends, user month, user tokens
-- ARGV: expected version ('' = absent), forced pause, has cap, monthly cap, hourly cap,
--       hour start, token, now, trim before, month ttl, version, state, data, index score, key,
--       has user cap, user monthly cap, user hourly cap, username,
--       smtpguard id, message id, upstream id
{{include lib/cap_unit.lua}}

local cur = redis.call('HMGET', KEYS[1], 'v', 'd', 's')
-- This very record is there already: our own write, re-run after its reply was lost.
if cur[1] == ARGV[11] and cur[2] == ARGV[13] then
  -- Rewritten as it is: a write the replicas receive, so that a WAIT on this connection
  -- (store.wait) waits for the record, not for nothing.
  redis.call('HSET', KEYS[1], 'v', cur[1])
  return {'ok'}
end
if ARGV[1] == '' then
  if cur[1] then return {'conflict', cur[2]} end
elseif cur[1] ~= ARGV[1] then
  return {'conflict', cur[2] or false}
end
if ARGV[2] == '1' or redis.call('EXISTS', KEYS[2]) == 1 then return {'paused'} end
-- A token already in the window was counted by an earlier run of this call.
if ARGV[3] == '1' and not redis.call('ZSCORE', KEYS[3], ARGV[7]) then
  local user = nil
  if ARGV[16] == '1' then
    user = {sends = KEYS[6], month = KEYS[7], tokens = KEYS[8], monthly = ARGV[17], hourly = ARGV[18],
      name = ARGV[19]}
  end
  local refused = CAP_UNIT(KEYS[3], KEYS[4], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10],
    user)
  if refused then return refused end
end
redis.call('HSET', KEYS[1], 'v', ARGV[11], 's', ARGV[12], 'd', ARGV[13])
redis.call('ZADD', KEYS[5], ARGV[14], ARGV[15])
{{include lib/indexes.lua IDX=5 MEMBER=15 STATE=12 SCORE=14}}

return {'ok'}
