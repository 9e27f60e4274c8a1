-- undo.lua: gives back what check.lua wrote for an admitted request: for a request whose answer
-- never reached its caller, or that another Cluster slot denied. The embedded store needs no
-- undo: it decides and answers in one step.
--
-- KEYS     the counters the request charged, as check.lua writes them.
-- ARGV     first the replication ID check.lua named when it charged, or '' to refund wherever
--          this runs; then per counter four values: its kind and what the charge was:
--          'f' (fixed window): the window index, the hits;
--          's' (sliding window): the window index (the call's time / window), the hits;
--          'l' (sliding log): the instant the entries were logged at, the hits;
--          'b' (bucket): the call's time, the units added (hits × window), the limit;
--          'h' (a hold taken, check.lua's hold section): the request id, the amount held.
--          The fourth value is '0' where unused.
-- Reply    the number of counters written: none on a node whose replication ID is not the one
--          named, such as a replica promoted after its primary failed, which may never have
--          received the charge (refunding it there would let a request over the limit).
-- Invariant: an undo only lowers what its own request raised, never more than of it can still
--          count: never below zero, never in another window, TTLs untouched, so it never lets a
--          later request over the limit. A bucket's charge is assumed to have drained first,
--          which is the least of it the level can still hold. A key that holds what no counter
--          does (another type, or fields that do not read as numbers) is skipped; the others
--          are still refunded.

local call, format, match, max, tonumber, unpack = redis.call, string.format, string.match,
  math.max, tonumber, unpack
local pcall, error, type, tostring = pcall, error, type, tostring

local function int(x)
  return format('%d', x)
end

-- Takes back one charge of `kind` (a, b, c as ARGV gives them) from `key`: 1 if it wrote, else 0.
local function undo(key, kind, a, b, c)
  if kind == 'f' then
    local count = tonumber(call('HGET', key, int(a)))
    if count then
      call('HSET', key, int(a), int(max(count - b, 0)))
      return 1
    end
  elseif kind == 's' then
    local h = call('HMGET', key, 'w', 'c', 'p')
    local w = tonumber(h[1])
    if w == a then
      call('HSET', key, 'c', int(max((tonumber(h[2]) or 0) - b, 0)))
      return 1
    elseif w == a + 1 then
      call('HSET', key, 'p', int(max((tonumber(h[3]) or 0) - b, 0)))
      return 1
    end
  elseif kind == 'l' then
    -- An instant's members sort by their number: the request's own are the last it logged.
    local members = call('ZRANGEBYSCORE', key, int(a), int(a))
    local gone = {}
    for j = max(#members - b + 1, 1), #members do gone[#gone + 1] = members[j] end
    if #gone > 0 then
      call('ZREM', key, unpack(gone))
      return 1
    end
  elseif kind == 'h' then
    -- Released only if it is still the request's hold: settled or expired, it is not. The
    -- table keeps the id's 16 bytes.
    a = string.gsub(a, '%x%x', function(h) return string.char(tonumber(h, 16)) end)
    local hkey = key .. '~h'
    if call('HGET', hkey, a) == 'h ' .. int(b) then
      call('HDEL', hkey, a)
      call('ZREM', key .. '~e', a)
      call('HSET', hkey, '~', int(max((tonumber(call('HGET', hkey, '~')) or 0) - b, 0)))
      return 1
    end
  elseif kind == 'b' then
    local h = call('HMGET', key, 't', 'l')
    if h[1] then
      local ours = b - max(tonumber(h[1]) - a, 0) * c
      if ours > 0 then
        local level = tonumber(h[2]) - ours
        if level > 0 then call('HSET', key, 'l', int(level)) else call('DEL', key) end
        return 1
      end
    end
  end
  return 0
end

if ARGV[1] ~= '' and match(call('INFO', 'replication'), 'master_replid:(%w+)') ~= ARGV[1] then
  return 0
end
local undone = 0
for i, key in ipairs(KEYS) do
  local o = 4 * i - 3
  local a, b, c = ARGV[o + 2], tonumber(ARGV[o + 3]), tonumber(ARGV[o + 4])
  if ARGV[o + 1] ~= 'h' then a = tonumber(a) end
  local done, e = pcall(undo, key, ARGV[o + 1], a, b, c)
  if done then
    undone = undone + e
  else
    -- The key's own doing (WRONGTYPE, or a Lua error on what was read) skips it; an error of
    -- the server's (READONLY, OOM, ...) fails the call, as it would unguarded.
    if type(e) == 'table' then e = e.err end
    e = tostring(e)
    if e:find('^%u+ ') and not e:find('^WRONGTYPE ') then error({ err = e }, 0) end
  end
end
return undone
