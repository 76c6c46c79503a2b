"""The runner's side of tensor parallelism: rank 0's runner hands each step to the other
ranks (RankMirror) before running it; every other rank's runner runs what arrives (follow).

Every rank runs the same launch() and sample() on the same plan, so every rank meets the same
collectives in the same order: the all-reduces of the forward pass, the logits' all-gather
(only for rows that sample, and prompt-logprob rows), and the broadcast of rank 0's sampled
tokens, which fill the next batch's placeholders on every rank. Only rank 0 reads results:
its plans carry the grammar matchers, pooling requests and the tokens penalties look at; the
others' copies do not (engine/tp_workers.py strips them), and what they sample is replaced by
rank 0's tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from mmserve.engine.sched_output import SchedulerOutput
from mmserve.models.parallel import TensorParallel


class RankMirror(Protocol):
    """Ranks 1..N-1 of a tensor-parallel model, as rank 0's runner drives them."""

    parallel: TensorParallel  # the group, rank 0's place in it

    def launch(self, plan: SchedulerOutput) -> None:
        """Sends the step to the other ranks (they run it as rank 0 does)."""
        ...

    def capture_graphs(
        self, max_batch: int, max_model_len: int, max_tokens: int, spec: tuple[int, int],
        prefill_tokens: int,
    ) -> None:  # fmt: skip
        """The other ranks capture the same CUDA graphs (as rank 0 is about to)."""
        ...

    def check_alive(self) -> None:
        """mmserve.errors.EngineDead when another rank is gone."""
        ...

    def shutdown(self) -> None:
        """Stops the other ranks; no process is left behind."""
        ...


class Follower(Protocol):
    """What follow() drives: a ModelRunner (named by its methods, not imported: the runner
    imports this module)."""

    def launch(self, plan: SchedulerOutput) -> Any: ...

    def sample(self, step: Any) -> None: ...

    def capture_graphs(
        self, max_batch: int, max_model_len: int, max_tokens: int, spec: tuple[int, int],
        prefill_tokens: int,
    ) -> None: ...


class Step:
    """A plan for a follower rank to run."""

    def __init__(self, plan: SchedulerOutput) -> None:
        self.plan = plan


class Capture:
    """capture_graphs() arguments for a follower rank."""

    def __init__(self, args: tuple[int, int, int, tuple[int, int], int]) -> None:
        self.args = args


def follow(runner: Follower, receive: Callable[[], Step | Capture | None]) -> None:
    """A follower rank's loop: runs each step rank 0 sends, until receive() returns None."""
    import torch

    with torch.inference_mode():
        while (message := receive()) is not None:
            if isinstance(message, Capture):
                runner.capture_graphs(*message.args)
                continue
            step = runner.launch(message.plan)
            if step is not None:
                runner.sample(step)  # its collectives; the tokens are rank 0's
