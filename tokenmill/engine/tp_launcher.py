"""Starting and minding the tensor-parallel ranks. Rank 0 runs the engine (its one scheduler) and starts the
other ranks of its node; every other node starts its own with `tokenmill worker`, after torchrun's convention
(--nnodes, --node-rank, --master-addr, --master-port). A rank that dies ends the whole group with a
TensorParallelError; collectives time out (TOKENMILL_DIST_TIMEOUT_S) rather than hang, and an idle rank 0
sends keepalives so that waiting workers can tell idle from gone. Joining has its own, longer timeout
(TOKENMILL_DIST_JOIN_TIMEOUT_S): other nodes may be started by hand."""
from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing.connection
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenmill.config import EngineArgs, ModelConfig
from tokenmill.distributed import (TIMEOUT_ENV, broadcast_object, collective_timeout_s, control_lock,
                                   destroy_tp_group, gather_object, init_tp_group)
from tokenmill.engine.devices import share_cpu_threads
from tokenmill.engine.tp_worker import KEEPALIVE, SHUTDOWN, CollectiveRPC, ranks_per_node, run_worker
from tokenmill.quant.loading import GGUF_NATIVE, parse_quantization
from tokenmill.quant.sharding import check_row_parallel
from tokenmill.runner.model_runner import ModelRunner

DEATH_GRACE_S = 2.0      # after a failed collective, how long a dying local rank gets to show its exit code
SHUTDOWN_JOIN_S = 10.0   # how long workers get to leave after the shutdown message


class TensorParallelError(RuntimeError):
    """A rank died or stopped answering: the group is gone and the engine must be started again."""


def check_tp_shapes(config: ModelConfig, tp: int) -> None:
    """Every split the parallel layers make must be even; say which is not before any process starts."""
    def fits(n: int) -> bool:
        kv = config.num_key_value_heads
        return (config.num_attention_heads % n == 0 and (kv % n == 0 if kv >= n else n % kv == 0)
                and config.intermediate_size % n == 0 and config.vocab_size % n == 0)

    if fits(tp):
        return
    sizes = [n for n in range(1, config.num_attention_heads + 1) if fits(n)]
    raise ValueError(f"tensor_parallel_size={tp} does not split this model evenly (it splits "
                     f"{config.num_attention_heads} attention heads, {config.num_key_value_heads} KV heads, "
                     f"intermediate_size {config.intermediate_size} and vocab_size {config.vocab_size}); "
                     f"sizes that work: {', '.join(map(str, sizes))}")


def check_quant_split(config: ModelConfig, tp: int, quantization: str | None) -> None:
    """Quantizing at load, the row-parallel projections (o_proj, down_proj) must split into whole groups: say
    which does not before any process starts (quantized checkpoints and GGUF files are checked as their
    layers are built)."""
    if quantization is None or quantization == GGUF_NATIVE:
        return
    fmt = parse_quantization(quantization)
    for in_features in (config.num_attention_heads * config.head_dim, config.intermediate_size):
        check_row_parallel(fmt, in_features, tp)


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def spawn_ranks(args: EngineArgs, ranks: Iterable[int]) -> dict[int, BaseProcess]:
    """One process per rank (spawned: CUDA and threads do not survive fork); each exits with its parent."""
    ctx = mp.get_context("spawn")
    procs = {}
    for rank in ranks:
        procs[rank] = ctx.Process(target=run_worker, args=(args, rank), name=f"tokenmill-tp-rank-{rank}", daemon=True)
        procs[rank].start()
    return procs


def describe_exit(rank: int, proc: BaseProcess) -> str:
    code = proc.exitcode
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    return f"tensor-parallel rank {rank} (pid {proc.pid}) {how}"


def stop_processes(procs: Iterable[BaseProcess], wait_s: float) -> None:
    """Join each process for up to wait_s, then terminate, then kill what is left."""
    procs = list(procs)
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()


