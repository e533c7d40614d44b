"""Device-dependent defaults: the offline LLM class's and the server's step budgets follow vLLM's table for the
GPU they run on; on the command line an unset budget stays unset until the command picks it."""
import argparse
from types import SimpleNamespace

import pytest
import torch

from tokenmill import LLM
from tokenmill.engine.arg_utils import add_engine_args, engine_args_from
from tokenmill.engine.devices import offline_max_num_batched_tokens, pick_device, server_max_num_batched_tokens

GIB = 1 << 30


@pytest.mark.parametrize("name, memory, budget", [
    ("NVIDIA H200", 139 * GIB, 16384),          # vLLM: 16384 for its LLM class on GPUs of 70 GiB or more
    ("NVIDIA H100 80GB HBM3", 79 * GIB, 16384),
    ("NVIDIA A100-SXM4-80GB", 79 * GIB, 8192),  # ... but A100s, where larger budgets measured slower
    ("NVIDIA L4", 22 * GIB, 8192),              # ... and 8192 on smaller GPUs
])
def test_offline_budget_on_cuda_follows_vllm(monkeypatch, name, memory, budget):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name=name, total_memory=memory))
    assert offline_max_num_batched_tokens(torch.device("cuda", 0), engine_default=2048) == budget


def test_offline_budget_on_cpu_is_the_engines_default():
    assert offline_max_num_batched_tokens(torch.device("cpu"), engine_default=2048) == 2048


def test_llm_takes_the_device_budget_unless_given(monkeypatch):
    tiny = {"load_format": "dummy", "model_preset": "tiny-llama", "device": "cpu"}
    seen = []

    def budget(device, engine_default):
        seen.append((device.type, engine_default))
        return 96

    monkeypatch.setattr("tokenmill.entrypoints.llm.offline_max_num_batched_tokens", budget)
    assert LLM(**tiny).llm_engine.scheduler.config.max_num_batched_tokens == 96
    assert seen == [("cpu", 2048)]
    assert LLM(**tiny, max_num_batched_tokens=40).llm_engine.scheduler.config.max_num_batched_tokens == 40
    assert len(seen) == 1  # a given budget is not second-guessed


@pytest.mark.parametrize("name, memory, budget", [
    ("NVIDIA H200", 139 * GIB, 8192),           # vLLM's API server: 8192 on GPUs of 70 GiB or more
    ("NVIDIA H100 80GB HBM3", 79 * GIB, 8192),
    ("NVIDIA A100-SXM4-80GB", 79 * GIB, 2048),  # ... but A100s
    ("NVIDIA L4", 22 * GIB, 2048),              # ... and 2048, the engine's default, on smaller GPUs
])
def test_server_budget_on_cuda_follows_vllm(monkeypatch, name, memory, budget):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name=name, total_memory=memory))
    assert server_max_num_batched_tokens(torch.device("cuda", 0), engine_default=2048) == budget
    assert server_max_num_batched_tokens(torch.device("cpu"), engine_default=2048) == 2048


def test_unset_budget_flag_stays_unset_until_the_command_picks():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    unset = parser.parse_args([])
    assert unset.max_num_batched_tokens is None  # the server tells "not given" from "given 2048"
    assert engine_args_from(unset).max_num_batched_tokens == 2048
    given = parser.parse_args(["--max-num-batched-tokens", "2048"])
    assert given.max_num_batched_tokens == 2048 and engine_args_from(given).max_num_batched_tokens == 2048


@pytest.mark.parametrize("device", ["tpu", "meta", "mps", "cpu:0", "cuda:x", "gpu", ""])
def test_unsupported_device_is_a_value_error_naming_the_allowed_ones(device):
    """torch.device took these (or raised a RuntimeError), and the engine failed later, with a torch traceback."""
    with pytest.raises(ValueError, match=r"is not supported; allowed: auto, cpu, cuda, cuda:N"):
        pick_device(device)


def test_cuda_without_a_gpu_and_a_gpu_index_past_the_last_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="CUDA is not available; use device='cpu'"):
            pick_device(device)
    assert pick_device("auto") == pick_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("cuda") == torch.device("cuda") and pick_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"device='cuda:2': this machine has 2 GPU\(s\), cuda:0 .. cuda:1"):
        pick_device("cuda:2")
