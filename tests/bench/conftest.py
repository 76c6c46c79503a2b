"""Shared fixtures of the benchmark tests."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
import torch

from mmserve.bench import cli


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny tensor ops on a busy machine: torch's thread pool only adds contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def bench_args(kind: str, *flags: str) -> argparse.Namespace:
    """`mmserve bench KIND FLAGS...` as the CLI parses it."""
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", kind, *flags])
