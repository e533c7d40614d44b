"""quant-eval and quantize end to end on the tiny checkpoint: metrics, sensitivity ranking, mixed plan,
GPTQ, replay of a prompts file, and the CLI's table / JSON / plot."""
from __future__ import annotations

import json

import pytest
import torch

from tokenmill.cli import main
from tokenmill.quant.eval import compare, evaluate
from tokenmill.quant.formats import QuantFormat
from tokenmill.quant.replay import parses_as_json


def test_compare_identical_and_different() -> None:
    windows = [[1, 2, 3, 4], [5, 6]]
    lp = [torch.log_softmax(torch.randn(len(w), 10), -1) for w in windows]
    same, kl = compare(windows, lp, lp)
    assert same.kl_mean == 0 and same.top1_agreement == 1 and same.ppl_base == same.ppl_quant and kl.numel() == 6
    other = [torch.log_softmax(x + torch.randn_like(x), -1) for x in lp]
    diff, _ = compare(windows, lp, other)
    assert diff.kl_mean > 0 and diff.kl_p99 >= diff.kl_mean


def test_evaluate_tiny(tiny_model_dir: str) -> None:
    r = evaluate(tiny_model_dir, QuantFormat.parse("int4-g32"), "int8", num_tokens=96, window=48, per_layer=True,
                 skip_top=2, calibration="gptq", calibration_tokens=96, device="cpu")
    assert r["windows"] == 2 and r["num_tokens"] == 96 and len(r["token_kl"]) == 96
    assert 0 < r["kl_mean"] <= r["kl_p99"] * 10 and 0 < r["top1_agreement"] <= 1
    ranks = [p["kl_mean"] for p in r["per_layer"]]
    assert len(ranks) == 8 and ranks == sorted(ranks, reverse=True)
    assert r["mixed"]["kept_16bit"] == [p["module"] for p in r["per_layer"][:2]]
    assert r["linear_bytes"] < r["mixed"]["linear_bytes"] < r["linear_bytes_16bit"]


def test_evaluate_with_lm_head(tiny_model_dir: str) -> None:
    """--quantize-lm-head: the head is quantized (GPTQ on its inputs too), ranked among the projections and
    counted in the bytes; it adds KL over the projections alone."""
    kw = {"num_tokens": 96, "window": 48, "calibration": "gptq", "calibration_tokens": 96, "device": "cpu"}
    fmt = QuantFormat.parse("int4-g32")
    alone = evaluate(tiny_model_dir, fmt, per_layer=True, **kw)
    head = evaluate(tiny_model_dir, fmt, per_layer=True, quantize_lm_head=True, **kw)
    assert [p["module"] for p in head["per_layer"]].count("lm_head") == 1 and len(head["per_layer"]) == 9
    assert head["kl_mean"] > alone["kl_mean"]
    assert head["linear_bytes"] - alone["linear_bytes"] == fmt.nbytes(49152, 64)
    assert head["linear_bytes_16bit"] - alone["linear_bytes_16bit"] == 49152 * 64 * 2
    with pytest.raises(ValueError, match="need a weight method"):
        evaluate(tiny_model_dir, None, "int8", quantize_lm_head=True)


def test_gptq_beats_rounding(tiny_model_dir: str) -> None:
    """On the tiny model too, GPTQ lands closer to the float model than plain rounding."""
    kw = {"num_tokens": 96, "window": 48, "calibration_tokens": 192, "device": "cpu"}
    gptq = evaluate(tiny_model_dir, QuantFormat.parse("int4-g32"), calibration="gptq", **kw)
    rtn = evaluate(tiny_model_dir, QuantFormat.parse("int4-g32"), calibration="rtn", **kw)
    assert gptq["kl_mean"] < rtn["kl_mean"]


def test_calibration_windows(default_model_path: str) -> None:
    """GPTQ calibrates on the corpus end (quant-eval scores its start), every other window a chat exchange."""
    from tokenmill.quant.corpus import calibration_windows, corpus_text, corpus_windows
    from tokenmill.tokenizer import load_tokenizer
    tok = load_tokenizer(default_model_path)
    cal = calibration_windows(tok, 512, 128)
    assert len(cal) == 4 and all(len(w) == 128 for w in cal)
    start = tok.token_to_id("<|im_start|>")
    assert start not in cal[0] and cal[1][0] == start
    scored = corpus_windows(tok.encode(corpus_text(), add_special_tokens=False), 512, 128)
    assert not {tuple(w) for w in scored} & {tuple(w) for w in cal}


def test_evaluate_needs_something() -> None:
    with pytest.raises(ValueError, match="nothing to evaluate"):
        evaluate(None, None)


