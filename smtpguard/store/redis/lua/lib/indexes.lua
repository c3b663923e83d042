-- Every record write also keeps the zone's lookups: the `ids` hash (m:<Message-ID without
-- <>>, u:<upstream id>, s:<smtpguard id> → key), so a provider event or an operator naming
-- one finds its record (§13, §14), and one sorted set per state (st:<state>: key → updated
-- at), so held records are listed without reading the others. The record keeps the ids it
-- indexed so that the purge can take them out again. The three ids are always the last
-- three ARGV of the script; KEYS[1] is the record, `cur` its fields (v, d, s) before the
-- write, and the zone's index is KEYS[{{IDX}}] (its prefix is the zone's).
-- Parameters: IDX the index's place in KEYS; MEMBER, STATE, SCORE the places in ARGV of the
-- record's key, its state and its index score.

do
  local sid, mid, uid = ARGV[#ARGV - 2], ARGV[#ARGV - 1], ARGV[#ARGV]
  local prefix = string.sub(KEYS[{{IDX}}], 1, -4)
  local ids = prefix .. 'ids'
  local member = ARGV[{{MEMBER}}]
  if mid ~= '' then redis.call('HSET', ids, 'm:' .. mid, member) end
  if uid ~= '' then redis.call('HSET', ids, 'u:' .. uid, member) end
  if sid ~= '' then redis.call('HSET', ids, 's:' .. sid, member) end
  redis.call('HSET', KEYS[1], 'mid', mid, 'uid', uid, 'sid', sid)
  local old, new = cur[3], ARGV[{{STATE}}]
  if old and old ~= new then redis.call('ZREM', prefix .. 'st:' .. old, member) end
  redis.call('ZADD', prefix .. 'st:' .. new, ARGV[{{SCORE}}], member)
end
