"""The engine core in its own process, so that the front end (tokenisation, detokenisation,
serialisation) never stalls a model step.

The child ("spawn" context) loads the model from the EngineConfig, answers Ready with its
EngineInfo, then loops: apply queued messages (blocking when idle), step, send the outputs.
Only msgpack bytes of the structs in messages.py cross the pipe. `ProcessClient` is the
front end's EngineClient for it. Grammars are compiled again in the child (engine/grammars.py).
Benchmarks that reach into `core.scheduler` or `core.kv` need the in-process core."""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import NoReturn, TypeVar

import msgspec

from mmserve.config import EngineConfig
from mmserve.engine import messages as m
from mmserve.engine.engine_core import EngineCore
from mmserve.engine.loading import load_engine
from mmserve.errors import EngineDead, RankLost

logger = logging.getLogger(__name__)
READY_TIMEOUT_S = 600.0  # model load (weights, KV cache, CUDA graphs)
STEP_WAIT_S = 0.05  # how long outputs() waits for news while requests are in flight
IDLE_POLL_S = 1.0  # an idle child checks this often whether its parent is still there
HEARTBEAT_S = 0.5  # a busy child reports at least this often, outputs or not (stall watchdog)
M = TypeVar("M")


# OpenMP threads that wait at a barrier spin this many times before they sleep, in a CPU engine
# process. libgomp spins 300,000 times unless a process has more threads than CPUs. Two engine
# processes on 2 cores (chat and embeddings, each with 2 threads) then spin on each other's cores:
# under a mixed load, chat streams got 41 tok/s and Embed 10 texts/s, against 172 and 43 at
# 1,000 spins (BENCHMARKS.md, session 19).
CPU_GOMP_SPINCOUNT = "1000"


def _throttle_openmp_spinning(config: EngineConfig) -> None:
    """Sets GOMP_SPINCOUNT for the engine processes started from here on, when this one runs on
    the CPU and the user set neither it nor OMP_WAIT_POLICY. A spawned child reads it as its
    OpenMP runtime loads; this process's runtime is loaded already and keeps its own."""
    from mmserve.models.loader import resolve_device

    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return
    if resolve_device(config.model.device).type == "cpu":
        os.environ["GOMP_SPINCOUNT"] = CPU_GOMP_SPINCOUNT


class ProcessClient:
    """An EngineClient (engine/client.py) over a pipe to the engine-core process. Not
    thread-safe: one thread drives it."""

    def __init__(self, config: EngineConfig) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=run_core,
            args=(child_conn, m.encoder.encode(config), os.getpid()),
            name="mmserve-engine-core",
            daemon=True,
        )
        _throttle_openmp_spinning(config)
        self._proc.start()
        child_conn.close()  # only the child holds it now: its death reads as EOF here
        self._in_flight: set[str] = set()
        self._pending: list[m.EngineOutput] = []
        self._outbox: list[m.EngineRequest] = []  # added since the last step (see add)
        self.dead: str | None = None
        self._dead_kind: type[EngineDead] = EngineDead  # RankLost: a tensor-parallel rank's
        self._last_progress = time.monotonic()
        self.info: m.EngineInfo = self._wait_for(m.Ready, READY_TIMEOUT_S).info
        blocks = self.info.num_kv_blocks
        self._stats = m.EngineStats(num_blocks=blocks, num_free_blocks=blocks)  # then the core's

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def add(self, requests: Sequence[m.EngineRequest]) -> None:
        """Queued here and sent with the others added before the next outputs() (or any
        other message): one AddRequests. Sent one by one, a burst reached the core in pieces
        and its first step ran on a few of them (a 64-input Embed call took several steps)."""
        self._check_alive()
        self._outbox.extend(requests)
        self._in_flight.update(r.request_id for r in requests)

    def abort(self, request_ids: Sequence[str]) -> None:
        self._send(m.Abort(list(request_ids)))  # each comes back with finish_reason "abort"

    def stop(self, request_id: str) -> None:
        self._send(m.Stop(request_id))
        self._in_flight.discard(request_id)  # the scheduler sends no output for a stop

    @property
    def has_unfinished(self) -> bool:
        return bool(self._in_flight or self._pending)

    def outputs(self) -> list[m.EngineOutput]:
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

    @property
    def last_progress(self) -> float:
        return self._last_progress

    def check_alive(self) -> None:
        """EngineDead once the core process is gone (killed, crashed), busy or idle. Takes
        any message that came in since (the core's last stats as it went idle)."""
        self._check_alive()
        if not self._proc.is_alive():
            self._died(f"exited with code {self._proc.exitcode}")
        self._receive(0.0)

    @property
    def latest_stats(self) -> m.EngineStats:
        return self._stats

    def stats(self) -> m.Stats:
        self._send(m.GetStats())
        return self._wait_for(m.Stats, 60.0)

    def kv_blocks(self) -> tuple[int, int]:
        stats = self.stats()
        return stats.num_blocks, stats.num_free_blocks

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

    def _send(self, msg: m.ToCore) -> None:
        """Sends msg after any queued requests (so an abort finds what it aborts)."""
        self._flush()
        self._write(msg)

    def _flush(self) -> None:
        if self._outbox:
            requests, self._outbox = self._outbox, []
            self._write(m.AddRequests(requests))

    def _write(self, msg: m.ToCore) -> None:
        self._check_alive()
        try:
            self._conn.send_bytes(m.encoder.encode(msg))
        except OSError as e:
            self._died(f"pipe closed: {e}")

    def _wait_for(self, kind: type[M], timeout: float) -> M:
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

    def _recv(self) -> m.FromCore:
        try:
            msg = m.from_core_decoder.decode(self._conn.recv_bytes())
            self._last_progress = time.monotonic()
            return msg
        except (EOFError, OSError):
            self._proc.join(1.0)
            self._died(f"exited with code {self._proc.exitcode}")

    def _handle(self, msg: m.FromCore) -> None:
        if isinstance(msg, m.Outputs):
            self._pending.extend(msg.outputs)
            if msg.stats is not None:
                self._stats = msg.stats
        elif isinstance(msg, m.Error):
            self._died(msg.message, RankLost if msg.rank_lost else EngineDead)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self._dead_kind(f"engine core process died: {self.dead}")

    def _died(self, why: str, kind: type[EngineDead] = EngineDead) -> NoReturn:
        if self.dead is None:
            self.dead, self._dead_kind = why, kind
        raise self._dead_kind(f"engine core process died: {self.dead}")


