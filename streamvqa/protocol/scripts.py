"""Every Lua script of the protocol, each defined once and named for what it guards.

A script runs atomically on one Redis node; each touches the keys of one session (one hash
slot on a Redis Cluster) or one global key, never both. Only CREATE_SESSION_LUA makes a
session's hash: the others add to its hash or streams only once they found it, so that no field
or entry of a gone session comes back. Above each: what it guards, its KEYS and ARGV, and what it
returns. Callers register them (`redis.register_script`) where they run them.
"""

from streamvqa.protocol.keys import REQUEUE_AFTER_S

# Marks a session that no worker holds (it left its worker idle) as waiting for a worker of its
# model, once (`queued` holds when; after REQUEUE_AFTER_S without a worker, a lost entry is
# replaced): a Lua function the scripts that bring work to a session call. `waking` wraps such a
# script so that it returns {its result, 1 when it marked the session}; the caller then queues it
# (`streamvqa.pending.enqueue`: the queue is a global key, in another slot than the session's).
WAKE_LUA = f"""
local woke = 0
local function wake(hash, now)
  local found = redis.call('HMGET', hash, 'worker', 'queued', 'state')
  local waiting = found[2] and tonumber(now) - tonumber(found[2]) < {REQUEUE_AFTER_S}
  if (not found[1] or found[1] == '') and not waiting and found[3] ~= 'error' then
    redis.call('HSET', hash, 'queued', now)
    woke = 1
  end
end
local function body()
"""


def waking(body: str) -> str:
    """A script whose body may call `wake(hash, now)`; it returns {the body's result, woke}."""
    return WAKE_LUA + body + "\nend\nreturn {body(), woke}\n"


# -- a session's life and the global sets (the gateway) --------------------------------------------

