"""Text <-> token ids and chat prompts, over a `tokenizers.Tokenizer`, built from a Hugging Face folder
(tokenizer.json + tokenizer_config.json) or rebuilt from a GGUF file's vocabulary, so that both give the ids
transformers' AutoTokenizer gives."""
from __future__ import annotations

import functools
import json
import os
import re
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from gguf import GGUFReader
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from tokenmill.model.gguf_loader import gguf_eos_ids, gguf_field, open_gguf
from tokenmill.model.hf_loader import generation_eos_ids, read_json

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# tokenizer.ggml.pre -> the split regex its merges were learned with (the names transformers knows);
# any other value keeps byte-level BPE's GPT-2 split.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def _compile_chat_template(source: str) -> jinja2.Template:
    """The sandboxed environment Hugging Face chat templates are written for (same options and helpers)."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class ChatTemplateError(ValueError):
    """The model's chat template refused or failed to render a conversation."""


class Tokenizer:
    """encode/decode and chat templating. BOS/EOS insertion lives in the backend's post-processor, so
    `encode(text, add_special_tokens=True)` adds exactly what the model's tokenizer config asks for."""

    def __init__(self, backend: Backend, special_tokens: dict[str, str], eos_token_ids: list[int],
                 chat_template: str | None = None, template_source: str = "the chat template") -> None:
        self.backend = backend
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.set_chat_template(chat_template, template_source)
        eos = self.token_to_id(self.special_tokens.get("eos_token"))
        self.eos_token_ids = list(dict.fromkeys(([eos] if eos is not None else []) + list(eos_token_ids)))
        self.bos_token_id = self.token_to_id(self.special_tokens.get("bos_token"))
        self.pad_token_id = self.token_to_id(self.special_tokens.get("pad_token"))
        self.all_special_ids = sorted(i for i, t in backend.get_added_tokens_decoder().items() if t.special)

    def set_chat_template(self, chat_template: str | None, source: str) -> None:
        """Use chat_template from now on (the model's, or the server's --chat-template); source: where it came from,
        which its errors name."""
        self._template = compiled_chat_template(chat_template, source) if chat_template else None
        self.chat_template, self.template_source = chat_template, source

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text. Through encode_batch, which releases the GIL (tokenizers' encode holds it
        throughout): a long prompt encoded in a worker thread leaves the server's event loop running."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (OpenAI's logprobs `bytes`). A token holding part of a UTF-8 character
        decodes to U+FFFD alone, yet its bytes joined with its neighbours' give the character back: they come
        from its piece, in GPT-2's byte alphabet or as SentencePiece's byte token <0xHH>."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            piece = self.backend.id_to_token(token_id) or ""
            byte = BYTE_PIECE.fullmatch(piece)
            if byte:
                return bytes([int(byte.group(1), 16)])
            if piece and all(ch in BYTE_LEVEL for ch in piece):
                return bytes(BYTE_LEVEL[ch] for ch in piece)
        return text.encode()

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens as it stands alone and after a space (vLLM's bad_words): the sequences that may not
        end an output."""
        texts = [text for word in words for text in (word.lstrip(), " " + word.lstrip())]
        encodings = self.backend.encode_batch(texts, add_special_tokens=False) if texts else []
        return [list(ids) for ids in dict.fromkeys(tuple(e.ids) for e in encodings if e.ids)]

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                            chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                            **kwargs: Any) -> str:
        """Render the conversation into the prompt text the model was trained on. continue_final_message (as
        transformers and vLLM): the text ends with the last message's content, left open for the model to go on
        with (a prefilled assistant answer); chat_template: a jinja2 template used instead of the model's;
        chat_template_kwargs (vLLM's), like kwargs: more variables for the template (e.g. enable_thinking)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the first goes "
                             "on with the last message, the second starts a new one; set add_generation_prompt false")
        kwargs = {**kwargs, **check_chat_template_kwargs(chat_template_kwargs)}
        template, source = self._template, self.template_source
        if chat_template is not None:
            template, source = compiled_chat_template(chat_template), "the chat_template given"
        if template is None:
            raise ValueError("this tokenizer has no chat template; send a plain prompt instead")
        try:
            text = template.render(messages=messages, tools=tools, documents=None,
                                   add_generation_prompt=add_generation_prompt, **{**self.special_tokens, **kwargs})
        except Exception as e:  # raise_exception() in the template, or any error inside jinja while rendering
            raise ChatTemplateError(f"{source} could not render these messages ({type(e).__name__}: {e})") from e
        return _open_final_message(text, messages, source) if continue_final_message else text


# what apply_chat_template sets itself: a template variable of these names would be ambiguous
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                               "chat_template")


