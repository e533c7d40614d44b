import json

from tokenmill.cli import main


def test_multiturn_prefix_caching_cuts_prefill(tmp_path):
    """The workload of docs/BENCHMARKS.md (8 conversations of 5 turns: 200 shared system tokens, 100 new user
    tokens and 100 generated a turn): caching computes at most 20% of the prefill tokens (the target)."""
    out = tmp_path / "mt.json"
    main(["bench", "multiturn", "--load-format", "dummy", "--model-preset", "tiny-llama", "--num-conversations", "8",
          "--num-turns", "5", "--system-len", "200", "--user-len", "100", "--output-len", "100", "--out", str(out)])
    res = json.loads(out.read_text())["results"]
    off, on = res["runs"]
    assert not off["prefix_caching"] and on["prefix_caching"]
    assert off["prefill_tokens_computed"] == off["prompt_tokens"] == on["prompt_tokens"]
    assert on["prefill_tokens_computed"] <= 0.2 * off["prefill_tokens_computed"]
    assert off["generated_tokens"] == on["generated_tokens"] == 8 * 5 * 100
