"""Lua scripts that make acquire-or-renew, release and claims atomic on the Redis server.

The scripts are registered with redis-py's ``register_script``: they are sent by SHA1
(``EVALSHA``) and re-sent in full when the server answers ``NOSCRIPT`` (after a restart or a
``SCRIPT FLUSH``). A lock's value is ``<fencing token>|<owner id>``; a node renews, deletes or
claims with a lock only while it holds exactly the value of the node's current term (which
names it as owner: node id plus a per-instance nonce), never an empty value. ``ELECT`` and
``CLAIM`` read the server clock (``TIME``) before they write, which needs script effects
replication, the default from Redis 5.0 on.

Anything that can write the project's keys may leave a value there that no script writes (an
operator's ``redis-cli``, another tool, a future version): no script fails on one, since a
script error fails the call for every job in it. A key of the wrong type or a value of another
form reads as none; the script that owns the key deletes or replaces it, and says so in the
server's log (``redis.log``, WARNING); ``ELECT`` also tells its caller, which logs it
(``_store.membership``). Lock values are the exception: one of another form, or a lock key of
another type, is *foreign* and stays, as nobody's, until it is deleted or expires (docs/design.md,
"Foreign values").
"""

from __future__ import annotations

from ..membership import MAX_RECORD_TTL_S
from ..records import LAST_INSTANT_US

__all__ = [
    "CLAIM",
    "CONTROL",
    "CONTROL_SHARDED",
    "ELECT",
    "ELECT_SHARDED",
    "OVERDUE",
    "RECORD_RUN",
    "RELEASE",
    "RELEASE_SHARDED",
    "RESET_CHECKPOINT",
    "RESET_CHECKPOINT_SHARDED",
    "SAVE_STATE",
]

# The start of the scripts that may meet a value no script writes: dropped(what, found) logs
# what the script deleted or replaced (``found`` the value it held, cut to 40 bytes, or nil) in
# the server's log and in ``notes``, which ELECT returns to its caller as ("#dropped", text)
# pairs: at most 20 each call, then one "<n> more"; typed(key, kind) deletes ``key`` when it
# holds another type than ``kind`` ("hash", "zset"), and says whether it did.
_DROPPED = """
local notes, unnoted = {}, 0
local function dropped(what, found)
  if found then
    what = what .. ' (it held ' .. string.sub(found, 1, 40) .. ')'
  end
  if #notes >= 40 then
    unnoted = unnoted + 1
    return
  end
  redis.log(redis.LOG_WARNING, 'singletonjob: deleted ' .. what)
  table.insert(notes, '#dropped')
  table.insert(notes, what)
end
local function typed(key, kind)
  local found = redis.call('TYPE', key)['ok']
  if found == kind or found == 'none' then
    return false
  end
  redis.call('DEL', key)
  dropped(key .. ', a ' .. found .. ' where a ' .. kind .. ' belongs')
  return true
end
"""

# The start of CLAIM and RELEASE: last_claimed(key), the instant a job's "last instant" key
# records and the token of the term that claimed it ("<instant µs>:<token>", or a bare
# "<instant µs>" from older versions); -1 and nil for none, and for what no script writes
# there (a key of another type, another form, an instant past year 9999, as
# ``records.last_us`` reads it), which the next write replaces.
_LAST_CLAIMED = f"""
local function last_claimed(key)
  local stored = redis.pcall('GET', key)
  if type(stored) ~= 'string' then
    return -1, nil
  end
  local at, by = string.match(stored, '^(%d+):?(%d*)$')
  local instant = at and #at <= {len(str(LAST_INSTANT_US))} and tonumber(at)
  if not instant or instant > {LAST_INSTANT_US} then
    return -1, nil
  end
  return instant, by
end
"""

