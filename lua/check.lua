-- check.lua: decides requests one after the other, each with every one of its counters together,
-- and writes a request's counters only if that request is admitted. It mirrors
-- src/limiter/window.rs (`evaluate`) and `admits` in src/limiter/mod.rs.
--
-- KEYS     the counters of every request, request by request; one hash per counter:
--          w = index of the window last written (now / window), c = count in that window,
--          p = count of the window before (sliding window).
-- ARGV[1]  '1': quota limits deny when all of a request's quota limits are over; '0': they never
--          deny here (a Cluster group, where the caller applies the rule across groups).
-- then, per request: n, the number of its counters, followed for each counter by: algorithm
--          ('f' fixed window, 's' sliding window), limit, window in ms, hits, refund ('1' gives
--          hits back), mode ('e' enforce, 's' shadow, 'q' quota).
-- Reply    the time of the call (Redis TIME, in ms), then per request: admitted (1|0), then per
--          counter: over (1|0), remaining if admitted, remaining if not, ms until reset. A counter
--          written was written in window floor(time / window): lua/undo.lua takes that index.
-- Invariant: the clock is Redis TIME; every counter of a request moves or none does; requests
--          are decided in order, each seeing what the ones before it wrote; a counter named twice
--          is counted twice; every written key gets a TTL.

-- Locals: every global lookup in a Redis script goes through the protected globals table.
local call, floor, max, tonumber = redis.call, math.floor, math.max, tonumber

local t = call('TIME')
local now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)

local function weigh(previous, overlap, window)
  return floor(previous * overlap / window)
end

-- The first offset into a window at which weigh(previous, window - offset, window) <= room.
local function first_fit(room, previous, window)
  local lo, hi = 0, window
  while lo < hi do
    local mid = lo + floor((hi - lo) / 2)
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
  local at = max(first_fit(limit - current - need, previous, window), start)
  return base + max(at - start, 1)
end

local quota_here = ARGV[1] == '1'
-- The state of each counter in Redis as this call knows it (false: no such key).
local disk = {}
local reply = { now }

-- Decides the request whose n counters are KEYS[k + 1 ..] and ARGV[a + 1 ..].
local function decide(k, a, n)
  local latest = {}
  local steps = {}
  for i = 1, n do
    local at = a + (i - 1) * 6
    local sliding = ARGV[at + 1] == 's'
    local limit = tonumber(ARGV[at + 2])
    local window = tonumber(ARGV[at + 3])
    local hits = tonumber(ARGV[at + 4])
    local refund = ARGV[at + 5] == '1'
    local key = KEYS[k + i]

    local stored = latest[key]
    if stored == nil then stored = disk[key] end
    if stored == nil then
      local h = call('HMGET', key, 'w', 'c', 'p')
      stored = h[1] and { w = tonumber(h[1]), c = tonumber(h[2]) or 0, p = tonumber(h[3]) or 0 }
      disk[key] = stored
    end

    local index = floor(now / window)
    local elapsed = now - index * window
    local to_end = window - elapsed
    local need = max(hits, 1)
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
    if refund then after = max(current - hits, 0) end
    local reset = to_end
    if sliding and over then reset = sliding_retry(limit, window, elapsed, previous, current, need) end
    local ttl = to_end
    if sliding then ttl = to_end + window end

    local next_state = { w = index, c = after, p = previous }
    latest[key] = next_state
    steps[i] = {
      over = over, mode = ARGV[at + 6], hits = hits, key = key, next = next_state, ttl = ttl,
      after = max(limit - (weighted + after), 0), before = max(limit - used, 0), reset = reset,
    }
  end

  local admitted = true
  local quotas, quotas_over = 0, 0
  for i = 1, n do
    local s = steps[i]
    if s.mode == 'e' and s.over then admitted = false end
    if s.mode == 'q' then
      quotas = quotas + 1
      if s.over then quotas_over = quotas_over + 1 end
    end
  end
  if quota_here and quotas > 0 and quotas_over == quotas then admitted = false end

  if admitted then
    for i = 1, n do
      local s = steps[i]
      if s.hits > 0 then
        local held = disk[s.key]
        if held and held.w == s.next.w and held.p == s.next.p then
          -- Same window: only the count changes; the TTL set with the window still holds.
          call('HSET', s.key, 'c', s.next.c)
        else
          call('HSET', s.key, 'w', s.next.w, 'c', s.next.c, 'p', s.next.p)
          call('PEXPIRE', s.key, s.ttl)
        end
        disk[s.key] = s.next
      end
    end
  end

  reply[#reply + 1] = admitted and 1 or 0
  for i = 1, n do
    local s = steps[i]
    reply[#reply + 1] = s.over and 1 or 0
    reply[#reply + 1] = s.after
    reply[#reply + 1] = s.before
    reply[#reply + 1] = s.reset
  end
end

local k, a = 0, 1
while a < #ARGV do
  local n = tonumber(ARGV[a + 1])
  decide(k, a + 1, n)
  k, a = k + n, a + 1 + 6 * n
end
return reply