# Stores a new session, queued (`queued` is the time), with its media and question streams and
# their group, for CREATE_GRACE_S: it gets SESSION_TTL_S once it holds its places. KEYS = the
# hash, media and question streams; ARGV = the grace TTL (s), the time, then the hash's field,
# value pairs.
CREATE_SESSION_LUA = """
redis.call('HSET', KEYS[1], 'queued', ARGV[2], unpack(ARGV, 3))
redis.call('XGROUP', 'CREATE', KEYS[2], 'workers', '0', 'MKSTREAM')
redis.call('XGROUP', 'CREATE', KEYS[3], 'workers', '0', 'MKSTREAM')
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
return 1
"""
# Adds ARGV[2] to its owner's set (KEYS[1]) unless it holds ARGV[1] sessions already, and gives
# the set a TTL of ARGV[3] s. ARGV[4...] (optional): members that do not count (failed sessions;
# a failed session stays failed). Returns 1, or 0 when it is full.
TAKE_OWNED_LUA = """
local held = redis.call('SCARD', KEYS[1])
for i = 4, #ARGV do held = held - redis.call('SISMEMBER', KEYS[1], ARGV[i]) end
if held >= tonumber(ARGV[1]) then return 0 end
redis.call('SADD', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""
# Admits a session to a model's places (KEYS[1], a hash: session id -> "<admitted at> <device
# bytes> <host bytes>", the memory it reserves on a worker), unless the places already hold as
# many sessions as the model's live workers may, or the sessions they hold and this one cannot
# all be placed on those workers, each session's memory on one worker: first-fit, the largest
# first, into each worker's device and host bytes (a session never counts on memory that is
# split between workers). ARGV = the places, the session id, its entry, its device bytes, its
# host bytes, then each worker's device bytes and host bytes (none: not known, not checked).
# Returns 1, 0 when no place is left, -1 when no worker has the device memory left for one of
# the sessions, -2 when none has the host memory.
TAKE_PLACE_LUA = """
local admitted = redis.call('HVALS', KEYS[1])
if #admitted >= tonumber(ARGV[1]) then return 0 end
local sessions = {{tonumber(ARGV[4]), tonumber(ARGV[5])}}
for _, entry in ipairs(admitted) do
  local _, d, h = string.match(entry, '^(%S+) (%d+) (%d+)$')
  sessions[#sessions + 1] = {tonumber(d or '0'), tonumber(h or '0')}
end
local workers = {}
for i = 6, #ARGV - 1, 2 do workers[#workers + 1] = {tonumber(ARGV[i]), tonumber(ARGV[i + 1])} end
if #workers > 0 then
  table.sort(sessions, function(a, b) if a[1] ~= b[1] then return a[1] > b[1] end return a[2] > b[2] end)
  for _, session in ipairs(sessions) do
    local device_room = false
    local placed = false
    for _, worker in ipairs(workers) do
      if session[1] <= worker[1] then
        device_room = true
        if session[2] <= worker[2] then
          worker[1], worker[2] = worker[1] - session[1], worker[2] - session[2]
          placed = true
          break
        end
      end
    end
    if not placed then return device_room and -2 or -1 end
  end
end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
return 1
"""
# Removes fields of a hash whose value is still the one read (ARGV: field, value pairs), so that
# one set again since it was read stays. Returns how many went.
DROP_UNCHANGED_LUA = """
local dropped = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    dropped = dropped + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return dropped
"""
# Deletes a session with every answer it was asked (and their cancel marks), at once. KEYS = the
# session's keys (the asked set first); ARGV = the answer keys' prefix, the cancel marks' prefix.
DELETE_SESSION_LUA = """
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do redis.call('DEL', ARGV[1] .. id, ARGV[2] .. id) end
return redis.call('DEL', unpack(KEYS))
"""


# -- a caller's request rate (the gateway) ---------------------------------------------------------

# A token bucket per caller, shared by every gateway. KEYS[1] = the bucket; ARGV = tokens per
# second, bucket size. Returns 0 when the request may go on, else the milliseconds until it may.
RATE_BUCKET_LUA = """
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1000000
local bucket = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(bucket[1]) or burst
local at = tonumber(bucket[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local wait_ms = 0
if tokens >= 1 then tokens = tokens - 1 else wait_ms = math.ceil((1 - tokens) / rate * 1000) end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 1)
return wait_ms
"""


# -- a session's media: its one writer, and its entries (the gateway) ------------------------------

# Claims a live session's media slot for an upload, marks it ingesting and claims its media for
# this request (renewed while it lives: a worker gives up an upload whose claim lapsed). KEYS =
# its hash, the streamer claim; ARGV = the time, the upload's connection id, the claim's TTL
# (ms). Returns 1 when claimed, 0 when the session already has media, -1 when it is gone.
START_UPLOAD_LUA = waking("""
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HSETNX', KEYS[1], 'media', 'upload') == 0 then return 0 end
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'pending' or state == 'ready' then redis.call('HSET', KEYS[1], 'state', 'ingesting') end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
wake(KEYS[1], ARGV[1])
return 1
""")
# Gives up an unfinished upload: tells the worker to drop its bytes (a media.MediaKind.ABORT entry),
# frees the media slot and puts the session back to ready (pending while no worker ever held it:
# records.TRANSITIONS). KEYS = hash, media stream; ARGV[1] = the media stream's MAXLEN.
ABORT_UPLOAD_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'type', 'abort')
redis.call('HDEL', KEYS[1], 'media', 'stream_bytes')
if redis.call('HGET', KEYS[1], 'state') == 'ingesting' then
  redis.call('HSET', KEYS[1], 'state', redis.call('HEXISTS', KEYS[1], 'worker') == 1 and 'ready' or 'pending')
end
return 1
"""
# Claims a session's media for a stream socket (the media's one writer: the gateway's claim, not a
# worker's lease). KEYS = hash, streamer key; ARGV = format, connection id, claim TTL (ms), the
# connection it resumes ('' for none). Returns [stream bytes received so far, last frame time or
# ''], or -1 when the session is gone, -2 when it has other media, -3 when another socket streams
# into it (one that is not the resumed one), -4 when it failed.
CLAIM_MEDIA_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HGET', KEYS[1], 'state') == 'error' then return -4 end
local media = redis.call('HGET', KEYS[1], 'media')
if media and media ~= ARGV[1] then return -2 end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[4] then return -3 end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('HSET', KEYS[1], 'media', ARGV[1])
local found = redis.call('HMGET', KEYS[1], 'stream_bytes', 'last_frame_s')
return {tonumber(found[1] or '0'), found[2] or ''}
"""
# Renews a media claim (`session:{id}:streamer`, a stream socket's or an upload's) for ARGV[2] ms
# while ARGV[1] holds it; 0 when it does not.
RENEW_MEDIA_CLAIM_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
# Adds a media entry to a live session, once, and wakes the session: the one writer of media
# entries, for every transport (a stream socket, an upload, a chat completion's image). A
# container's bytes carry the count of the session's media bytes before them (ARGV[6]), a frame its
# time (ARGV[4]): a call retried after its reply was lost, or a frame sent again, is found there.
# The bytes are counted in the hash's `stream_bytes` (which an aborted or abandoned upload drops).
# KEYS = hash, media stream, streamer key (the media claim); ARGV = MAXLEN, media bytes to count,
# this writer's connection, a frame's time ('' for none), the time, the offset ('' for none), then
# the entry's field, value pairs. Returns {the new entry's id (a string), 1 when found added, 0 for
# a frame not after the last one, -1 when the session is gone, -2 when it failed, -3 when another
# connection took the media over, -4 when bytes before these are missing (Redis lost them: a socket
# sends on from `bytes_received`, an upload starts again); 1 when it woke the session}.
ADD_MEDIA_ENTRY_LUA = waking("""
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HGET', KEYS[1], 'state') == 'error' then return -2 end
local holder = redis.call('GET', KEYS[3])
if holder and holder ~= ARGV[3] then return -3 end
if ARGV[4] ~= '' and tonumber(ARGV[4]) <= tonumber(redis.call('HGET', KEYS[1], 'last_frame_s') or '-1') then return 0 end
if ARGV[6] ~= '' then
  local received = tonumber(redis.call('HGET', KEYS[1], 'stream_bytes') or '0')
  if received > tonumber(ARGV[6]) then return 1 end
  if received < tonumber(ARGV[6]) then return -4 end
end
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', unpack(ARGV, 7))
if tonumber(ARGV[2]) > 0 then redis.call('HINCRBY', KEYS[1], 'stream_bytes', ARGV[2]) end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'last_frame_s', ARGV[4]) end
wake(KEYS[1], ARGV[5])
return id
""")
# Counts a socket among its session's open sockets, unless ARGV[3] are open. KEYS[1] = the
# session's sockets (a sorted set: connection id -> expiry, ms); ARGV = connection id, TTL (ms),
# limit. Sockets whose gateway died expire. Returns 1 when counted (or renewed), 0 when full.
OPEN_SOCKET_LUA = """
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


# -- a session's questions (the gateway) -----------------------------------------------------------

# Marks an answer cancelled (its client left) while the session lives: the worker stops it at its
# next token, or skips the question if it has not begun. KEYS = the hash, the cancel mark; ARGV =
# TTL (s). Returns 1 when marked, 0 when the session is gone.
CANCEL_ANSWER_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('SET', KEYS[2], '1', 'EX', ARGV[1])
return 1
"""

# Queues a question unless ARGV[1] already wait, records its id, and wakes the session. KEYS =
# the question stream, the session's asked ids, its hash, the asked questions' text; ARGV =
# backlog, the message, the answer id, the time, the asked ids' bound, TTL (s), the question.
# Returns {1 when queued (or found queued: a call retried after its reply was lost), 0 when the
# backlog is full, -1 when the session is gone, -2 when it failed; 1 when it woke the session}.
SUBMIT_QUESTION_LUA = waking("""
if redis.call('ZSCORE', KEYS[2], ARGV[3]) then return 1 end
if redis.call('EXISTS', KEYS[3]) == 0 then return -1 end
if redis.call('HGET', KEYS[3], 'state') == 'error' then return -2 end
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('XADD', KEYS[1], '*', 'm', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
redis.call('HSET', KEYS[4], ARGV[3], ARGV[7])
local forgotten = redis.call('ZRANGE', KEYS[2], 0, -tonumber(ARGV[5]) - 1)
if #forgotten > 0 then
  redis.call('ZREM', KEYS[2], unpack(forgotten))
  redis.call('HDEL', KEYS[4], unpack(forgotten))
end
redis.call('EXPIRE', KEYS[2], ARGV[6])
redis.call('EXPIRE', KEYS[4], ARGV[6])
wake(KEYS[3], ARGV[4])
return 1
""")


# -- a session's watches (the gateway adds and removes them, the worker checks them) ---------------

# Adds a watch to a live session unless it has ARGV[1] already, with the session's TTL, and counts
# the change in the hash's `watches_rev` (its worker reads the watches again when that moves).
# KEYS = the hash, the watches; ARGV = the limit, the watch id, the watch (JSON). Returns 1 when
# added, 0 when the session has as many watches as it may, -1 when it is gone.
ADD_WATCH_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('HINCRBY', KEYS[1], 'watches_rev', 1)
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
return 1
"""
# Removes a watch and, while the hash exists, counts the change in its `watches_rev`. KEYS = the
# hash, the watches; ARGV = the watch id. Returns 1 when removed, 0 when there was none.
DELETE_WATCH_LUA = """
if redis.call('HDEL', KEYS[2], ARGV[1]) == 0 then return 0 end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HINCRBY', KEYS[1], 'watches_rev', 1) end
return 1
"""
# Writes a watch after a check, and its firing as an event, once: only while the session and the
# watch live, and only when the stored watch has had ARGV[2] checks (those the check was decided
# from) and its last check was before this one's time (a worker that took the session over and
# checks again what another checked writes nothing). KEYS = the hash, the watches, the events
# stream; ARGV = the watch id, its checks before, this check's video time, the watch after (JSON),
# the `watch_fired` event ('' for none), the events' MAXLEN. Returns 1 when written, 0 when the
# session or the watch is gone, 2 when the stored watch is not the one the check was decided from.
RECORD_CHECK_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local stored = redis.call('HGET', KEYS[2], ARGV[1])
if not stored then return 0 end
local watch = cjson.decode(stored)
if tonumber(watch['checks'] or 0) ~= tonumber(ARGV[2]) then return 2 end
local last = watch['checked_s']
if last ~= nil and last ~= cjson.null and tonumber(last) >= tonumber(ARGV[3]) then return 2 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
if ARGV[5] ~= '' then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'm', ARGV[5])
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl > 0 then redis.call('PEXPIRE', KEYS[3], ttl) end
end
return 1
"""


# -- a session's lease: the one worker that holds it (the worker) ----------------------------------

# Takes a session's lease (its one worker) and names this worker in its hash, in one step, so that a
# worker that dies while opening the session leaves it to be queued again. KEYS = the lease, the
# hash; ARGV = worker id, TTL (ms). Returns 1 when taken, 0 when held by another, -1 when gone.
TAKE_LEASE_LUA = """
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
redis.call('HSET', KEYS[2], 'worker', ARGV[1])
redis.call('HDEL', KEYS[2], 'queued')
return 1
"""
# Renews a lease while this worker (ARGV[1]) holds it, and takes it back when nobody does and
# the hash still names this worker (a restarted Redis forgets leases that lapsed while it was
# down; a session queued again for another worker no longer names it). KEYS = the lease, the
# session's hash; ARGV[2] = TTL (ms). Returns 1 when the worker holds the lease, 0 when it does
# not or the session is gone.
RENEW_LEASE_LUA = """
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if holder or redis.call('HGET', KEYS[2], 'worker') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# Sets field ARGV[1] of hash KEYS[1] to ARGV[2] unless it is set, while the hash exists. Returns
# 1 when set here; else the field's value (another's claim); nil when the hash is gone.
CLAIM_FIELD_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then return 1 end
return redis.call('HGET', KEYS[1], ARGV[1])
"""
# Deletes a key (a worker's lease, a socket's claim) only while ARGV[1], its holder, holds it.
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# Marks a dead worker's session as waiting for a worker again, once: KEYS = its hash, its lease;
# ARGV = the dead worker's id, the time. Returns 1 when marked (the lease has lapsed and the
# hash still names the dead worker); the caller then queues it (`streamvqa.pending.enqueue`).
REQUEUE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
if redis.call('HGET', KEYS[1], 'worker') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'worker', '', 'queued', ARGV[2])
return 1
"""
# Lets an idle (or failed) session go: KEYS = its hash, lease, question stream, media stream,
# streamer claim; ARGV = worker id, '1' for a failed session. Refused (0) while the lease is
# another's, a question waits, or (unless failed) media waits or a socket streams into it; the
# gateway queues it again at its next question or media. The caller then takes it out of the
# model's places (`streamvqa.pending.leave`), with the memory it reserved.
PARK_LUA = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
if redis.call('XLEN', KEYS[3]) > 0 then return 0 end
if ARGV[2] ~= '1' and (redis.call('XLEN', KEYS[4]) > 0 or redis.call('EXISTS', KEYS[5]) == 1) then return 0 end
redis.call('DEL', KEYS[2])
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'worker', '')
  redis.call('HDEL', KEYS[1], 'queued')
