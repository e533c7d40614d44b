"""Two real model servers shared by the whole session; each module starts the routers (and extra servers) it
needs."""
from __future__ import annotations

import pytest
from router_helpers import start_servers


@pytest.fixture(scope="session")
def backends():
    servers = start_servers(2)
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="session")
def model_name(backends):
    import httpx
    return httpx.get(backends[0].url + "/v1/models", timeout=10).json()["data"][0]["id"]
