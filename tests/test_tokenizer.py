"""Our tokenizer against transformers' AutoTokenizer: the default GGUF, a tiny SentencePiece (Llama 2 style) GGUF,
and Hugging Face folders derived from the default GGUF (as saved, with BOS insertion on, with an extra special
token, with a template in tokenizer_config.json)."""
from __future__ import annotations

import json
import os

import gguf
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import pre_tokenizers, processors

transformers = pytest.importorskip("transformers")

from tokenmill.tokenizer import BYTE_LEVEL, Tokenizer, load_tokenizer  # noqa: E402

TEXTS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "ünïcødé façade — naïve 你好，世界 🙂👍🏽 ÅΩ≈ç√",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "code:\n\tdef f(x):\n\t\treturn x**2  # square\n\n\n",
    "Numbers 12345, 3.14159 and 1,000,000; it's they're I'LL",
    "<repo_name>tokenmill<file_sep>a.py<|endoftext|>",
    "<|im_start|",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye 👋"}],
]
CUSTOM_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}"
                   "{{ raise_exception('unknown role ' + m.role) }}{% endif %}[{{ m.role }}] {{ m.content }}"
                   "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
                   "{{ strftime_now('%Y') | length }}")


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(default_model_path: str):
    folder, name = os.path.split(default_model_path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def gguf_tokenizer(default_model_path: str) -> Tokenizer:
    return load_tokenizer(default_model_path)


def assert_same(ours: Tokenizer, ref, texts: list[str] = TEXTS) -> None:
    for text in texts:
        for special in (True, False):
            ids = ref(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special) == ids, text
        ids = ref(text)["input_ids"]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
        assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids), text
    for messages in CONVERSATIONS:
        for gen in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == \
                ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def test_gguf_tokenizer_matches_transformers(gguf_tokenizer: Tokenizer, hf_gguf_tokenizer) -> None:
    assert_same(gguf_tokenizer, hf_gguf_tokenizer)
    assert gguf_tokenizer.backend.to_str() == hf_gguf_tokenizer.backend_tokenizer.to_str()


def test_gguf_tokenizer_properties(gguf_tokenizer: Tokenizer, hf_gguf_tokenizer) -> None:
    assert gguf_tokenizer.eos_token_ids == [hf_gguf_tokenizer.eos_token_id] == [2]
    assert gguf_tokenizer.bos_token_id == hf_gguf_tokenizer.bos_token_id
    assert gguf_tokenizer.pad_token_id == hf_gguf_tokenizer.pad_token_id
    assert gguf_tokenizer.vocab_size == len(hf_gguf_tokenizer) == 49152
    assert set(hf_gguf_tokenizer.all_special_ids) <= set(gguf_tokenizer.all_special_ids)
    assert gguf_tokenizer.encode("Hi") == gguf_tokenizer.encode("Hi", add_special_tokens=False)  # add_bos_token off


# A Llama 2 style vocabulary: <unk> <s> </s>, the 256 byte tokens, then pieces whose scores rank the merges
# transformers derives (a SentencePiece GGUF stores no merges), one control and one user-defined token.
SP_PIECES = {"▁": -1.0, "▁t": -2.0, "▁th": -3.0, "▁the": -4.0, "h": -5.0, "e": -6.0, "t": -7.0,
             "he": -8.0, "▁a": -9.0, "a": -10.0, "▁▁": -11.0, "▁c": -12.0, "c": -13.0,
             "at": -14.0, "▁ca": -15.0, "▁cat": -16.0, "[INST]": 0.0, "<tool>": 0.0}
SP_TEXTS = ["the cat", "  the  cat  ", "a\nthe\n\ncat\n", "▁the", "café 🙂", "<s>the</s> [INST] <tool>",
            "hat", ""]