# Acquire or renew the leases of several jobs for one node, keep its membership record, and
# read the operators' controls of those jobs, in one round trip.
#
# KEYS[1]    - the project's membership hash (owner id -> record JSON)
# KEYS[2]    - the membership expiries (sorted set: owner id -> server time in ms)
# KEYS[3]    - the project's controls hash (``paused:<job>``, ``trigger:<job>``,
#              ``step-down:<job>``, ``reset:<job>``)
# KEYS[4]    - the project's placement hash (owner id -> "<joined, server ms>|<jobs digest>",
#              and "#epoch" -> a counter that grows whenever a member joins or leaves)
# KEYS[3i+2] - lock key of job i   KEYS[3i+3] - fence key of job i   KEYS[3i+4] - its checkpoint
# ARGV[1]    - owner id of the caller
# ARGV[2]    - the caller's membership record (JSON), or "" when it was written before and has
#              not changed: then only its expiry is pushed back. A record sent whole also
#              refreshes the digest of the caller's placement entry when it differs from
#              ARGV[5] (a job retired), keeping its join time, and raises the epoch
# ARGV[3]    - how long the membership record lives without a renewal, in milliseconds, or ""
#              for a caller without a record (nothing of the membership is read or written)
# ARGV[4]    - the placement epoch the caller knows ("" for none)
# ARGV[5]    - the digest of the caller's jobs (which nodes run the same jobs, and define them
#              alike: ``membership.jobs_digest``; opaque here)
# ARGV[6]    - the release channel, to publish "echo" on (a listener's keepalive), or ""
# ARGV[4i+3] - lease time of job i, in milliseconds, or "0" to look at the lock without taking
#              it when it is free (placement: another node is preferred for it)
# ARGV[4i+4] - the exact lock value the caller holds for job i in its current term, or "" (the
#              caller sends "" for a value this library does not write: such a value is never
#              the caller's, and "" itself is never renewed)
# ARGV[4i+5] - the checkpoint retention of job i in milliseconds, or "" (no checkpoint): while
#              the caller holds the lock, its checkpoint's expiry is pushed back to it, so that
#              only the record of a job that no node leads any more expires
# ARGV[4i+6] - the name of job i (to find its controls)
#
# Returns first 1 when the caller's membership record is stored, 0 when ARGV[2] was "" and the
# record is missing (expired, or Redis lost it) or was not the caller's (deleted, see below):
# the caller sends it whole on its next call.
# Then, for each job, in order, one string "<status> <ttl> <controls> <value>" (" <value>"
# left out when the lock is free: no value), so that a reply for a thousand jobs is a
# thousand strings for the client to parse, not four thousand values:
#   status: 1 if the caller holds the lock after the call (acquired or renewed), 0 if not, -1
#   if acquiring failed (the error message is then the value, e.g. "OOM ..." under
#   noeviction, "READONLY ..." on a replica: the caller raises StoreReadOnly for the latter;
#   or the lock key is of another type than string, foreign: nobody takes it until it goes);
#   ttl: the lock's remaining time to live in milliseconds (-1: no expiry, or an error);
#   controls: the job's controls as bits: 1 paused; 2 an extra run asked for, 4 a step-down
#   asked for, and 8 the checkpoint reset (``RESET_CHECKPOINT``), each of these three
#   consumed (deleted) by this call, and only ever reported to the lock's holder;
#   value: the lock's value "<token>|<holder>" after the call (or the error message), last
#   and whole: it may hold spaces (anybody may write a lock key).
#   The controls hash is read once (HLEN, then HGETALL only when it is not empty).
# Then the server time in ms and the placement epoch; and, when that epoch is not ARGV[4] and
# the caller keeps a membership record, the placement hash's fields and values, flat; then a
# ("#dropped", what) pair for each value this call deleted or replaced (``_DROPPED``).
#
# Only the exact value of the caller's current term is renewed: a lock of the caller's that
# outlived a term the caller already ended (a lost reply) is left to expire, so that a node
# which stepped down never keeps its old lock alive. A free lock starts a new term whose token
# is max(last token + 1, server time in µs); the server-time floor keeps tokens growing when
# the fence key was lost (restart without persistence, FLUSHALL), or holds no token this script
# writes (a whole number below 2^53: Lua numbers are doubles), as long as the server clock
# does not step back. The acquisition writes use pcall: when Redis refuses writes (OOM under
# noeviction), held locks are still renewed (PEXPIRE is allowed) and only that job reports it;
# the membership writes use pcall too, so that a full Redis never fails the election. Expired
# records are deleted a thousand at a time: Lua's unpack() takes at most about 8,000 values, and a
# fleet that reconnects after an outage may leave more than that expiring together.
#
# The membership is three entries per owner, which ELECT writes and drops together: its record,
# its expiry and its placement entry; the expiry says who is a member. What this script meets
# there that it does not write is deleted: a key of another type (the placement hash's epoch
# then restarts at the server time in ms, a value no node knows, so that every node reads the
# placement again); an epoch that is not a count of at most 18 digits (HINCRBY could not raise
# it), restarted so; the caller's own record when it is not a JSON object naming the caller as
# its owner, with a node id and a start as strings, jobs as an object and a lifetime of 0 to
# MAX_RECORD_TTL_S (``MemberRecord.from_json`` also parses the start; one record is checked
# per call); an owner whose expiry lies further ahead than any record lives (it would never
# expire), with its three entries; a record whose owner has no expiry (looked for only when
# there are more records than placement entries); and, when the placement hash is read for the
# caller, an entry that is not "<joined, up to 15 digits>|<digest>" or whose owner has no
# expiry (the epoch is raised then, so that every node reads it again). The commands used stay
# within the ACL rule of docs/redis.md.
ELECT = (
    _DROPPED
    + f"""
local owner = ARGV[1]
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now_us / 1000)
local live = nil
local function members()
  if not live then
    live = {{}}
    for _, who in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
      live[who] = true
    end
  end
  return live
end
local function forget(owners)
  for first = 1, #owners, 1000 do
    local last = math.min(first + 999, #owners)
    redis.call('HDEL', KEYS[1], unpack(owners, first, last))
    redis.call('HDEL', KEYS[4], unpack(owners, first, last))
  end
end
local function placed(entry)
  local joined = string.match(entry, '^(%d+)|')
  return joined ~= nil and #joined <= 15
end
local function own_record(text)
  local ok, record = pcall(cjson.decode, text)
  if not ok or type(record) ~= 'table' or record.owner ~= owner then
    return false
  end
  local ttl = record.ttl_s or 0
  return type(record.node_id) == 'string' and type(record.started_at) == 'string'
    and type(record.jobs or {{}}) == 'table' and type(ttl) == 'number'
    and ttl >= 0 and ttl <= {MAX_RECORD_TTL_S}
end
local member = 1
if ARGV[3] ~= '' then
  typed(KEYS[1], 'hash')
  typed(KEYS[2], 'zset')
  local restart = typed(KEYS[4], 'hash')
  local epoch = redis.call('HGET', KEYS[4], '#epoch')
  if epoch and not (#epoch <= 18 and string.match(epoch, '^%d+$')) then
    dropped(KEYS[4] .. ' field #epoch, not a count', epoch)
    restart = true
  end
  if restart then
    redis.pcall('HSET', KEYS[4], '#epoch', now_ms)
  end
  if ARGV[2] ~= '' then
    redis.pcall('HSET', KEYS[1], owner, ARGV[2])
    local entry = redis.call('HGET', KEYS[4], owner)
    local joined, digest = string.match(entry or '', '^(%d+)|(.*)$')
    if joined and digest ~= ARGV[5] then
      redis.pcall('HSET', KEYS[4], owner, joined .. '|' .. ARGV[5])
      redis.pcall('HINCRBY', KEYS[4], '#epoch', 1)
    end
  else
    local record = redis.call('HGET', KEYS[1], owner)
    if record and not own_record(record) then
      redis.call('HDEL', KEYS[1], owner)
      dropped('the record of ' .. owner .. ' in ' .. KEYS[1] .. ', not its own', record)
      record = nil
    end
    if not record then
      member = 0
    end
  end
  redis.pcall('ZADD', KEYS[2], now_ms + tonumber(ARGV[3]), owner)
  if redis.pcall('HSETNX', KEYS[4], owner, now_ms .. '|' .. ARGV[5]) == 1 then
    redis.pcall('HINCRBY', KEYS[4], '#epoch', 1)
  end
  local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now_ms)
  local never = '(' .. (now_ms + {round(MAX_RECORD_TTL_S * 1000)})
  local ahead = redis.call('ZRANGEBYSCORE', KEYS[2], never, '+inf')
  for _, who in ipairs(ahead) do
    dropped('the member ' .. who .. ' of ' .. KEYS[2] .. ', which would never expire')
  end
  forget(gone)
  forget(ahead)
  if #gone > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
  end
  if #ahead > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[2], never, '+inf')
  end
  if #gone + #ahead > 0 then
    redis.pcall('HINCRBY', KEYS[4], '#epoch', 1)
  end
  local entries = redis.call('HLEN', KEYS[4]) - redis.call('HEXISTS', KEYS[4], '#epoch')
  if redis.call('HLEN', KEYS[1]) > entries then
    local flat = redis.call('HGETALL', KEYS[1])
    for i = 1, #flat, 2 do
      if not members()[flat[i]] then
        redis.call('HDEL', KEYS[1], flat[i])
        dropped('the record of ' .. flat[i] .. ' in ' .. KEYS[1] .. ', which has no expiry')
      end
    end
  end
end
typed(KEYS[3], 'hash')
local controls = nil
if redis.call('HLEN', KEYS[3]) > 0 then
  controls = {{}}
  local flat = redis.call('HGETALL', KEYS[3])
  for i = 1, #flat, 2 do
    local kind, job = string.match(flat[i], '^([^:]+):(.*)$')
    if kind then
      controls[job] = controls[job] or {{}}
      controls[job][kind] = true
    end
  end
end
local function last_token(fence)
  local stored = redis.pcall('GET', fence)
  if type(stored) == 'string' and #stored <= 16 and string.match(stored, '^%d+$')
      and tonumber(stored) < 2 ^ 53 then
    return tonumber(stored)
  end
  if stored then
    local found = type(stored) == 'string' and stored or nil
    dropped(fence .. ', not a fencing token (replaced)', found)
  end
  return 0
end
local out = {{member}}
for i = 1, (#KEYS - 4) / 3 do
  local lock, fence, checkpoint = KEYS[3 * i + 2], KEYS[3 * i + 3], KEYS[3 * i + 4]
  local ttl, held = ARGV[4 * i + 3], ARGV[4 * i + 4]
  local retention, name = ARGV[4 * i + 5], ARGV[4 * i + 6]
  local status, value, left = 0, redis.pcall('GET', lock), nil
  if type(value) == 'table' then
    local kind = redis.call('TYPE', lock)['ok']
    status, left = -1, -1
    value = lock .. ' is a ' .. kind .. ', not a lock value: foreign, no node takes the job '
      .. 'until it is deleted or expires'
  elseif not value and ttl == '0' then
    value, left = false, -2
  elseif value then
    if held ~= '' and value == held then
      redis.call('PEXPIRE', lock, ttl)
      status, left = 1, tonumber(ttl)
    else
      left = redis.call('PTTL', lock)
    end
  else
    local token = string.format('%.0f', math.max(last_token(fence) + 1, now_us))
    value = token .. '|' .. owner
    local written = redis.pcall('SET', lock, value, 'PX', ttl)
    if type(written) == 'table' and written.err then
      status, value, left = -1, written.err, -1
    else
      redis.pcall('SET', fence, token)
      status, left = 1, tonumber(ttl)
    end
  end
  if status == 1 and retention ~= '' then
    redis.call('PEXPIRE', checkpoint, retention)
  end
  local flags = 0
  local asked = controls and controls[name]  -- almost always nil: no control at all
  if asked then
    if asked['paused'] then
      flags = 1
    end
    if status == 1 and asked['trigger'] then
      redis.call('HDEL', KEYS[3], 'trigger:' .. name)
      flags = flags + 2
    end
    if status == 1 and asked['step-down'] then
      redis.call('HDEL', KEYS[3], 'step-down:' .. name)
      flags = flags + 4
    end
    if status == 1 and asked['reset'] then
      redis.call('HDEL', KEYS[3], 'reset:' .. name)
      flags = flags + 8
    end
  end
  local reply = status .. ' ' .. string.format('%d', left) .. ' ' .. flags
  if value then
    reply = reply .. ' ' .. value
  end
  table.insert(out, reply)
end
local epoch = redis.call('HGET', KEYS[4], '#epoch') or '0'
local placement = {{}}
if ARGV[3] ~= '' and epoch ~= ARGV[4] then
  local flat = redis.call('HGETALL', KEYS[4])
  local odd = 0
  for i = 1, #flat, 2 do
    local who, entry = flat[i], flat[i + 1]
    if who == '#epoch' or (placed(entry) and members()[who]) then
      table.insert(placement, who)
      table.insert(placement, entry)
    else
      redis.call('HDEL', KEYS[4], who)
      dropped('the entry of ' .. who .. ' in ' .. KEYS[4], entry)
      odd = odd + 1
    end
  end
  if odd > 0 then
    redis.pcall('HINCRBY', KEYS[4], '#epoch', 1)
    epoch = redis.call('HGET', KEYS[4], '#epoch') or '0'
  end
end
table.insert(out, now_ms)
table.insert(out, epoch)
for _, item in ipairs(placement) do
  table.insert(out, item)
end
if unnoted > 0 then
  redis.log(redis.LOG_WARNING, 'singletonjob: deleted ' .. unnoted .. ' more')
  table.insert(notes, '#dropped')
  table.insert(notes, unnoted .. ' more')
end
for _, item in ipairs(notes) do
  table.insert(out, item)
end
if ARGV[6] ~= '' then
  redis.call('PUBLISH', ARGV[6], 'echo')
end
return out
"""
)

