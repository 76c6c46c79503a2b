"""The engine core in its own process, so that the front end (tokenisation, detokenisation,
serialisation) never stalls a model step.

The child ("spawn" context) loads the model from the EngineConfig and loops: apply queued
messages (blocking when idle), step, send the outputs. Only msgpack bytes cross the pipe
(core_messages.py). `EngineCoreClient` stands in for EngineCore inside LLMEngine.

Grammars: a matcher is a live object that cannot cross processes, so the front end compiles
a request's constraint (to refuse a bad one with its field named) and the core compiles it
again (cached) on a worker thread of its own; the request joins the scheduler once its
grammar is ready, and no step waits for a compile. Images travel as msgspec tensors; the
front end sizes their placeholders with a weightless (meta-device) copy of the model.
Benchmarks that reach into `core.scheduler` or `core.kv` need the in-process core."""

from __future__ import annotations

import logging
import multiprocessing
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import msgspec

from mmserve.config import EngineConfig
from mmserve.engine import core_messages as m
from mmserve.outputs import EngineOutput
from mmserve.request import Request

if TYPE_CHECKING:
    from mmserve.engine.engine_core import EngineCore
    from mmserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)
READY_TIMEOUT_S = 600.0  # model load (weights, KV cache, CUDA graphs)
STEP_WAIT_S = 0.05  # how long step() waits for news while requests are in flight
GRAMMAR_THREADS = 2  # the core process's grammar compiles run beside its steps


@dataclass(frozen=True)
class RemoteModel:
    """The model facts LLMEngine reads from `core.runner.model`."""

    vocab_size: int
    hidden_size: int | None
    type_vocab_size: int


@dataclass(frozen=True)
class RemoteRunner:
    model: RemoteModel


class EngineCoreDead(RuntimeError):
    pass


class EngineCoreClient:
    """EngineCore's interface (add_request, abort, stop, has_unfinished, step) over a pipe to
    the engine-core process. Not thread-safe: one thread drives it, as with EngineCore."""

    def __init__(self, config: EngineConfig) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=run_core,
            args=(child_conn, m.encoder.encode(config), os.getpid()),
            name="mmserve-engine-core",
            daemon=True,
        )
        self._proc.start()
        child_conn.close()  # only the child holds it now: its death reads as EOF here
        self._in_flight: set[str] = set()
        self._pending: list[EngineOutput] = []
        self._outbox: list[m.AddRequest] = []  # added since the last step (see add_request)
        self.dead: str | None = None
        ready = self._wait_for(m.Ready, READY_TIMEOUT_S)
        self.ready = ready
        self.max_model_len = ready.max_model_len
        self.num_kv_blocks = ready.num_kv_blocks
        self.device = ready.device
        self.compute_dtype = ready.compute_dtype
        self.quantization = ready.quantization
        self.runner: Any = RemoteRunner(
            RemoteModel(ready.model_vocab_size, ready.hidden_size, ready.type_vocab_size)
        )

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def add_request(self, request: Request) -> None:
        """Queued here and sent with the others added before the next step (or any other
        message): one AddRequests. Sent one by one, a burst reached the core in pieces and
        its first step ran on a few of them (a 64-input Embed call took several steps)."""
        self._check_alive()
        self._outbox.append(m.encode_request(request))  # a grammar is rebuilt there
        self._in_flight.add(request.request_id)

    def abort(self, request_ids: list[str]) -> None:
        self._send(m.Abort(list(request_ids)))  # each comes back with finish_reason "abort"

    def stop(self, request_id: str) -> None:
        self._send(m.Stop(request_id))
        self._in_flight.discard(request_id)  # the scheduler sends no output for a stop

    @property
    def has_unfinished(self) -> bool:
        return bool(self._in_flight or self._pending)

    def step(self) -> list[EngineOutput]:
        """Sends the requests added since the last call; returns the outputs received so
        far, waiting up to STEP_WAIT_S for some while requests run."""
        self._flush()
        if not self._pending and self._in_flight:
            self._receive(STEP_WAIT_S)
        self._receive(0.0)
        out, self._pending = self._pending, []
        for o in out:
            if o.finish_reason is not None:
                self._in_flight.discard(o.request_id)
        return out

    def stats(self) -> m.Stats:
        self._send(m.GetStats())
        return self._wait_for(m.Stats, 60.0)

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send_bytes(m.encoder.encode(m.Shutdown()))
            except OSError:
                pass
            self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()
        self.dead = self.dead or "shut down"

    def _send(self, msg: Any) -> None:
        """Sends msg after any queued requests (so an abort finds what it aborts)."""
        self._flush()
        self._write(msg)

    def _flush(self) -> None:
        if self._outbox:
            requests, self._outbox = self._outbox, []
            self._write(m.AddRequests(requests))

    def _write(self, msg: Any) -> None:
        self._check_alive()
        try:
            self._conn.send_bytes(m.encoder.encode(msg))
        except OSError as e:
            self._died(f"pipe closed: {e}")

    def _wait_for(self, kind: type, timeout: float) -> Any:
        """Collects outputs until a message of `kind` arrives."""
        while True:
            self._check_alive()
            if not self._conn.poll(timeout):
                self._died(f"no {kind.__name__} within {timeout:.0f}s")
            msg = self._recv()
            if isinstance(msg, kind):
                return msg
            self._handle(msg)

    def _receive(self, timeout: float) -> None:
        while self._conn.poll(timeout):
            self._handle(self._recv())
            timeout = 0.0

    def _recv(self) -> m.Outputs | m.Ready | m.Stats | m.Error:
        try:
            return m.from_core_decoder.decode(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._proc.join(1.0)
            return self._died(f"exited with code {self._proc.exitcode}")

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, m.Outputs):
            self._pending.extend(m.decode_output(o) for o in msg.outputs)
        elif isinstance(msg, m.Error):
            self._died(msg.message)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineCoreDead(f"engine core process died: {self.dead}")

    def _died(self, why: str) -> NoReturn:
        self.dead = self.dead or why
        raise EngineCoreDead(f"engine core process died: {self.dead}")


