"""The benchmark workloads of shared BENCHMARKS.md, drawn exactly as written there so figures stay comparable."""
from __future__ import annotations

import random
from dataclasses import dataclass

from tokenmill.tokenizer import Tokenizer

# Workload 5: short chat questions; with SmolLM2's template (system prompt included) each renders to ~40 tokens.
CHAT_QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain in one sentence what a CPU does.",
    "List three primary colors.", "Why is the sky blue?", "Give me a tip for learning to cook.",
    "What does a compiler do?", "Name three planets of the solar system.", "How do bees make honey?",
    "Suggest a name for a small grey cat.", "What is the boiling point of water at sea level?",
    "Describe a rainy morning in two sentences.", "What is photosynthesis?", "How many legs does a spider have?",
    "Write a short greeting for a birthday card.", "What is the difference between weather and climate?",
    "Recommend a book for a long train ride.", "Why do leaves change color in autumn?",
    "What is a prime number?", "Explain gravity to a child.", "What are the ingredients of a pancake?",
    "Translate 'good morning' into Spanish.", "What is the largest ocean on Earth?",
    "Give two reasons to drink more water.", "What is an algorithm?", "Write a one-line poem about the moon.",
    "How does a bicycle stay upright?", "What causes the seasons?", "Name a famous painting and its painter.",
    "What is the tallest mountain in the world?", "How do I make a cup of tea?", "What is a black hole?",
]


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


def nano_vllm_workload(num_requests: int = 256, max_input_len: int = 1024, max_output_len: int = 1024,
                       min_input_len: int = 100, min_output_len: int = 100, vocab_size: int = 10001,
                       seed: int = 0) -> Workload:
    """Workload 2, nano-vllm's bench.py draw for draw: with the defaults, 256 prompts of U[100, 1024] tokens in
    [0, 10000], then 256 max_tokens in U[100, 1024] (133,966 output tokens). Shrunk runs cap each lower bound at its
    upper one; a vocabulary smaller than 10001 caps the token ids."""
    rng = random.Random(seed)  # the same stream as random.seed(seed) + random.randint
    top_id = min(10000, vocab_size - 1)
    lo_in, lo_out = min(min_input_len, max_input_len), min(min_output_len, max_output_len)
    prompts = [[rng.randint(0, top_id) for _ in range(rng.randint(lo_in, max_input_len))]
               for _ in range(num_requests)]
    max_tokens = [rng.randint(lo_out, max_output_len) for _ in range(num_requests)]
    return Workload(prompts, max_tokens)


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(length)]


def chat_prompts(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    """Workload 5's prompts: `count` chat-templated user questions (cycling through the list)."""
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                             add_special_tokens=False)
            for q in (CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] for i in range(count))]
