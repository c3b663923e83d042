-- A reconciliation cursor's compare-and-swap (DESIGN.md §19).  KEYS[1] the cursor
-- (sg:cursor:NAME); ARGV: the value expected ('' = absent), the new value.
-- Returns 1 when set, 0 when the cursor was not the one expected (nothing changes).

local cur = redis.call('GET', KEYS[1])
if (cur == false and ARGV[1] == '') or cur == ARGV[1] then
    redis.call('SET', KEYS[1], ARGV[2])
    return 1
end
return 0
