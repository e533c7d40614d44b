"""The simulator runs the real scheduler and KV cache manager on a virtual clock: policies, pool limits, completion,
determinism; the workload generator follows the benchmark's random-dataset recipe; the fit recovers known costs."""
import json
import subprocess
import sys

import numpy as np
import pytest

from tokenmill.cli import main
from tokenmill.config import SchedulerConfig
from tokenmill.request import RequestStatus
from tokenmill.sim.cost_model import FEATURES, CostModel, StepShape
from tokenmill.sim.fit import fit
from tokenmill.sim.report import class_stats, format_report
from tokenmill.sim.simulator import Simulator
from tokenmill.sim.workload import RequestClass, generate, parse_class

COST = CostModel({"step": 0.005, "prefill_tokens": 2e-5, "decode_tokens": 1e-4, "decode_context": 1e-8,
                  "prefill_attention": 1e-10})
SHORT = RequestClass("short", num_requests=150, request_rate=20.0, input_len=32, output_len=16, range_ratio=0.5,
                     priority=0)
LONG_FLOOD = RequestClass("long", num_requests=20, start=2.0, input_len=2000, output_len=8, priority=1)


def simulate(classes, policy="fcfs", num_blocks=4096, seed=0, check=True, **config):
    workload = generate(classes, vocab_size=1000, special_ids={0, 1}, seed=seed)
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=4096, policy=policy, **config)
    return workload, Simulator(cfg, num_blocks, 16, COST).run(workload, check_invariants=check)


def p99_ttft(result, cls):
    return next(s for s in class_stats(result) if s.name == cls).pct("ttft", 99)


def test_priority_protects_short_requests_from_a_long_prompt_flood():
    _, fcfs = simulate([SHORT, LONG_FLOOD], "fcfs")
    _, prio = simulate([SHORT, LONG_FLOOD], "priority")
    fcfs_p99, prio_p99 = p99_ttft(fcfs, "short"), p99_ttft(prio, "short")
    print(f"\np99 TTFT of short requests under a long-prompt flood: fcfs {fcfs_p99 * 1e3:.0f} ms, "
          f"priority {prio_p99 * 1e3:.0f} ms")
    assert prio_p99 < 0.5 * fcfs_p99
    _, alone = simulate([SHORT])
    assert p99_ttft(alone, "short") < prio_p99 <= fcfs_p99   # the flood hurts; priority limits the harm


def test_tight_pool_preempts_but_never_overflows_and_everything_finishes():
    workload, result = simulate([RequestClass("x", num_requests=60, input_len=300, output_len=200, range_ratio=0.5)],
                                num_blocks=200)
    assert result.num_preemptions > 0
    assert max(s.used_blocks for s in result.timeline) <= result.usable_blocks == 199
    assert len(result.requests) == len(workload) and not result.rejected
    wanted = {r.request_id: r.max_tokens for r in workload}
    for req in result.requests:
        assert req.status == RequestStatus.FINISHED_LENGTH
        assert req.num_output_tokens == wanted[req.request_id]
        assert req.metrics.arrival_time <= req.metrics.first_token_time <= req.metrics.finished_time <= result.end


def test_same_seed_same_run_other_seed_other_run():
    def fingerprint(seed):
        _, r = simulate([SHORT, LONG_FLOOD], "priority", seed=seed, check=False)
        return [(q.request_id, q.metrics.first_token_time, q.metrics.finished_time) for q in r.requests]
    assert fingerprint(3) == fingerprint(3)
    assert fingerprint(3) != fingerprint(4)


def test_requests_too_big_for_the_pool_are_rejected_not_hung():
    _, result = simulate([RequestClass("big", num_requests=3, input_len=1000, output_len=100)], num_blocks=50)
    assert len(result.rejected) == 3 and "KV blocks" in result.rejected[0][1]
    assert "failed" in format_report(result) and class_stats(result)[0].failed == 3


def test_timeouts_use_the_virtual_clock():
    workload = generate([RequestClass("x", num_requests=40, input_len=500, output_len=400)], 1000, set())
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=4, max_model_len=4096)
    result = Simulator(cfg, 4096, 16, COST, timeout_s=2.0).run(workload)
    timed_out = [r for r in result.requests if r.status == RequestStatus.FINISHED_ABORTED]
    assert timed_out and all(r.stop_reason == "timeout" for r in timed_out)
    assert result.end > 2.0


