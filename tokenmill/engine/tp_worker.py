"""A tensor-parallel worker: one rank other than 0. It builds its shard of the model and its KV cache as rank 0
does, then replays rank 0: before every forward rank 0 broadcasts the step's flat batch (ModelInput) and each
rank runs the same forward, the layers' collectives keeping them in step. Only rank 0 schedules and samples
(the LM head's logits are gathered on every rank)."""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.config import EngineArgs
from tokenmill.distributed import broadcast_object, broadcast_tensor, destroy_tp_group, gather_object, init_tp_group
from tokenmill.engine.devices import pick_device, pick_dtype, share_cpu_threads
from tokenmill.model.loader import load_model, load_model_config, resolve_model
from tokenmill.runner.model_runner import ModelInput, ModelRunner

SHUTDOWN = "shutdown"    # rank 0 is closing: leave the loop
KEEPALIVE = "keepalive"  # rank 0 is idle but alive: keep waiting


@dataclass
class CollectiveRPC:
    """Run fn(runner) on every rank and gather the results on rank 0 (vLLM's collective_rpc)."""

    fn: Callable[[ModelRunner], Any]


def ranks_per_node(args: EngineArgs) -> int:
    return args.tensor_parallel_size // args.nnodes


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes of the parameters this rank holds (a tied embedding and LM head count once)."""
    return sum(p.numel() * p.element_size() for p in runner.model.parameters())


def build_runner(args: EngineArgs, device: torch.device) -> ModelRunner:
    """This rank's shard of the model and its KV cache, built from rank 0's options as rank 0 builds them."""
    model_path = resolve_model(args.model) if args.load_format != "dummy" or args.model else None
    config = load_model_config(model_path, args.load_format, args.model_preset)
    dtype = pick_dtype(args.dtype, config.torch_dtype, device)
    max_len = args.max_model_len or config.max_position_embeddings
    model = load_model(config, model_path, args.load_format, dtype, device, seed=args.seed,
                       quantization=args.quantization, fold_norms=True, quantize_lm_head=args.quantize_lm_head)
    return ModelRunner(model, config, args, device, dtype, max_len, list(config.eos_token_id))


def replay(runner: ModelRunner) -> None:
    """Run rank 0's messages until it shuts down; a lost or silent rank 0 raises from the collective. Under
    async scheduling a step's input may take tokens rank 0 sampled at the step before, which it broadcasts on
    the device right after sampling them."""
    while True:
        msg = broadcast_object(None)
        if isinstance(msg, ModelInput):
            runner.forward(msg)
            if msg.shares_sampled and len(msg.sample_rows):
                broadcast_tensor(runner.sampled[:len(msg.sample_rows)])
        elif isinstance(msg, CollectiveRPC):
            gather_object(msg.fn(runner))
        elif msg == SHUTDOWN:
            return


def exit_with_parent(rank: int) -> None:
    """A spawned rank ends when the process that started it ends, even one killed without a word."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        print(f"tokenmill tensor-parallel rank {rank}: the process that started it ended; exiting", file=sys.stderr)
        os._exit(1)

    threading.Thread(target=watch, name="tokenmill-parent-watch", daemon=True).start()


def run_worker(args: EngineArgs, rank: int) -> None:
    """Process entry of one rank other than 0 (started by the engine, or by `tokenmill worker` on other nodes).
    Ctrl-C reaches every process of the terminal; rank 0 alone decides, and its shutdown message ends the loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent(rank)
    device = pick_device(args.device, rank % ranks_per_node(args))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        share_cpu_threads(ranks_per_node(args))
    init_tp_group(rank, args.tensor_parallel_size, args.master_addr, args.master_port, device)
    try:
        engine_args = broadcast_object(None)  # rank 0's options: every rank builds the same model and cache
        torch.manual_seed(engine_args.seed)
        replay(build_runner(engine_args, device))
    finally:
        destroy_tp_group()
