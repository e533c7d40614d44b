import json

from tokenmill.cli import main


def test_multiturn_prefix_caching_cuts_prefill(tmp_path):
    out = tmp_path / "mt.json"
    main(["bench", "multiturn", "--load-format", "dummy", "--model-preset", "tiny-llama", "--num-conversations", "2",
          "--num-turns", "3", "--system-len", "32", "--user-len", "20", "--output-len", "8", "--out", str(out)])
    res = json.loads(out.read_text())["results"]
    off, on = res["runs"]
    assert not off["prefix_caching"] and on["prefix_caching"]
    assert off["prefill_tokens_computed"] == off["prompt_tokens"] == on["prompt_tokens"]
    assert on["prefill_tokens_computed"] < 0.6 * off["prefill_tokens_computed"]
    assert off["generated_tokens"] == on["generated_tokens"] == 2 * 3 * 8