def test_random_dataset_draws_follow_the_benchmark_recipe():
    c = RequestClass("r", num_requests=50, input_len=100, output_len=20, range_ratio=0.5, prefix_len=7)
    reqs = sorted(generate([c], vocab_size=500, special_ids={0, 1, 2}, seed=5), key=lambda r: int(r.request_id[2:]))
    rng = np.random.default_rng(5)
    input_lens, output_lens = rng.integers(50, 151, size=50), rng.integers(10, 31, size=50)
    offsets = rng.integers(0, 500, size=50)
    allowed = np.arange(3, 500)
    prefix = allowed[rng.integers(0, len(allowed), size=7)].tolist()
    for i, r in enumerate(reqs):
        body = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        assert r.prompt_token_ids == prefix + body and r.max_tokens == output_lens[i]
        assert r.arrival_time == 0.0


def test_arrivals_poisson_and_bursty():
    def gaps(burstiness):
        c = RequestClass("p", num_requests=4000, request_rate=10.0, burstiness=burstiness, start=3.0, input_len=4,
                         output_len=1)
        t = np.array([r.arrival_time for r in generate([c], 100, set())])
        assert t[0] == 3.0
        return np.diff(t)
    poisson, bursty = gaps(1.0), gaps(0.25)
    assert np.allclose(gaps(float("inf")), 0.1)                           # the gamma's limit: evenly spaced
    assert poisson.mean() == pytest.approx(0.1, rel=0.05) and bursty.mean() == pytest.approx(0.1, rel=0.1)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.1)    # CV of exponential gaps
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)     # 1/sqrt(shape)


def test_parse_class():
    base = RequestClass(input_len=77, output_len=5)
    c = parse_class("chat:n=10,rate=2.5,in=128,priority=-1,dist=lognormal,range=0.8", base)
    assert (c.name, c.num_requests, c.request_rate, c.input_len, c.output_len, c.priority, c.dist) == \
        ("chat", 10, 2.5, 128, 5, -1, "lognormal")
    assert parse_class("batch", base).input_len == 77
    for bad in ("x:foo=1", "x:n=", ":n=3", "x:dist=zipf", "x:rate=0", "x:rate=nan", "x:burstiness=nan",
                "x:start=nan", "x:start=-1", "x:dist=lognormal,range=nan"):   # NaN arrivals hung the simulator
        with pytest.raises(ValueError):
            parse_class(bad, base)
    lengths = [r.max_tokens for r in generate([parse_class("l:n=3000,out=100,dist=lognormal,range=1", base)], 100,
                                              set())]
    assert np.mean(lengths) == pytest.approx(100, rel=0.1) and max(lengths) > 500


def test_fit_recovers_known_coefficients_despite_outliers():
    rng = np.random.default_rng(0)
    truth = dict(zip(FEATURES, [0.02, 3e-4, 2e-3, 4e-6, 1e-7]))   # every term matters in some steps
    samples, n_hiccups = [], 0
    for _ in range(300):
        prefill = int(rng.integers(1, 2048)) if rng.random() < 0.5 else 0
        shape = StepShape(prefill, int(rng.integers(0, 64)), int(rng.integers(0, 60000)),
                          prefill * int(rng.integers(0, 1000)))
        t = CostModel(truth).step_time(shape) * (1 + 0.02 * rng.standard_normal())
        hiccup = rng.random() < 0.05                                        # a busy machine's hiccups
        n_hiccups += hiccup
        samples.append((shape, t * (5 if hiccup else 1)))
    model = fit(samples)
    for name, value in truth.items():
        assert model.coefficients[name] == pytest.approx(value, rel=0.1), name
    assert model.meta["num_outliers"] == n_hiccups


def test_cost_model_round_trip(tmp_path):
    path = tmp_path / "c.json"
    COST.save(str(path))
    assert CostModel.load(str(path)).coefficients == COST.coefficients
    for bad in ({"coefficients": {"flops": 1}}, [1], {"coefficients": [1]}, {"coefficients": {"step": "fast"}}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="not a cost model"):
            CostModel.load(str(path))


def test_cli_cost_model_that_is_not_json_is_named(tmp_path):
    """json's "Expecting value: line 1 column 1 (char 0)" named no file."""
    for name, data in (("cost.txt", b"step 0.001"), ("cost.bin", b"\xff\xfe")):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ValueError) as e:
            main(["simulate", "--model", "tiny-llama", "--cost-model", str(path)])
        assert str(e.value).startswith(f"--cost-model {path} is not JSON ("), e.value
        assert "as `tokenmill simulate --fit` writes it: {'coefficients': {step, prefill_tokens" in str(e.value)


