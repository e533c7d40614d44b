"""SamplingParams: what a request asks of the sampler, validated with clear errors."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's bound on a logit_bias value
MAX_LOGPROBS = 20  # alternatives a position may list (OpenAI's bound, vLLM's default)


def truncated_prompt(ids: list[int], truncate_prompt_tokens: int, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last this many tokens, -1 being the model's context length."""
    return ids[-(max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens):]


class RequestOutputKind(enum.Enum):
    """When the engine reports a request: every step (the text so far and the new delta, for streaming), or only
    once it has finished (offline generate, which saves building an output per request per step)."""

    CUMULATIVE = "cumulative"
    FINAL_ONLY = "final_only"


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: logprobs of the prompt's tokens (and this many alternatives)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens can be sampled
    # vLLM's: words the output may not contain: a word's last token cannot follow the rest of its tokens
    bad_words: list[str] | None = None
    # the token sequences of bad_words, as the engine's tokenizer spells them (with and without a leading space)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    truncate_prompt_tokens: int | None = None  # vLLM's: keep only the prompt's last this many tokens (-1: context)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):  # checked before list() would fail on them with a TypeError
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                self._fail(name, value, "a list" + (" of strings, or a string" if name == "stop" else " of token ids"))
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        seqs = self.bad_words_token_ids
        if not isinstance(seqs, (list, tuple)) or not all(
                isinstance(ids, (list, tuple)) and ids and all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids) for ids in seqs):
            self._fail("bad_words_token_ids", seqs, "a list of non-empty lists of token ids")
        self.bad_words_token_ids = [list(ids) for ids in seqs]
        self._validate()
        self.logit_bias = self._checked_logit_bias()

    @staticmethod
    def _fail(name: str, value: object, allowed: str) -> None:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")

    def _validate(self) -> None:
        def is_num(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            self._fail("n", self.n, "an integer >= 1")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            self._fail("temperature", self.temperature, "a number in [0, 100]")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            self._fail("top_p", self.top_p, "a number in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            self._fail("top_k", self.top_k, "-1 or 0 (disabled) or an integer >= 1")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            self._fail("min_p", self.min_p, "a number in [0, 1]")
        if not is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            self._fail("repetition_penalty", self.repetition_penalty, "a number in (0, 10]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2.0 <= v <= 2.0:
                self._fail(name, v, "a number in [-2, 2]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2 ** 63):
            self._fail("seed", self.seed, "None or an integer in [0, 2**63)")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 1):
            self._fail("max_tokens", self.max_tokens, "None or an integer >= 1")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0 or (
                self.max_tokens is not None and self.min_tokens > self.max_tokens):
            self._fail("min_tokens", self.min_tokens, "an integer in [0, max_tokens]")
        if not all(isinstance(s, str) and s for s in self.stop):
            self._fail("stop", self.stop, "a non-empty string or a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            self._fail("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
                self._fail(name, v, f"None or an integer in [0, {MAX_LOGPROBS}]")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):  # "no" would be truthy
            if not isinstance(getattr(self, name), bool):
                self._fail(name, getattr(self, name), "True or False")
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple)) or not all(
                isinstance(w, str) and w.strip() for w in self.bad_words)):
            self._fail("bad_words", self.bad_words, "None or a list of words (strings with more than whitespace)")
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, (list, tuple)) or not allowed or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in allowed):
                self._fail("allowed_token_ids", allowed, "None or a non-empty list of non-negative token ids")
            self.allowed_token_ids = sorted(set(allowed))
        keep = self.truncate_prompt_tokens
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep == 0 or keep < -1):
            self._fail("truncate_prompt_tokens", self.truncate_prompt_tokens,
                       "None, -1 (the model's context length) or an integer >= 1")
        if not isinstance(self.output_kind, RequestOutputKind):
            self._fail("output_kind", self.output_kind, "a RequestOutputKind")

    def _checked_logit_bias(self) -> dict[int, float] | None:
        """A copy with float values, or None for an empty map: the sampler then skips the request at no cost."""
        bias = self.logit_bias
        if bias is None:
            return None
        if not isinstance(bias, dict):
            self._fail("logit_bias", bias, "None or a dict mapping token ids to biases")
        for token_id, value in bias.items():
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
            # NaN and infinities fail the range test; a huge int is compared without overflowing a float
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT):
                raise ValueError(f"logit_bias values must be finite numbers in [-{LOGIT_BIAS_LIMIT:g}, "
                                 f"{LOGIT_BIAS_LIMIT:g}], got {value!r} for token {token_id}")
        return {token_id: float(value) for token_id, value in bias.items()} or None

    def verify_vocab(self, vocab_size: int) -> None:
        """Token ids checked against the model's vocabulary, which SamplingParams is built without: the engine
        calls this when the request arrives, so a bad id is the caller's ValueError, not a failing step."""
        for name, ids in (("logit_bias", self.logit_bias or ()), ("stop_token_ids", self.stop_token_ids),
                          ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("bad_words_token_ids", [t for ids in self.bad_words_token_ids for t in ids])):
            bad = sorted(t for t in ids if t >= vocab_size)
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {vocab_size}) (the model's vocabulary), "
                                 f"got {bad[:5]}")

    def banned_before_min_tokens(self, eos_token_ids: list[int]) -> list[int]:
        """The ids that cannot be sampled before min_tokens outputs: stop_token_ids, and EOS unless ignore_eos."""
        return list(self.stop_token_ids) + ([] if self.ignore_eos else list(eos_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1
