"""`tokenmill bench serve`: vLLM's `bench serve` against any OpenAI-compatible server.

The same work as vLLM's random dataset (docs: shared BENCHMARKS.md, workload 3): lengths, offsets and prefix drawn
from numpy.random.default_rng(seed), prompts decoded to text and re-encoded to their target length; arrivals all at
once (request rate inf) or with gamma gaps (shape = burstiness, 1 = Poisson) from np.random seeded with the same
seed, rescaled so the last request is sent at num_prompts / rate; optional client-side max concurrency. Measured on
the client from the event stream: TTFT (send to first chunk with choices), ITL (gaps between such chunks), TPOT per
request ((E2E - TTFT) / (output tokens - 1)), E2E (send to last such chunk); throughputs; goodput under SLOs."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from tokenmill.engine.arg_utils import check_at_least
from tokenmill.tokenizer import Tokenizer, load_tokenizer

ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
SLO_NAMES = ("ttft", "tpot", "e2el")
METRIC_HEADERS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                  "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


@dataclass
class RequestResult:
    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    start_time: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


# ---- the random dataset -----------------------------------------------------------------------------
def _special_ids(tokenizer: Tokenizer) -> set[int]:
    """The ids of the named special tokens (bos, eos, unk, pad, ...), as transformers' all_special_ids."""
    ids = (tokenizer.token_to_id(t) for t in tokenizer.special_tokens.values())
    return {i for i in ids if i is not None}


def _decode_to_target_len(tokenizer: Tokenizer, tokens: list[int], target: int, rng: np.random.Generator,
                          vocab_size: int, max_retry: int = 10) -> tuple[str, list[int]]:
    """Decode, re-encode and pad or cut until the text encodes to `target` tokens (at most max_retry rounds)."""
    for attempt in range(max_retry + 1):
        prompt = tokenizer.decode(tokens, skip_special_tokens=False)
        tokens = tokenizer.encode(prompt, add_special_tokens=False)
        if attempt == max_retry or len(tokens) == target:
            break
        if len(tokens) < target:
            tokens.extend(rng.integers(0, vocab_size, size=target - len(tokens)).tolist())
        else:
            tokens = tokens[:target]
    return prompt, tokens


def sample_random_requests(tokenizer: Tokenizer, num_requests: int, input_len: int, output_len: int,
                           range_ratio: float, prefix_len: int, seed: int) -> list[SampleRequest]:
    """vLLM's RandomDataset.sample, draw for draw."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    num_special = len(tokenizer.encode(""))
    real_input_len = max(0, input_len - num_special)
    input_low = math.floor(real_input_len * (1 - range_ratio))
    input_high = math.ceil(real_input_len * (1 + range_ratio))
    output_low = max(math.floor(output_len * (1 - range_ratio)), 1)
    output_high = max(math.ceil(output_len * (1 + range_ratio)), 1)
    if prefix_len + input_low < 1:
        raise ValueError(f"--random-input-len {input_len} leaves no prompt tokens after {num_special} special tokens; "
                         "raise it or --random-prefix-len")
    vocab_size = tokenizer.backend.get_vocab_size(with_added_tokens=False)
    input_lens = rng.integers(input_low, input_high + 1, size=num_requests)
    output_lens = rng.integers(output_low, output_high + 1, size=num_requests)
    offsets = rng.integers(0, vocab_size, size=num_requests)
    allowed = np.array(sorted(set(range(vocab_size)) - _special_ids(tokenizer)))
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if prefix_len > 0 else []
    requests = []
    for i in range(num_requests):
        body = allowed[(int(offsets[i]) + i + np.arange(int(input_lens[i]))) % len(allowed)].tolist()
        prompt, ids = _decode_to_target_len(tokenizer, prefix + body, prefix_len + int(input_lens[i]), rng, vocab_size)
        requests.append(SampleRequest(prompt, len(ids), int(output_lens[i])))
    return requests


def arrival_delays(num_requests: int, request_rate: float, burstiness: float) -> list[float]:
    """Send time of each request after the start, as vLLM's get_request draws them (from np.random)."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if request_rate == float("inf"):
        return [0.0] * num_requests
    if burstiness == float("inf"):
        gaps = [1.0 / request_rate] * num_requests
    else:
        gaps = [np.random.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness)) for _ in range(num_requests)]
    delays = np.cumsum(gaps)
    return (delays * (num_requests / request_rate) / delays[-1]).tolist()