def run_core(conn: Connection, config_bytes: bytes, parent_pid: int) -> None:
    """The child's main: load, report Ready, then serve until Shutdown or the parent goes."""
    from mmserve.engine.loading import load_engine_parts

    try:
        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        engine = load_engine_parts(replace(config, multiprocess=False))
        conn.send_bytes(m.encoder.encode(_ready(engine)))
        with ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="grammar") as pool:
            _serve(conn, engine, parent_pid, pool)
    except (EOFError, BrokenPipeError):
        pass  # the parent went away: nothing to report to
    except BaseException as e:
        logger.exception("engine core process failed")
        try:
            conn.send_bytes(m.encoder.encode(m.Error(f"{type(e).__name__}: {e}")))
        except OSError:
            pass


class _Compiling:
    """Requests whose grammar compiles on the pool; they join the core when it is ready."""

    def __init__(self, engine: Any, pool: ThreadPoolExecutor) -> None:
        self.engine, self.pool = engine, pool
        self.pending: list[tuple[Future[Any], Request]] = []

    def submit(self, request: Request) -> None:
        structured = request.params.structured
        if isinstance(structured, dict):  # msgspec decodes the Any-typed field as a dict
            from mmserve.structured_output.params import StructuredOutputParams

            request.params.structured = StructuredOutputParams(**structured)
        self.pending.append((self.pool.submit(self.engine.compile_grammar, request.params), request))

    def admit_ready(self, conn: Connection) -> None:
        still = []
        for future, request in self.pending:
            if not future.done():
                still.append((future, request))
                continue
            try:
                request.grammar = future.result().matcher()
                self.engine.core.add_request(request)
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                _fail(conn, request.request_id, e)
        self.pending = still


def _serve(conn: Connection, engine: Any, parent_pid: int, pool: ThreadPoolExecutor) -> None:
    core, compiling = engine.core, _Compiling(engine, pool)
    while True:
        compiling.admit_ready(conn)
        busy = core.has_unfinished
        waiting = 0.0 if busy else (0.005 if compiling.pending else 1.0)
        # idle: block (in slices, to notice being orphaned); busy: take only what is queued
        if conn.poll(waiting):
            msg = m.to_core_decoder.decode(conn.recv_bytes())  # EOFError once the parent is gone
            if isinstance(msg, m.Shutdown):
                return
            _apply(conn, core, msg, compiling)
        elif busy:
            outputs = core.step()
            if outputs:
                conn.send_bytes(m.encoder.encode(m.Outputs([m.encode_output(o) for o in outputs])))
        elif os.getppid() != parent_pid:
            return


