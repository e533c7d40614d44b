"""The `tokenmill` command: generate | chat | serve | worker | bench | quantize | quant-eval | simulate | plan | router.
Each subcommand parses its options and calls into the package; no logic lives here."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import TYPE_CHECKING

from tokenmill.engine.arg_utils import add_engine_args, engine_args_from

if TYPE_CHECKING:
    from tokenmill.engine.llm_engine import LLMEngine

# subcommand -> module with add_parser(subparsers) that sets `func` on its parser
EXTRA_COMMANDS = ["tokenmill.serve.cli", "tokenmill.bench.cli", "tokenmill.quant.cli", "tokenmill.sim.cli",
                  "tokenmill.plan", "tokenmill.router.cli"]


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="maximum new tokens (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens, -1 = all")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="penalty on tokens already present")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty")
    p.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")


def sampling_params_from(ns: argparse.Namespace):
    from tokenmill.sampling_params import SamplingParams
    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                          min_p=ns.min_p, repetition_penalty=ns.repetition_penalty,
                          presence_penalty=ns.presence_penalty, frequency_penalty=ns.frequency_penalty,
                          seed=ns.sampling_seed, stop=ns.stop, ignore_eos=ns.ignore_eos)


def stream(engine, prompt, params, out=sys.stdout) -> str:
    """Print a request's text as it is produced; returns the whole text."""
    rid = engine.add_request(None, prompt, params)
    text = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid:
                out.write(o.outputs[0].delta_text)
                out.flush()
                text = o.outputs[0].text
    out.write("\n")
    return text


def text_engine(ns: argparse.Namespace) -> LLMEngine:
    """The engine of generate and chat, which take text: one without a tokenizer (dummy weights without
    --tokenizer, or --skip-tokenizer-init) is refused with a message, not an AttributeError on the first prompt."""
    from tokenmill.engine.llm_engine import LLMEngine
    args = engine_args_from(ns)
    engine = None if args.skip_tokenizer_init else LLMEngine(args)
    if engine is None or engine.tokenizer is None:
        raise ValueError(f"tokenmill {ns.command} takes text, and this engine has no tokenizer (dummy weights "
                         "without --tokenizer, or --skip-tokenizer-init)")
    return engine


def cmd_generate(ns: argparse.Namespace) -> None:
    engine = text_engine(ns)
    params = sampling_params_from(ns)
    prompt = ns.prompt
    if ns.chat_template:
        tok = engine.tokenizer
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]), add_special_tokens=False)
    stream(engine, prompt, params)


def cmd_chat(ns: argparse.Namespace) -> None:
    engine = text_engine(ns)
    tok, params = engine.tokenizer, sampling_params_from(ns)
    messages = [{"role": "system", "content": ns.system}] if ns.system else []
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 come as surrogates, refused below, rather than
        sys.stdin.reconfigure(errors="surrogateescape")  # a UnicodeDecodeError losing the lines read with them
    print("tokenmill chat: type a message, /reset to start over, /exit or Ctrl-D to quit.")
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            messages = messages[:1] if ns.system else []
            continue
        if not line.strip():
            continue
        try:
            line.encode("utf-8")
            ids = tok.encode(tok.apply_chat_template(messages + [{"role": "user", "content": line}]),
                             add_special_tokens=False)
            answer = stream(engine, ids, params)
        except (UnicodeEncodeError, ValueError) as e:  # one bad message is said and dropped; the chat goes on
            reason = "the message is not valid UTF-8" if isinstance(e, UnicodeEncodeError) else str(e)
            print(f"tokenmill chat: {reason}; the message was not sent", file=sys.stderr)
            continue
        messages += [{"role": "user", "content": line}, {"role": "assistant", "content": answer}]


def cmd_worker(ns: argparse.Namespace) -> None:
    from tokenmill.engine.tp_launcher import TensorParallelError, run_worker_node
    try:
        run_worker_node(engine_args_from(ns))
    except (TensorParallelError, ValueError) as e:
        sys.exit(f"tokenmill worker: {e}")
    except KeyboardInterrupt:
        sys.exit("tokenmill worker: interrupted; this node's ranks were stopped")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine and server")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt as a user message in the model's chat template (default: on)")
    add_sampling_args(g)
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive multi-turn chat using the model's chat template")
    c.add_argument("--system", default=None, help="system message")
    add_sampling_args(c)
    add_engine_args(c)
    c.set_defaults(func=cmd_chat)
    w = sub.add_parser("worker", help="run this node's tensor-parallel ranks of a multi-node engine (node-rank >= 1)",
                       description="Runs ranks node_rank*N/nnodes .. of a --tensor-parallel-size N engine whose rank 0 "
                                   "(tokenmill serve or generate on node 0) listens at --master-addr:--master-port. "
                                   "The model and every other option come from rank 0; --device is this node's.")
    add_engine_args(w)
    w.set_defaults(func=cmd_worker)
    for mod in EXTRA_COMMANDS:
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    ns.func(ns)


def run() -> None:
    """The console entry point: bad input (a ValueError, whose message says what is wrong and what is allowed,
    or a FileNotFoundError for a model or file that is not there) ends the command with that message and status
    2, as argparse's own errors do, instead of a traceback."""
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    run()