def write_sentencepiece_gguf(path, add_bos_token: bool | None = None) -> str:
    """The tokenizer metadata of a Llama 2 GGUF (all that both loaders read), no tensors."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SP_PIECES]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL,
             *[gguf.TokenType.BYTE] * 256, *[gguf.TokenType.NORMAL] * (len(SP_PIECES) - 2),
             gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + list(SP_PIECES.values()))
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_bos_token is not None:
        writer.add_add_bos_token(add_bos_token)
    writer.add_chat_template(CUSTOM_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("add_bos_token", [None, True, False], ids=["bos-unset", "bos-on", "bos-off"])
def test_sentencepiece_gguf_matches_transformers(add_bos_token: bool | None, tmp_path) -> None:
    path = write_sentencepiece_gguf(tmp_path / "sp.gguf", add_bos_token)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    ours = load_tokenizer(path)
    assert_same(ours, ref, SP_TEXTS)
    assert ours.backend.to_str() == ref.backend_tokenizer.to_str()
    assert ours.encode("the cat", add_special_tokens=False) == [ours.token_to_id("▁the"),
                                                                 ours.token_to_id("▁cat")]
    assert ours.encode("é", add_special_tokens=False)[1:] == [ours.token_to_id("<0xC3>"),
                                                                 ours.token_to_id("<0xA9>")]  # byte fallback
    bos = [] if add_bos_token is False else [1]  # unset: llama.cpp's default for SentencePiece, BOS on
    assert ours.encode("hi") == bos + ours.encode("hi", add_special_tokens=False)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.vocab_size) == (1, [2], len(ref))


def test_unsupported_gguf_tokenizer(tmp_path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "t5.gguf"), "t5")
    writer.add_tokenizer_model("t5")
    writer.add_token_list(["<pad>", "</s>"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"tokenizer type 't5' is not supported; supported: 'gpt2' .*'llama'"):
        load_tokenizer(str(tmp_path / "t5.gguf"))


def hf_folder(tmp_path, ref, bos: bool = False, **config_changes) -> str:
    """A Hugging Face tokenizer folder saved by transformers, with tokenizer_config.json entries changed and,
    with `bos`, a tokenizer.json post-processor that prepends BOS (as Llama's does)."""
    ref.save_pretrained(tmp_path)
    if bos:
        backend = Backend.from_file(str(tmp_path / "tokenizer.json"))
        backend.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A", pair="<|im_start|> $A <|im_start|> $B", special_tokens=[("<|im_start|>", 1)])
        backend.save(str(tmp_path / "tokenizer.json"))
    path = tmp_path / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(config_changes)
    path.write_text(json.dumps(config))
    if "chat_template" in config_changes:
        os.remove(tmp_path / "chat_template.jinja")
    return str(tmp_path)


@pytest.mark.parametrize("changes", [
    {},
    {"bos": True},
    {"add_bos_token": True, "add_eos_token": True},  # ignored next to tokenizer.json, as in transformers 5
    {"extra_special_tokens": ["<|tool|>"]},
    {"chat_template": CUSTOM_TEMPLATE},
], ids=["as-saved", "bos-post-processor", "add-bos-flags", "extra-special", "config-template"])
def test_hf_folder_matches_transformers(changes: dict, tmp_path, hf_gguf_tokenizer) -> None:
    folder = hf_folder(tmp_path, hf_gguf_tokenizer, **changes)
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    ours = load_tokenizer(folder)
    assert_same(ours, ref, TEXTS + ["call <|tool|> now"])
    assert ours.eos_token_ids == [ref.eos_token_id]


def test_chat_template_helpers(tmp_path, hf_gguf_tokenizer) -> None:
    tok = load_tokenizer(hf_folder(tmp_path, hf_gguf_tokenizer, chat_template=CUSTOM_TEMPLATE))
    rendered = tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert rendered == "<|im_start|>[user] x<|im_end|>\n[assistant] 4"
    with pytest.raises(ValueError, match=r"tokenizer_config\.json could not render these messages "
                                         r"\(TemplateError: unknown role tool\)"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("template, error", [
    ("{{ messages[0].content + 1 }}", "TypeError: can only concatenate str"),
    ("{{ messages[0].nope.deeper }}", "UndefinedError: 'dict object' has no attribute 'nope'"),
])
def test_chat_template_that_fails_names_the_template(tmp_path, hf_gguf_tokenizer, template, error) -> None:
    """A template failing inside jinja used to surface as jinja's (or Python's) bare exception."""
    folder = hf_folder(tmp_path, hf_gguf_tokenizer, chat_template=template)
    tok = load_tokenizer(folder)
    with pytest.raises(ValueError, match=rf"the chat template of {tmp_path}/tokenizer_config\.json could not "
                                         rf"render these messages \({error}"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_syntax_error_names_the_file(tmp_path, hf_gguf_tokenizer) -> None:
    """A template that does not compile failed the tokenizer's load with a TemplateSyntaxError naming no file."""
    folder = hf_folder(tmp_path, hf_gguf_tokenizer)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ValueError, match=rf"the chat template {tmp_path}/chat_template\.jinja is not a valid jinja2 "
                                         r"chat template \(line 1: Unexpected end of template"):
        load_tokenizer(folder)


def test_generation_config_eos(tmp_path, hf_gguf_tokenizer) -> None:
    folder = hf_folder(tmp_path, hf_gguf_tokenizer)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert load_tokenizer(folder).eos_token_ids == [2, 0]


def test_no_chat_template(tmp_path, hf_gguf_tokenizer) -> None:
    folder = hf_folder(tmp_path, hf_gguf_tokenizer)
    os.remove(tmp_path / "chat_template.jinja")
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_tokenizer(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="expected a Hugging Face model folder with tokenizer.json"):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json not found; expected a Hugging Face fast tokenizer"):
        load_tokenizer(str(tmp_path))


def test_token_bytes_give_back_characters_split_over_tokens(gguf_tokenizer: Tokenizer, tmp_path) -> None:
    """A token holding part of a character decodes to U+FFFD; its bytes (OpenAI's logprobs `bytes`) joined with
    its neighbours' are the text's UTF-8, for byte-level BPE (the default model) and SentencePiece byte tokens."""
    assert set(BYTE_LEVEL) == set(pre_tokenizers.ByteLevel.alphabet()) and sorted(BYTE_LEVEL.values()) == \
        list(range(256))
    text = "ünïcødé 你好，世界 🙂👍🏽 く"
    ids = gguf_tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in gguf_tokenizer.decode([i]) for i in ids)  # some tokens hold part of a character
    assert b"".join(gguf_tokenizer.token_bytes(i) for i in ids) == text.encode()
    sp = load_tokenizer(write_sentencepiece_gguf(tmp_path / "sp.gguf"))
    ids = sp.encode("é", add_special_tokens=False)[1:]
    assert [sp.token_bytes(i) for i in ids] == [b"\xc3", b"\xa9"]


def test_continue_final_message_matches_transformers(gguf_tokenizer: Tokenizer, hf_gguf_tokenizer) -> None:
    """The prompt ends with the last message's content, open for the model to go on, as transformers renders it;
    both options at once, and a last message the template drops, are errors."""
    for final in ("The capital of France is", "  Padded answer  ", "Line one\nline two"):
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": final}]
        ours = gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
        assert ours == hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                                             continue_final_message=True)
        assert ours.endswith((final, final.strip()))
    with pytest.raises(ValueError, match="cannot both be true"):
        gguf_tokenizer.apply_chat_template(messages, continue_final_message=True)
    with pytest.raises(ValueError, match="does not appear in the chat as the chat_template given renders it"):
        gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                           chat_template="{{ messages[0].content }}")


