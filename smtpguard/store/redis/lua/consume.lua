-- KEYS: sends, month, user sends, user month, user tokens.  ARGV: monthly cap, hourly cap,
-- hour start, token, now, trim before, month ttl, has user cap, user monthly cap, user hourly
-- cap, username.  The cap half of reserve.lua, for store-and-forward, which checks caps at
-- delivery.
{{include lib/cap_unit.lua}}

-- A token already in the window was counted by an earlier run of this call.
if redis.call('ZSCORE', KEYS[1], ARGV[4]) then return {'ok'} end
local user = nil
if ARGV[8] == '1' then
  user = {sends = KEYS[3], month = KEYS[4], tokens = KEYS[5], monthly = ARGV[9], hourly = ARGV[10],
    name = ARGV[11]}
end
return CAP_UNIT(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], user)
  or {'ok'}
