"""EngineArgs refuses an option of the wrong type before anything loads."""
import pathlib

import pytest

from tokenmill.config import EngineArgs


@pytest.mark.parametrize("kw, message", [
    (dict(enable_prefix_caching="false"), r"enable_prefix_caching must be true/false, got 'false' \(str\)"),
    (dict(max_num_seqs=1.5), r"max_num_seqs must be an integer, got 1.5 \(float\)"),
    (dict(kv_cache_memory="1GiB"), r"kv_cache_memory must be an integer or null, got '1GiB'"),
    (dict(seed=None), r"seed must be an integer, got None"),
    (dict(gpu_memory_utilization=True), r"gpu_memory_utilization must be a number, got True \(bool\)"),
    (dict(model=3), r"model must be a string or null, got 3 \(int\)"),
])
def test_option_of_the_wrong_type_is_named(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kw)


def test_integral_floats_and_paths_are_taken() -> None:
    args = EngineArgs(model=pathlib.Path("/models/x"), kv_cache_memory=2e9, gpu_memory_utilization=1)
    assert args.model == "/models/x"
    assert args.kv_cache_memory == 2_000_000_000 and isinstance(args.kv_cache_memory, int)
    assert args.gpu_memory_utilization == 1


@pytest.mark.parametrize("kw, message", [
    # each was ignored without a word: the run went on without speculation, or with the bundled model
    (dict(num_speculative_tokens=3), r"num_speculative_tokens only apply to speculative decoding, which is off"),
    (dict(prompt_lookup_max=3, prompt_lookup_min=1), r"prompt_lookup_max, prompt_lookup_min only apply"),
    (dict(model_preset="qwen3-0.6b"), r"model_preset='qwen3-0.6b' is the architecture of random weights and needs "
                                      r"load_format='dummy'; got load_format='auto'"),
    # was a TypeError from TCPStore once the ranks started
    (dict(tensor_parallel_size=2, master_port=99999), r"master_port must be a port number in \[1, 65535\]"),
])
def test_an_option_that_would_not_apply_is_refused(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kw)


def test_options_of_what_they_apply_to_are_taken() -> None:
    args = EngineArgs(speculative="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    plain = args.without_speculation()
    assert plain.speculative is None and plain.num_speculative_tokens == EngineArgs.num_speculative_tokens
    assert EngineArgs(load_format="dummy", model_preset="tiny-llama").model_preset == "tiny-llama"
