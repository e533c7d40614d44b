"""AsyncEngine over a real LLMEngine, in process: streams, failure isolation, aborts and timeouts."""
from __future__ import annotations

import asyncio

import pytest
import torch

from tokenmill.engine.async_engine import AsyncEngine, RequestFailedError, RequestTimeoutError
from tokenmill.engine.llm_engine import LLMEngine, QueueFullError
from tokenmill.sampling_params import SamplingParams
from tokenmill.serve.metrics import ServerMetrics

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)


class Recorder:
    def __init__(self) -> None:
        self.steps = self.outputs = self.ooms = 0
        self.aborts: list[str] = []

    def on_step(self, step) -> None:
        self.steps += 1

    def on_output(self, output) -> None:
        self.outputs += 1

    def on_abort(self, reason: str, request_id: str) -> None:
        self.aborts.append(reason)

    def on_oom(self) -> None:
        self.ooms += 1


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_engine_args(max_model_len=512, max_num_seqs=4, max_queue_len=2)


def run(engine, scenario):
    """Run scenario(async_engine, recorder) on a fresh loop; returns its result and the recorder."""
    recorder = Recorder()

    async def main():
        ae = AsyncEngine(engine, recorder)
        ae.start()
        try:
            return await scenario(ae, recorder)
        finally:
            await ae.stop()

    return asyncio.run(main()), recorder


async def collect(stream):
    return [out async for out in stream]


def prompt(i: int = 0) -> list[int]:
    return [100 + i, 200, 300, 400]


def blocks_in_use(stats) -> int:
    return stats["num_blocks_total"] - stats["num_blocks_free"]


def test_stream_delivers_deltas_to_the_end(engine):
    async def scenario(ae, _):
        outs = await collect(await ae.add_request("a", prompt(), PARAMS))
        return outs, await ae.get_stats()

    (outs, stats), rec = run(engine, scenario)
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert sum(len(o.outputs[0].delta_token_ids) for o in outs) == 6
    assert outs[-1].outputs[0].token_ids == [t for o in outs for t in o.outputs[0].delta_token_ids]
    assert rec.steps >= 6 and rec.outputs == len(outs)
    assert blocks_in_use(stats) == 0


def test_bad_add_fails_only_that_request(engine):
    async def scenario(ae, _):
        good = asyncio.create_task(ae.add_request("good", prompt(), PARAMS))
        with pytest.raises(ValueError, match="token ids"):
            await ae.add_request("bad", [10 ** 9], PARAMS)
        with pytest.raises(ValueError, match="already in use"):
            await ae.add_request("good", prompt(), PARAMS)
        return await collect(await good)

    outs, _ = run(engine, scenario)
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6


def test_add_requests_takes_a_batch_in_one_step_all_or_none(engine):
    """A batch of prompts waits for one engine iteration, not one a prompt; a refused one takes the batch with it."""
    async def scenario(ae, rec):
        streams = await ae.add_requests([(f"b{i}", prompt(i), PARAMS) for i in range(2)])
        steps_to_admit = rec.steps
        outs = [await collect(s) for s in streams]
        with pytest.raises(ValueError, match="token ids"):
            await ae.add_requests([("ok", prompt(), PARAMS), ("bad", [10 ** 9], PARAMS)])
        with pytest.raises(ValueError, match="already in use"):
            await ae.add_requests([("twice", prompt(), PARAMS), ("twice", prompt(), PARAMS)])
        return steps_to_admit, outs, await ae.get_stats()

    (steps_to_admit, outs, stats), rec = run(engine, scenario)
    assert steps_to_admit <= 1
    assert all(o[-1].finished and len(o[-1].outputs[0].token_ids) == 6 for o in outs)
    assert "error" in rec.aborts  # "ok", queued beside "bad", was aborted
    assert blocks_in_use(stats) == 0 and not engine.has_unfinished_requests()


def test_queue_full_raises(engine):
    async def scenario(ae, _):
        long = SamplingParams(max_tokens=50, ignore_eos=True)
        adds = [asyncio.create_task(ae.add_request(f"q{i}", prompt(i), long)) for i in range(8)]
        results = await asyncio.gather(*adds, return_exceptions=True)
        for r in results:
            if not isinstance(r, Exception):
                ae.abort(r.request_id, "client_disconnect")
        return results, await ae.get_stats()

    (results, stats), rec = run(engine, scenario)
    full = [r for r in results if isinstance(r, Exception)]
    assert full and all(isinstance(r, QueueFullError) for r in full)
    assert len(results) - len(full) <= 4 + 2  # at most max_num_seqs running + max_queue_len waiting
    assert blocks_in_use(stats) == 0


def test_failing_step_fails_the_requests_in_flight_and_the_loop_lives_on(engine, monkeypatch):
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("simulated")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)

    async def scenario(ae, _):
        streams = [await ae.add_request(f"f{i}", prompt(i), SamplingParams(max_tokens=30, ignore_eos=True))
                   for i in range(2)]
        for s in streams:
            with pytest.raises(RequestFailedError, match="OutOfMemoryError"):
                await collect(s)
        after = await collect(await ae.add_request("after", prompt(), PARAMS))
        return after, await ae.get_stats()

    (after, stats), rec = run(engine, scenario)
    assert after[-1].finished and len(after[-1].outputs[0].token_ids) == 6
    assert rec.ooms == 1 and rec.aborts == ["error", "error"]
    assert blocks_in_use(stats) == 0


def test_abort_frees_blocks_before_the_next_step(engine):
    async def scenario(ae, _):
        stream = await ae.add_request("x", prompt(), SamplingParams(max_tokens=100, ignore_eos=True))
        await anext(stream)
        during = await ae.get_stats()
        ae.abort("x", "client_disconnect")
        return during, await ae.get_stats()

    (during, after), rec = run(engine, scenario)
    assert blocks_in_use(during) > 0 and blocks_in_use(after) == 0
    assert rec.aborts == ["client_disconnect"]


def test_server_metrics_forget_an_aborted_request():
    """ServerMetrics kept the inter-token clock of every request aborted mid-stream (a client disconnect): an
    aborted request never reports a finished output, where the clock used to be dropped."""
    engine = LLMEngine.from_engine_args(max_model_len=512, max_num_seqs=4)
    metrics = ServerMetrics("m")

    async def main():
        ae = AsyncEngine(engine, metrics)
        ae.start()
        try:
            stream = await ae.add_request("x", prompt(), SamplingParams(max_tokens=100, ignore_eos=True))
            await anext(stream)
            assert "x" in metrics._last_token_time
            ae.abort("x", "client_disconnect")
            await ae.get_stats()
        finally:
            await ae.stop()

    asyncio.run(main())
    assert metrics._last_token_time == {}


def test_timeout(engine):
    async def scenario(ae, _):
        stream = await ae.add_request("t", prompt(), SamplingParams(max_tokens=400, ignore_eos=True), timeout_s=0.3)
        with pytest.raises(RequestTimeoutError):
            await collect(stream)
        return await ae.get_stats()

    stats, rec = run(engine, scenario)
    assert rec.aborts == ["timeout"] and blocks_in_use(stats) == 0
