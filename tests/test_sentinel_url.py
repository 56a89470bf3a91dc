"""The ``redis+sentinel://`` URL form: what it reads, and what it refuses with the field, the
URL without its secrets, and the fix. No server needed (see test_sentinel.py for the real
topology, and test_redaction.py for the redaction of these URLs everywhere)."""

from __future__ import annotations

import pytest

from fastapi_singletonjob import ConfigurationError, SingletonJobs
from fastapi_singletonjob._config.sentinel_url import SentinelAddress, parse_sentinel_url

SECRET = "Zx9pass"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        pytest.param(
            "redis+sentinel://s1:26379,s2:26380,s3/mymaster/0",
            SentinelAddress((("s1", 26379), ("s2", 26380), ("s3", 26379)), "mymaster", 0),
            id="three-sentinels-default-port",
        ),
        pytest.param(
            "redis+sentinel://s1/mymaster",
            SentinelAddress((("s1", 26379),), "mymaster", 0),
            id="db-defaults-to-0",
        ),
        pytest.param(
            "redis+sentinel://app:p%40ss%2F1@[::1]:5000,10.0.0.2/cache.main/3"
            "?sentinel_password=s%26p&sentinel_username=watch",
            SentinelAddress(
                (("::1", 5000), ("10.0.0.2", 26379)),
                "cache.main",
                3,
                username="app",
                password="p@ss/1",
                sentinel_username="watch",
                sentinel_password="s&p",
            ),
            id="credentials-percent-decoded-ipv6",
        ),
        pytest.param(
            "redis+sentinel://:pw@s1/m/1",
            SentinelAddress((("s1", 26379),), "m", 1, password="pw"),
            id="password-only",
        ),
    ],
)
def test_reads(url: str, expected: SentinelAddress) -> None:
    address = parse_sentinel_url(url)
    assert address == expected
    assert (address.username, address.password) == (expected.username, expected.password)
    assert address.sentinel_password == expected.sentinel_password
    assert "pw" not in repr(address) and "p@ss" not in repr(address)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis+sentinel://s1", "does not name the service"),
        ("redis+sentinel://s1/", "does not name the service"),
        ("redis+sentinel://s1/my master/0", "does not name the service"),
        ("redis+sentinel://s1/m/0/extra", "does not name the service"),
        ("redis+sentinel://s1/m/x", "not a whole number"),
        ("redis+sentinel://s1/m/-1", "not a whole number"),
        ("redis+sentinel://s1,,s2/m", "empty sentinel address"),
        ("redis+sentinel://s1:99999/m", "not a number from 0 to 65535"),
        (f"redis+sentinel://app:{SECRET}/m", "not a number from 0 to 65535"),
        (f"redis+sentinel://:{SECRET}@s1/m?password={SECRET}", "does not take"),
        (f"redis+sentinel://:{SECRET}@s1/m#x", "'#'"),
        (f"redis+sentinel://:a/{SECRET}@s1/m", "'@' after the hosts"),
    ],
)
def test_refuses_with_field_fix_and_no_secret(url: str, problem: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        SingletonJobs(url, project="p")
    message = str(caught.value)
    assert caught.value.field == "redis_url"
    assert problem in message, message
    assert message.startswith("redis_url='redis+sentinel://"), message
    assert "use redis+sentinel://" in message or "percent-encode" in message, message
    assert SECRET not in message and SECRET not in repr(caught.value)


def test_an_unknown_scheme_names_the_sentinel_form() -> None:
    with pytest.raises(ConfigurationError, match=r"redis\+sentinel://host:26379"):
        SingletonJobs("sentinel://s1/m", project="p")
