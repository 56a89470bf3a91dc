"""Lua scripts that make acquire-or-renew, release and claims atomic on the Redis server.

The scripts are registered with redis-py's ``register_script``: they are sent by SHA1
(``EVALSHA``) and re-sent in full when the server answers ``NOSCRIPT`` (after a restart or a
``SCRIPT FLUSH``). A lock's value is ``<fencing token>|<owner id>``; a node renews, deletes or
claims with a lock only while it holds exactly the value of the node's current term (which
names it as owner: node id plus a per-instance nonce), never an empty value. ``ELECT`` and
``CLAIM`` read the server clock (``TIME``) before they write, which needs script effects
replication, the default from Redis 5.0 on.
"""

from __future__ import annotations

__all__ = [
    "CLAIM",
    "CONTROL",
    "CONTROL_SHARDED",
    "ELECT",
    "ELECT_SHARDED",
    "RECORD_RUN",
    "RELEASE",
    "RELEASE_SHARDED",
    "RESET_CHECKPOINT",
    "RESET_CHECKPOINT_SHARDED",
    "SAVE_STATE",
]

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
# ARGV[5]    - the digest of the caller's jobs (which nodes run the same jobs)
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
# record is missing (expired, or Redis lost it): the caller sends it whole on its next call.
# Then, for each job, in order, four values:
#   1 if the caller holds the lock after the call (acquired or renewed), 0 if not, -1 if
#   acquiring failed (the error message then comes second, e.g. "OOM ..." under noeviction,
#   "READONLY ..." on a replica: the caller raises StoreReadOnly for the latter);
#   the lock's value "<token>|<holder>" after the call (or the error message);
#   the lock's remaining time to live in milliseconds (-1: no expiry, or an error);
#   the job's controls as bits: 1 paused; 2 an extra run asked for, 4 a step-down asked
#   for, and 8 the checkpoint reset (``RESET_CHECKPOINT``), each of these three consumed
#   (deleted) by this call, and only ever reported to the lock's holder.
#   The controls hash is read once (HLEN, then HGETALL only when it is not empty).
# Then the server time in ms and the placement epoch; and, when that epoch is not ARGV[4] and
# the caller keeps a membership record, the placement hash's fields and values, flat.
#
# Only the exact value of the caller's current term is renewed: a lock of the caller's that
# outlived a term the caller already ended (a lost reply) is left to expire, so that a node
# which stepped down never keeps its old lock alive. A free lock starts a new term whose token
# is max(last token + 1, server time in µs); the server-time floor keeps tokens growing when
# the fence key was lost (restart without persistence, FLUSHALL) as long as the server clock
# does not step back. The acquisition writes use pcall: when Redis refuses writes (OOM under
# noeviction), held locks are still renewed (PEXPIRE is allowed) and only that job reports it;
# the membership writes use pcall too, so that a full Redis never fails the election. Expired
# records are deleted a thousand at a time: Lua's unpack() takes at most about 8,000 values, and a
# fleet that reconnects after an outage may leave more than that expiring together.
ELECT = """
local owner = ARGV[1]
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now_us / 1000)
local member = 1
if ARGV[3] ~= '' then
  if ARGV[2] ~= '' then
    redis.pcall('HSET', KEYS[1], owner, ARGV[2])
    local entry = redis.call('HGET', KEYS[4], owner)
    local joined, digest = string.match(entry or '', '^(%d+)|(.*)$')
    if joined and digest ~= ARGV[5] then
      redis.pcall('HSET', KEYS[4], owner, joined .. '|' .. ARGV[5])
      redis.pcall('HINCRBY', KEYS[4], '#epoch', 1)
    end
  elseif redis.call('HEXISTS', KEYS[1], owner) == 0 then
    member = 0
  end
  redis.pcall('ZADD', KEYS[2], now_ms + tonumber(ARGV[3]), owner)
  if redis.pcall('HSETNX', KEYS[4], owner, now_ms .. '|' .. ARGV[5]) == 1 then
    redis.pcall('HINCRBY', KEYS[4], '#epoch', 1)
  end
  local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now_ms)
  if #gone > 0 then
    for first = 1, #gone, 1000 do
      local last = math.min(first + 999, #gone)
      redis.call('HDEL', KEYS[1], unpack(gone, first, last))
      redis.call('HDEL', KEYS[4], unpack(gone, first, last))
    end
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms)
    redis.pcall('HINCRBY', KEYS[4], '#epoch', 1)
  end
end
local controls = nil
if redis.call('HLEN', KEYS[3]) > 0 then
  controls = {}
  local flat = redis.call('HGETALL', KEYS[3])
  for i = 1, #flat, 2 do
    local kind, job = string.match(flat[i], '^([^:]+):(.*)$')
    if kind then
      controls[job] = controls[job] or {}
      controls[job][kind] = true
    end
  end
end
local out = {member}
for i = 1, (#KEYS - 4) / 3 do
  local lock, fence, checkpoint = KEYS[3 * i + 2], KEYS[3 * i + 3], KEYS[3 * i + 4]
  local ttl, held = ARGV[4 * i + 3], ARGV[4 * i + 4]
  local retention, name = ARGV[4 * i + 5], ARGV[4 * i + 6]
  local status, value, left = 0, redis.call('GET', lock), nil
  if not value and ttl == '0' then
    value, left = false, -2
  elseif value then
    if held ~= '' and value == held then
      redis.call('PEXPIRE', lock, ttl)
      status, left = 1, tonumber(ttl)
    else
      left = redis.call('PTTL', lock)
    end
  else
    local last = tonumber(redis.call('GET', fence)) or 0
    local token = string.format('%.0f', math.max(last + 1, now_us))
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
  table.insert(out, status)
  table.insert(out, value)
  table.insert(out, left)
  table.insert(out, flags)
end
local epoch = redis.call('HGET', KEYS[4], '#epoch') or '0'
table.insert(out, now_ms)
table.insert(out, epoch)
if ARGV[3] ~= '' and epoch ~= ARGV[4] then
  for _, item in ipairs(redis.call('HGETALL', KEYS[4])) do
    table.insert(out, item)
  end
end
if ARGV[6] ~= '' then
  redis.call('PUBLISH', ARGV[6], 'echo')
end
return out
"""