def test_chat_template_given_by_the_caller(gguf_tokenizer: Tokenizer) -> None:
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    messages = [{"role": "user", "content": "x"}]
    assert gguf_tokenizer.apply_chat_template(messages, chat_template=template) == "user: x\n"
    assert gguf_tokenizer.apply_chat_template(messages).startswith("<|im_start|>")  # the model's own is kept
    with pytest.raises(ValueError, match=r"chat_template is not a valid jinja2 chat template \(line 1"):
        gguf_tokenizer.apply_chat_template(messages, chat_template="{% for m in messages %}")


def test_chat_template_kwargs(gguf_tokenizer: Tokenizer) -> None:
    """vLLM's chat_template_kwargs are variables of the template (as transformers' extra kwargs); names the
    renderer sets itself are refused, naming them."""
    template = "{% if enable_thinking %}<think>{% endif %}{{ messages[0].content }}"
    messages = [{"role": "user", "content": "x"}]
    assert gguf_tokenizer.apply_chat_template(messages, chat_template=template) == "x"
    assert gguf_tokenizer.apply_chat_template(messages, chat_template=template,
                                              chat_template_kwargs={"enable_thinking": True}) == "<think>x"
    for bad in ({"add_generation_prompt": False}, {"messages": [], "documents": None}):
        with pytest.raises(ValueError, match=f"chat_template_kwargs cannot set {', '.join(bad)}:"):
            gguf_tokenizer.apply_chat_template(messages, chat_template_kwargs=bad)
    with pytest.raises(ValueError, match="must be a dict of template variable names to values, got"):
        gguf_tokenizer.apply_chat_template(messages, chat_template_kwargs=[("enable_thinking", True)])
