"""64 concurrent streams through the official async client, each finishing with exact usage counts."""
from __future__ import annotations

import asyncio

import httpx
import openai
from serve_helpers import wait_until

NUM_STREAMS = 64
MAX_TOKENS = 8


def test_64_concurrent_streams_exact_usage(server, model_name):
    prompts = [f"Count from {i} to {i + 10}:" for i in range(NUM_STREAMS)]
    prompt_lens = [httpx.post(server.url + "/tokenize", json={"prompt": p}).json()["count"] for p in prompts]

    async def one(client: openai.AsyncOpenAI, prompt: str):
        chunks = []
        stream = await client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            chunks.append(chunk)
        return chunks

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    results = asyncio.run(run())
    for chunks, prompt_len in zip(results, prompt_lens):
        usage = chunks[-1].usage
        assert usage.prompt_tokens == prompt_len
        assert usage.completion_tokens == MAX_TOKENS
        assert usage.total_tokens == prompt_len + MAX_TOKENS
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["length"]
        assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert wait_until(lambda: server.metric("tokenmill:kv_cache_used_tokens") == 0, timeout=5)
    assert server.metric("tokenmill:batch_size_decode_count") > 0


def test_a_long_prompt_tokenizes_off_the_event_loop(server):
    """A prompt of 5M characters takes seconds to tokenize (with truncate_prompt_tokens it must be: a text that
    cannot fit is otherwise refused before tokenizing). It used to be encoded on the event loop, so /health and
    every other stream waited for it; now /health keeps answering throughout."""
    text = "The quick brown fox jumps over the lazy dog. " * 110_000

    async def run() -> tuple[float, float, list[float], int]:
        loop = asyncio.get_running_loop()
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            start = loop.time()
            big = asyncio.create_task(client.post("/v1/completions", json={"prompt": text, "max_tokens": 1,
                                                                           "truncate_prompt_tokens": 8}))
            done: list[float] = []
            big.add_done_callback(lambda _: done.append(loop.time()))
            answered = []
            while not big.done():
                await client.get("/health")
                answered.append(loop.time())
                await asyncio.sleep(0.05)
            return start, done[0], answered, (await big).status_code

    start, done, answered, status = asyncio.run(run())
    assert status == 200
    assert done - start > 0.5, "the prompt tokenized too fast to show anything; make it longer"
    # answered in the second half of the long request, well before its end: not only before its encoding began
    assert any(start + 0.5 * (done - start) < t < done - 0.25 for t in answered), (start, done, answered)