def test_mixed_plan_keeping_every_projection_is_the_kv_cache_alone(tiny_model_dir: str) -> None:
    """--skip-top keeping all projections in 16-bit leaves the KV cache quantized: the mixed figure equals the
    KV-only evaluation (fp8 folds scales into the projections: its mixed pass runs on its own model copy), and
    the all-quantized figure after it is the same as without --skip-top."""
    kw = {"num_tokens": 64, "window": 32, "calibration": "rtn", "device": "cpu"}
    for kv in ("fp8", "int8"):
        kv_only = evaluate(tiny_model_dir, None, kv, **kw)
        r = evaluate(tiny_model_dir, QuantFormat.parse("int8"), kv, skip_top=1000, **kw)
        plain = evaluate(tiny_model_dir, QuantFormat.parse("int8"), kv, **kw)
        assert r["mixed"]["kl_mean"] == pytest.approx(kv_only["kl_mean"], rel=1e-6) and kv_only["kl_mean"] > 0
        assert r["kl_mean"] == pytest.approx(plain["kl_mean"], rel=1e-6)


def test_bad_evaluation_arguments_and_inputs(tiny_model_dir: str, tmp_path) -> None:
    fmt = QuantFormat.parse("int8")
    for kw, match in (({"window": 1}, "window"), ({"skip_top": -2}, "skip_top")):
        with pytest.raises(ValueError, match=match):
            evaluate(tiny_model_dir, fmt, device="cpu", **kw)
    quantized = tmp_path / "q"
    main(["quantize", "--model", tiny_model_dir, "--method", "int8", "--calibration", "rtn", "--out",
          str(quantized), "--device", "cpu"])
    with pytest.raises(ValueError, match="already quantized"):  # re-quantizing packed weights as if float
        main(["quantize", "--model", str(quantized), "--method", "int4", "--calibration", "rtn", "--out",
              str(tmp_path / "qq"), "--device", "cpu"])
    with pytest.raises(ValueError, match="already quantized"):
        evaluate(str(quantized), fmt, num_tokens=32, window=32, device="cpu")
    for line, match in (('{"messages": []}', "messages"), ('{"prompt": 5}', "prompt"),
                        ('{"messages": "hello"}', "messages"), ('{"prompt": "hi", "max_tokens": "5"}', "max_tokens")):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": "fine"}\n' + line + "\n")
        with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{match}"):  # before any evaluation runs
            main(["quant-eval", "--model", tiny_model_dir, "--method", "int8", "--replay", str(bad),
                  "--device", "cpu"])


def test_bad_sizes_are_refused_before_any_work(tiny_model_dir: str) -> None:
    """A corpus count of 0 or below sliced (nearly) the whole corpus, minutes of evaluation or calibration; a
    window past the model's positions died with an IndexError in the rotary embedding."""
    for kw, match in (({"num_tokens": 0}, "num_tokens must be at least 2"),
                      ({"num_tokens": -5}, "num_tokens must be at least 2"),
                      ({"num_tokens": 32, "calibration": "gptq", "calibration_tokens": 0}, "calibration_tokens"),
                      ({"num_tokens": 600, "window": 600}, "600 tokens exceed the model's 512 positions")):
        with pytest.raises(ValueError, match=match):
            evaluate(tiny_model_dir, QuantFormat.parse("int8"), **{"window": 32, "device": "cpu", **kw})


def test_quantize_never_writes_over_existing_files(tiny_model_dir: str, tmp_path) -> None:
    """--out the model's own folder used to overwrite the original's weights and config, then fail on copying its
    tokenizer onto itself; --out a file failed with a FileExistsError traceback."""
    import shutil
    source = tmp_path / "model"
    shutil.copytree(tiny_model_dir, source)
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    (tmp_path / "file").write_text("x")
    for out, match in ((source, "output folder .* is not empty"), (tmp_path / "file", "output .* is a file")):
        with pytest.raises(ValueError, match=match):
            main(["quantize", "--model", str(source), "--method", "int8", "--calibration", "rtn", "--out", str(out),
                  "--device", "cpu"])
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before
    (tmp_path / "empty").mkdir()
    main(["quantize", "--model", str(source), "--method", "int8", "--calibration", "rtn", "--out",
          str(tmp_path / "empty"), "--device", "cpu"])
    assert (tmp_path / "empty" / "model.safetensors").is_file()


def test_options_are_refused_before_a_model_loads(tiny_model_dir: str, tmp_path, monkeypatch) -> None:
    """Each was found out after the work (17 s of quantizing, 85 s of evaluating on the default model): an --out
    that cannot be created, a --json / --plot that cannot be written, --max-tokens 0 for --replay, a GPTQ
    calibration that cannot run."""
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr("tokenmill.model.loader.load_model", no_load)
    (tmp_path / "file").write_text("x")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    model = ["--model", tiny_model_dir, "--device", "cpu"]
    for argv, match in (
            (["quantize", "--method", "int8", "--out", str(tmp_path / "file" / "q")], "output folder .* cannot be "
                                                                                     "created: .* is not a folder"),
            (["quantize", "--method", "int8", "--out", "/proc/tokenmill/q"], "output folder /proc/tokenmill/q cannot "
                                                                            "be written: creating a file in /proc"),
            (["quantize", "--method", "fp8", "--calibration", "gptq", "--out", str(tmp_path / "q")], "rounded to"),
            (["quantize", "--method", "int4", "--calibration-tokens", "0", "--out", str(tmp_path / "q")],
             "calibration_tokens must be at least 2 for GPTQ, got 0"),
            (["quant-eval", "--json", str(tmp_path)], "--json .* is a directory; give a file path"),
            (["quant-eval", "--plot", str(tmp_path / "file" / "kl.png")], "--plot folder .* cannot be created"),
            (["quant-eval", "--json", str(tmp_path / "file" / "r.json")], "--json folder .* cannot be created"),
            (["quant-eval", "--max-tokens", "0", "--replay", str(prompts)], "--max-tokens must be at least 1, got 0"),
            (["quant-eval", "--method", "fp8", "--calibration", "gptq"], "rounded to"),
            (["quant-eval", "--method", "int4", "--calibration-tokens", "1"], "calibration_tokens must be at least 2")):
        with pytest.raises(ValueError, match=match):
            main([*argv, *model])
    assert not (tmp_path / "q").exists()


