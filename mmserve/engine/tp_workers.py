"""The ranks of a tensor-parallel model: rank 0 is the engine core (in the server's process or
the engine process); ranks 1..N-1 are processes this module starts on this host, or the ones
torchrun started (then `mmserve serve` runs follow_torchrun() on them).

Rank 0 sends each step's plan to the others as msgspec bytes (never pickle), broadcast over a
gloo group of its own (its timeout is long: an idle server sends nothing); the forward passes'
collectives run on a second group, NCCL on CUDA, gloo on CPU, under distributed_timeout. Both
groups are made for this model (not torch's global default group). A rank that dies fails
rank 0's next collective (its socket closes), and check_alive() sees its exit at once; a
collective that hangs past the timeout raises. Either way the engine is dead, its model turns
NOT_SERVING, its calls fail UNAVAILABLE, and shutdown() stops every rank. A spawned rank dies
with its parent (PR_SET_PDEATHSIG) and exits when rank 0's socket closes.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import torch

from mmserve import envs
from mmserve.config import EngineConfig
from mmserve.engine import messages as m
from mmserve.engine.sched_output import ScheduledRequest, SchedulerOutput
from mmserve.errors import RankLost
from mmserve.models.parallel import TensorParallel
from mmserve.runner.distributed import Capture, Step

logger = logging.getLogger(__name__)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
# ranks on this host: NCCL's bootstrap sockets (and its socket transport) on the loopback
# interface, over IPv4 as the store and gloo; by default NCCL listens on the first network
# interface, reachable from the network
NCCL_LOOPBACK_ENV = {"NCCL_SOCKET_IFNAME": "=lo", "NCCL_SOCKET_FAMILY": "AF_INET"}
PLAN_TIMEOUT = datetime.timedelta(days=365)  # followers wait for plans as long as rank 0 idles
STOP_GRACE_S = 2.0  # a rank gets this long to exit after RankShutdown, then it is killed
_PR_SET_PDEATHSIG = 1


@dataclass
class Groups:
    """One rank's two process groups of a model."""

    parallel: TensorParallel  # the forward passes' collectives (NCCL on CUDA, gloo on CPU)
    plans: Any  # gloo ProcessGroup: rank 0's messages (receivers wait for them as long as it idles)
    timeout: datetime.timedelta  # distributed_timeout: rank 0's sends wait no longer


def rank_device(device: str, local_rank: int) -> str:
    """The device of a rank: cuda:<local rank> on CUDA (one GPU per rank), else cpu."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return f"cuda:{local_rank}" if device.startswith("cuda") else device


def nccl_env(loopback: bool, environ: Mapping[str, str]) -> dict[str, str]:
    """The NCCL settings a rank's process needs that `environ` does not set (a value the user
    set wins). loopback: the ranks share this host, so NCCL binds the loopback interface,
    unless the user chose an interface (NCCL_SOCKET_IFNAME) or an address (NCCL_COMM_ID)."""
    wanted = dict(NCCL_ENV)
    if loopback and not {"NCCL_SOCKET_IFNAME", "NCCL_COMM_ID"} & environ.keys():
        wanted |= NCCL_LOOPBACK_ENV
    return {name: value for name, value in wanted.items() if name not in environ}


def make_groups(
    store: Any, rank: int, size: int, device: str, timeout: float, loopback: bool = False
) -> Groups:
    """Both groups over store (a rendezvous); every rank calls it, and it returns once all have.
    loopback: the ranks share this host (spawned here, or torchrun's on one host:
    envs.torchrun_one_host), so gloo listens on 127.0.0.1 only (by
    default it binds the address the host name resolves to, reachable from the network), and
    NCCL on the loopback interface (nccl_env)."""
    import torch.distributed as dist

    def gloo(prefix: str, limit: datetime.timedelta) -> Any:
        if not loopback:
            return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, limit)
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = limit
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, options)

    limit = datetime.timedelta(seconds=timeout)
    plans = gloo("plans", PLAN_TIMEOUT)
    if device.startswith("cuda"):
        # read when the NCCL group is made, in every rank's process (rank 0's too): NVLink
        # multicast off, as the GPU hosts need; a failed or timed-out collective raises in
        # wait() (RankLost) instead of the NCCL watchdog tearing the process down; NCCL's
        # sockets on loopback for ranks of this host (read once, at the process's first)
        os.environ.update(nccl_env(loopback, os.environ))
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = limit
        compute: Any = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, options)
    else:
        compute = gloo("gloo", limit)
    return Groups(TensorParallel(rank, size, compute, device), plans, limit)


def broadcast_bytes(
    group: Any, data: bytes | None, timeout: datetime.timedelta | None = None
) -> bytes:
    """Rank 0's bytes (data) on every rank (the others pass None); timeout: instead of the
    group's."""
    length = torch.tensor([0 if data is None else len(data)], dtype=torch.int64)
    wait = () if timeout is None else (timeout,)
    group.broadcast(length, 0).wait(*wait)
    if data is None:
        buffer = torch.empty(int(length.item()), dtype=torch.uint8)
    else:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    group.broadcast(buffer, 0).wait(*wait)
    return buffer.numpy().tobytes()


