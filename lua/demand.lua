-- demand.lua: the quota buckets of the Rate Limit Quota Service, divided among the streams (one
-- per Envoy) that report them, whichever sluice replica serves them. Per stream, a bucket's hash
-- keeps the stream's demand and its grant: the share of the limit its Envoy may be enforcing now.
-- A grant shrinks at once and grows only by what no stream holds: the grants of a bucket never
-- add up to more than its limit. One call settles one bucket for one replica, the replica's own
-- streams of it listed; the quota service's records waiting at once ride in one call (on a
-- Cluster, one key per call).
--
-- KEYS[i]  a bucket's hash: per stream id, '<demand>:<grant>:<held>:<expiry ms>'; `held` is at
--          least the grant and, after a shrink, the grant before it, until the replica says the
--          shrink has reached its Envoy. '~frozen': until when (ms) no grant grows, once a
--          record was found lost.
-- ARGV     the channel told of a bucket whose other replicas have grants to move; then per key:
--          the limit; whether the replica's streams may grow ('1' or '0'); how long (ms) a stream
--          stays counted after its report, or after its grant moved (an assignment lives at most
--          that long); how long (ms) no grant grows once a record is
--          found lost; the Redis time (ms) past which the call changes nothing, for its caller has
--          given up (0: none); the Redis time (ms) past which it grows nothing, for a call that
--          late may have waited out a restart that emptied the store (0: none); the server the
--          replica last had an answer from for this key (the first 16 hex digits of its run_id;
--          '' when none): a call that meets another has lost what every replica's streams hold,
--          until they list it again; the number of the replica's streams listed; and per stream
--          five: its id;
--          'r' (a report: its demand is new), 'k' (kept: as the store has it, or as listed if the
--          store lost it) or 'l' (it leaves the bucket); its demand; the most its Envoy may be
--          enforcing (what it was last sent, or more while a smaller grant sent to it may not have
--          reached it); '1' when the replica had it counted here before (so that its absence
--          means the record was lost), else '0'. Demands, grants and the limit are whole
--          numbers, thousandths of a request per window.
-- Reply    the Redis clock (ms) and this server's id ('' where INFO is refused), then per key: -2 when the call came past its time (nothing
--          changed); else 1 when a shrink of the replica's streams is yet
--          to reach their Envoys (the replica calls again once it has), else 0; when (ms) the
--          first stream the replica did not list and that holds something stops being counted
--          (0: none), as what it holds is then free; the number of streams counted and, per
--          stream, its id, its demand, its grant and its share; or -1 and the type the key holds
--          when it holds another type than a hash (left as it is).
-- Invariant: the grants of a bucket, each counted at its `held`, add up to at most its limit
--          unless a shrink of the limit or a lost record made them more, and then no grant grows
--          until they add up to less. A listed stream's `held` is what its replica says its Envoy
--          may be enforcing, and at least its grant.

local call, tonumber, match, floor = redis.call, tonumber, string.match, math.floor

local time = call('TIME')
local now = tonumber(time[1]) * 1000 + floor(tonumber(time[2]) / 1000)
-- The server: a restarted one has another run_id, and has lost every record.
local info = redis.pcall('INFO', 'server')
local server = type(info) == 'string' and match(info, 'run_id:(%x+)') or ''
server = string.sub(server, 1, 16)
local out = { now, server }
local channel = ARGV[1]

-- Max-min fair division of `limit` among `wants` (in order), as `quota::share::divide` divides.
local function divide(limit, wants)
  local n, given, order, w = #wants, {}, {}, {}
  if n == 0 then
    return given
  end
  local least = 0
  if limit >= n * 1000 then
    least = 1000
  end
  for i = 1, n do
    w[i] = math.max(wants[i], least)
    order[i] = i
  end
  table.sort(order, function(a, b)
    if w[a] ~= w[b] then
      return w[a] < w[b]
    end
    return a < b
  end)
  local left = limit
  for k = 1, n do
    local i = order[k]
    given[i] = math.min(w[i], floor(left / (n - k + 1)))
    left = left - given[i]
  end
  -- What nobody asked for, in equal parts among the streams that ask for some.
  local asking = 0
  for i = 1, n do
    if wants[i] > 0 then
      asking = asking + 1
    end
  end
  if asking == 0 then
    return given
  end
  local each, rest, k = floor(left / asking), left % asking, 0
  for i = 1, n do
    if wants[i] > 0 then
      k = k + 1
      given[i] = given[i] + each
      if k <= rest then
        given[i] = given[i] + 1
      end
    end
  end
  return given
end

-- Whether a grant stays while its share is `share`, as `limiter::share::settled` says: within 2 %.
local function settled(grant, share)
  return math.abs(grant - share) * 50 <= grant
end