def check_chat_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """chat_template_kwargs as given (None: none), or a ValueError saying what is wrong with them."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError("chat_template_kwargs must be a dict of template variable names to values, "
                         f"got {kwargs!r:.80}")
    if taken := [k for k in kwargs if k in RESERVED_TEMPLATE_VARIABLES]:
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}: "
                         f"{', '.join(RESERVED_TEMPLATE_VARIABLES)} are set by options of their own")
    return kwargs


@functools.lru_cache(maxsize=16)
def compiled_chat_template(template: str, source: str = "chat_template") -> jinja2.Template:
    """A chat template compiled once however many calls send it, or a ValueError naming its source and the line
    jinja2 refused."""
    try:
        return _compile_chat_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{source} is not a valid jinja2 chat template (line {e.lineno}: {e.message})") from e


def _open_final_message(text: str, messages: list[dict[str, Any]], source: str) -> str:
    """The rendered chat cut right after the last message's content, dropping the end-of-turn the template wrote
    after it. Templates may strip a message's content, so the stripped content is looked for too."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, str) and final:
        for needle in (final, final.strip()):
            at = text.rfind(needle) if needle else -1
            if at >= 0:
                return text[:at + len(needle)]
    raise ChatTemplateError(f"continue_final_message: the last message's content {final!r:.60} does not appear in "
                            f"the chat as {source} renders it, so it cannot be continued")


def _content(token: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken-like dict."""
    return token.get("content") if isinstance(token, dict) else token


def _set_bos_eos(backend: Backend, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool) -> None:
    """Post-processor adding BOS/EOS as transformers builds it from a GGUF's add_bos_token/add_eos_token."""
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    special = ([(bos, backend.token_to_id(bos))] if add_bos else []) + \
              ([(eos, backend.token_to_id(eos))] if add_eos else [])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _load_hf_tokenizer(model_dir: str) -> Tokenizer:
    """tokenizer.json is authoritative for BOS/EOS insertion (its post-processor); like transformers 5, the
    add_bos_token/add_eos_token of tokenizer_config.json are ignored when tokenizer.json exists."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found; expected a Hugging Face fast tokenizer (tokenizer.json) "
                                "next to config.json (slow sentencepiece-only tokenizers are not supported)")
    try:
        backend = Backend.from_file(path)
    except Exception as e:
        raise ValueError(f"{path} is not a valid tokenizer.json ({e})") from e
    backend.no_truncation()
    backend.no_padding()
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    config = read_json(config_path, "a Hugging Face tokenizer config") if os.path.isfile(config_path) else {}

    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = [AddedToken(t["content"], single_word=t.get("single_word", False), lstrip=t.get("lstrip", False),
                          rstrip=t.get("rstrip", False), normalized=t.get("normalized", True),
                          special=t.get("special", False))
               for _, t in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0]))
               if t["content"] not in added]
    if missing:
        backend.add_tokens(missing)
    special = {name: _content(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    extra = list(extra.values()) if isinstance(extra, dict) else extra
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    new_special = [t for t in dict.fromkeys([*special.values(), *map(_content, extra)]) if t and t not in added]
    if new_special:
        backend.add_tokens([AddedToken(t, special=True) for t in new_special])

    template_path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(template_path):
        with open(template_path, encoding="utf-8") as f:
            template = f.read()
        source = f"the chat template {template_path}"
    else:
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        source = f"the chat template of {config_path}"
    return Tokenizer(backend, special, generation_eos_ids(model_dir), template, source)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte alphabet read backwards: the byte each character of a byte-level piece stands for (tokenizers
    exposes the alphabet, ByteLevel.alphabet(), but not which byte a character is)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


BYTE_LEVEL = _byte_level_alphabet()
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """GGUF tokens spelled in GPT-2's byte alphabet; a token with other characters (a mislabelled added token)
    is respelled byte by byte, as transformers does."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return {t if set(t) <= alphabet else "".join(piece for piece, _ in spell.pre_tokenize_str(t)): i
            for i, t in enumerate(tokens)}


