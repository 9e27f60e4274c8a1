-- demand.lua: streams' demands for quota buckets of the Rate Limit Quota Service, each kept
-- beside every other stream's, whichever sluice replica serves it, so that every replica shares
-- the bucket's limit out from the same figures. One call records one demand per key: the quota
-- service's records waiting at once ride in one call (on a Cluster, one key per call).
--
-- KEYS[i]  a bucket's hash: per stream id, '<demand>:<expiry ms>'.
-- ARGV     per key, three: the stream id; its demand (a whole number: thousandths of a request
--          per window), or '' when the stream leaves the bucket; how long (ms) the stream stays
--          counted without reporting again.
-- Reply    the Redis clock (ms), then per key: the number of streams counted and, per stream,
--          its id and its demand; or -1 and the type the key holds when it holds another type
--          than a hash (left as it is).
-- Invariant: a stream is counted once, with the demand it last reported, until it leaves or
--          stops reporting for the ms given; a key expires when its last stream would; a field
--          that is not a demand this script wrote is dropped.

local call, tonumber, match = redis.call, tonumber, string.match

local time = call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local out = { now }

for k = 1, #KEYS do
  local key = KEYS[k]
  local stream, demand, stays = ARGV[3 * k - 2], ARGV[3 * k - 1], tonumber(ARGV[3 * k])
  local held = call('TYPE', key).ok
  if held ~= 'hash' and held ~= 'none' then
    out[#out + 1] = -1
    out[#out + 1] = held
  else
    if demand == '' then
      call('HDEL', key, stream)
    else
      call('HSET', key, stream, demand .. ':' .. string.format('%d', now + stays))
    end
    local count_at, latest = #out + 1, 0
    out[count_at] = 0
    local fields = call('HGETALL', key)
    for i = 1, #fields, 2 do
      local d, expiry = match(fields[i + 1], '^(%d+):(%d+)$')
      expiry = tonumber(expiry)
      if d == nil or expiry <= now then
        call('HDEL', key, fields[i])
      else
        out[#out + 1] = fields[i]
        out[#out + 1] = d
        out[count_at] = out[count_at] + 1
        if expiry > latest then
          latest = expiry
        end
      end
    end
    if latest > 0 then
      call('PEXPIREAT', key, string.format('%d', latest))
    end
  end
end
return out