def test_cli_simulate_table_plot_and_sweep(tmp_path, capsys):
    png = tmp_path / "sim.png"
    main(["simulate", "--model", "llama-3-8b", "--class", "short:n=50,rate=10,in=128,out=32,priority=0",
          "--class", "long:n=5,start=1,in=4000,out=16,priority=1", "--scheduling-policy", "priority",
          "--goodput", "ttft:500", "tpot:50", "--plot", str(png)])
    out = capsys.readouterr().out
    assert "short" in out and "long" in out and "goodput" in out and "KV cache: pool" in out
    assert png.stat().st_size > 10_000
    main(["simulate", "--model", "llama-3-8b", "--num-prompts", "40", "--random-input-len", "2000",
          "--random-output-len", "500", "--kv-tokens", "8000,32000,128000"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:2] == ["blocks", "KV"] and len(lines) == 5
    rows = [line.split() for line in lines[2:]]
    assert int(rows[0][7]) > 0 and int(rows[2][7]) == 0   # preemptions fall as the pool grows


def test_cli_pool_from_a_byte_budget_is_capped_as_the_engine_caps_it(capsys):
    """A KV budget in bytes buys at most max_num_seqs full contexts (ModelRunner._num_blocks): 2 x 256 / 16."""
    main(["simulate", "--model", "llama-3-8b", "--num-prompts", "4", "--random-input-len", "50",
          "--random-output-len", "8", "--kv-cache-memory", str(1 << 40), "--max-num-seqs", "2",
          "--max-model-len", "256"])
    assert "pool 32 blocks x 16" in capsys.readouterr().out


def test_cli_fit_on_a_tiny_dummy_model(tmp_path, capsys):
    path = tmp_path / "cost.json"
    main(["simulate", "--fit", "--load-format", "dummy", "--model-preset", "tiny-llama", "--device", "cpu",
          "--fit-batch-sizes", "1,4", "--fit-prompt-lens", "8,64", "--fit-output-len", "4", "--cost-model", str(path)])
    model = CostModel.load(str(path))
    assert set(model.coefficients) == set(FEATURES) and min(model.coefficients.values()) >= 0
    assert model.meta["device"] == "cpu" and model.meta["num_steps"] > 10
    capsys.readouterr()
    main(["simulate", "--load-format", "dummy", "--model-preset", "tiny-llama", "--cost-model", str(path),
          "--num-prompts", "10", "--random-input-len", "50", "--random-output-len", "10"])
    out = capsys.readouterr().out
    assert f"pool {model.meta['num_blocks'] - 1:,} blocks" in out   # the fitted engine's pool by default


def test_cli_zero_prompts_is_a_message_not_a_traceback():
    """It was an IndexError in the report: zero prompts leave nothing to report, so the flag is refused."""
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "simulate", "--model", "llama-3-8b", "--num-prompts",
                        "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "tokenmill: error: --num-prompts must be at least 1, got 0" in r.stderr


@pytest.mark.parametrize("flags, match", [
    (["--class", "a:n=0", "--class", "b:n=0"], "no requests: every --class has n=0"),   # IndexError in the report
    (["--seed", "-1"], "--seed must be at least 0, got -1"),                            # numpy's "non-negative"
    (["--kv-tokens", "0"], "--kv-tokens must be at least 1, got 0"),                    # "got 1" block
    (["--max-model-len", "-1"], "max_model_len must be an integer >= 1"),               # ZeroDivisionError
    (["--goodput", "ttft:nan"], "--goodput takes NAME:MILLISECONDS"),                   # "ttft <= nan ms"
    (["--fit", "--fit-batch-sizes", "0"], "--fit-batch-sizes must be at least 1, got 0"),   # IndexError
    (["--fit", "--fit-prompt-lens", ""], "--fit-prompt-lens needs at least one value"),     # IndexError
    # a pool sized for contexts the engine refuses
    (["--max-model-len", "100000"], "max_model_len=100000 exceeds the model's max_position_embeddings 4096"),
])
def test_cli_bad_numbers_are_refused_before_anything_is_built(flags, match):
    with pytest.raises(ValueError, match=match):
        main(["simulate", "--model", "tiny-llama", *flags])


def test_cli_a_class_of_zero_requests_in_a_mix_is_switched_off(capsys):
    main(["simulate", "--model", "llama-3-8b", "--class", "off:n=0", "--class", "on:n=3,in=20,out=4"])
    out = capsys.readouterr().out
    assert "on " in out and "off" not in out
