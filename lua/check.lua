-- check.lua: decides requests one after the other, each with every one of its counters together,
-- and writes a request's counters only if that request is admitted. One section per algorithm
-- module of src/limiter/algorithm/ (window.rs, log.rs, gcra.rs), mirroring it line for line;
-- `decide` mirrors the embedded store (src/store/memory.rs) and `admits` (src/limiter/mod.rs).
--
-- KEYS     the counters of every request, request by request.
-- ARGV     first '1' to have the reply name this node's replication ID, '0' not to; then per
--          request: n, the number of its counters; the instant it names (ms since the Unix
--          epoch; '0' for none); '1' if its quota limits deny when all of them are over, '0' if
--          they never deny here (a Cluster group, where the caller applies the rule across
--          groups, or a request where a descriptor passes as a quota); followed for each counter
--          by: kind ('f' fixed window, 'c' fixed window on the calendar, 's' sliding window, 'l'
--          sliding log, 'b' bucket), limit, window in ms (on the calendar: 'b0 b1 b2 b3', the
--          boundaries of three windows in a row around the replica's clock, in ms; the one holding
--          Redis' clock counts), burst, hits, change ('0' charges the hits, '1' gives them back; for a
--          window, 'u<n>' takes a leased block: as many of the hits as fit in 1/LEASE_SHARE of
--          what remains, at least n, over when n do not fit; 'r<w>' gives a block's hits back
--          in window w only; 'h<estimate> <ttl> <charge> <most> <settle> <id>' holds for request id, or
--          settles its hold at the hits: see the hold section), mode ('e' enforce, 's' shadow,
--          'q' quota, 'p' shadow and quota: a quota limit never over), counting ('1' always: charged whatever the answer, over
--          only when the count is above the limit).
-- Reply    the time of the call (Redis TIME, in ms), this node's replication ID if asked ('' if
--          not: a refund names it, so that lua/undo.lua refunds only on the node that charged,
--          never on a replica promoted without the charge), then per request: admitted (1|0),
--          then per counter: over (1|0), remaining if admitted, remaining if not, ms until reset if
--          admitted, ms until reset if not, what its write charges (hits, log entries or
--          bucket units; 0 for none), the window it counts in (instant / window, or a calendar
--          window's start; 0 for a log or a bucket), and for a held counter what it did (1 held, 2 settled, 3 id
--          reused, 4 settled unheld, 5 table full) plus 8 per expired hold it found (0: not held). lua/undo.lua takes back what a request wrote, given this
--          time. A request one of whose keys holds what no counter does (another type, or
--          fields that do not read as numbers) is answered -1, the counter's place in it (from
--          1), the key's type and the error instead, and writes nothing.
-- Invariant: the clock is Redis TIME, and a request's instant is never earlier; every counter of
--          a request moves or none does, except that a counter counted always moves either way;
--          requests are decided in order, each seeing what the
--          ones before it wrote; a counter named twice is counted twice; every written key gets
--          an expiry, set as an instant on the TIME clock (PEXPIREAT: Redis' own clock for
--          relative TTLs is the call's start, which may trail TIME by a millisecond and would
--          end a key early); a key written for an instant expires one window after the latest
--          instant it holds (a fixed window: the end of its latest window, a calendar window's
--          end; a log: its newest entry
--          plus a window), and the service names no instant more than --max-schedule-ahead from
--          now, so no key outlives now + --max-schedule-ahead + its window; numbers are written
--          with %d, never in a form that loses digits; a key that cannot be read fails only the
--          requests naming it, while an error of the server's (READONLY, OOM, ...) fails the whole
--          call.

-- Locals: every global lookup in a Redis script goes through the protected globals table.
local call, floor, max, min, tonumber, format, match, unpack, type = redis.call, math.floor,
  math.max, math.min, tonumber, string.format, string.match, unpack, type
local gsub, char = string.gsub, string.char

-- The most a window counts and a bucket holds (limiter::algorithm::MOST_COUNT, gcra::MOST_LEVEL):
-- past them a charge is clamped, so that every number stays exact in a double.
local MOST_COUNT = 2 ^ 52
local MOST_LEVEL = 2 ^ 52
-- A leased block takes at most this part of what remains (limiter::lease::SHARE).
local LEASE_SHARE = 8

