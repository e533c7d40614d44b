"""The offline workload through Hugging Face transformers' continuous batching (the manager behind
`generate_batch`: paged attention, its own scheduler and CUDA graphs), the baseline issue 3 names for offline
throughput. Each request keeps its own max_tokens and ignores EOS, as in tokenmill's pass, so both generate the
same number of tokens; the figure is generated tokens / wall time from the first request added to the last
finished."""
from __future__ import annotations

import time
from typing import Any

import torch

from tokenmill.bench.workloads import Workload

WARM_UP_TOKENS = 4


def hf_generation_config(temperature: float, max_tokens: int) -> Any:
    """Sampling as tokenmill's pass samples: plain temperature (transformers' default top_k of 50 switched off),
    greedy at 0, EOS disabled (-1) so every request runs to its max_tokens."""
    from transformers import GenerationConfig

    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {
        "do_sample": False}
    return GenerationConfig(max_new_tokens=max_tokens, eos_token_id=-1, pad_token_id=0, **sampling)


def _collect(manager: Any, request_ids: list[str]) -> dict[str, Any]:
    """Block until every request has finished; a failed request or a dead generation loop is an error, not a
    shorter run that would read as a faster one."""
    pending, done = set(request_ids), {}
    while pending:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"transformers' generation loop stopped with {len(pending)} requests unfinished")
            continue
        if result.is_finished() and result.request_id in pending:
            if result.error is not None:
                raise RuntimeError(f"transformers failed request {result.request_id}: {result.error}")
            pending.discard(result.request_id)
            done[result.request_id] = result
    return done


@torch.no_grad()  # not inference mode: the manager's loop thread updates tensors made here in place
def run_hf_workload(model: torch.nn.Module, workload: Workload, temperature: float,
                    device: torch.device) -> dict[str, Any]:
    """One timed pass of the workload through transformers' continuous batching, after a warm-up of the same
    prompts for WARM_UP_TOKENS tokens each (compiles and graph captures stay out of the timing)."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    hints = WorkloadHints(max_prompt_length=max(len(p) for p in workload.prompts),
                          max_generated_length=max(workload.max_tokens), num_requests=len(workload.prompts))
    config = hf_generation_config(temperature, max(workload.max_tokens))
    with model.continuous_batching_context_manager(generation_config=config, workload_hints=hints) as manager:
        _collect(manager, [manager.add_request(p, max_new_tokens=WARM_UP_TOKENS, eos_token_id=-1)
                           for p in workload.prompts])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=m, eos_token_id=-1)
               for p, m in zip(workload.prompts, workload.max_tokens)]
        done = _collect(manager, ids)
        elapsed = time.perf_counter() - start
        attn_implementation = model.config._attn_implementation  # the manager's paged choice, undone on exit
    out_tokens = sum(len(done[i].generated_tokens) for i in ids)
    return {"system": "transformers", "attn_implementation": attn_implementation,
            "temperature": temperature, "num_requests": len(ids), "input_tokens": workload.num_input_tokens,
            "output_tokens": out_tokens, "elapsed_s": elapsed, "requests_per_s": len(ids) / elapsed,
            "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (workload.num_input_tokens + out_tokens) / elapsed}
