"""One backend server as the router sees it: whether it takes requests, how loaded it is (its own /metrics plus
the router's count of requests in flight to it), and the poll that keeps both current."""
from __future__ import annotations

import asyncio
import logging
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

KV_WEIGHT = 4.0          # a full KV cache weighs as much as this many requests
DOWN_AFTER_TIMEOUTS = 2  # consecutive /health timeouts that declare a hung backend dead
# the backend's gauges the load is made of -> Backend attribute
LOAD_GAUGES = {"tokenmill:num_requests_running": "running", "tokenmill:num_requests_waiting": "waiting",
               "tokenmill:kv_cache_usage_perc": "kv_usage"}


class Backend:
    def __init__(self, url: str, pool: str, api_key: str | None = None) -> None:
        self.url = url
        self.pool = pool
        self.api_key = api_key        # sent with the router's own /v1/models requests (--backend-api-key)
        self.healthy = False          # routable: the last /health said 200 and no request failed to connect since
        self.dead = asyncio.Event()   # set while unreachable: the requests in flight on it give up
        self.in_flight = 0            # requests this router has open on it
        self.running = 0.0            # the rest as of the last /metrics
        self.waiting = 0.0
        self.kv_usage = 0.0
        self.models: set[str] | None = None  # the ids its /v1/models lists; None: not known (it needs a key)
        self._models_refused = False  # its /v1/models said 401/403: not asked again until it comes back healthy
        self._timeouts = 0
        self._last_progress = float("-inf")  # time.monotonic() of the last bytes a request in flight got from it
        self._checks = 0                     # /health requests sent
        self._late_answered = 0              # the last of them whose answer came after its timeout
        self._late_checks: set[asyncio.Future] = set()  # /health requests past their timeout, still waited for

    def progressed(self) -> None:
        """A request in flight on it just received bytes: it is alive, however slowly it answers /health."""
        self._last_progress = time.monotonic()

    def load(self) -> float:
        """Outstanding work. The router's own count is current where the scraped one is up to a poll old; the
        scraped one also sees requests from other clients. A waiting request counts twice: it has not started and
        queues behind everything. A nearly full KV cache means preemptions."""
        return max(self.in_flight, self.running + self.waiting) + self.waiting + KV_WEIGHT * self.kv_usage

    def serves(self, model: str | None) -> bool:
        """Whether a request for this model may go here: a request naming none, or a backend whose list is not
        known, may go anywhere."""
        return model is None or self.models is None or model in self.models

    def set_unavailable(self) -> None:
        """Stop routing to it until a poll finds it healthy again; the requests in flight on it go on."""
        self.healthy = False

    def _set_dead(self, why: str) -> None:
        self.healthy = False
        if not self.dead.is_set():
            logger.warning("backend %s is down (%s); requests in flight on it: %d, failed", self.url, why,
                           self.in_flight)
            self.dead.set()

    def _set_reachable(self, healthy: bool) -> None:
        self._timeouts = 0
        if self.dead.is_set():
            logger.info("backend %s answers again", self.url)
            self.dead = asyncio.Event()
        if healthy != self.healthy:
            logger.info("backend %s is %s", self.url, "healthy" if healthy else "not taking requests")
        self.healthy = healthy

    async def poll(self, client: httpx.AsyncClient, timeout: float) -> None:
        """/health, then /metrics while healthy. A refused connection is a dead backend at once; a hung one is
        dead after a few timeouts; a non-200 /health (draining) only stops new requests. So does a run of timeouts
        while its streams still deliver: a busy server (a CPU engine holding the interpreter) can be slow to answer
        /health, and failing the requests it is serving would lose work that was progressing. So does a late
        answer to one of the run's earlier checks: the only sign of life a backend serving non-streaming requests
        gives. Only /health decides: a server's /metrics waits for its engine's current step (seconds for a long
        prefill on a CPU), so a slow one leaves the last load reading in place."""
        try:
            health = await self._check_health(client, timeout)
            if health.status_code == 200:
                if not self.healthy or (self.models is None and not self._models_refused):
                    await self._poll_models(client, timeout)  # a backend back from a restart may serve another
                await self._poll_load(client, timeout)
        except httpx.TimeoutException:
            self._timeouts += 1
            if self._timeouts < DOWN_AFTER_TIMEOUTS:
                return
            streams_deliver = time.monotonic() - self._last_progress < DOWN_AFTER_TIMEOUTS * timeout
            answered_late = self._late_answered > self._checks - DOWN_AFTER_TIMEOUTS  # one of this run's checks
            if streams_deliver or answered_late:
                self.set_unavailable()
            else:
                self._set_dead(f"{self._timeouts} health checks timed out, no response bytes or late answers since")
            return
        except httpx.HTTPError as e:
            self._set_dead(f"{type(e).__name__}: {e}")
            return
        self._set_reachable(health.status_code == 200)

    async def _check_health(self, client: httpx.AsyncClient, timeout: float) -> httpx.Response:
        """/health's answer within timeout, else TimeoutException. The request itself goes on for the timeouts that
        would declare the backend dead; an answer that lands meanwhile (any status) shows it alive, and keeps the
        next timed-out check's verdict at "not routable", whatever the poll interval."""
        self._checks += 1
        number = self._checks
        check = asyncio.ensure_future(client.get(self.url + "/health", timeout=DOWN_AFTER_TIMEOUTS * timeout))
        try:
            done, _ = await asyncio.wait({check}, timeout=timeout)
        except asyncio.CancelledError:  # the router shuts down
            check.cancel()
            if check.done() and not check.cancelled():
                check.exception()  # retrieved: it ended in the same instant, no "never retrieved" warning
            raise
        if not done:
            self._late_checks.add(check)  # the event loop keeps only a weak reference to a task
            check.add_done_callback(lambda c: self._late_answer(number, c))
            raise httpx.TimeoutException(f"/health did not answer within {timeout} s")
        return check.result()

    def _late_answer(self, number: int, check: asyncio.Future) -> None:
        self._late_checks.discard(check)
        if not check.cancelled() and check.exception() is None:
            self._late_answered = max(self._late_answered, number)

    def close(self) -> None:
        """Stop waiting for late /health answers (the router shuts down)."""
        for check in list(self._late_checks):
            check.cancel()

    async def _poll_models(self, client: httpx.AsyncClient, timeout: float) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            answer = await client.get(self.url + "/v1/models", headers=headers, timeout=timeout)
            self._models_refused = answer.status_code in (401, 403)
            if self._models_refused:
                logger.warning("backend %s refused the router's /v1/models (%d): requests naming a model may go to "
                               "it whichever it serves; give the router its key with --backend-api-key", self.url,
                               answer.status_code)
            data = answer.json()["data"] if answer.status_code == 200 else None
            self.models = {m["id"] for m in data} if isinstance(data, list) else None
        except (httpx.TimeoutException, ValueError, KeyError, TypeError):
            self.models = None

    async def _poll_load(self, client: httpx.AsyncClient, timeout: float) -> None:
        try:
            metrics = await client.get(self.url + "/metrics", timeout=timeout)
        except httpx.TimeoutException:
            return
        if metrics.status_code == 200:
            self._read_load(metrics.text)

    def _read_load(self, text: str) -> None:
        values = dict.fromkeys(LOAD_GAUGES.values(), 0.0)
        for family in text_string_to_metric_families(text):
            attr = LOAD_GAUGES.get(family.name)
            if attr is not None:
                values[attr] = sum(s.value for s in family.samples)
        self.running, self.waiting, self.kv_usage = values["running"], values["waiting"], values["kv_usage"]

    async def poll_forever(self, client: httpx.AsyncClient, interval: float, timeout: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.poll(client, timeout)
            except Exception:
                logger.exception("polling %s failed", self.url)
