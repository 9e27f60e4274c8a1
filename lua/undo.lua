-- undo.lua: gives back what check.lua charged for an admitted request, in the window it was
-- charged in: for a request whose answer never reached its caller, or that another Cluster slot
-- denied. The embedded store needs no undo: it decides and answers in one step.
--
-- KEYS     the counters the request charged, one hash each as check.lua writes them.
-- ARGV     per counter: the index of the window it was charged in (the call's time / window),
--          then the hits to give back.
-- Reply    the number of counters written.
-- Invariant: a counter still in that window loses the hits from its count `c`; one window later,
--          from `p` (where the sliding window keeps the window before); later, or gone, nothing.
--          Never below zero, never in another window, the TTL untouched: an undo can only lower
--          a count its own request raised, so it never lets a later request over the limit.

local call, max, tonumber = redis.call, math.max, tonumber

local undone = 0
for i, key in ipairs(KEYS) do
  local index = tonumber(ARGV[2 * i - 1])
  local hits = tonumber(ARGV[2 * i])
  local h = call('HMGET', key, 'w', 'c', 'p')
  local w = tonumber(h[1])
  if w == index then
    call('HSET', key, 'c', max((tonumber(h[2]) or 0) - hits, 0))
    undone = undone + 1
  elseif w == index + 1 then
    call('HSET', key, 'p', max((tonumber(h[3]) or 0) - hits, 0))
    undone = undone + 1
  end
end
return undone