# ---- one request ------------------------------------------------------------------------------------
async def send_request(client: httpx.AsyncClient, url: str, backend: str, model: str, req: SampleRequest,
                       ns: argparse.Namespace, headers: dict[str, str]) -> RequestResult:
    """Stream one request and time it the way vLLM's request functions do."""
    payload: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if backend == "openai":
        payload.update(prompt=req.prompt, repetition_penalty=1.0, max_tokens=req.expected_output_len, logprobs=None)
    else:
        payload.update(messages=[{"role": "user", "content": req.prompt}],
                       max_completion_tokens=req.expected_output_len)
    if ns.ignore_eos:
        payload["ignore_eos"] = True
    if ns.temperature is not None:
        payload["temperature"] = ns.temperature
    out = RequestResult(prompt_len=req.prompt_len)
    st = time.perf_counter()
    out.start_time = last = st
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:500]}"
                return out
            async for line in response.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    out.error = str(chunk["error"].get("message", chunk["error"]))
                    return out
                if choices := chunk.get("choices"):
                    now = time.perf_counter()
                    if not out.ttft:
                        out.ttft = now - st
                    else:
                        out.itl.append(now - last)
                    last = now
                    text = choices[0].get("text") if backend == "openai" else choices[0].get("delta", {}).get("content")
                    out.generated_text += text or ""
                elif usage := chunk.get("usage"):
                    out.output_tokens = usage.get("completion_tokens") or 0
                    out.prompt_len = usage.get("prompt_tokens") or out.prompt_len
        out.latency = last - st
        out.success = bool(out.ttft)
        if not out.success:
            out.error = "never received a chunk with choices"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


# ---- metrics ----------------------------------------------------------------------------------------
def _stats(values: list[float], percentiles: list[float]) -> dict[str, Any]:
    v = values or [0.0]
    return {"mean": float(np.mean(v)) * 1000, "median": float(np.median(v)) * 1000, "std": float(np.std(v)) * 1000,
            "percentiles": [(p, float(np.percentile(v, p)) * 1000) for p in percentiles]}