local clock = call('TIME')
local now = tonumber(clock[1]) * 1000 + floor(tonumber(clock[2]) / 1000)
-- What this call knows of each counter in Redis, by key (false: nothing stored).
local disk = {}
-- A replica takes its primary's replication ID, and a promoted one a new ID: the ID names the
-- node that took these writes, among those that can take writes.
local function replication_id()
  return match(call('INFO', 'replication'), 'master_replid:(%w+)') or ''
end
local reply = { now, ARGV[1] == '1' and replication_id() or '' }

local function int(x)
  return format('%d', x)
end

local function ceil_div(a, b)
  return floor((a + b - 1) / b)
end

-- Windows (window.rs) ---------------------------------------------------------------------------
-- A fixed window: a hash field per window index (a calendar window's start). A sliding window: a
-- hash of w (the window last written), c (its count), p (the count of the window before). A
-- window is its length in ms (windows aligned to the Unix epoch), or a calendar window as
-- `calendar` picks it: { start, end }.

-- The window holding `at`: what names it (its index, or a calendar window's start), its start
-- and its end.
local function bounds(window, at)
  if type(window) == 'table' then return window[1], window[1], window[2] end
  local index = floor(at / window)
  return index, index * window, (index + 1) * window
end

-- Of the calendar boundaries 'b0 b1 b2 b3' the replica sent (three windows in a row around its
-- own clock), the window holding Redis' clock: the replicas agree on it whatever their clocks
-- say, with the end of the window after it where the replica sent it. A replica more than a
-- window from Redis' clock fails the request (`unreadable`).
local function calendar(text)
  local b = { match(text, '^(%d+) (%d+) (%d+) (%d+)$') }
  for i = 1, 4 do b[i] = tonumber(b[i]) end
  if not b[4] or now < b[1] or now >= b[4] then
    error({ calendar = true }, 0)
  end
  if now >= b[3] then return { b[3], b[4] } end
  if now >= b[2] then return { b[2], b[3], b[4] } end
  return { b[1], b[2], b[3] }
end

local function weigh(previous, overlap, window)
  return floor(previous * overlap / window)
end

-- The first offset into a window at which weigh(previous, window - offset, window) <= room.
local function first_offset(room, previous, window)
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
  local at = max(first_offset(limit - current - need, previous, window), start)
  return base + max(at - start, 1)
end

-- The count of window `index` of a fixed window (false: none).
local function fixed_load(key, index)
  local windows = disk[key]
  if not windows then
    windows = {}
    disk[key] = windows
  end
  local count = windows[index]
  if count == nil then
    count = tonumber(call('HGET', key, int(index))) or false
    windows[index] = count
  end
  return count
end

-- Writes a fixed window's count; a new window also drops the windows already over and makes the
-- key live until the latest window it holds ends.
local function fixed_store(key, state, window)
  local windows = disk[key]
  if not windows[state.w] then
    local current, _, finish = bounds(window, now)
    local latest = state.w
    local over = {}
    for _, field in ipairs(call('HKEYS', key)) do
      local index = tonumber(field)
      if index == nil or index < current then
        over[#over + 1] = field
      elseif index > latest then
        latest = index
      end
    end
    if #over > 0 then call('HDEL', key, unpack(over)) end
    call('HSET', key, int(state.w), int(state.c))
    -- Off the calendar, the latest window may be a scheduled instant's.
    if type(window) ~= 'table' then finish = (latest + 1) * window end
    call('PEXPIREAT', key, int(finish))
  else
    call('HSET', key, int(state.w), int(state.c))
  end
  windows[state.w] = state.c
end

local function sliding_load(key)
  local stored = disk[key]
  if stored == nil then
    local h = call('HMGET', key, 'w', 'c', 'p')
    stored = false
    if h[1] then stored = { w = tonumber(h[1]), c = tonumber(h[2]) or 0, p = tonumber(h[3]) or 0 } end
    disk[key] = stored
  end
  return stored
end

local function sliding_store(key, state, ttl)
  local held = disk[key]
  if held and held.w == state.w and held.p == state.p then
    -- Same window: only the count changes; the TTL set with the window still holds.
    call('HSET', key, 'c', int(state.c))
  else
    call('HSET', key, 'w', int(state.w), 'c', int(state.c), 'p', int(state.p))
    call('PEXPIREAT', key, int(now + ttl))
  end
  disk[key] = state
end

local function window_step(sliding, key, latest, limit, window, at, hits, refund, always, least, within)
  local index, start, finish = bounds(window, at)
  local stored = latest[key]
  if stored == nil then
    if sliding then
      stored = sliding_load(key)
    else
      local count = fixed_load(key, index)
      stored = count and { w = index, c = count, p = 0 }
    end
  end
  local elapsed = at - start
  local to_end = finish - now
  local need = max(hits, 1)
  if always then need = hits end
  if least then need = max(least, 1) end
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
  if least then hits = min(hits, max(need, floor(max(limit - used, 0) / LEASE_SHARE))) end
  if within and within ~= index then hits = 0 end
  local after = min(current + hits, MOST_COUNT)
  if refund then after = max(current - hits, 0) end
  local reset = to_end
  if sliding and over then reset = sliding_retry(limit, window, elapsed, previous, current, need) end
  local ttl = to_end
  if sliding then ttl = to_end + window end

  local state = { w = index, c = after, p = previous }
  latest[key] = state
  local step = {
    over = over, after = max(limit - (weighted + after), 0), before = max(limit - used, 0),
    reset_after = reset, reset_before = reset, charged = 0, window = index,
  }
  if not refund then step.charged = after - current end
  if hits > 0 then
    if sliding then
      step.write = function() sliding_store(key, state, ttl) end
    else
      step.write = function() fixed_store(key, state, window) end
    end
  end
  return step
end

-- Sliding log (log.rs) --------------------------------------------------------------------------
-- A sorted set scored by instant, members '<instant>:<n>' numbering an instant's entries 0001 up.

-- The live entries of a log (those less than a window old), ascending.
local function log_load(key, window)
  local entries = disk[key]
  if entries == nil then
    entries = {}
    local found = call('ZRANGEBYSCORE', key, '(' .. int(now - window), '+inf', 'WITHSCORES')
    for i = 2, #found, 2 do entries[#entries + 1] = tonumber(found[i]) end
    disk[key] = entries
  end
  return entries
end

-- The most entries any window holding `at` holds.
local function peak(log, at, window)
  local best = 0
  for i = 1, #log do
    if log[i] >= at and log[i] < at + window then best = best + 1 end
  end
  local last = 1
  for first = 1, #log do
    local start = log[first]
    if start > at then break end
    if start + window > at then
      if last < first then last = first end
      while last <= #log and log[last] < start + window do last = last + 1 end
      if last - first > best then best = last - first end
    end
  end
  return best
end

-- The earliest instant from `at` at which no window holding it holds more than `room` entries.
local function first_fit(log, at, window, room)
  for first = 1, #log - room do
    local start, last = log[first], log[first + room]
    if last < start + window and last < at + window and start + window > at then
      at = start + window
    end
  end
  return at
end

-- The entries after adding `hits` at `at`, or removing up to `hits` of the newest at or before it.
local function log_apply(entries, add, at, hits)
  local out, n = {}, #entries
  local stop = 0
  while stop < n and entries[stop + 1] <= at do stop = stop + 1 end
  local keep_to = stop
  if not add then keep_to = max(stop - hits, 0) end
  for i = 1, keep_to do out[#out + 1] = entries[i] end
  if add then
    for _ = 1, hits do out[#out + 1] = at end
  end
  for i = stop + 1, n do out[#out + 1] = entries[i] end
  return out
end

local function member(instant, n)
  return format('%d:%04d', instant, n)
end

local function log_store(key, before, after, add, at, hits, window)
  call('ZREMRANGEBYSCORE', key, '-inf', int(now - window))
  if add then
    local base = 0
    for i = 1, #before do
      if before[i] == at then base = base + 1 end
    end
    local args = {}
    for n = 1, hits do
      args[#args + 1] = int(at)
      args[#args + 1] = member(at, base + n)
    end
    call('ZADD', key, unpack(args))
  else
    -- The removed entries are `before`'s from #after + 1 - (entries later than `at`) on: each
    -- is its instant's entry numbered by its rank among that instant's entries.
    local later = 0
    for i = 1, #before do
      if before[i] > at then later = later + 1 end
    end
    local gone = {}
    local rank, previous = 0, nil
    for i = 1, #before - later do
      if before[i] == previous then rank = rank + 1 else rank, previous = 1, before[i] end
      if i > #after - later then gone[#gone + 1] = member(before[i], rank) end
    end
    call('ZREM', key, unpack(gone))
  end
  if #after == 0 then
    call('DEL', key)
  else
    call('PEXPIREAT', key, int(after[#after] + window))
  end
  disk[key] = after
end

local function log_step(key, latest, limit, window, at, hits, refund, always)
  local entries = latest[key] or log_load(key, window)
  local need = max(hits, 1)
  if always then need = hits end
  local fullest = peak(entries, at, window)
  local never = need > limit
  local over = (not refund) and (never or fullest + need > limit)
  local function until_empty(log)
    if #log == 0 then return 0 end
    return log[#log] + window - now
  end
  local before = max(limit - fullest, 0)
  local step = {
    over = over, after = before, before = before,
    reset_after = until_empty(entries), reset_before = until_empty(entries), charged = 0,
  }
  if over then
    local fits = window
    if not never then fits = first_fit(entries, at, window, limit - need) - now end
    step.reset_after, step.reset_before = fits, fits
    -- Counted always, logged anyway, up to one entry past the limit in the fullest window.
    local logged = 0
    if always then logged = min(hits, max(limit + 1 - fullest, 0)) end
    if logged > 0 then
      local after = log_apply(entries, true, at, logged)
      latest[key] = after
      step.after = max(limit - (fullest + logged), 0)
      step.charged = logged
      step.write = function() log_store(key, entries, after, true, at, logged, window) end
    end
    return step
  end
  local add = not refund
  if hits == 0 or (refund and not (#entries > 0 and entries[1] <= at)) then return step end
  local after = log_apply(entries, add, at, hits)
  latest[key] = after
  if add then
    step.after = max(limit - (fullest + hits), 0)
    step.charged = hits
    step.reset_after = max(entries[#entries] or at, at) + window - now
  else
    step.after = max(limit - peak(after, at, window), 0)
    step.reset_after = until_empty(after)
  end
  step.write = function() log_store(key, entries, after, add, at, hits, window) end
  return step
end

-- Buckets (gcra.rs) -----------------------------------------------------------------------------
-- A hash of t (when the level was measured, ms) and l (the level: a hit weighs `window` units,
-- `limit` units drain per ms).

local function bucket_step(key, latest, limit, window, burst, hits, refund, always)
  local stored = latest[key]
  if stored == nil then stored = disk[key] end
  if stored == nil then
    local h = call('HMGET', key, 't', 'l')
    stored = false
    if h[1] then stored = { t = tonumber(h[1]), l = tonumber(h[2]) } end
    disk[key] = stored
  end
  local level = 0
  if stored then
    local drained = max(now - stored.t, 0) * limit
    if stored.l > drained then level = stored.l - drained end
  end
  local need = max(hits, 1)
  if always then need = hits end
  local capacity = burst * window
  local never = limit == 0 or need > burst
  local over = (not refund) and (never or level + need * window > capacity)
  local after = level
  local changed = limit > 0 and (refund or not over or always) and hits > 0
  if changed then
    if not refund then
      after = min(level + hits * window, MOST_LEVEL)
    elseif hits >= ceil_div(level, window) then
      after = 0
    else
      after = level - hits * window
    end
  end
  local function remaining(l) return max(burst - ceil_div(l, window), 0) end
  local function until_full(l)
    if limit == 0 then return window end
    return ceil_div(l, limit)
  end
  local step = {
    over = over, after = remaining(after), before = remaining(level),
    reset_after = until_full(after), reset_before = until_full(level), charged = 0,
  }
  if not refund then step.charged = after - level end
  if over then
    local fits = window
    if not never then fits = ceil_div(level + need * window - capacity, limit) end
    step.reset_after, step.reset_before = fits, fits
  end
  if changed then
    local state = false
    if after > 0 then state = { t = now, l = after } end
    latest[key] = state
    step.write = function()
      if state then
        call('HSET', key, 't', int(now), 'l', int(after))
        call('PEXPIREAT', key, int(now + ceil_div(after, limit)))
      else
        call('DEL', key)
      end
      disk[key] = state
    end
  end
  return step
end

-- Holds (hold.rs) ------------------------------------------------------------------------------
-- A held counter at `key` keeps its table beside it, in its slot: the hash `key~h` of each
-- request's entry ('h <amount>' held, 's' settled, 'x <charged>' lapsed: its hold expired,
-- which charged that) and of '~' (what the holds outstanding hold), the sorted set `key~e` of
-- the holds by when they expire and the sorted set `key~m` of the marks (settled, lapsed) by
-- when they are forgotten. All three live two times to live after the table's last change,
-- and at least until the window in which its newest hold may expire ends.

-- The most due holds, and the most due marks, one call tidies (hold::MOST_DUE).
local MOST_DUE = 16

-- What the held counter at `key` does for a request of `hits` (a settle's cost) whose change is
-- 'h<estimate> <ttl> <1: charge expired holds> <most entries> <1: settle> <request id>'; its
-- table is tidied whatever the answer, and the hold taken only if the request is admitted.
local function hold_step(sliding, key, latest, limit, window, hits, change)
  local estimate, ttl, charge_expired, most, settle, id =
    match(change, '^h(%d+) (%d+) (%d) (%d+) (%d) (%x+)$')
  estimate, ttl, most = tonumber(estimate), tonumber(ttl), tonumber(most)
  -- The table keeps the id's 16 bytes, not its 32 hex digits.
  id = gsub(id, '%x%x', function(h) return char(tonumber(h, 16)) end)
  local hkey, ekey, mkey = key .. '~h', key .. '~e', key .. '~m'
  local head = call('HGET', hkey, '~')
  local held, count = 0, 0
  if head then held, count = tonumber(head), call('HLEN', hkey) - 1 end
  -- What this call read and changed: entries (false: none), fields to set, fields to delete,
  -- holds to add and remove, marks to add and remove.
  local entries, sets, dels, holds, unholds, marks, unmarks = {}, {}, {}, {}, {}, {}, {}
  local function entry(rid)
    if entries[rid] == nil then entries[rid] = call('HGET', hkey, rid) or false end
    return entries[rid]
  end
  local function put(rid, e) entries[rid], sets[#sets + 1] = e, { rid, e } end
  local function forget(rid)
    entries[rid], dels[#dels + 1], unmarks[#unmarks + 1] = false, rid, rid
    count = count - 1
  end
  local expired, charge = 0, 0
  local fresh = {}
  for _, rid in ipairs(call('ZRANGEBYSCORE', ekey, '-inf', int(now), 'LIMIT', 0, MOST_DUE)) do
    local amount = match(entry(rid) or '', '^h (%d+)$')
    unholds[#unholds + 1] = rid
    if amount then
      amount = tonumber(amount)
      held = held - amount
      local charged = 0
      if charge_expired == '1' then charged = amount end
      charge = charge + charged
      expired = expired + 1
      put(rid, 'x ' .. int(charged))
      marks[#marks + 1], fresh[rid] = { now + ttl, rid }, true
    end
  end
  for _, rid in ipairs(call('ZRANGEBYSCORE', mkey, '-inf', int(now), 'LIMIT', 0, MOST_DUE)) do
    if entry(rid) then forget(rid) else unmarks[#unmarks + 1] = rid end
  end
  -- Forgets the oldest mark this call did not make or, if there is none, the least of those it
  -- made (all due at once), if there is one.
  local function forget_oldest()
    for _, rid in ipairs(call('ZRANGE', mkey, 0, #unmarks)) do
      if entry(rid) and not fresh[rid] then
        forget(rid)
        return true
      end
    end
    local least = nil
    for rid in pairs(fresh) do
      if entries[rid] and (least == nil or rid < least) then least = rid end
    end
    if least then
      forget(least)
      return true
    end
    return false
  end
  local own = entry(id)
  local outcome
  if settle == '1' then
    local amount = match(own or '', '^h (%d+)$')
    local charged = match(own or '', '^x (%d+)$')
    if amount then
      held = held - tonumber(amount)
      charge = charge + hits
      unholds[#unholds + 1] = id
      put(id, 's')
      marks[#marks + 1] = { now + ttl, id }
      outcome = 2
    elseif charged then
      charge = charge + max(hits - tonumber(charged), 0)
      put(id, 's')
      marks[#marks + 1] = { now + ttl, id }
      outcome = 4
    else
      charge = charge + hits
      outcome = 4
    end
  elseif own then
    outcome = 3
  elseif count >= most and not forget_oldest() then
    outcome = 5
  else
    outcome = 1
  end
  local room = max(limit - held, 0)
  local charged
  if charge > 0 then
    charged = window_step(sliding, key, latest, room, window, now, charge, false, true, nil, nil)
  end
  local step
  local kept = latest[key]
  if settle == '1' then
    step = window_step(sliding, key, latest, room, window, now, 0, false, true, nil, nil)
    step.over = false
  else
    step = window_step(sliding, key, latest, room, window, now, estimate, false, false, nil, nil)
    latest[key] = kept
    local without = window_step(sliding, key, latest, limit, window, now, estimate, false, false,
      nil, nil)
    latest[key] = kept
    -- Over for the holds in flight alone (or a table full of them): room comes back when the
    -- next hold is due.
    if outcome == 5 or (step.over and not without.over) then
      local gone = {}
      for _, rid in ipairs(unholds) do gone[rid] = true end
      local next_due = call('ZRANGE', ekey, 0, #unholds, 'WITHSCORES')
      for i = 1, #next_due, 2 do
        if not gone[next_due[i]] then
          local wait = max(tonumber(next_due[i + 1]) - now, 1)
          step.reset_before = min(step.reset_before, wait)
          step.reset_after = min(step.reset_after, wait)
          break
        end
      end
    end
    if outcome == 3 or outcome == 5 then step.over = true end
  end
  step.charged = 0
  step.hold = outcome + 8 * expired
  step.write = charged and charged.write
  step.always = true
  local take = outcome == 1 and not step.over
  step.tidy = function(admitted)
    local left = count
    if take and admitted then
      put(id, 'h ' .. int(estimate))
      holds[#holds + 1] = { now + ttl, id }
      held = held + estimate
      left = left + 1
    end
    if left == 0 then
      call('DEL', hkey, ekey, mkey)
      return
    end
    if #dels > 0 then call('HDEL', hkey, unpack(dels)) end
    if #unholds > 0 then call('ZREM', ekey, unpack(unholds)) end
    if #unmarks > 0 then call('ZREM', mkey, unpack(unmarks)) end
    -- What this call set and then forgot (a mark it made) is not written.
    local fields = { '~', int(held) }
    for _, s in ipairs(sets) do
      if entries[s[1]] == s[2] then fields[#fields + 1], fields[#fields + 2] = s[1], s[2] end
    end
    call('HSET', hkey, unpack(fields))
    local function scored(list)
      local scores = {}
      for _, d in ipairs(list) do
        if entries[d[2]] then scores[#scores + 1], scores[#scores + 2] = int(d[1]), d[2] end
      end
      return scores
    end
    local held_scores, mark_scores = scored(holds), scored(marks)
    if #held_scores > 0 then call('ZADD', ekey, unpack(held_scores)) end
    if #mark_scores > 0 then call('ZADD', mkey, unpack(mark_scores)) end
    -- Two times to live, and not before the window in which the newest hold may expire ends
    -- (a sliding window's, a window later): a hold that expires unsettled is found and charged
    -- while its window counts, however long its user stays away.
    local _, _, finish = bounds(window, now + ttl)
    if type(window) == 'table' and now + ttl >= finish and window[3] then finish = window[3] end
    if sliding then finish = finish + window end
    local keep = int(max(now + 2 * ttl, finish))
    for _, k in ipairs({ hkey, ekey, mkey }) do call('PEXPIREAT', k, keep) end
  end
  return step
end

-- Requests ---------------------------------------------------------------------------------------

local pcall, error, tostring = pcall, error, tostring

-- What the counter at `key` with the arguments ARGV[o + 1 .. o + 8] finds at instant `at`, and
-- how it would be written, given what the request's earlier counters wrote (`latest`).
local function counter_step(key, o, latest, at)
  local kind = ARGV[o + 1]
  local limit, window = tonumber(ARGV[o + 2]), tonumber(ARGV[o + 3])
  if kind == 'c' then window = calendar(ARGV[o + 3]) end
  local hits, change = tonumber(ARGV[o + 5]), ARGV[o + 6]
  local refund = change == '1'
  local least, within
  if change:sub(1, 1) == 'u' then least = tonumber(change:sub(2)) end
  if change:sub(1, 1) == 'r' then refund, within = true, tonumber(change:sub(2)) end
  local always = ARGV[o + 8] == '1'
  local step
  if change:sub(1, 1) == 'h' then
    step = hold_step(kind == 's', key, latest, limit, window, hits, change)
    step.mode = ARGV[o + 7]
    return step
  end
  if kind == 'l' then
    step = log_step(key, latest, limit, window, at, hits, refund, always)
  elseif kind == 'b' then
    step = bucket_step(key, latest, limit, window, tonumber(ARGV[o + 4]), hits, refund, always)
  elseif kind == 'f' or kind == 'c' then
    step = window_step(false, key, latest, limit, window, at, hits, refund, always, least, within)
  else
    step = window_step(true, key, latest, limit, window, now, hits, refund, always, least, within)
  end
  step.mode = ARGV[o + 7]
  step.always = always
  return step
end

-- Answers a request whose i-th counter, at `key`, failed to read with error `e`: the key holds
-- another type (WRONGTYPE) or what no counter holds (a Lua error on what was read), or its
-- calendar windows are not around Redis' clock (the type answered is then 'calendar'). Any
-- other error is the server's (READONLY, OOM, ...) and fails the whole call, as it would
-- unguarded.
local function unreadable(key, i, e)
  local r = #reply
  if type(e) == 'table' and e.calendar then
    reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4] = -1, i, 'calendar', ''
    return
  end
  if type(e) == 'table' then e = e.err end
  e = tostring(e)
  if e:find('^%u+ ') and not e:find('^WRONGTYPE ') then error({ err = e }, 0) end
  reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4] = -1, i, call('TYPE', key).ok, e
end

-- Decides the request whose n counters are KEYS[k + 1 ..] and ARGV[a + 1 ..], at instant `at`;
-- its quota limits deny when all are over if `quota_here`. Every counter is read before any is
-- written, so that a key that cannot be read leaves the request's other counters as they were.
local function decide(k, a, n, at, quota_here)
  local latest = {}
  local steps = {}
  for i = 1, n do
    local key = KEYS[k + i]
    local read, step = pcall(counter_step, key, a + (i - 1) * 8, latest, at)
    if not read then return unreadable(key, i, step) end
    steps[i] = step
  end

  local admitted = true
  local quotas, quotas_over = 0, 0
  for i = 1, n do
    local s = steps[i]
    if s.mode == 'e' and s.over then admitted = false end
    if s.mode == 'q' or s.mode == 'p' then quotas = quotas + 1 end
    if s.mode == 'q' and s.over then quotas_over = quotas_over + 1 end
  end
  if quota_here and quotas > 0 and quotas_over == quotas then admitted = false end

  for i = 1, n do
    local s = steps[i]
    if s.write and (admitted or s.always) then s.write() end
    if s.tidy then s.tidy(admitted) end
  end

  reply[#reply + 1] = admitted and 1 or 0
  for i = 1, n do
    local s = steps[i]
    reply[#reply + 1] = s.over and 1 or 0
    reply[#reply + 1] = s.after
    reply[#reply + 1] = s.before
    reply[#reply + 1] = s.reset_after
    reply[#reply + 1] = s.reset_before
    reply[#reply + 1] = s.charged
    reply[#reply + 1] = s.window or 0
    reply[#reply + 1] = s.hold or 0
  end
end

local k, a = 0, 1
while a < #ARGV do
  local n = tonumber(ARGV[a + 1])
  decide(k, a + 3, n, max(tonumber(ARGV[a + 2]), now), ARGV[a + 3] == '1')
  k, a = k + n, a + 3 + 8 * n
end
return reply