def for_ranks(plan: SchedulerOutput) -> SchedulerOutput:
    """The plan as the other ranks need it: what builds the batch and shapes the collectives.
    Grammar matchers stay with rank 0 (they mask only its logits), pooling too (the hidden
    states are the same on every rank), and the tokens penalties read (rank 0 samples);
    prompt ids travel only where the batch needs them (prompt logprobs, M-RoPE)."""
    return replace(plan, scheduled=[_for_ranks(s) for s in plan.scheduled])


def _for_ranks(s: ScheduledRequest) -> ScheduledRequest:
    keep_prompt = bool(s.params.prompt_logprobs) or s.mrope_positions is not None
    return replace(
        s,
        grammar=None,
        pooling=None,
        draft_probs=None,  # (a draft model's q, on rank 0's device: rank 0 alone verifies)
        output_token_ids=[],
        prompt_token_ids=s.prompt_token_ids if keep_prompt else [],
    )


class Ranks:
    """The RankMirror (runner/distributed.py) of rank 0: the other ranks as it drives them."""

    def __init__(
        self, groups: Groups, procs: list[subprocess.Popen[bytes]], store: Any = None
    ) -> None:
        self.parallel = groups.parallel
        self._plans = groups.plans
        self._timeout = groups.timeout
        self._procs = procs  # spawned ranks 1..N-1 ([] under torchrun)
        self._store = store  # the rendezvous rank 0 hosts, kept as long as the ranks run
        self._stopped = False

    def launch(self, plan: SchedulerOutput) -> None:
        if plan.is_empty and not plan.finished_ids and not plan.encoder_free:
            return  # nothing for them to do or forget
        self._send(m.RankStep(for_ranks(plan)))

    def capture_graphs(
        self, max_batch: int, max_model_len: int, max_tokens: int, spec: tuple[int, int],
        prefill_tokens: int,
    ) -> None:  # fmt: skip
        self._send(m.RankCapture(max_batch, max_model_len, max_tokens, spec, prefill_tokens))

    def check_alive(self) -> None:
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                raise RankLost(f"tensor-parallel rank {rank} exited with code {code}")

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        grace = STOP_GRACE_S
        try:  # a hung or dead rank takes no message: then every rank is killed at once
            self._send(m.RankShutdown(), datetime.timedelta(seconds=STOP_GRACE_S))
        except RankLost:
            grace = 0.0
        for proc in self._procs:
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _send(self, message: m.ToRank, timeout: datetime.timedelta | None = None) -> None:
        self.check_alive()
        try:
            broadcast_bytes(self._plans, m.encoder.encode(message), timeout or self._timeout)
        except RuntimeError as e:  # a rank's socket closed, or the send timed out
            raise RankLost(f"tensor-parallel ranks unreachable: {e}") from e


def start_ranks(config: EngineConfig) -> Ranks:
    """Rank 0's side: spawns ranks 1..N-1 on this host (or joins the ranks torchrun started)
    and returns once every rank has joined both groups. config.model.model is a folder
    (a GGUF is converted first): every rank reads its slices of the same files."""
    import torch.distributed as dist

    size, timeout = config.parallel.tensor_parallel_size, config.parallel.distributed_timeout
    launched = envs.torchrun_rank()
    if launched is not None:
        rank, world, local_rank = launched
        if (rank, world) != (0, size):
            raise ValueError(
                f"tensor_parallel_size {size} under torchrun needs WORLD_SIZE {size} and the "
                f"server on RANK 0 (got RANK {rank}, WORLD_SIZE {world})"
            )
        store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout)))
        device = rank_device(config.model.device, local_rank)
        return Ranks(make_groups(store, 0, size, device, timeout, loopback=envs.torchrun_one_host()), [])
    # the store listens on a socket bound to 127.0.0.1 (TCPStore's own binds every interface)
    listener = socket.create_server(("127.0.0.1", 0))
    store = dist.TCPStore(
        "127.0.0.1",
        listener.getsockname()[1],
        size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
        master_listen_fd=listener.detach(),
    )
    payload = m.encoder.encode(config)
    procs = [_spawn(rank, size, store.port, payload) for rank in range(1, size)]
    try:
        device = rank_device(config.model.device, 0)
        groups = make_groups(store, 0, size, device, timeout, loopback=True)
    except BaseException:
        _kill(procs)
        raise
    return Ranks(groups, procs, store)


def rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of a spawned rank: `environ` and the NCCL settings of ranks that share
    this host (see make_groups; a value set in environ wins)."""
    return {**environ, **nccl_env(True, environ)}


def _spawn(rank: int, size: int, port: int, config: bytes) -> subprocess.Popen[bytes]:
    env = rank_env(os.environ)
    cmd = [sys.executable, "-m", "mmserve.engine.tp_workers", str(rank), str(size), str(port)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
    assert proc.stdin is not None
    proc.stdin.write(config)
    proc.stdin.close()
    return proc


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def follow_torchrun(config: EngineConfig) -> None:
    """A rank > 0 that torchrun started: joins rank 0 (the server) and runs its steps."""
    import torch.distributed as dist

    launched = envs.torchrun_rank()
    if launched is None:
        raise ValueError("follow_torchrun() outside torchrun (no RANK / WORLD_SIZE)")
    from mmserve.models.loader import tp_model_path

    rank, world, local_rank = launched
    config = replace(config, model=replace(config.model, model=tp_model_path(config.model)))  # as rank 0 reads it
    timeout = config.parallel.distributed_timeout
    store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout)))
    device = rank_device(config.model.device, local_rank)
    _run_rank(config, make_groups(store, rank, world, device, timeout, loopback=envs.torchrun_one_host()))


def _run_rank(config: EngineConfig, groups: Groups) -> None:
    """Loads this rank's shard, sizes its KV cache with the others, then runs rank 0's steps."""
    from mmserve.attention import get_attention_backend
    from mmserve.engine.engine_core import kv_blocks_for_budget, kv_cache_dtype
    from mmserve.models.loader import load_model, resolve_dtype
    from mmserve.runner.distributed import follow
    from mmserve.runner.model_runner import ModelRunner

    tp = groups.parallel
    device = torch.device(tp.device)
    dtype = resolve_dtype(config.model.dtype, device)
    backend = get_attention_backend("triton" if device.type == "cuda" else "torch")
    model, _, _ = load_model(config.model, device, dtype, backend, tp)
    blocks = 0
    cache_dtype = kv_cache_dtype(config.cache, dtype)
    if model.capabilities.uses_kv_cache:
        cache = config.cache
        blocks = cache.num_blocks or kv_blocks_for_budget(cache, model, cache_dtype, device)
    blocks = tp.min_over_ranks(blocks)  # rank 0's EngineCore takes the same minimum
    runner = ModelRunner(
        model, blocks, config.cache.block_size, device, cache_dtype, config.seed, parallel=tp
    )
    follow(runner, lambda: _receive(groups.plans))


def _receive(plans: Any) -> Step | Capture | None:
    message = m.to_rank_decoder.decode(broadcast_bytes(plans, None))
    if isinstance(message, m.RankShutdown):
        return None
    if isinstance(message, m.RankCapture):
        return Capture(
            (message.max_batch, message.max_model_len, message.max_tokens, message.spec, message.prefill_tokens)
        )
    for s in message.plan.scheduled:
        if s.mrope_positions is not None:  # a field typed Any arrives as the encoded triple
            s.mrope_positions = m.tensor_from_wire(s.mrope_positions)
    return Step(message.plan)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (no orphan ranks)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def main(argv: list[str]) -> None:
    """A spawned rank: `python -m mmserve.engine.tp_workers RANK SIZE PORT`, the EngineConfig
    as msgpack on stdin."""
    import torch.distributed as dist

    _die_with_parent()
    rank, size, port = (int(a) for a in argv)
    config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=EngineConfig)
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(message)s")
    timeout = datetime.timedelta(seconds=config.parallel.distributed_timeout)
    if not rank_device(config.model.device, rank).startswith("cuda"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # the ranks share the cores
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
    groups = make_groups(
        store, rank, size, rank_device(config.model.device, rank), timeout.total_seconds(),
        loopback=True,
    )
    try:
        _run_rank(config, groups)
    except RuntimeError as e:  # RankLost: rank 0 went away (its socket closed), or a timeout
        logger.warning("stopping: %s", e)
        sys.exit(1)
    logging.shutdown()
    os._exit(0)  # RankShutdown: nothing to tear down that the exit does not (saves a second)


if __name__ == "__main__":
    main(sys.argv[1:])