# Set or clear one operator's control of a job and wake every node's election at once.
#
# KEYS[1] - the project's controls hash
# ARGV[1] - the release channel ("control <job>" wakes every node for a round about the job)
# ARGV[2] - the field (``paused:<job>``, ``trigger:<job>`` or ``step-down:<job>``)
# ARGV[3] - its value, or "" to delete the field. Returns 1 when the field changed.
CONTROL = """
local changed
if ARGV[3] == '' then
  changed = redis.call('HDEL', KEYS[1], ARGV[2])
else
  changed = redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
end
redis.call('PUBLISH', ARGV[1], 'control ' .. (string.match(ARGV[2], ':(.*)') or ''))
return changed
"""

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
# number of records deleted (0 or 1).
RESET_CHECKPOINT = """
local deleted = redis.call('DEL', KEYS[1])
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('HSET', KEYS[3], ARGV[2], '1')
  redis.call('PUBLISH', ARGV[1], 'control ' .. (string.match(ARGV[2], ':(.*)') or ''))
end
return deleted
"""

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
# fixed rate). That record is written with pcall: out of memory, the lock is still released.
RELEASE = """
local released = 0
local names = {}
local now_us = nil
for i = 1, #KEYS / 2 do
  local value, last = ARGV[2 * i + 1], ARGV[2 * i + 2]
  if value ~= '' and redis.call('GET', KEYS[2 * i - 1]) == value then
    redis.call('DEL', KEYS[2 * i - 1])
    released = released + 1
    table.insert(names, string.match(KEYS[2 * i - 1], ':([^:]+):lock$') or '')
    if last ~= '' then
      if not now_us then
        local t = redis.call('TIME')
        now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
      end
      local instant = tonumber(last)
      local stored = tonumber(string.match(redis.call('GET', KEYS[2 * i]) or '', '^(%d+)')) or -1
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
CLAIM = """
local now_us = nil
local function claim(lock, last_key, held, instant_text, ahead)
  if held == '' or redis.call('GET', lock) ~= held then
    return -1
  end
  local instant = tonumber(instant_text)
  local token = string.match(held, '^(%d+)|')
  local stored = redis.call('GET', last_key)
  local last, by = -1, nil
  if stored then
    local at, who = string.match(stored, '^(%d+):?(%d*)$')
    last, by = tonumber(at) or -1, who
  end
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

# The start of the checkpoint scripts (see ``_checkpoint``): fenced(lock, record, token), the
# fence and then the record's repair, given a job's lock key, its checkpoint key (a hash) and
# the fencing token of the caller's term in decimal (never "").
#
# Returns false, having written nothing, unless the lock holds a value of that term: its token is
# read with the pattern CLAIM and RELEASE use, and compared as text, so tokens up to 2^63 - 1
# stay exact (Lua numbers are doubles). A checkpoint key of another type, or a hash without a
# whole-number "iteration" (which HINCRBY could not add to), is not a record: it is deleted,
# and the write starts a new one. ``read_checkpoint`` reports exactly those as no checkpoint.
_CHECKPOINT_FENCE = """
local function fenced(lock, record, token)
  local value = redis.call('GET', lock)
  if not value or string.match(value, '^(%d+)|') ~= token then
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

# Record finished runs in their jobs' checkpoints, each if its caller's term still holds the
# job's lock: the runs that ended on one node in one turn of its event loop, or while its
# previous call was in flight, sent together (one round trip however many jobs share an
# instant; a job may come more than once, its runs in the order they ended).
#
# KEYS[2i-1] - lock key of run i's job        KEYS[2i] - checkpoint key of run i's job
# ARGV[i]    - run i, one string (``_store.records.run_arg``: one value per run keeps the
#              client's encoding cheap): "<fencing token> <outcome> <scheduled µs> <retention
#              ms> <node id>", a line break, then the error, already shortened ("" for none);
#              the outcome is "success", "failed", "timeout" or "cancelled"
#
# Returns one string: the server time of the writes in µs (the records' "last_completed_us"),
# then, comma-separated, one value per run, in order: "-1" (nothing written) when the term no
# longer holds the lock, else the record's "iteration" after the write (exact up to 2^63 - 1).
# The caller knows the other fields, which it sent; one small reply keeps the client's parsing
# cheap. A success adds one to "iteration" and clears "last_error"; any other outcome keeps
# "iteration" (and every run keeps "state"). All fields are strings, so µs times and tokens
# stay exact. Each write sets the record's expiry to the retention; ELECT is to refresh it
# while a node leads the job.
#
# "last_completed_us" is the server clock (TIME) when the run is recorded, never the caller's:
# a new leader measures the time since it on the same clock (``Store.load_checkpoint``), so an
# interval job keeps its spacing across leaders whatever their wall clocks say.
RECORD_RUN = (
    _CHECKPOINT_FENCE
    + """
local t = redis.call('TIME')
local now_us = string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2]))
local out = {now_us}
for i = 1, #KEYS / 2 do
  local lock, record = KEYS[2 * i - 1], KEYS[2 * i]
  local token, outcome, scheduled, retention, node, err =
    string.match(ARGV[i], '^(%d+) (%a+) (%d+) (%d+) ([^\\n]*)\\n(.*)$')
  if token and fenced(lock, record, token) then
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