def calculate_metrics(outputs: list[RequestResult], duration: float, tokenizer: Tokenizer, percentiles: list[float],
                      goodput: dict[str, float]) -> tuple[dict[str, Any], list[int]]:
    """vLLM's calculate_metrics: per-request TPOT, all ITLs pooled, goodput = requests meeting every SLO / s."""
    output_lens, ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], [], []
    total_input = completed = good = 0
    for o in outputs:
        if not o.success:
            output_lens.append(0)
            continue
        n = o.output_tokens or len(tokenizer.encode(o.generated_text, add_special_tokens=False))
        output_lens.append(n)
        total_input += o.prompt_len
        tpot = (o.latency - o.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += o.itl
        ttfts.append(o.ttft)
        e2els.append(o.latency)
        completed += 1
    per_request = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
    if goodput:
        for values in zip(*(per_request[k] for k in goodput)):
            good += all(v <= goodput[k] / 1000 for k, v in zip(goodput, values))
    total_output = sum(output_lens)
    metrics = {
        "completed": completed, "failed": len(outputs) - completed, "total_input": total_input,
        "total_output": total_output, "request_throughput": completed / duration,
        "request_goodput": good / duration, "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "ttft": _stats(ttfts, percentiles), "tpot": _stats(tpots, percentiles), "itl": _stats(itls, percentiles),
        "e2el": _stats(e2els, percentiles),
    }
    return metrics, output_lens


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    slos = {}
    for pair in pairs or []:
        name, _, value = pair.partition(":")
        if name not in SLO_NAMES or not value:
            raise ValueError(f"--goodput takes NAME:MILLISECONDS with NAME in {SLO_NAMES}, got {pair!r}")
        if float(value) < 0:
            raise ValueError(f"--goodput {pair}: the SLO must be >= 0 ms")
        slos[name] = float(value)
    return slos


# ---- the run ----------------------------------------------------------------------------------------
async def first_model(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    response = await client.get(f"{base_url}/v1/models", headers=headers)
    response.raise_for_status()
    data = response.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]


async def benchmark(ns: argparse.Namespace, requests: list[SampleRequest], tokenizer: Tokenizer) -> dict[str, Any]:
    base_url = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    url = base_url + (ns.endpoint or ENDPOINTS[ns.backend])
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    limit = ns.max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600.0), limits=limits) as client:
        try:
            model = ns.model or await first_model(client, base_url, headers)
        except httpx.HTTPError as e:
            raise ValueError(f"cannot list the models of {base_url} ({type(e).__name__}: {e}); start a server "
                             "(tokenmill serve) or point --base-url / --host / --port at one") from None
        print("Starting initial single prompt test run...")
        test = await send_request(client, url, ns.backend, model, requests[0], ns, headers)
        if not test.success:
            raise ValueError(f"initial test run against {url} failed; check the server and the benchmark "
                             f"arguments. Error: {test.error}")
        print("Initial test run completed.")
        distribution = "Poisson process" if ns.burstiness == 1.0 else "Gamma distribution"
        print(f"Traffic request rate: {ns.request_rate}\nBurstiness factor: {ns.burstiness} ({distribution})\n"
              f"Maximum request concurrency: {ns.max_concurrency}")
        delays = arrival_delays(len(requests), ns.request_rate, ns.burstiness)
        semaphore = asyncio.Semaphore(limit)
        pbar = tqdm(total=len(requests), disable=ns.disable_tqdm)

        async def limited(req: SampleRequest) -> RequestResult:
            async with semaphore:
                result = await send_request(client, url, ns.backend, model, req, ns, headers)
            pbar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for req, delay in zip(requests, delays):
            wait = start + delay - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(limited(req)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        pbar.close()
    percentiles = [float(p) for p in ns.metric_percentiles.split(",")]
    goodput = parse_goodput(ns.goodput)
    m, output_lens = calculate_metrics(outputs, duration, tokenizer, percentiles, goodput)
    result = report(ns, m, duration, goodput, [s.strip() for s in ns.percentile_metrics.split(",")])
    result.update(model_id=model, input_lens=[o.prompt_len for o in outputs], output_lens=output_lens,
                  ttfts=[o.ttft for o in outputs], itls=[o.itl for o in outputs],
                  latencies=[o.latency for o in outputs], start_times=[o.start_time - start for o in outputs],
                  generated_texts=[o.generated_text for o in outputs], errors=[o.error for o in outputs])
    return result


def report(ns: argparse.Namespace, m: dict[str, Any], duration: float, goodput: dict[str, float],
           selected: list[str]) -> dict[str, Any]:
    """Print the results as vLLM does and return them under vLLM's result-file keys."""
    row = "{:<40} {:<10}".format
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print(row("Successful requests:", m["completed"]))
    print(row("Failed requests:", m["failed"]))
    if ns.max_concurrency is not None:
        print(row("Maximum request concurrency:", ns.max_concurrency))
    if ns.request_rate != float("inf"):
        print(row("Request rate configured (RPS):", f"{ns.request_rate:.2f}"))
    print(row("Benchmark duration (s):", f"{duration:.2f}"))
    print(row("Total input tokens:", m["total_input"]))
    print(row("Total generated tokens:", m["total_output"]))
    print(row("Request throughput (req/s):", f"{m['request_throughput']:.2f}"))
    if goodput:
        print(row("Request goodput (req/s):", f"{m['request_goodput']:.2f}"))
    print(row("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"))
    print(row("Total token throughput (tok/s):", f"{m['total_token_throughput']:.2f}"))
    result: dict[str, Any] = {
        "duration": duration, "completed": m["completed"], "failed": m["failed"],
        "total_input_tokens": m["total_input"], "total_output_tokens": m["total_output"],
        "request_throughput": m["request_throughput"], "request_goodput": m["request_goodput"] if goodput else None,
        "output_throughput": m["output_throughput"], "total_token_throughput": m["total_token_throughput"],
    }
    for key in PERCENTILE_METRICS:
        if key not in selected:
            continue
        name, header = METRIC_HEADERS[key]
        s = m[key]
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        print(row(f"Mean {name} (ms):", f"{s['mean']:.2f}"))
        print(row(f"Median {name} (ms):", f"{s['median']:.2f}"))
        result.update({f"mean_{key}_ms": s["mean"], f"median_{key}_ms": s["median"], f"std_{key}_ms": s["std"]})
        for p, value in s["percentiles"]:
            word = str(int(p)) if int(p) == p else str(p)
            print(row(f"P{word} {name} (ms):", f"{value:.2f}"))
            result[f"p{word}_{key}_ms"] = value
    print("=" * 50)
    return result


def plot(result: dict[str, Any], path: str) -> None:
    """TTFT / TPOT / ITL distributions and a timeline of the requests, in one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [i for i, e in enumerate(result["errors"]) if not e]
    tpots = [(result["latencies"][i] - result["ttfts"][i]) / (result["output_lens"][i] - 1) * 1000
             for i in ok if result["output_lens"][i] > 1]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, values, title in ((axes[0][0], [result["ttfts"][i] * 1000 for i in ok], "TTFT (ms)"),
                              (axes[0][1], tpots, "TPOT (ms)"),
                              (axes[1][0], [x * 1000 for i in ok for x in result["itls"][i]], "ITL (ms)")):
        ax.hist(values, bins=40, color="#2a6fdb")
        ax.set_title(title)
        ax.set_ylabel("count")
    ax = axes[1][1]
    for row, i in enumerate(ok):
        start = result["start_times"][i]
        ax.plot([start, start + result["ttfts"][i]], [row, row], color="#d9822b", linewidth=1)
        ax.plot([start + result["ttfts"][i], start + result["latencies"][i]], [row, row], color="#2a6fdb", linewidth=1)
    ax.set_title("requests over time: waiting for the first token / decoding")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("request")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_serve_bench_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("serve", help="benchmark an OpenAI-compatible server as vLLM's `bench serve`")
    p.add_argument("--backend", choices=sorted(ENDPOINTS), default="openai",
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions (default: %(default)s)")
    p.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help="API path (default: the backend's)")
    p.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="HF folder or GGUF whose tokenizer builds the prompts (default: the default model's)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--dataset-name", choices=["random"], default="random")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to generate exactly the output length")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics to report (default: %(default)s)")
    p.add_argument("--metric-percentiles", default="90,99", help="percentiles to report (default: %(default)s)")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--save-result", action="store_true", help="write the results to a JSON file")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--plot", action="store_true", help="also write a PNG of the latency distributions and timeline")
    p.set_defaults(func=run)


PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def check_args(ns: argparse.Namespace) -> None:
    """The options read after the run, read before it: a typo must not cost the run."""
    try:
        percentiles = [float(p) for p in ns.metric_percentiles.split(",")]
    except ValueError:
        raise ValueError(f"--metric-percentiles must be numbers separated by commas, got {ns.metric_percentiles!r}") \
            from None
    if not all(0 < p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles must be in (0, 100], got {ns.metric_percentiles!r}")
    unknown = [m for m in ns.percentile_metrics.split(",") if m.strip() not in PERCENTILE_METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(map(repr, unknown))}; allowed: "
                         f"{', '.join(PERCENTILE_METRICS)}, separated by commas")
    if (ns.save_result or ns.plot) and ns.result_dir and os.path.exists(ns.result_dir) \
            and not os.path.isdir(ns.result_dir):
        raise ValueError(f"--result-dir {ns.result_dir} is a file, not a folder")
    parse_goodput(ns.goodput)
    if not ns.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {ns.request_rate}")
    if not ns.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0 (inf: evenly spaced), got {ns.burstiness}")
    # zero prompts would wait forever on a pool of zero connections, a negative seed fail in numpy's words
    check_at_least(ns, {"num_prompts": 1, "random_input_len": 0, "random_output_len": 1, "random_prefix_len": 0,
                        "seed": 0, "max_concurrency": 1, "port": 1})


def run(ns: argparse.Namespace) -> dict[str, Any]:
    check_args(ns)
    random.seed(ns.seed)
    np.random.seed(ns.seed)
    if ns.tokenizer is None:
        from tokenmill.model.default import default_model_path
        ns.tokenizer = default_model_path()
    tokenizer = load_tokenizer(ns.tokenizer)
    requests = sample_random_requests(tokenizer, ns.num_prompts, ns.random_input_len, ns.random_output_len,
                                      ns.random_range_ratio, ns.random_prefix_len, ns.seed)
    result = asyncio.run(benchmark(ns, requests, tokenizer))
    result = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": ns.backend,
              "tokenizer_id": ns.tokenizer, "num_prompts": ns.num_prompts, "request_rate": ns.request_rate,
              "burstiness": ns.burstiness, "max_concurrency": ns.max_concurrency, **result}
    if ns.save_result or ns.plot:
        concurrency = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency is not None else ""
        name = ns.result_filename or (f"{ns.backend}-{ns.request_rate}qps{concurrency}-"
                                      f"{os.path.basename(str(result['model_id']))}-{result['date']}.json")
        path = os.path.join(ns.result_dir, name) if ns.result_dir else name
        if ns.result_dir:
            os.makedirs(ns.result_dir, exist_ok=True)
        if ns.save_result:
            with open(path, "w") as f:
                json.dump(result, f, indent=2)
            print(f"results written to {path}")
        if ns.plot:
            plot(result, os.path.splitext(path)[0] + ".png")
            print(f"plot written to {os.path.splitext(path)[0]}.png")
    return result