def test_report_counts_the_projections_kept() -> None:
    """--skip-top larger than the number of projections keeps them all, and the table says how many."""
    from tokenmill.quant.report import format_report
    metrics = {"kl_mean": 0.01, "kl_p99": 0.05, "top1_agreement": 0.9, "ppl_base": 10.0, "ppl_quant": 10.5,
               "ppl_change": 0.05, "num_tokens": 64}
    r = {"model": "m", "method": "int8", "calibration": "rtn", "kv_cache_dtype": "auto", "dtype": "float32",
         "device": "cpu", "windows": 2, "window": 32, "linear_bytes_16bit": 100, "linear_bytes": 50, **metrics,
         "mixed": {"skip_top": 1000, "kept_16bit": ["a", "b", "c"], **metrics, "linear_bytes": 100}}
    assert "mixed precision, 3 most sensitive kept in 16-bit" in format_report(r)


def test_parses_as_json() -> None:
    assert parses_as_json(' {"a": 1} ') and parses_as_json('```json\n[1, 2]\n```')
    assert not parses_as_json("Sure! {") and not parses_as_json("")


def test_cli(tiny_model_dir: str, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Give a JSON list of two numbers."}\n{"prompt": "Hi", "raw": true, "max_tokens": 3}\n')
    out, png = tmp_path / "new" / "r.json", tmp_path / "new" / "r.png"   # the folder is made
    main(["quant-eval", "--model", tiny_model_dir, "--method", "int8", "--kv-cache-dtype", "fp8", "--num-tokens",
          "64", "--window", "32", "--per-layer", "--skip-top", "1", "--replay", str(prompts), "--max-tokens", "5",
          "--json", str(out), "--plot", str(png), "--device", "cpu"])
    text = capsys.readouterr().out
    for key in ("KL mean / p99", "top-1 agreement", "perplexity", "most sensitive", "mixed precision", "replay of 2"):
        assert key in text
    r = json.loads(out.read_text())
    assert r["method"] == "int8" and r["kv_cache_dtype"] == "fp8" and r["replay"]["prompts"] == 2
    assert 0 <= r["replay"]["first_token_agreement"] <= 1 and len(r["token_kl"]) == 64
    assert png.stat().st_size > 1000

    main(["quantize", "--model", tiny_model_dir, "--method", "int4", "--group-size", "32", "--calibration", "rtn",
          "--out", str(tmp_path / "q"), "--device", "cpu", "--quantize-lm-head"])
    assert "wrote int4-g32 model" in capsys.readouterr().out
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["lm_head"] is True
    main(["quant-eval", "--model", str(tmp_path / "q"), "--method", "none", "--kv-cache-dtype", "int8",
          "--num-tokens", "32", "--window", "32", "--device", "cpu", "--json", "-"])
    assert json.loads(capsys.readouterr().out)["method"] == "none"


def test_replay_runs_the_weights_scored(tiny_model_dir: str, tmp_path) -> None:
    """quant-eval --replay generates with the GPTQ weights it scored (a `tokenmill quantize` folder with the same
    calibration gives the same answers), not with a rounding at load."""
    from tokenmill import LLM, SamplingParams
    prompts = tmp_path / "prompts.jsonl"
    texts = ["The capital of France is", "One, two, three,"]
    prompts.write_text("".join(json.dumps({"prompt": t, "raw": True, "max_tokens": 8}) + "\n" for t in texts))
    cal = ["--method", "int4", "--group-size", "32", "--calibration", "gptq", "--calibration-tokens", "96",
           "--device", "cpu"]
    out = tmp_path / "r.json"
    main(["quant-eval", "--model", tiny_model_dir, *cal, "--num-tokens", "64", "--window", "32", "--replay",
          str(prompts), "--json", str(out)])
    replayed = [row["quant"] for row in json.loads(out.read_text())["replay"]["rows"]]
    main(["quantize", "--model", tiny_model_dir, *cal, "--out", str(tmp_path / "q")])
    llm = LLM(model=str(tmp_path / "q"), device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=8)
    assert replayed == [o.outputs[0].text for o in llm.generate(texts, greedy)]