def _fail(conn: Connection, request_id: str, error: Exception) -> None:
    failed = m.Output(request_id, [], None, None, "abort", error=str(error))
    conn.send_bytes(m.encoder.encode(m.Outputs([failed])))


def _apply(conn: Connection, core: Any, msg: Any, compiling: _Compiling) -> None:
    if isinstance(msg, m.AddRequests):
        for added in msg.requests:
            try:
                request = m.decode_request(added)
                if request.params.structured is not None:
                    compiling.submit(request)
                else:
                    core.add_request(request)
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                _fail(conn, added.request_id, e)
    elif isinstance(msg, m.Abort):
        compiling.pending = [(f, r) for f, r in compiling.pending if r.request_id not in msg.request_ids]
        core.abort(msg.request_ids)
    elif isinstance(msg, m.Stop):
        core.stop(msg.request_id)
    elif isinstance(msg, m.GetStats):
        kv = core.kv
        stats = m.Stats(kv.pool.num_blocks, kv.num_free_blocks, len(core.scheduler.requests))
        conn.send_bytes(m.encoder.encode(stats))


def _ready(engine: Any) -> m.Ready:
    from mmserve.models.gguf_cache import materialize
    from mmserve.models.loader import resolve_model_source

    source = materialize(resolve_model_source(engine.core.config.model.model))
    model, setup = engine.core.runner.model, engine.setup
    return m.Ready(
        str(source.folder),
        source.gguf_file,
        engine.max_model_len,
        engine.vocab_size,
        model.vocab_size,
        getattr(model, "hidden_size", None),
        getattr(model, "type_vocab_size", 1),
        sorted(engine.eos_token_ids),
        engine.architecture,
        list(setup.tasks),
        setup.score_method,
        list(setup.labels),
        setup.embedding_size,
        setup.max_input_len,
        setup.yes_no_ids,
        setup.st_normalize,
        engine.num_kv_blocks,
        engine.device,
        engine.compute_dtype,
        engine.images is not None,
        engine.quantization,
    )


def load_multiprocess_engine(config: EngineConfig) -> LLMEngine:
    """An LLMEngine whose core runs in a child process; only the tokenizer loads here."""
    from mmserve.engine.llm_engine import LLMEngine
    from mmserve.engine.pooling_setup import PoolingSetup
    from mmserve.processors.tokenizer import load_tokenizer

    client = EngineCoreClient(config)
    r = client.ready
    tokenizer = load_tokenizer(r.model_folder, r.gguf_file)
    setup = PoolingSetup(
        tuple(r.tasks),
        None,
        r.score_method,
        tuple(r.labels),
        r.embedding_size,
        r.max_input_len,
        r.yes_no_ids,
        r.st_normalize,
    )
    images = None
    if r.reads_images:  # size placeholders with a weightless copy of the model
        from mmserve.engine.loading import image_prompts

        client.runner = RemoteRunner(_meta_model(r.model_folder))
        images = image_prompts(client.runner.model, Path(r.model_folder))
    core = cast("EngineCore", client)  # a duck-typed stand-in (see EngineCoreClient)
    return LLMEngine(
        core, tokenizer, frozenset(r.eos_token_ids), r.vocab_size, setup, r.architecture, images
    )


def _meta_model(folder: str) -> Any:
    """The model class built on the meta device: its config-derived facts and methods
    (image token counts, M-RoPE positions), no weights."""
    import torch

    from mmserve.attention.torch_ref import TorchAttentionBackend
    from mmserve.models.loader import ModelSource, load_hf_config
    from mmserve.models.registry import architecture_of, get_model_class

    hf_config = load_hf_config(ModelSource(Path(folder), None))
    with torch.device("meta"):
        return get_model_class(architecture_of(hf_config))(hf_config, TorchAttentionBackend())
