"""How the model runner sizes the KV pool."""
import torch

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.runner.model_runner import kv_bytes_per_token


def engine(**kw) -> LLMEngine:
    return LLMEngine.from_engine_args(load_format="dummy", model_preset="tiny-llama", skip_tokenizer_init=True,
                                      dtype="float32", block_size=16, **kw)


def test_pool_never_exceeds_what_max_num_seqs_requests_can_hold():
    """A budget far beyond need (a small model on a large GPU) gives one full-context table per request (plus
    the null block), not millions of blocks."""
    e = engine(kv_cache_memory=8 << 30, max_num_seqs=4, max_model_len=100)
    assert e.runner.num_blocks == 1 + 4 * 7
    assert e.get_stats()["num_blocks_total"] == 4 * 7  # usable: all but the null block


def test_pool_follows_the_budget_below_that():
    e = engine(kv_cache_memory=1 << 16, max_num_seqs=64, max_model_len=1024)
    per_block = kv_bytes_per_token(e.model_config, torch.float32) * 16
    assert e.runner.num_blocks == (1 << 16) // per_block < 1 + 64 * 64