def run_core(conn: Connection, config_bytes: bytes, parent_pid: int) -> None:
    """The child's main: load, report Ready, then serve until Shutdown or the parent goes. A
    failure is reported before the core shuts down (stopping tensor-parallel ranks, a hung
    one included, takes a while)."""
    core: EngineCore | None = None
    try:
        config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
        loaded = load_engine(replace(config, multiprocess=False))
        core = loaded.core
        conn.send_bytes(m.encoder.encode(m.Ready(loaded.info)))
        _serve(conn, core, parent_pid)
    except (EOFError, BrokenPipeError):
        pass  # the parent went away: nothing to report to
    except BaseException as e:
        logger.exception("engine core process failed")
        try:
            error = m.Error(f"{type(e).__name__}: {e}", rank_lost=isinstance(e, RankLost))
            conn.send_bytes(m.encoder.encode(error))
        except OSError:
            pass
    finally:
        if core is not None:
            core.shutdown()


def _serve(conn: Connection, core: EngineCore, parent_pid: int) -> None:
    reported = time.monotonic()
    while True:
        busy = core.has_unfinished
        # idle: block (in slices, to notice being orphaned); busy: take only what is queued
        if conn.poll(0.0 if busy else IDLE_POLL_S):
            msg = m.to_core_decoder.decode(conn.recv_bytes())  # EOFError once the parent is gone
            if isinstance(msg, m.Shutdown):
                return
            _apply(conn, core, msg)
        elif busy:
            outputs = core.step()
            # no news for a while (a long chunked prefill): an empty Outputs says it progresses;
            # going idle, one more carries the stats the last step left
            if outputs or not core.has_unfinished or time.monotonic() - reported > HEARTBEAT_S:
                conn.send_bytes(m.encoder.encode(m.Outputs(outputs, core.stats())))
                reported = time.monotonic()
        elif os.getppid() != parent_pid:
            return
        else:
            core.check_alive()  # idle: a tensor-parallel rank that died is reported now


def _apply(conn: Connection, core: EngineCore, msg: m.ToCore) -> None:
    if isinstance(msg, m.AddRequests):
        for request in msg.requests:
            core.add_request(request)
    elif isinstance(msg, m.Abort):
        core.abort(msg.request_ids)
    elif isinstance(msg, m.Stop):
        core.stop(msg.request_id)
    elif isinstance(msg, m.GetStats):
        kv = core.kv
        stats = m.Stats(kv.pool.num_blocks, kv.num_free_blocks, len(core.scheduler.requests))
        conn.send_bytes(m.encoder.encode(stats))
