-- demand.lua: one stream's demand for one quota bucket of the Rate Limit Quota Service, kept
-- beside every other stream's, whichever sluice replica serves it, so that every replica shares
-- the bucket's limit out from the same figures. One call per bucket per report.
--
-- KEYS[1]  the bucket's hash: per stream id, '<demand>:<expiry ms>'.
-- ARGV     the stream id; its demand (a whole number: thousandths of a request per window), or ''
--          when the stream leaves the bucket; how long (ms) the stream stays counted without
--          reporting again.
-- Reply    the Redis clock (ms), then, per stream counted, its id and its demand; or -1 and the
--          key's type when the key holds another type than a hash (left as it is).
-- Invariant: a stream is counted once, with the demand it last reported, until it leaves or
--          stops reporting for the ms given; the key expires when the last stream would; a
--          field that is not a demand this script wrote is dropped.

local call, tonumber, match = redis.call, tonumber, string.match

local time = call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local key, stream, demand, stays = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])

local held = call('TYPE', key).ok
if held ~= 'hash' and held ~= 'none' then
  return { -1, held }
end

if demand == '' then
  call('HDEL', key, stream)
else
  call('HSET', key, stream, demand .. ':' .. string.format('%d', now + stays))
end

local out, latest = { now }, 0
local fields = call('HGETALL', key)
for i = 1, #fields, 2 do
  local d, expiry = match(fields[i + 1], '^(%d+):(%d+)$')
  expiry = tonumber(expiry)
  if d == nil or expiry <= now then
    call('HDEL', key, fields[i])
  else
    out[#out + 1] = fields[i]
    out[#out + 1] = d
    if expiry > latest then
      latest = expiry
    end
  end
end
if latest > 0 then
  call('PEXPIREAT', key, string.format('%d', latest))
end
return out
