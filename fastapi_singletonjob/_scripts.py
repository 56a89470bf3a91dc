"""Lua scripts that make acquire-or-renew and release atomic on the Redis server.

Both scripts are registered with redis-py's ``register_script``: they are sent by SHA1
(``EVALSHA``) and re-sent in full when the server answers ``NOSCRIPT`` (after a restart or a
``SCRIPT FLUSH``). A lock's value is ``<fencing token>|<owner id>``; a node renews or deletes a
lock only when the owner id in it is its own (node id plus a per-instance nonce).
"""

from __future__ import annotations

__all__ = ["CLAIM", "ELECT", "RELEASE"]

# Acquire or renew the leases of several jobs for one node, in one round trip.
#
# KEYS[2i-1] - lock key of job i       KEYS[2i] - fence key of job i
# ARGV[1]    - owner id of the caller
# ARGV[2i]   - lease time of job i, in milliseconds
# ARGV[2i+1] - the exact lock value the caller holds for job i in its current term, or ""
#
# For each job, in order, returns three values:
#   1 if the caller holds the lock after the call (acquired or renewed), 0 if not, -1 if
#   acquiring failed (the error message then comes second, e.g. OOM under noeviction);
#   the lock's value "<token>|<holder>" after the call (or the error message);
#   the lock's remaining time to live in milliseconds (-1: no expiry, or an error).
#
# Only the exact value of the caller's current term is renewed: a lock of the caller's that
# outlived a term the caller already ended (a lost reply) is left to expire, so that a node
# which stepped down never keeps its old lock alive. A free lock starts a new term whose token
# is max(last token + 1, server time in µs); the server-time floor keeps tokens growing when
# the fence key was lost (restart without persistence, FLUSHALL) as long as the server clock
# does not step back. The acquisition writes use pcall: when Redis refuses writes (OOM under
# noeviction), held locks are still renewed (PEXPIRE is allowed) and only that job reports it.
ELECT = """
local owner = ARGV[1]
local out = {}
local now_us = nil
for i = 1, #KEYS / 2 do
  local lock, fence = KEYS[2 * i - 1], KEYS[2 * i]
  local ttl, held = ARGV[2 * i], ARGV[2 * i + 1]
  local value = redis.call('GET', lock)
  if value then
    if value == held then
      redis.call('PEXPIRE', lock, ttl)
      table.insert(out, 1)
      table.insert(out, value)
      table.insert(out, tonumber(ttl))
    else
      table.insert(out, 0)
      table.insert(out, value)
      table.insert(out, redis.call('PTTL', lock))
    end
  else
    if not now_us then
      local t = redis.call('TIME')
      now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
    end
    local last = tonumber(redis.call('GET', fence)) or 0
    local token = string.format('%.0f', math.max(last + 1, now_us))
    value = token .. '|' .. owner
    local written = redis.pcall('SET', lock, value, 'PX', ttl)
    if type(written) == 'table' and written.err then
      table.insert(out, -1)
      table.insert(out, written.err)
      table.insert(out, -1)
    else
      redis.pcall('SET', fence, token)
      table.insert(out, 1)
      table.insert(out, value)
      table.insert(out, tonumber(ttl))
    end
  end
end
return out
"""

# Release the locks a node holds, and tell the other nodes at once.
#
# KEYS[i]   - lock key of job i
# ARGV[1]   - pub/sub channel to announce the release on
# ARGV[1+i] - the exact value "<token>|<owner id>" the caller holds for job i
#
# Deletes a lock only while it still holds that exact value (same holder, same term), then
# publishes the number of locks deleted when it is not zero. Returns that number.
RELEASE = """
local released = 0
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1 + i] then
    redis.call('DEL', KEYS[i])
    released = released + 1
  end
end
if released > 0 then
  redis.call('PUBLISH', ARGV[1], released)
end
return released
"""

# Claim one instant of a job before running it, so that no instant runs twice across leaders.
#
# KEYS[1] - lock key of the job        KEYS[2] - "last instant" key of the job
# ARGV[1] - the exact lock value "<token>|<owner id>" the caller holds
# ARGV[2] - the instant, in whole microseconds since the Unix epoch
#
# Returns 1 when the caller still holds the lock and the instant is later than every instant
# claimed before (it is recorded), 0 when it is not later (already run), -1 when the caller no
# longer holds the lock.
CLAIM = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return -1
end
local last = tonumber(redis.call('GET', KEYS[2])) or -1
local instant = tonumber(ARGV[2])
if instant <= last then
  return 0
end
redis.call('SET', KEYS[2], ARGV[2])
return 1
"""
