-- check.lua: decides every counter of one request together and writes only if the request is
-- admitted. It mirrors src/limiter/window.rs (`evaluate`) and `admits` in src/limiter/mod.rs.
--
-- KEYS[i]  one hash per counter: w = index of the window last written (now / window),
--          c = count in that window, p = count of the window before (sliding window).
-- ARGV[1]  '1': quota limits deny when all of them are over; '0': they never deny here (a
--          Cluster group, where the caller applies the rule across groups).
-- ARGV[2 + 6(i-1) ...] for counter i: algorithm ('f' fixed window, 's' sliding window),
--          limit, window in ms, hits, refund ('1' gives hits back), mode ('e' enforce,
--          's' shadow, 'q' quota).
-- Reply    { admitted (1|0), then per counter: over (1|0), remaining if admitted,
--          remaining if not, ms until reset }.
-- Invariant: the clock is Redis TIME; either every counter of the request moves or none does;
--          a counter named twice is counted twice; every written key gets a TTL.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function weigh(previous, overlap, window)
  return math.floor(previous * overlap / window)
end

-- The first offset into a window at which weigh(previous, window - offset, window) <= room.
local function first_fit(room, previous, window)
  local lo, hi = 0, window
  while lo < hi do
    local mid = lo + math.floor((hi - lo) / 2)
    if weigh(previous, window - mid, window) <= room then hi = mid else lo = mid + 1 end
  end
  return lo
end

local function sliding_retry(limit, window, elapsed, previous, current, need)
  local to_end = window - elapsed
  if need > limit then return to_end + window end
  local base, start = 0, elapsed
  if current + need > limit then
    base, start, previous, current = to_end, 0, current, 0
  end
  local at = math.max(first_fit(limit - current - need, previous, window), start)
  return base + math.max(at - start, 1)
end

local quota_here = ARGV[1] == '1'
local latest = {}
local steps = {}
for i = 1, #KEYS do
  local a = 1 + (i - 1) * 6
  local sliding = ARGV[a + 1] == 's'
  local limit = tonumber(ARGV[a + 2])
  local window = tonumber(ARGV[a + 3])
  local hits = tonumber(ARGV[a + 4])
  local refund = ARGV[a + 5] == '1'
  local key = KEYS[i]

  local stored = latest[key]
  if stored == nil then
    local h = redis.call('HMGET', key, 'w', 'c', 'p')
    if h[1] then
      stored = { w = tonumber(h[1]), c = tonumber(h[2]) or 0, p = tonumber(h[3]) or 0 }
    end
  end

  local index = math.floor(now / window)
  local elapsed = now - index * window
  local to_end = window - elapsed
  local need = math.max(hits, 1)
  local previous, current = 0, 0
  if stored then
    if stored.w == index then
      previous, current = stored.p, stored.c
    elseif sliding and stored.w + 1 == index then
      previous, current = stored.c, 0
    end
  end
  local weighted = 0
  if sliding then weighted = weigh(previous, window - elapsed, window) end
  local used = weighted + current
  local over = (not refund) and used + need > limit
  local after = current + hits
  if refund then after = math.max(current - hits, 0) end
  local reset = to_end
  if sliding and over then reset = sliding_retry(limit, window, elapsed, previous, current, need) end
  local ttl = to_end
  if sliding then ttl = to_end + window end

  local next_state = { w = index, c = after, p = previous }
  latest[key] = next_state
  steps[i] = {
    over = over, mode = ARGV[a + 6], hits = hits, key = key, next = next_state, ttl = ttl,
    after = math.max(limit - (weighted + after), 0), before = math.max(limit - used, 0), reset = reset,
  }
end

local admitted = true
local quotas, quotas_over = 0, 0
for i = 1, #steps do
  local s = steps[i]
  if s.mode == 'e' and s.over then admitted = false end
  if s.mode == 'q' then
    quotas = quotas + 1
    if s.over then quotas_over = quotas_over + 1 end
  end
end
if quota_here and quotas > 0 and quotas_over == quotas then admitted = false end

if admitted then
  for i = 1, #steps do
    local s = steps[i]
    if s.hits > 0 then
      redis.call('HSET', s.key, 'w', s.next.w, 'c', s.next.c, 'p', s.next.p)
      redis.call('PEXPIRE', s.key, s.ttl)
    end
  end
end

local reply = { admitted and 1 or 0 }
for i = 1, #steps do
  local s = steps[i]
  reply[#reply + 1] = s.over and 1 or 0
  reply[#reply + 1] = s.after
  reply[#reply + 1] = s.before
  reply[#reply + 1] = s.reset
end
return reply