# Set or clear one operator's control of a job and wake every node's election at once.
#
# KEYS[1] - the project's controls hash
# ARGV[1] - the release channel ("control <job>" wakes every node for a round about the job)
# ARGV[2] - the field (``paused:<job>``, ``trigger:<job>`` or ``step-down:<job>``)
# ARGV[3] - its value, or "" to delete the field. Returns 1 when the field changed.
#
# A controls key of another type than hash holds no control: it is deleted first.
CONTROL = (
    _DROPPED
    + """
typed(KEYS[1], 'hash')
local changed
if ARGV[3] == '' then
  changed = redis.call('HDEL', KEYS[1], ARGV[2])
else
  changed = redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
end
redis.call('PUBLISH', ARGV[1], 'control ' .. (string.match(ARGV[2], ':(.*)') or ''))
return changed
"""
)

# Reset a job's checkpoint (an operator's action, unfenced) and tell its leader, at once.
#
# KEYS[1] - the job's checkpoint key    KEYS[2] - the job's lock key
# KEYS[3] - the project's controls hash
# ARGV[1] - the release channel ("control <job>" wakes every node for a round about the job)
# ARGV[2] - the field ``reset:<job>``
#
# Deletes the record; while the lock exists (some node leads the job), sets the field to "1"
# and publishes the notice, so that the holder's next ELECT (brought forward by the notice)
# reports the reset (bit 8) and the holder forgets the copy of the record it keeps. Without a
# lock no node keeps a copy worth forgetting: a new term reads the record first. Returns the
# number of records deleted (0 or 1). A controls key of another type than hash is deleted, as
# CONTROL does.
RESET_CHECKPOINT = (
    _DROPPED
    + """
local deleted = redis.call('DEL', KEYS[1])
if redis.call('EXISTS', KEYS[2]) == 1 then
  typed(KEYS[3], 'hash')
  redis.call('HSET', KEYS[3], ARGV[2], '1')
  redis.call('PUBLISH', ARGV[1], 'control ' .. (string.match(ARGV[2], ':(.*)') or ''))
end
return deleted
"""
)