def _gguf_merges(reader: GGUFReader, tokens: list[str], path: str) -> list[tuple[str, str]]:
    """The file's merges; a SentencePiece vocabulary has none, so derive them as transformers'
    `generate_merges` does: every split of a token into two tokens, ranked by the token's score, then by longer
    left and right pieces; remaining ties keep vocabulary order."""
    merges = gguf_field(reader, "tokenizer.ggml.merges")
    if merges:
        return [tuple(m.split(" ")) for m in merges]
    scores = gguf_field(reader, "tokenizer.ggml.scores")
    if not scores:
        raise ValueError(f"{path}: GGUF lacks both tokenizer.ggml.merges and tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for token, score in dict(zip(tokens, scores)).items():
        splits = [(token[:k], token[k:], score) for k in range(1, len(token))
                  if token[:k] in vocab and token[k:] in vocab]
        ranked.extend(sorted(splits, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _byte_level_backend(reader: GGUFReader, tokens: list[str], path: str) -> Backend:
    """Byte-level BPE (tokenizer.ggml.model "gpt2"): GPT-2's byte alphabet, split by tokenizer.ggml.pre."""
    backend = Backend(BPE(vocab=_byte_level_vocab(tokens), merges=_gguf_merges(reader, tokens, path),
                          dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = GGUF_PRE_TOKENIZER_SPLITS.get(gguf_field(reader, "tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(reader: GGUFReader, tokens: list[str], path: str) -> Backend:
    """SentencePiece BPE (tokenizer.ggml.model "llama": Llama 2, Mistral), as transformers' LlamaTokenizer
    builds it: spaces as ▁ with one prepended to the text's start, characters outside the vocabulary as
    <0xXX> byte tokens. Like transformers, tokenizer.ggml.add_space_prefix is not read."""
    backend = Backend(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=_gguf_merges(reader, tokens, path),
                          dropout=None, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    return backend


# tokenizer.ggml.model -> (its backend, its add_bos_token when the file has none: llama.cpp adds BOS to a
# SentencePiece vocabulary that does not say otherwise, and transformers follows it)
_GGUF_TOKENIZERS = {"gpt2": (_byte_level_backend, False), "llama": (_sentencepiece_backend, True)}


def _load_gguf_tokenizer(path: str) -> Tokenizer:
    reader = open_gguf(path)
    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind not in _GGUF_TOKENIZERS:
        raise ValueError(f"{path}: GGUF tokenizer type {kind!r} is not supported; supported: 'gpt2' "
                         "(byte-level BPE), 'llama' (SentencePiece BPE); use the model's Hugging Face folder for "
                         "its tokenizer instead")
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{path}: GGUF lacks tokenizer.ggml.tokens")
    token_types = gguf_field(reader, "tokenizer.ggml.token_type", [])
    build, add_bos_default = _GGUF_TOKENIZERS[kind]
    backend = build(reader, tokens, path)

    # In a byte-level vocabulary a control token spelled outside the byte alphabet is a llama.cpp mislabel;
    # adding it would grow the vocabulary past the model's, so it is skipped (as transformers does).
    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if kind == "gpt2" else None
    control = [AddedToken(t, normalized=False, special=True) for t, t_type in zip(tokens, token_types)
               if t_type == _CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    user_defined = [AddedToken(t, normalized=False, special=False) for t, t_type in zip(tokens, token_types)
                    if t_type == _USER_DEFINED and t in vocab]
    if user_defined:
        backend.add_tokens(user_defined)

    def token(key: str) -> str | None:
        i = gguf_field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if i is None or not 0 <= i < len(tokens) else tokens[i]

    special = {"bos_token": token("bos"), "eos_token": token("eos"), "unk_token": token("unknown"),
               "pad_token": token("padding")}
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    new_special = [t for t in dict.fromkeys(special.values()) if t and t not in added]
    if new_special:
        backend.add_tokens([AddedToken(t, special=True) for t in new_special])
    _set_bos_eos(backend, special["bos_token"], special["eos_token"],
                 bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", add_bos_default)),
                 bool(gguf_field(reader, "tokenizer.ggml.add_eos_token", False)))
    return Tokenizer(backend, special, gguf_eos_ids(reader), gguf_field(reader, "tokenizer.chat_template"),
                     f"the chat template of {path} (tokenizer.chat_template)")


def load_tokenizer(path: str) -> Tokenizer:
    """Tokenizer of a Hugging Face model folder or of a .gguf file."""
    if os.path.isdir(path):
        return _load_hf_tokenizer(path)
    if os.path.isfile(path):
        return _load_gguf_tokenizer(path)
    raise FileNotFoundError(f"{path} not found; expected a Hugging Face model folder with tokenizer.json "
                            "or a .gguf file")
