"""Fixtures the vLLM-side tests share: a throwaway redis-server and a raw client on it."""

from __future__ import annotations

import shutil

import pytest

from tests.local_services import RedisProcess

needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server binary not installed (apt-get install redis-server)")


@pytest.fixture
def redis_server():
    server = RedisProcess().start()
    yield server
    server.stop()


@pytest.fixture
def raw(redis_server):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()