# Release the locks a node holds, record the last instant each ran, and tell the other nodes.
#
# KEYS[2i-1] - lock key of job i       KEYS[2i] - "last instant" key of job i
# ARGV[1]    - pub/sub channel to announce the release on
# ARGV[2]    - how far a recorded instant may lie ahead of the server clock, in microseconds
# ARGV[2i+1] - the exact value "<token>|<owner id>" the caller holds for job i
# ARGV[2i+2] - the instant of the last run the caller started for job i, in µs, or ""
#
# Deletes a lock only while it still holds that exact value (same holder, same term), then
# publishes "jobs <name> <name> ..." (the jobs whose locks it deleted, read from their keys)
# when it deleted any, so that the other nodes ask about those jobs only. Returns how many.
# An empty value deletes nothing (the caller never sends a value this library does not write).
# With a lock it deletes, it also raises the job's "last instant" to the given one (unless that
# lies ahead of the server clock): a successor whose wall clock is behind then never runs that
# instant again, even for schedules that claim only the first instant of a term (sub-second
# fixed rate). That record is written with pcall: out of memory, the lock is still released. A
# lock key of another type is nobody's; a "last instant" key that holds no instant
# (``_LAST_CLAIMED``) is replaced.
RELEASE = (
    _LAST_CLAIMED
    + """
local released = 0
local names = {}
local now_us = nil
for i = 1, #KEYS / 2 do
  local value, last = ARGV[2 * i + 1], ARGV[2 * i + 2]
  if value ~= '' and redis.pcall('GET', KEYS[2 * i - 1]) == value then
    redis.call('DEL', KEYS[2 * i - 1])
    released = released + 1
    table.insert(names, string.match(KEYS[2 * i - 1], ':([^:]+):lock$') or '')
    if last ~= '' then
      if not now_us then
        local t = redis.call('TIME')
        now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
      end
      local instant = tonumber(last)
      local stored = last_claimed(KEYS[2 * i])
      if instant > stored and instant <= now_us + tonumber(ARGV[2]) then
        redis.pcall('SET', KEYS[2 * i], last .. ':' .. string.match(value, '^(%d+)|'))
      end
    end
  end
end
if released > 0 then
  redis.call('PUBLISH', ARGV[1], 'jobs ' .. table.concat(names, ' '))
end
return released
"""
)


