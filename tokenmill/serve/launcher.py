"""Running the server: load the engine, serve the app with uvicorn, and drain on SIGTERM.

The first SIGTERM (or Ctrl-C) stops taking new requests (they get 503, and so does /health) while the requests in
flight finish, for up to the grace period; whatever is left is then aborted and the process exits with status 0.
A second signal exits at once. Neither waits more than a few seconds for an engine step that is still running: a
step cannot be interrupted, and one long prefill can last minutes."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from types import FrameType

import uvicorn
from fastapi import FastAPI

from tokenmill.config import EngineArgs
from tokenmill.engine.arg_utils import engine_args_from
from tokenmill.engine.async_engine import RequestFailedError
from tokenmill.engine.devices import pick_device, server_max_num_batched_tokens
from tokenmill.units import allowed_origins

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05
ENGINE_THREAD_EXIT_S = 1.0  # how long the process waits, once served, for the engine thread to end


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None:
            self.should_exit = self.force_exit = True
            return
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        serving, engine = self.app.state.serving, self.app.state.engine
        serving.draining = True
        logger.info("draining: %d requests in flight, up to %.1f s", engine.num_in_flight, self.grace_s)
        deadline = asyncio.get_running_loop().time() + self.grace_s
        while engine.num_in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if engine.num_in_flight:
            logger.warning("grace period over: aborting %d requests", engine.num_in_flight)
            engine.abort_all("shutdown", RequestFailedError("the server shut down before the request finished"))
        self.should_exit = True


def leave_engine_thread(executor: ThreadPoolExecutor, worker: threading.Thread) -> None:
    """Python joins the engine thread at exit, which is to wait for the step it is in (its requests have been
    aborted already); a step still running after ENGINE_THREAD_EXIT_S is abandoned by exiting at once, with the
    status of a drained server."""
    executor.shutdown(wait=False, cancel_futures=True)
    worker.join(ENGINE_THREAD_EXIT_S)
    if worker.is_alive():
        logger.warning("exiting while the engine thread is still in a step")
        logging.shutdown()
        os._exit(0)


def served_model_name(ns: argparse.Namespace, model_path: str | None) -> str:
    if ns.served_model_name:
        return ns.served_model_name
    if ns.model:
        return ns.model
    return os.path.basename(model_path or "tokenmill").removesuffix(".gguf")


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads (as vLLM does), so that a port in use is said at once
    rather than after the load, and no other process can take the port meanwhile."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run_server(ns: argparse.Namespace) -> None:
    from tokenmill.engine.async_engine import engine_thread
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.serve.api_server import ServerConfig, build_app

    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = listening_socket(ns.host, ns.port)
    executor = engine_thread()
    worker = executor.submit(threading.current_thread).result()
    if ns.max_num_batched_tokens is None:  # vLLM's API server's budget for the GPU
        ns.max_num_batched_tokens = server_max_num_batched_tokens(pick_device(ns.device),
                                                                  EngineArgs.max_num_batched_tokens)
    engine = executor.submit(LLMEngine, engine_args_from(ns)).result()
    if ns.chat_template is not None and engine.tokenizer is not None:
        engine.tokenizer.set_chat_template(*ns.chat_template)
    name = served_model_name(ns, engine.model_path)
    app = build_app(engine, ServerConfig(model_name=name, model_root=engine.model_path or name, api_key=ns.api_key,
                                         max_request_bytes=ns.max_request_bytes,
                                         trust_request_chat_template=ns.trust_request_chat_template,
                                         allowed_origins=allowed_origins(ns),
                                         default_chat_template_kwargs=ns.default_chat_template_kwargs), executor)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level, access_log=ns.access_log,
                            timeout_graceful_shutdown=ns.shutdown_timeout, ssl_certfile=ns.ssl_certfile,
                            ssl_keyfile=ns.ssl_keyfile)
    logger.info("serving %s on %s://%s:%d", name, "https" if ns.ssl_certfile else "http", ns.host, ns.port)
    DrainingServer(config, app, ns.shutdown_timeout).run(sockets=[sock])
    leave_engine_thread(executor, worker)
