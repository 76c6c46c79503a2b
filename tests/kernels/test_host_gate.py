"""The host gate (mmserve.kernels.host_gate): work a stream enqueues after a gate runs only once a
host thread opened it, and sees what that thread wrote before opening it. On CUDA the gate waits
on the device; under the interpreter (CPU) the launch itself returns only once opened."""

from __future__ import annotations

import threading
import time

import torch

from mmserve.kernels.host_gate import HostGate


def _source(device: torch.device, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32, pin_memory=device.type == "cuda")


def test_work_after_the_gate_sees_what_the_host_wrote_before_opening(device: torch.device) -> None:
    gate = HostGate(device)
    for ticket in (1, 2, 3, 16, 17):  # (values Triton would specialise: 1, multiples of 16)
        src = _source(device, 4096)
        opened = threading.Event()

        def fill(src: torch.Tensor = src, ticket: int = ticket, opened: threading.Event = opened) -> None:
            time.sleep(0.05)  # the main thread is past close() (or waiting in it) by now
            src.fill_(ticket)
            opened.set()
            gate.open(ticket)

        worker = threading.Thread(target=fill)
        worker.start()
        gate.close(ticket)
        dst = src.to(device, non_blocking=True)  # copied after the gate: the filled values
        worker.join()
        assert torch.equal(dst.cpu(), torch.full((4096,), ticket, dtype=torch.int32))
        assert opened.is_set() and gate.gave_up == 0


def test_an_opened_ticket_lets_it_and_earlier_ones_through(device: torch.device) -> None:
    gate = HostGate(device)
    gate.open(5)
    for ticket in (0, 3, 5):
        gate.close(ticket)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert gate.gave_up == 0


def test_a_wait_never_opened_gives_up_and_says_so(device: torch.device) -> None:
    gate = HostGate(device, max_spins=64)
    gate.open(1)
    gate.close(2)
    gate.close(3)
    gate.close(1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert gate.gave_up == 2