def _sharded(script: str) -> str:
    """``script`` for Redis Cluster: its notices go out by sharded pub/sub (Redis 7.0+), on the
    shard of the project's slot, where the listener subscribes (``_store.redis.cluster``)."""
    sharded = script.replace("redis.call('PUBLISH'", "redis.call('SPUBLISH'")
    assert sharded != script
    return sharded


CONTROL_SHARDED, ELECT_SHARDED, RELEASE_SHARDED, RESET_CHECKPOINT_SHARDED = map(
    _sharded, (CONTROL, ELECT, RELEASE, RESET_CHECKPOINT)
)

# Claim instants of jobs before running them, so that no instant runs twice across leaders:
# the claims made while the node's previous claim was in flight, sent together.
#
# KEYS[2i-1] - lock key of job i       KEYS[2i] - "last instant" key of job i
# ARGV[3i-2] - the exact lock value "<token>|<owner id>" the caller holds for job i (never "")
# ARGV[3i-1] - the instant, in whole microseconds since the Unix epoch
# ARGV[3i]   - how far the instant may lie ahead of the server clock, in microseconds
#
# The "last instant" key holds "<instant µs>:<fencing token of the term that claimed it>" (a bare
# "<instant µs>" from older versions reads the same). Returns, per claim in order: -1 when the
# caller no longer holds the lock; 1 when the instant is the one this very term claimed last (a
# claim retried after its reply was lost is not mistaken for another leader's); else 0 when the
# instant is not later than every instant claimed before (already run); else 1 when it is
# recorded, or -2 when the instant is later than server time + ARGV[3i]: the caller's wall clock
# runs ahead, and recording the instant would make every node skip the instants before it.
# Nothing is recorded then. The record is written with pcall: when Redis refuses writes (out of
# memory under noeviction) the instant is still judged against the instants recorded before,
# and runs, rather than silence the job while Redis is full; on a replica (READONLY) the whole
# call fails. Times in µs since the epoch stay below 2^53, so Lua's doubles hold them exactly.
# A lock key of another type is nobody's (-1); a "last instant" key that holds no instant
# (``_LAST_CLAIMED``) is as none, and the claim replaces it.
CLAIM = (
    _LAST_CLAIMED
    + """
local now_us = nil
local function claim(lock, last_key, held, instant_text, ahead)
  if held == '' or redis.pcall('GET', lock) ~= held then
    return -1
  end
  local instant = tonumber(instant_text)
  local token = string.match(held, '^(%d+)|')
  local last, by = last_claimed(last_key)
  if instant == last and by == token then
    return 1
  end
  if instant <= last then
    return 0
  end
  if not now_us then
    local t = redis.call('TIME')
    now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  if instant > now_us + tonumber(ahead) then
    return -2
  end
  local written = redis.pcall('SET', last_key, instant_text .. ':' .. token)
  if type(written) == 'table' and written.err and string.sub(written.err, 1, 8) == 'READONLY' then
    error(written)
  end
  return 1
end
local out = {}
for i = 1, #KEYS / 2 do
  out[i] = claim(KEYS[2 * i - 1], KEYS[2 * i], ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i])
end
return out
"""
)

