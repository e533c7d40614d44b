"""The simulator against the real engine on the CPU: fit the cost model on a small profile of the default model,
run a steady workload on both, and require the simulator's TTFT and TPOT medians within 25% of the engine's.
The machine is shared and its speed drifts, so profiling and the real runs are interleaved: profile, half the
workload, profile, the other half, profile."""
import time

import numpy as np
import pytest
import torch

from tokenmill.config import SchedulerConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sim.fit import fit, profile, profile_phases
from tokenmill.sim.replay import replay
from tokenmill.sim.report import class_stats
from tokenmill.sim.simulator import Simulator
from tokenmill.sim.workload import RequestClass, generate, special_ids

TOLERANCE = 0.25   # the bound


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine, two spinning threads make step times erratic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pooled_median(results, metric):
    return float(np.median([v for r in results for v in getattr(class_stats(r)[0], metric)]))


def test_simulator_matches_engine_medians(one_thread):
    t_start = time.monotonic()
    engine = LLMEngine.from_engine_args(max_model_len=512, max_num_batched_tokens=256, dtype="bfloat16")
    vocab, special = engine.model_config.vocab_size, special_ids(engine.model_config)
    phases = profile_phases(batch_sizes=[1, 2, 4], prompt_lens=[32, 64, 128], output_len=10, vocab_size=vocab,
                            special_ids=special)
    steady = RequestClass("steady", num_requests=12, request_rate=1.2, burstiness=4.0, input_len=64, output_len=16,
                          range_ratio=0.25)
    halves = [generate([steady], vocab, special, seed=s) for s in (1, 2)]
    samples, real, real_s = profile(engine, phases[0::3]), [], 0.0
    for half, more in zip(halves, (phases[1::3], phases[2::3])):
        t0 = time.monotonic()
        real.append(replay(engine, half)[0])
        real_s += time.monotonic() - t0
        samples += profile(engine, more)
    cost = fit(samples)
    sched = engine.scheduler.config
    config = SchedulerConfig(**{k: getattr(sched, k) for k in sched.__dataclass_fields__})
    sim = [Simulator(config, engine.kv_cache.num_blocks, engine.kv_cache.block_size, cost).run(h) for h in halves]
    print(f"\nprofile and fit {time.monotonic() - t_start - real_s:.1f} s ({cost.meta['num_steps']} steps, median "
          f"error {cost.meta['median_rel_error']:.1%}), real runs {real_s:.1f} s; coefficients {cost.coefficients}")
    assert all(class_stats(r)[0].finished == len(h) for r, h in zip(real + sim, halves + halves))
    for metric in ("ttft", "tpot"):
        r, s = pooled_median(real, metric), pooled_median(sim, metric)
        print(f"{metric} median: real {r * 1e3:.1f} ms, simulated {s * 1e3:.1f} ms")
        assert abs(s - r) <= TOLERANCE * r, metric
