"""Builds outlines-core Indexes in processes of their own, so that a build past its time
limit is stopped, not left running (the build is native code, which a thread cannot leave:
outlines-core 0.2.14 took six minutes on one 300-byte schema), and one past its memory fails
there (another schema took it past 20 GB). The regex of a schema is made there too.

The worker is this file run as a script (importing it as part of mmserve would load torch):
frames (8-byte length, then the bytes) on stdin and stdout, never a pickle - first the
vocabulary in outlines-core's own binary form, then one job per build as JSON, answered by
b"o" and the Index in its binary form, or b"e" and the error message.
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

_HEADER = struct.Struct("<Q")
# An Index bigger than this is refused: memory (the grammar cache keeps hundreds, each about
# as big again once loaded), and the time to hand it over (one real-world schema's was
# 1.7 GB). Each free-text state of the automaton maps most of the vocabulary: a string of
# maxLength 255 alone makes ~90 MiB.
MAX_INDEX_BYTES = 128 * 1024 * 1024
# The worker's address space: a build that needs more fails there (one real-world schema
# took outlines-core past 20 GB), not in the server.
WORKER_MEMORY_BYTES = 4 * 1024 * 1024 * 1024

# outlines-core 0.2.14 drops each token whose bytes before its last one complete a match
# (its DFA reports a match one byte late, and src/index.rs keeps a token landing on such a
# state only if the token ends a match too; fixed upstream after 0.2.14, unreleased):
# `0(\.0)?` refused "." after "0", the choice ["a", "ab"] refused "ab". So every Index is
# built for the regex followed by an end mark that no token of the vocabulary holds: a token
# can then never end past a match, and the output so far matches the regex exactly where
# the end mark's own token leads to a final state (outlines_backend.py). NUL: JSON text never
# holds one, and the outlines backend never writes one. The cost: an accepting state from
# which the regex could read a NUL (`.*` at the end) gets a twin, reached only by the mark.
END_MARK = b"\x00"
END_MARK_TOKEN_ID = 2**32 - 1  # outlines-core's ids are u32; past any bitmask's width
# Whitespace between JSON tokens: any run, as pretty-printed JSON has (outlines-core's own is
# one space at most). Unbounded, unlike xgrammar's 32 per gap: a bound is a counter, one
# automaton state per count and gap, which made builds about nine times slower (one real
# schema: 1.5 s -> 18.7 s), while `*` costs what one space did.
JSON_WHITESPACE = r"[ \n\r\t]*"


def _write(stream: IO[bytes], data: bytes) -> None:
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read(stream: IO[bytes]) -> bytes | None:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    return stream.read(_HEADER.unpack(header)[0])


def binary(value: Any) -> bytes:
    """An outlines-core Index's or Vocabulary's own binary form: the bytes its pickling
    support hands to `from_binary` (which reads them back without running any code)."""
    rebuild, args = value.__reduce__()
    if getattr(rebuild, "__name__", "") != "from_binary" or not isinstance(args[0], bytes):
        raise TypeError(f"{type(value).__name__} has no binary form")
    return args[0]


@dataclass(frozen=True)
class SchemaJob:
    """A prepared schema (prepare.py), for outlines-core's regex, with its splices
    (outlines_schema.py: placeholder text -> a regex, or a map's key regex and value schema)."""

    schema_text: str
    splices: dict[str, Any] = field(default_factory=dict)


Job = str | SchemaJob  # a regex, or a schema


def _payload(job: Job) -> bytes:
    """The job as JSON (a splice's pair becomes a list)."""
    value = job if isinstance(job, str) else [job.schema_text, job.splices]
    return json.dumps(value).encode()


def _regex(payload: Any) -> str:
    """The regex of a job's payload, end mark included (in the worker: it imports
    outlines-core)."""
    if isinstance(payload, str):
        return rf"(?:{payload})\x00"
    from outlines_core.json_schema import build_regex_from_schema

    schema_text, splices = payload
    regex = build_regex_from_schema(schema_text, JSON_WHITESPACE)
    return _regex(_spliced(str(regex), splices))


def _spliced(regex: str, splices: dict[str, Any]) -> str:
    """outlines-core's regex with each placeholder replaced, also those inside what
    replaces another."""
    parts = {placeholder: _splice_regex(splice) for placeholder, splice in splices.items()}
    for _ in range(len(parts) + 1):
        found = [p for p in parts if p in regex]
        if not found:
            return regex
        for placeholder in found:
            regex = regex.replace(placeholder, f"(?:{parts[placeholder]})")
    raise ValueError("placeholders nested in a cycle")  # cannot happen: schemas are written out


def _splice_regex(splice: Any) -> str:
    if isinstance(splice, str):
        return splice
    from outlines_core.json_schema import build_regex_from_schema

    keys, values = splice  # an object of one patternProperties pattern
    ws = JSON_WHITESPACE
    member = f'"{keys}"{ws}:{ws}(?:{build_regex_from_schema(json.dumps(values), ws)})'
    return rf"\{{{ws}(?:{member}(?:{ws},{ws}{member})*)?{ws}\}}"


class BuildTimeout(Exception):
    """A build ran past its time limit and was stopped."""


class IndexBuilder:
    """Index(regex, vocabulary) in up to `max_workers` worker processes at once, each build
    stopped after `timeout_s`. Thread-safe; workers start on first use and are reused."""

    def __init__(self, vocabulary: Any, timeout_s: float, max_workers: int = 2) -> None:
        self.timeout_s = timeout_s
        self._vocabulary = binary(vocabulary)
        self._idle: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()
        self._slots = threading.Semaphore(max_workers)

    def build(self, job: Job) -> Any:
        """The Index; BuildTimeout past the limit, ValueError for outlines-core's errors."""
        with self._slots:
            worker = self._checkout()
            try:
                status, value = self._call(worker, job)
            except BaseException:
                _stop(worker)
                raise
            with self._lock:
                self._idle.append(worker)
        if status != "ok":
            raise ValueError(value)
        return value

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            _stop(worker)

    def _checkout(self) -> subprocess.Popen[bytes]:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.poll() is None:
                    return worker
        worker = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert worker.stdin is not None
        worker.stdin.write(_HEADER.pack(len(self._vocabulary)) + self._vocabulary)
        worker.stdin.flush()
        return worker

    def _call(self, worker: subprocess.Popen[bytes], job: Job) -> tuple[str, Any]:
        """The worker's answer, read by the deadline (the build and the hand-over)."""
        assert worker.stdin is not None and worker.stdout is not None
        try:
            _write(worker.stdin, _payload(job))
        except OSError:  # it ended (a broken pipe)
            raise ValueError("the outlines-core worker process ended") from None
        deadline = time.monotonic() + self.timeout_s
        fd = worker.stdout.fileno()
        header = _read_by(fd, _HEADER.size, deadline, self.timeout_s)
        data = _read_by(fd, _HEADER.unpack(header)[0], deadline, self.timeout_s)
        if data[:1] == b"e":
            return "error", data[1:].decode()
        from outlines_core import Index

        return "ok", Index.from_binary(data[1:])


def _read_by(fd: int, size: int, deadline: float, timeout_s: float) -> bytes:
    chunks, left = [], size
    while left:
        wait = deadline - time.monotonic()
        if wait <= 0 or not select.select([fd], [], [], wait)[0]:
            raise BuildTimeout(f"over {timeout_s:g} s")
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise ValueError(
                f"building its automaton ran out of memory (over {WORKER_MEMORY_BYTES >> 30} GiB)"
            )
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _stop(worker: subprocess.Popen[bytes]) -> None:
    worker.kill()
    worker.wait()


def _serve() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    from outlines_core import Index, Vocabulary

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    vocabulary = Vocabulary.from_binary(_read(stdin))
    while (job := _read(stdin)) is not None:
        try:
            data = b"o" + binary(Index(_regex(json.loads(job)), vocabulary))
        except Exception as e:  # noqa: BLE001 - reported to the caller
            data = b"e" + str(e).encode()
        if len(data) > MAX_INDEX_BYTES:
            data = f"eits automaton is too large ({len(data) >> 20} MiB)".encode()
        _write(stdout, data)


if __name__ == "__main__":
    _serve()