local at = 2
for k = 1, #KEYS do
  local key = KEYS[k]
  local limit, grow, stays, freeze, not_after, grow_until, heard, listed = tonumber(ARGV[at]),
    ARGV[at + 1] == '1', tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3]), tonumber(ARGV[at + 4]),
    tonumber(ARGV[at + 5]), ARGV[at + 6], tonumber(ARGV[at + 7])
  local first = at + 8
  grow = grow and (grow_until == 0 or now <= grow_until)
  at = first + 5 * listed
  local held = call('TYPE', key).ok
  if not_after > 0 and now > not_after then
    -- Its caller has given up (a call held up by a reconnection): what it lists may be stale.
    out[#out + 1] = -2
  elseif held ~= 'hash' and held ~= 'none' then
    out[#out + 1] = -1
    out[#out + 1] = held
  else
    -- `changed`: what the others may take moved (a demand, a stream, a grant or a delivery).
    local streams, changed = {}, false
    local frozen = 0
    local fields = call('HGETALL', key)
    for i = 1, #fields, 2 do
      local d, g, h, e = match(fields[i + 1], '^(%d+):(%d+):(%d+):(%d+)$')
      if fields[i] == '~frozen' then
        frozen = tonumber(fields[i + 1]) or 0
      elseif d ~= nil and tonumber(e) > now then
        streams[fields[i]] = { d = tonumber(d), g = tonumber(g), h = tonumber(h), e = tonumber(e) }
      else
        changed = true
      end
    end
    if heard ~= '' and server ~= '' and heard ~= server then
      -- Not the server the replica last heard from: a restarted one, which lost what the other
      -- replicas' streams hold as well, until they list them again.
      frozen = math.max(frozen, now + freeze)
    end
    local mine = {}
    for s = first, at - 1, 5 do
      local id, what, demand, grant = ARGV[s], ARGV[s + 1], tonumber(ARGV[s + 2]), tonumber(ARGV[s + 3])
      local stream = streams[id]
      if what == 'l' then
        changed = changed or stream ~= nil
        streams[id] = nil
      else
        if stream == nil and ARGV[s + 4] == '1' then
          -- Counted here before, and lost (a restarted server): what the other replicas'
          -- streams hold is not known either until they list them again.
          frozen = math.max(frozen, now + freeze)
        end
        if stream == nil then
          stream = { d = demand, g = grant, h = grant, e = now + stays }
          streams[id] = stream
          changed = true
        elseif what == 'r' then
          changed = changed or stream.d ~= demand
          stream.d, stream.e = demand, now + stays
        end
        local h = math.max(stream.g, grant)
        if h ~= stream.h then
          stream.h = h
          changed = true
        end
        mine[id] = true
      end
    end
    local ids, wants = {}, {}
    for id in pairs(streams) do
      ids[#ids + 1] = id
    end
    table.sort(ids)
    for i, id in ipairs(ids) do
      wants[i] = streams[id].d
    end
    local shares = divide(limit, wants)
    -- A grant within 2 % of its share stays, unless the grants add up to more than the limit (a
    -- lowered limit), or a stream is short of its share by more: then every grant above its
    -- share shrinks, so that the short one finds room.
    local held_all, short = 0, false
    for i, id in ipairs(ids) do
      local stream = streams[id]
      held_all = held_all + stream.h
      if stream.g < shares[i] and not settled(stream.g, shares[i]) then
        short = true
      end
    end
    local over = held_all > limit
    local shrink = over or short
    local taken = 0
    for i, id in ipairs(ids) do
      local stream = streams[id]
      if mine[id] and stream.g > shares[i] and (shrink or not settled(stream.g, shares[i])) then
        -- Sent now: it lives as long as a grant sent with a report.
        stream.g, stream.e, changed = shares[i], math.max(stream.e, now + stays), true
      end
      taken = taken + stream.h
    end
    local free, again, others = math.max(limit - taken, 0), 0, false
    grow = grow and now >= frozen
    for i, id in ipairs(ids) do
      local stream = streams[id]
      if mine[id] then
        if grow and stream.g < shares[i] and not settled(stream.g, shares[i]) and free > 0 then
          local more = math.min(shares[i] - stream.g, free)
          stream.g, free, changed = stream.g + more, free - more, true
          stream.h, stream.e = math.max(stream.h, stream.g), math.max(stream.e, now + stays)
        end
        if stream.h > stream.g then
          again = 1
        end
      elseif not settled(stream.g, shares[i]) or (shrink and stream.g > shares[i]) then
        others = true
      end
    end
    local lapse = 0
    for _, id in ipairs(ids) do
      local stream = streams[id]
      if not mine[id] and stream.h > 0 and (lapse == 0 or stream.e < lapse) then
        lapse = stream.e
      end
    end
    call('DEL', key)
    out[#out + 1] = again
    out[#out + 1] = lapse
    out[#out + 1] = #ids
    local latest = 0
    if frozen > now then
      call('HSET', key, '~frozen', string.format('%d', frozen))
    end
    for i, id in ipairs(ids) do
      local stream = streams[id]
      call('HSET', key, id, string.format('%d:%d:%d:%d', stream.d, stream.g, stream.h, stream.e))
      if stream.e > latest then
        latest = stream.e
      end
      out[#out + 1] = id
      out[#out + 1] = stream.d
      out[#out + 1] = stream.g
      out[#out + 1] = shares[i]
    end
    if latest > 0 then
      call('PEXPIREAT', key, string.format('%d', latest))
    end
    if others and changed then
      call('PUBLISH', channel, key)
    end
  end
end
return out
