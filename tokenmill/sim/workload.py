"""Synthetic workloads: one or more request classes, each with its own arrival process and length distributions.

A class is the random dataset of the serving benchmark (BENCHMARKS.md, workload 3), drawn the same way from
numpy.random.default_rng(seed + class index): input lengths uniform in [floor(L(1-r)), ceil(L(1+r))], output
lengths uniform in [max(1, floor(O(1-r))), max(1, ceil(O(1+r)))], an offset per request, a shared random prefix,
prompt body = allowed_ids[(offset + i + arange(len)) % len(allowed_ids)]. Lengths are token counts as the engine
sees them (no tokenizer round trip, so no special tokens are subtracted). `dist=lognormal` instead draws lengths
as L·exp(r·z − r²/2) (mean L, log-spread r), for heavy-tailed chat traffic. Arrivals: all at `start` (rate inf)
or gamma gaps with shape = burstiness (1 = Poisson, inf = evenly spaced) and scale = 1/(rate·burstiness), first
request at `start`."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from tokenmill.config import ModelConfig

# short key in a --class spec -> RequestClass field
CLASS_KEYS = {"n": "num_requests", "rate": "request_rate", "burstiness": "burstiness", "start": "start",
              "in": "input_len", "out": "output_len", "range": "range_ratio", "prefix": "prefix_len",
              "priority": "priority", "dist": "dist"}


@dataclass
class RequestClass:
    name: str = "all"
    num_requests: int = 200
    request_rate: float = math.inf      # requests per second; inf = all at `start`
    burstiness: float = 1.0             # gamma shape of the gaps; 1 = Poisson, < 1 burstier, inf = even
    start: float = 0.0                  # seconds after the beginning when this class starts arriving
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0            # uniform: lengths within ±r of the mean; lognormal: σ of log length
    prefix_len: int = 0                 # random tokens shared by every prompt of the class
    priority: int = 0                   # lower = more urgent (scheduling_policy priority)
    dist: str = "uniform"               # uniform | lognormal

    def __post_init__(self) -> None:
        if self.num_requests < 0 or self.input_len < 1 or self.output_len < 1 or self.prefix_len < 0:
            raise ValueError(f"class {self.name}: n >= 0, in >= 1, out >= 1 and prefix >= 0 are required")
        if not (self.request_rate > 0 and self.burstiness > 0):   # NaN too: a NaN arrival never comes
            raise ValueError(f"class {self.name}: rate and burstiness must be > 0, got {self.request_rate} and "
                             f"{self.burstiness}")
        if not 0.0 <= self.start < math.inf:
            raise ValueError(f"class {self.name}: start must be a finite number of seconds >= 0, got {self.start}")
        if self.dist not in ("uniform", "lognormal"):
            raise ValueError(f"class {self.name}: dist must be uniform or lognormal, got {self.dist!r}")
        if self.dist == "uniform" and not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"class {self.name}: range must be in [0, 1) for dist=uniform, got {self.range_ratio}")
        if self.dist == "lognormal" and not 0.0 <= self.range_ratio < math.inf:
            raise ValueError(f"class {self.name}: range must be a finite number >= 0 for dist=lognormal, got "
                             f"{self.range_ratio}")


@dataclass
class SimRequest:
    request_id: str
    cls: str
    arrival_time: float
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int


def parse_class(spec: str, defaults: RequestClass) -> RequestClass:
    """'short:n=400,rate=8,in=128,out=64,priority=-1' -> RequestClass; unnamed keys take `defaults`."""
    name, _, body = spec.partition(":")
    if not name:
        raise ValueError(f"--class {spec!r}: expected NAME:key=value,... with keys {', '.join(CLASS_KEYS)}")
    values = {"name": name}
    types = {f.name: f.type for f in dataclasses.fields(RequestClass)}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        if key not in CLASS_KEYS or not value:
            raise ValueError(f"--class {spec!r}: unknown or empty key {key!r}; keys: {', '.join(CLASS_KEYS)}")
        field = CLASS_KEYS[key]
        values[field] = value if types[field] == "str" else float(value) if types[field] == "float" else int(value)
    return dataclasses.replace(defaults, **values)


def special_ids(config: ModelConfig) -> set[int]:
    """Ids kept out of prompt bodies: the model's BOS and EOS tokens."""
    return set(config.eos_token_id) | ({config.bos_token_id} if config.bos_token_id is not None else set())


def _lengths(rng: np.random.Generator, mean: int, r: float, n: int, dist: str, low: int = 1) -> np.ndarray:
    if dist == "lognormal":
        return np.maximum(low, np.rint(mean * np.exp(r * rng.standard_normal(n) - r * r / 2))).astype(np.int64)
    lo, hi = max(math.floor(mean * (1 - r)), low), max(math.ceil(mean * (1 + r)), low)
    return rng.integers(lo, hi + 1, size=n)


def _arrivals(c: RequestClass, rng: np.random.Generator) -> np.ndarray:
    if math.isinf(c.request_rate) or c.num_requests == 0:
        return np.full(c.num_requests, c.start)
    if math.isinf(c.burstiness):   # the gamma's limit, as in `bench serve`: evenly spaced (the draw would be NaN)
        gaps = np.full(c.num_requests, 1.0 / c.request_rate)
    else:
        gaps = rng.gamma(shape=c.burstiness, scale=1.0 / (c.request_rate * c.burstiness), size=c.num_requests)
    return c.start + np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def generate(classes: list[RequestClass], vocab_size: int, special_ids: set[int], seed: int = 0) -> list[SimRequest]:
    """All requests of all classes, in arrival order; the same seed gives the same workload."""
    allowed = np.array(sorted(set(range(vocab_size)) - special_ids))
    out: list[SimRequest] = []
    for k, c in enumerate(classes):
        rng = np.random.default_rng(seed + k)
        input_lens = _lengths(rng, c.input_len, c.range_ratio, c.num_requests, c.dist, low=0 if c.prefix_len else 1)
        output_lens = _lengths(rng, c.output_len, c.range_ratio, c.num_requests, c.dist)
        offsets = rng.integers(0, vocab_size, size=c.num_requests)
        prefix = allowed[rng.integers(0, len(allowed), size=c.prefix_len)].tolist() if c.prefix_len else []
        arrivals = _arrivals(c, np.random.default_rng([seed, k]))
        for i in range(c.num_requests):
            body = allowed[(int(offsets[i]) + i + np.arange(int(input_lens[i]))) % len(allowed)].tolist()
            out.append(SimRequest(f"{c.name}-{i}", c.name, float(arrivals[i]), prefix + body, int(output_lens[i]),
                                  c.priority))
    out.sort(key=lambda r: r.arrival_time)
    return out
