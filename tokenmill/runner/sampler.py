"""Batched sampling on the device: logit_bias, penalties, temperature, top-k / top-p / min-p, per-request seeds,
logprobs. Sampling uses the exponential-race form (argmax of p / Exp(1) noise) so a seeded request
draws its noise from its own generator and gets the same tokens whatever batch it is in."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels import get_ops
from tokenmill.outputs import Logprob
from tokenmill.request import Request
from tokenmill.runner.staging import device_tensor


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprob | None]


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.argmax = get_ops(device).argmax  # torch's reduces a row of 128k logits in one block: 27 us on an H200
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def request_generator(self, req: Request) -> torch.Generator:
        gen = self.request_generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(req.sampling_params.seed)
            self.request_generators[req.request_id] = gen
        return gen

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, reqs: list[Request]) -> None:
        """Each request's logit_bias added to its row: one index_put_ for the batch, over the biased entries only.
        Ids past this sampler's vocabulary (a draft model's may be smaller than the target's) are left out."""
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        vocab = logits.shape[1]
        for i, r in enumerate(reqs):
            bias = r.sampling_params.logit_bias
            if not bias:
                continue
            if max(bias) >= vocab:
                bias = {t: b for t, b in bias.items() if t < vocab}
            rows += [i] * len(bias)
            cols += bias.keys()
            vals += bias.values()
        if rows:
            index = device_tensor([rows, cols], torch.long, logits.device)
            logits.index_put_((index[0], index[1]), device_tensor(vals, logits.dtype, logits.device), accumulate=True)

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        rows = [i for i, r in enumerate(reqs) if r.sampling_params.repetition_penalty != 1.0
                or r.sampling_params.presence_penalty or r.sampling_params.frequency_penalty]
        for i in rows:
            p = reqs[i].sampling_params
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = device_tensor(sorted(t for t in set(reqs[i].all_token_ids) if t < row.shape[0]), torch.long,
                                     logits.device)
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and reqs[i].output_token_ids:
                out = device_tensor(reqs[i].output_token_ids, torch.long, logits.device)
                counts = torch.zeros_like(row).scatter_add_(0, out, torch.ones_like(out, dtype=row.dtype))
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    def _suppress_stop_tokens(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """Before min_tokens outputs, EOS and stop token ids cannot be chosen. One index_put_ for the batch, its
        values filled on the device: a Python scalar as the value would be copied from pageable memory, which
        waits for the GPU."""
        rows, cols = [], []
        for i, r in enumerate(reqs):
            p = r.sampling_params
            if r.num_output_tokens < p.min_tokens:
                ids = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                ids = [t for t in ids if t < logits.shape[1]]
                rows += [i] * len(ids)
                cols += ids
        if rows:
            index = device_tensor([rows, cols], torch.long, logits.device)
            logits.index_put_((index[0], index[1]), logits.new_full((len(rows),), float("-inf")))

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        """logits: float32 [len(reqs), vocab] (rows past vocab_size, if any, are cut)."""
        tokens, raw_logprobs = self.sample(logits, reqs)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self.logprobs(raw_logprobs, token_list, reqs))

    def sample(self, logits: torch.Tensor, reqs: list[Request],
               out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens (and raw logprobs if asked) on the device, nothing read back: async scheduling feeds the
        tokens to the next step before the host sees them (from out, a fixed buffer a CUDA graph reads)."""
        logits, raw_logprobs = self.process(logits, reqs)
        params = [r.sampling_params for r in reqs]
        tokens = self.argmax(logits, out)
        if not all(p.greedy for p in params):
            greedy = device_tensor([p.greedy for p in params], torch.bool, logits.device)
            sampled = self.race(self.probs(logits, params), reqs)
            tokens = torch.where(greedy, tokens, sampled)
            if out is not None:
                tokens = out.copy_(tokens)
        return tokens, raw_logprobs

    def process(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cut to the vocabulary, apply logit_bias, penalties and min_tokens in place, in vLLM's order; also the
        raw log-softmax (before any of them: vLLM's default logprobs mode) when a request asks for logprobs.
        Speculative verification and the draft proposer share this, so their distributions are exactly the
        one sampled here."""
        logits = logits[:, : self.vocab_size]
        want = any(r.sampling_params.logprobs is not None for r in reqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want else None
        self._apply_logit_bias(logits, reqs)
        self._apply_penalties(logits, reqs)
        self._suppress_stop_tokens(logits, reqs)
        return logits, raw_logprobs

    def probs(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        """Temperature (1 for greedy rows), top-k / top-p / min-p, softmax."""
        temps = device_tensor([1.0 if p.greedy else p.temperature for p in params], torch.float32, logits.device)
        return torch.softmax(self._filter(logits / temps[:, None], params), dim=-1)

    def race(self, probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """One token per row drawn from probs: argmax(p / E), E ~ Exp(1), seeded rows from their own generator."""
        unseeded = [i for i, r in enumerate(reqs) if r.sampling_params.seed is None]
        if len(unseeded) == len(reqs):
            return self.argmax(probs / torch.empty_like(probs).exponential_(generator=self.generator))
        noise = torch.empty_like(probs)
        if unseeded:
            noise[device_tensor(unseeded, torch.long, probs.device)] = torch.empty(
                len(unseeded), probs.shape[1], device=probs.device).exponential_(generator=self.generator)
        for i, r in enumerate(reqs):
            if r.sampling_params.seed is not None:
                noise[i].exponential_(generator=self.request_generator(r))
        return self.argmax(probs / noise)

    @staticmethod
    def logprobs(raw_logprobs: torch.Tensor | None, token_list: list[int], reqs: list[Request]) -> list[Logprob | None]:
        out: list[Logprob | None] = [None] * len(reqs)
        if raw_logprobs is None:
            return out
        for i, r in enumerate(reqs):
            k = r.sampling_params.logprobs
            if k is None:
                continue
            row = raw_logprobs[i]
            top = {}
            if k > 0:
                vals, idx = row.topk(k)
                top = dict(zip(idx.tolist(), vals.tolist()))
            out[i] = Logprob(token_list[i], float(row[token_list[i]]), top)
        return out

    @staticmethod
    def _filter(logits: torch.Tensor, params: list) -> torch.Tensor:
        """top-k, then top-p, then min-p, as vLLM orders them."""
        top_k = [min(p.top_k, logits.shape[1]) if p.top_k > 0 else logits.shape[1] for p in params]  # int64-safe
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if all(k >= logits.shape[1] for k in top_k) and all(p >= 1.0 for p in top_p) and not any(min_p):
            return logits
        dev = logits.device
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=dev)[None, :]
        k = device_tensor(top_k, torch.long, dev)[:, None]
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        p = device_tensor(top_p, torch.float32, dev)[:, None]
        sorted_logits = sorted_logits.masked_fill(cum >= p, float("-inf"))
        mp = device_tensor(min_p, torch.float32, dev)[:, None]
        sorted_logits = sorted_logits.masked_fill(probs < mp * probs[:, :1], float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)