# The start of the checkpoint scripts (see ``_checkpoint``): fenced(lock, record, token), the
# fence and then the record's repair, given a job's lock key, its checkpoint key (a hash) and
# the fencing token of the caller's term in decimal (never "").
#
# Returns false, having written nothing, unless the lock holds a value of that term: its token is
# read with the pattern CLAIM and RELEASE use, and compared as text, so tokens up to 2^63 - 1
# stay exact (Lua numbers are doubles); a lock key of another type is nobody's. A checkpoint
# key of another type, or a hash without a whole-number "iteration" (which HINCRBY could not
# add to), is not a record: it is deleted, and the write starts a new one. ``read_checkpoint``
# reports exactly those as no checkpoint.
_CHECKPOINT_FENCE = """
local function fenced(lock, record, token)
  local value = redis.pcall('GET', lock)
  if type(value) ~= 'string' or string.match(value, '^(%d+)|') ~= token then
    return false
  end
  local kind = redis.call('TYPE', record)['ok']
  if kind ~= 'none' then
    local iteration = kind == 'hash' and redis.call('HGET', record, 'iteration')
    if not iteration or #iteration > 18 or not string.match(iteration, '^%d+$') then
      redis.call('DEL', record)
    end
  end
  return true
end
"""

# Record finished runs in their jobs' checkpoints and histories, each if its caller's term
# still holds the job's lock: the runs that ended on one node in one turn of its event loop,
# or while its previous call was in flight, sent together (one round trip however many jobs
# share an instant; a job may come more than once, its runs in the order they ended). An
# instant the leader did not run is sent the same way, for the history alone.
#
# KEYS[1]    - the lock key of the first run's job: it names the project's hash slot, which
#              every key here shares (a cluster sends the call there). The keys of each run's
#              job, this one's too, are ARGV[1] followed by the job's name and ":lock",
#              ":checkpoint" (a hash) or ":history" (a list, newest first: ``_history``):
#              declaring three keys per run made a call of 500 runs cost the client 1,500
#              more values to encode and the connection 60 KB more to carry, while any server
#              this library supports lets a script touch the keys of its declared key's slot
#              (see docs/redis.md, "Versions")
# ARGV[1]    - what every key of the project's jobs begins with (``keys.job_prefix``)
# ARGV[2]    - the runs, one after the other (``records.run_arg``, ``RunArgs``): "<kind>
#              <outcome> <scheduled µs> <started µs> <duration µs> <fencing token>
#              <retention ms> <history> <job> <node id>", a line break, then the error's
#              length in bytes, a colon and the error, already shortened ("0:" for none);
#              the fields from the token on are the term's. The kind is "r" (a run: the
#              outcome is "success", "failed", "timeout" or "cancelled") or "m" (a missed
#              instant: the outcome is its reason, <started µs> the last instant it stands
#              for (0: the same), <duration µs> how many (1 for one; 0: more than were
#              counted), and only the history changes); <history> is how many entries the
#              job's history keeps (0: none, nothing added)
#
# Returns one string: the server time of the writes in µs (the records' "last_completed_us"),
# then, comma-separated, one value per run, in order: "-1" (nothing written) when the term no
# longer holds the lock, else the record's "iteration" after the write (exact up to 2^63 - 1;
# "0" for a missed instant). The caller knows the other fields, which it sent; one small
# reply keeps the client's parsing cheap. A success adds one to "iteration" and clears
# "last_error"; any other outcome keeps "iteration" (and every run keeps "state"). All fields
# are strings, so µs times and tokens stay exact. Each write sets the record's (and the
# history's) expiry to the retention; ELECT is to refresh the record's while a node leads the
# job. A history key of another type is replaced. With a history, each entry also moves the
# record's "history" field ("<latest µs>:<token>:<before µs>", ``_history.next_mark``): the
# latest instant the history stands for, the term that wrote it, and the latest instant of
# the terms before; a missed entry moves it only in a record that exists (none is created).
#
# "last_completed_us" is the server clock (TIME) when the run is recorded, never the caller's:
# a new leader measures the time since it on the same clock (``Store.load_checkpoint``), so an
# interval job keeps its spacing across leaders whatever their wall clocks say.
RECORD_RUN = (
    _CHECKPOINT_FENCE
    + """
local t = redis.call('TIME')
local now_us = string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2]))
local function note(key, keep, retention, entry)
  local kind = redis.call('TYPE', key)['ok']
  if kind ~= 'none' and kind ~= 'list' then
    redis.call('DEL', key)
  end
  redis.call('LPUSH', key, entry)
  redis.call('LTRIM', key, 0, keep - 1)
  redis.call('PEXPIRE', key, retention)
end
local function later(a, b)
  return #a > #b or (#a == #b and a > b)
end
local function marked(record, token, latest)
  local mark = redis.call('HGET', record, 'history')
  local at, by, before
  if mark then
    at, by, before = string.match(mark, '^(%d+):(%d+):(%d*)$')
  end
  if not at then
    at, by, before = nil, '', ''
  end
  if by ~= token then
    before = at or ''
  end
  if not at or later(latest, at) then
    at = latest
  end
  redis.call('HSET', record, 'history', at .. ':' .. token .. ':' .. before)
end
local out = {now_us}
local prefix, runs, at, i = ARGV[1], ARGV[2], 1, 0
while at <= #runs do
  local _, last, kind, outcome, scheduled, started, took, token, retention, keep, job, node,
    size = string.find(runs,
      '^([rm]) ([%a_]+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) ([%w_.%-]+) ([^\\n]*)\\n(%d+):',
      at)
  if not last then
    return redis.error_reply('RECORD_RUN: ARGV[2] holds no run at byte ' .. at)
  end
  local err = string.sub(runs, last + 1, last + tonumber(size))
  at, i = last + tonumber(size) + 1, i + 1
  local lock, record = prefix .. job .. ':lock', prefix .. job .. ':checkpoint'
  local history = prefix .. job .. ':history'
  if fenced(lock, record, token) then
    keep = tonumber(keep)
    local entry = '{"k":"' .. (kind == 'r' and 'run' or 'missed') .. '","at":' .. scheduled
    if kind == 'r' then
      entry = entry .. ',"st":' .. started .. ',"d":' .. took
    end
    entry = entry .. ',"end":' .. now_us .. ',"n":' .. cjson.encode(node) .. ',"t":"' ..
      token .. '","o":"' .. outcome .. '"'
    if err ~= '' then
      entry = entry .. ',"e":' .. cjson.encode(err)
    end
    local latest = scheduled
    if kind == 'm' and took ~= '1' then
      entry = entry .. ',"c":' .. took
      if later(started, scheduled) then
        entry = entry .. ',"to":' .. started
        latest = started
      end
    end
    entry = entry .. '}'
    if kind == 'r' then
      local success = outcome == 'success'
      redis.call('HINCRBY', record, 'iteration', success and 1 or 0)
      redis.call('HSET', record, 'last_outcome', outcome, 'last_scheduled_us', scheduled,
        'last_completed_us', now_us, 'node_id', node, 'fencing_token', token)
      if success or err == '' then
        redis.call('HDEL', record, 'last_error')
      else
        redis.call('HSET', record, 'last_error', err)
      end
      redis.call('PEXPIRE', record, retention)
      out[i + 1] = redis.call('HGET', record, 'iteration')
    else
      out[i + 1] = '0'
    end
    if keep > 0 then
      note(history, keep, retention, entry)
      if kind == 'r' or redis.call('HEXISTS', record, 'iteration') == 1 then
        marked(record, token, latest)
      end
    end
  else
    out[i + 1] = '-1'
  end
end
return table.concat(out, ',')
"""
)