end
return 1
"""


# -- a held session's record, answers and snapshot (the worker) ------------------------------------

# Updates a live session's record (a state change is one of records.TRANSITIONS): KEYS = its hash,
# then the keys that take the TTL (the worker: its media and question streams; the gateway, as a
# chat completion begins to use a session: every key of Keys.session_data); ARGV[1] = TTL (s),
# ARGV[2] = a state to set ('' for none), ARGV[3] = the state it must replace ('' for any),
# ARGV[4..] = field, value pairs, written before the state. Returns 0 (nothing written) when the
# session is gone.
UPDATE_RECORD_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if #ARGV > 3 then redis.call('HSET', KEYS[1], unpack(ARGV, 4)) end
if ARGV[2] ~= '' and (ARGV[3] == '' or redis.call('HGET', KEYS[1], 'state') == ARGV[3]) then
  redis.call('HSET', KEYS[1], 'state', ARGV[2])
end
for i = 1, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
return 1
"""
# Sets KEYS[2] to ARGV[1] with a TTL of ARGV[2] seconds while the session (hash KEYS[1]) lives.
SET_IF_LIVE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
return 1
"""
# Records an upload's progress and acknowledges its media entry in one step. KEYS = the hash,
# the media stream; ARGV = the entry id, then field, value pairs. Returns 0 (and only
# acknowledges) when the session is gone.
UPLOAD_ACK_LUA = """
redis.call('XACK', KEYS[2], 'workers', ARGV[1])
redis.call('XDEL', KEYS[2], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
return 1
"""
# Gives up an upload whose connection is gone (its gateway died part-way): frees the session's
# media slot for another upload. KEYS = the hash, the streamer claim, the media stream. Refused
# (0) while the claim is held or entries wait.
ABANDON_UPLOAD_LUA = """
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('XLEN', KEYS[3]) > 0 then return 0 end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HDEL', KEYS[1], 'media', 'upload_bytes', 'upload_ended', 'media_duration_s', 'stream_bytes')
if redis.call('HGET', KEYS[1], 'state') == 'ingesting' then redis.call('HSET', KEYS[1], 'state', 'ready') end
return 1
"""
# Adds an answer event while the session lives (a deleted session's answer stops), once: the
# event is the answer's ARGV[4]-th (from 0), which a call retried after its reply was lost finds
# there. KEYS = the hash, the answer stream, and for a token its cancel mark; ARGV = the event,
# MAXLEN, TTL (s), its index. Returns 1 when added (or found added), 0 when the session is gone,
# 2 when the answer was cancelled (nothing added).
PUBLISH_ANSWER_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('XLEN', KEYS[2]) > tonumber(ARGV[4]) then return 1 end
if KEYS[3] and redis.call('EXISTS', KEYS[3]) == 1 then return 2 end
redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[2], '*', 'm', ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
"""
# Replaces a session's snapshot while the session lives and the worker ARGV[2] holds it (its
# lease, or no lease and the hash names it, as RENEW_LEASE_LUA takes it back): a worker that
# lost the session must not overwrite what the new holder stored. KEYS = the session's hash, its
# snapshot, its lease; ARGV = TTL (s), the worker id, then field, value pairs. Returns {1, the
# replaced snapshot's `path` or nil} when stored (the caller deletes that file), {0, nil} when
# the session is gone, {-1, nil} when another worker holds it.
STORE_SNAPSHOT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, false} end
local holder = redis.call('GET', KEYS[3])
if holder ~= ARGV[2] and (holder or redis.call('HGET', KEYS[1], 'worker') ~= ARGV[2]) then return {-1, false} end
local replaced = redis.call('HGET', KEYS[2], 'path')
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[2], ARGV[1])
return {1, replaced}
"""
