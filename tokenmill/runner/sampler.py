"""Batched sampling on the device: logit_bias, penalties, temperature, top-k / top-p / min-p, per-request seeds,
logprobs. Sampling uses the exponential-race form (argmax of p / Exp(1) noise) so a seeded request
draws its noise from its own generator and gets the same tokens whatever batch it is in."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.kernels import get_ops
from tokenmill.outputs import Logprob
from tokenmill.request import Request
from tokenmill.runner.staging import device_tensor


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprob | None]
    prompt_logprobs: list[tuple[Request, list[Logprob]]] = field(default_factory=list)  # the runner's, this step


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        ops = get_ops(device)
        self.argmax = ops.argmax  # torch's reduces a row of 128k logits in one block: 27 us on an H200
        self.race_argmax = ops.race_argmax
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def compile(self, logits: torch.Tensor) -> None:
        """Run argmax and race_argmax once on logits as the LM head gives them (their Triton kernels specialize on
        the shapes' divisibility), drawing nothing from the generators."""
        logits = logits[:, : self.vocab_size]
        self.argmax(logits)
        self.race_argmax(logits, torch.ones(logits.shape[0], device=logits.device), torch.ones_like(logits))

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

    @staticmethod
    def _apply_allowed_token_ids(logits: torch.Tensor, reqs: list[Request]) -> None:
        """Every token outside a request's allowed_token_ids to -inf. A draft model's smaller vocabulary may hold
        none of them: its row is left as it is (verification against the target still masks them)."""
        for i, r in enumerate(reqs):
            allowed = r.sampling_params.allowed_token_ids
            if allowed is None or allowed[0] >= logits.shape[1]:
                continue
            keep = device_tensor([t for t in allowed if t < logits.shape[1]], torch.long, logits.device)
            row = logits[i]
            kept = row[keep]
            row.fill_(float("-inf"))
            row[keep] = kept

    def _apply_bad_words(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """vLLM's bad words: a sequence's last token to -inf where the output ends with the rest of it (always, for
        a one-token word). A drafted view's output holds its drafts, so each draft position is masked as decoding
        would mask it. Where a request's longer words would ban every token its allowed_token_ids leaves (which
        no check on arrival can foresee), they are lifted for that step: allowed_token_ids stays the hard limit,
        where an all -inf row would be answered with a token outside it (vLLM's is)."""
        rows, cols = [], []
        for i, r in enumerate(reqs):
            seqs = r.sampling_params.bad_words_token_ids
            if not seqs:
                continue
            out = r.output_token_ids
            banned = []
            for ids in seqs:
                prefix = len(ids) - 1
                if ids[-1] < logits.shape[1] and (not prefix or (len(out) >= prefix and out[-prefix:] == ids[:-1])):
                    banned.append((prefix, ids[-1]))
            if self._leaves_no_allowed_token(r, {t for _, t in banned}, logits.shape[1]):
                banned = [(prefix, t) for prefix, t in banned if not prefix]
            rows += [i] * len(banned)
            cols += [t for _, t in banned]
        if rows:
            index = device_tensor([rows, cols], torch.long, logits.device)
            logits.index_put_((index[0], index[1]), logits.new_full((len(rows),), float("-inf")))

    def _leaves_no_allowed_token(self, req: Request, banned: set[int], vocab: int) -> bool:
        """Whether banning these ids (and, before min_tokens, the stop ids) leaves none of the request's
        allowed_token_ids (False where it has none, or they lie past this sampler's vocabulary)."""
        p = req.sampling_params
        if p.allowed_token_ids is None or p.allowed_token_ids[0] >= vocab:
            return False
        if req.num_output_tokens < p.min_tokens:
            banned = banned | set(p.banned_before_min_tokens(self.eos_token_ids))
        return all(t in banned for t in p.allowed_token_ids if t < vocab)

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
                ids = [t for t in p.banned_before_min_tokens(self.eos_token_ids) if t < logits.shape[1]]
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
        greedy = [r.sampling_params.greedy for r in reqs]
        if all(greedy):
            return self.argmax(logits, out), raw_logprobs
        if not any(greedy):
            return self.draw(logits, reqs, out), raw_logprobs
        tokens = torch.where(device_tensor(greedy, torch.bool, logits.device), self.argmax(logits),
                             self.draw(logits, reqs))
        return (tokens if out is None else out.copy_(tokens)), raw_logprobs

    def process(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Cut to the vocabulary, apply allowed_token_ids, bad words, logit_bias, penalties and min_tokens in place,
        in vLLM's order; also the raw log-softmax (before any of them: vLLM's default logprobs mode) when a request
        asks for logprobs. Speculative verification and the draft proposer share this, so their distributions are
        exactly the one sampled here."""
        logits = logits[:, : self.vocab_size]
        want = any(r.sampling_params.logprobs is not None for r in reqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want else None
        self._apply_allowed_token_ids(logits, reqs)
        self._apply_bad_words(logits, reqs)
        self._apply_logit_bias(logits, reqs)
        self._apply_penalties(logits, reqs)
        self._suppress_stop_tokens(logits, reqs)
        return logits, raw_logprobs

    def probs(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        """Temperature (1 for greedy rows), top-k / top-p / min-p, softmax."""
        return torch.softmax(self._filter(logits * _inv_temps(params, logits.device)[:, None], params), dim=-1)

    def draw(self, logits: torch.Tensor, reqs: list[Request], out: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row from the distribution probs() gives, without computing it: the race in log form,
        argmax(logits / T - log E) over the tokens the filters keep (race_argmax, one pass over the logits),
        with race()'s noise. Plain decoding and the verification of a seeded request's n-gram drafts both draw
        here, so that request's tokens are the same with drafts or without."""
        params = [r.sampling_params for r in reqs]
        inv_temps = _inv_temps(params, logits.device)
        if self._filters(params, logits.shape[1]):  # the filters cut the scaled logits: the race scales no more
            logits = self._filter(logits * inv_temps[:, None], params)
            inv_temps = torch.ones_like(inv_temps)
        return self.race_argmax(logits, inv_temps, self.noise(logits, reqs), out)

    def race(self, probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """One token per row drawn from probs: argmax(p / E), E ~ Exp(1) (noise())."""
        return self.argmax(probs / self.noise(probs, reqs))

    def noise(self, like: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Exp(1) draws of like's shape: unseeded rows from the sampler's generator, a seeded request's row from
        its own, one row a draw, so its tokens do not depend on its batch mates."""
        unseeded = [i for i, r in enumerate(reqs) if r.sampling_params.seed is None]
        if len(unseeded) == len(reqs):
            return torch.empty_like(like).exponential_(generator=self.generator)
        noise = torch.empty_like(like)
        if unseeded:
            noise[device_tensor(unseeded, torch.long, like.device)] = torch.empty(
                len(unseeded), like.shape[1], dtype=like.dtype, device=like.device).exponential_(
                generator=self.generator)
        for i, r in enumerate(reqs):
            if r.sampling_params.seed is not None:
                noise[i].exponential_(generator=self.request_generator(r))
        return noise

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
            chosen = row[token_list[i]]
            out[i] = Logprob(token_list[i], float(chosen), top, int((row > chosen).sum()) + 1)
        return out

    @staticmethod
    def _filters(params: list, vocab: int) -> bool:
        """Whether any row has a top-k, top-p or min-p that can cut a token."""
        return any(0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p for p in params)

    @staticmethod
    def _filter(logits: torch.Tensor, params: list) -> torch.Tensor:
        """top-k, then top-p, then min-p, as vLLM orders them."""
        if not Sampler._filters(params, logits.shape[1]):
            return logits
        top_k = [min(p.top_k, logits.shape[1]) if p.top_k > 0 else logits.shape[1] for p in params]  # int64-safe
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        dev = logits.device
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=dev)[None, :]
        k = device_tensor(top_k, torch.long, dev)[:, None]
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        p = device_tensor(top_p, torch.float32, dev)[:, None]  # a top_p below float32's least is 0 here
        sorted_logits = sorted_logits.masked_fill((cum >= p) & (ranks > 0), float("-inf"))  # the first always stays
        mp = device_tensor(min_p, torch.float32, dev)[:, None]
        sorted_logits = sorted_logits.masked_fill(probs < mp * probs[:, :1], float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)


def _inv_temps(params: list, device: torch.device) -> torch.Tensor:
    """1 / temperature a row, float32 (1 for greedy rows): the one temperature scaling of probs() and draw()."""
    return device_tensor([1.0 if p.greedy else 1.0 / p.temperature for p in params], torch.float32, device)