class TPWorkerGroup:
    """Rank 0's side of the group: starts this node's other ranks, joins the group, hands them the engine's
    options, and turns a rank's death into TensorParallelError."""

    def __init__(self, args: EngineArgs, model_config: ModelConfig, device: torch.device) -> None:
        if args.node_rank != 0:
            raise ValueError(f"node_rank={args.node_rank}: the engine runs on node 0; the ranks of other nodes are "
                             "started with `tokenmill worker`")
        check_tp_shapes(model_config, args.tensor_parallel_size)
        check_quant_split(model_config, args.tensor_parallel_size, args.quantization)
        if device.type == "cuda" and ranks_per_node(args) > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={args.tensor_parallel_size} over nnodes={args.nnodes} needs "
                             f"{ranks_per_node(args)} GPUs on each node; this one has {torch.cuda.device_count()}")
        if device.type == "cpu":
            share_cpu_threads(ranks_per_node(args))
        args = dataclasses.replace(args, master_port=args.master_port or free_port(args.master_addr))
        self.procs = spawn_ranks(args, range(1, ranks_per_node(args)))
        self.failure: str | None = None
        self.closed = False
        self._stop = threading.Event()
        self._keepalive: threading.Thread | None = None
        try:
            with self.watch():
                init_tp_group(0, args.tensor_parallel_size, args.master_addr, args.master_port, device,
                              check=self.check_health)
                broadcast_object(args)
        except BaseException:
            self.shutdown(graceful=False)
            raise

    def start_keepalive(self) -> None:
        """Once every rank waits for steps: while the engine idles, tell the workers rank 0 is still there."""
        def loop() -> None:
            while not self._stop.wait(collective_timeout_s() / 4):
                try:
                    broadcast_object(KEEPALIVE)
                except RuntimeError:
                    return  # a rank is gone; the engine's next call reports it

        self._keepalive = threading.Thread(target=loop, name="tokenmill-tp-keepalive", daemon=True)
        self._keepalive.start()

    # ---- failures ---------------------------------------------------------------------------
    def _dead(self, grace_s: float) -> list[str]:
        """Local ranks that have exited, waiting up to grace_s for one to do so."""
        deadline = time.monotonic() + grace_s
        while self.procs:
            dead = [describe_exit(r, p) for r, p in self.procs.items() if p.exitcode is not None]
            left = deadline - time.monotonic()
            if dead or left <= 0:
                return dead
            multiprocessing.connection.wait([p.sentinel for p in self.procs.values()], timeout=left)
        return []

    def _fail(self, message: str, cause: BaseException | None = None) -> None:
        self.failure = f"{message}; the tensor-parallel group is gone, start the engine again"
        self.shutdown(graceful=False)
        raise TensorParallelError(self.failure) from cause

    def check_health(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        if self.closed:
            raise TensorParallelError("the engine was shut down (its tensor-parallel workers have exited)")
        dead = self._dead(0.0)
        if dead:
            self._fail("; ".join(dead))

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Around anything that talks to the other ranks: a rank that died (here, or on another node as seen
        through a failed or timed-out collective) becomes a TensorParallelError."""
        self.check_health()
        try:
            yield
        except TensorParallelError:
            raise
        except RuntimeError as e:
            dead = self._dead(DEATH_GRACE_S)
            if dead:
                self._fail("; ".join(dead), e)
            text = str(e).lower()
            if isinstance(e, dist.DistError) or "gloo" in text or "nccl" in text:
                self._fail(f"a tensor-parallel collective failed: a rank died or did not answer within "
                           f"{TIMEOUT_ENV}={collective_timeout_s():g}s ({e})", e)
            raise

    # ---- requests to every rank -------------------------------------------------------------
    def collective_rpc(self, fn: Callable[[ModelRunner], Any], runner: ModelRunner) -> list[Any]:
        """fn(runner) on every rank, results in rank order."""
        with self.watch(), control_lock:
            broadcast_object(CollectiveRPC(fn))
            return gather_object(fn(runner))

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every local rank (graceful: they leave their loop; remote ranks too) and leave the group."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self._keepalive is not None:
            self._keepalive.join()
        if graceful and self.failure is None and dist.is_initialized():
            with contextlib.suppress(RuntimeError):
                broadcast_object(SHUTDOWN)
        stop_processes(self.procs.values(), SHUTDOWN_JOIN_S if graceful else 0.0)
        destroy_tp_group()


def run_worker_node(args: EngineArgs) -> None:
    """`tokenmill worker`: run this node's ranks until rank 0 shuts them down; one failing ends them all."""
    if args.nnodes < 2 or args.node_rank == 0:
        raise ValueError("`tokenmill worker` runs the ranks of nodes 1 .. nnodes-1 of a multi-node launch "
                         f"(got --nnodes {args.nnodes} --node-rank {args.node_rank}); node 0 runs the engine "
                         "(tokenmill serve / generate) with the same --tensor-parallel-size, --nnodes, "
                         "--master-addr and --master-port")
    per = ranks_per_node(args)
    procs = spawn_ranks(args, range(args.node_rank * per, (args.node_rank + 1) * per))
    try:
        running = dict(procs)
        while running:
            multiprocessing.connection.wait([p.sentinel for p in running.values()])
            for rank, p in list(running.items()):
                if p.exitcode is None:
                    continue
                if p.exitcode != 0:
                    raise TensorParallelError(f"{describe_exit(rank, p)}; stopping this node's other ranks")
                del running[rank]
    finally:
        stop_processes(procs.values(), 0.0)