# Replace the state of the job's checkpoint, if the caller's term still holds the lock.
#
# KEYS[1] - lock key of the job        KEYS[2] - checkpoint key of the job
# ARGV[1] - fencing token of the caller's term     ARGV[2] - node id of the caller
# ARGV[3] - the state, JSON text       ARGV[4] - retention of the record, in milliseconds
#
# Returns -1 (nothing written) when the term no longer holds the lock, else 1. Only "state",
# "node_id" and "fencing_token" change; a record that did not exist starts at iteration 0 (a
# first run that saves state before it ends).
SAVE_STATE = (
    _CHECKPOINT_FENCE
    + """
if not fenced(KEYS[1], KEYS[2], ARGV[1]) then
  return -1
end
redis.call('HINCRBY', KEYS[2], 'iteration', 0)
redis.call('HSET', KEYS[2], 'state', ARGV[3], 'node_id', ARGV[2], 'fencing_token', ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return 1
"""
)

# The overdue check of the jobs a node watches (``_overdue``), one call per check.
#
# KEYS[1]    - the project's controls hash
# KEYS[3i-1] - checkpoint key of job i   KEYS[3i] - its "last instant" key
# KEYS[3i+1] - its overdue key ("<since µs>:<told>:<anchor>": the job's open spell, and
#              whether a node has taken the telling of it, 1, or not yet, 0)
# ARGV[1]    - how long an overdue key lives, in ms (the checkpoint retention)
# ARGV[4i-2] - the name of job i
# ARGV[4i-1] - the anchor the caller judged job i by (see below), or "" for none yet
# ARGV[4i]   - when job i is overdue by that anchor, µs of the server clock, or "" (the caller
#              does not watch it, or it is never overdue)
# ARGV[4i+1] - "1" when the caller has an on_overdue for job i (it can tell), else "0"
#
# A job's anchor is what is stored of its last run: "<last_scheduled_us>,<last_completed_us>,
# <last claimed instant µs>" (each digits, or empty when absent or of another form). For each
# job, in order: a paused job has no spell (its overdue key is deleted); a spell whose anchor
# is not the job's anchor any more ended (a run was recorded or claimed since): deleted. Then,
# when the job is not paused, has no spell, its anchor is still the one the caller judged it by
# and the server clock has passed the caller's deadline, the spell opens: the key is set with
# the deadline and the anchor. The telling of a spell goes to the first caller that can tell
# (at its opening, or later): only that call hears so, so one node in the cluster calls back.
# Returns the server time as {seconds, µs}, then per job: its anchor, 1 if paused else 0, its
# spell's value or "", and bits: 1 this call opened the spell, 2 this call is to tell it.
# Keys of another type read as none and are replaced (pcall: nothing here fails the call for
# the other jobs).
OVERDUE = """
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local out = {t[1], t[2]}
local function field(stored)
  if type(stored) ~= 'string' then
    return ''
  end
  return string.match(stored, '^(%d+)') or ''
end
for i = 1, (#KEYS - 1) / 3 do
  local checkpoint, last, key = KEYS[3 * i - 1], KEYS[3 * i], KEYS[3 * i + 1]
  local name, judged, deadline = ARGV[4 * i - 2], ARGV[4 * i - 1], ARGV[4 * i]
  local can_tell = ARGV[4 * i + 1] == '1'
  local fields = redis.pcall('HMGET', checkpoint, 'last_scheduled_us', 'last_completed_us')
  if type(fields) ~= 'table' then
    fields = {}
  end
  local anchor = field(fields[1]) .. ',' .. field(fields[2]) .. ',' ..
    field(redis.pcall('GET', last))
  local paused = redis.pcall('HEXISTS', KEYS[1], 'paused:' .. name) == 1
  local spell = redis.pcall('GET', key)
  local since, told, of
  if type(spell) == 'string' then
    since, told, of = string.match(spell, '^(%d+):([01]):(.*)$')
  end
  if since and (paused or of ~= anchor) then
    since = nil
  end
  if not since and type(spell) == 'string' then
    redis.call('DEL', key)
  end
  local bits = 0
  if since and told == '0' and can_tell then
    told = '1'
    local ttl = redis.call('PTTL', key)
    redis.pcall('SET', key, since .. ':1:' .. anchor, 'PX', ttl > 0 and ttl or ARGV[1])
    bits = 2
  elseif not since and not paused and deadline ~= '' and judged == anchor
      and now_us >= tonumber(deadline) then
    since, told = deadline, can_tell and '1' or '0'
    redis.pcall('SET', key, since .. ':' .. told .. ':' .. anchor, 'PX', ARGV[1])
    bits = can_tell and 3 or 1
  end
  table.insert(out, anchor)
  table.insert(out, paused and 1 or 0)
  table.insert(out, since and (since .. ':' .. told .. ':' .. anchor) or '')
  table.insert(out, bits)
end
return out
"""
