"""Where one gRPC client's Embed calls spend their time (issue 23, target 4): serves a model with
`mmserve serve`, sends 64-text calls from this process one after another, and samples the server
(and its engine process) and this client with py-spy. Prints the client's latency per call, the
server's own `timing.total_ms`, and each process's busiest functions (inclusive samples).

    python scripts/embed_grpc_profile.py --model shape:bert-base --device cuda --out /tmp/out

Needs py-spy (`pip install py-spy`; not a dependency of mmserve). Sampling slows what it samples a
little; compare shares, not absolute times, with `mmserve bench embed`."""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from transformers import AutoTokenizer

from mmserve.bench.embed import make_texts, model_folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def summarize(raw: Path, top: int) -> str:
    """py-spy's raw (collapsed) stacks -> per process, the functions by inclusive samples."""
    by_proc: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        at = max((i for i, f in enumerate(frames) if f.startswith("process ")), default=-1)
        proc = frames[at][:70] if at >= 0 else "this client"
        totals[proc] += int(count)
        seen = set()
        for frame in frames[at + 1 :]:
            name = re.sub(r"\((?:/[^:]*/(?:site-packages|lib/python3\.\d+|mmserve)/)?", "(", frame)[:130]
            if name not in seen:
                seen.add(name)
                by_proc[proc][name] += int(count)
        leaves[proc][name] += int(count)  # (the innermost frame's)
    out = []
    for proc, total in totals.most_common():
        # the frames nearly every sample passes through (the thread's base) say nothing
        inner = [(name, n) for name, n in by_proc[proc].most_common() if n < 0.97 * total]
        out.append(f"== {proc}: {total} samples; inclusive")
        out += [f"{n:7d} {100 * n / total:5.1f}%  {name}" for name, n in inner[:top]]
        out.append("-- innermost")
        out += [f"{n:7d} {100 * n / total:5.1f}%  {name}" for name, n in leaves[proc].most_common(top // 2)]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shape:bert-base")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seconds", type=float, default=12.0, help="profiled seconds of calls")
    p.add_argument("--rate", type=int, default=400, help="py-spy samples a second")
    p.add_argument("--top", type=int, default=45)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    p.add_argument("serve_args", nargs="*", help="more `mmserve serve` flags (after --)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = model_folder(args.model)
    texts = make_texts(AutoTokenizer.from_pretrained(str(folder)), args.batch_size * 8, args.seq_len)
    calls = [texts[i : i + args.batch_size] for i in range(0, len(texts), args.batch_size)]
    with open(out / "embed_grpc_server.log", "w") as log, open(out / "spy_errors.log", "w") as errors:
        run(args, out, folder, calls, log, errors)


def run(
    args: argparse.Namespace, out: Path, folder: Path, calls: list[list[str]], log: IO[str], errors: IO[str]
) -> None:
    from mmserve_client import Client
    from mmserve_client.errors import MMServeError

    spy = shutil.which("py-spy") or str(Path(sys.prefix) / "bin" / "py-spy")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mmserve.server.cli", "serve", f"m={folder}", "--device", args.device,
         "--port", str(port), *args.serve_args],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        client = Client(f"127.0.0.1:{port}", timeout=600)
        deadline = time.monotonic() + 600
        while True:
            try:
                client.embed(calls[0], model="m", truncate="right")
                break
            except MMServeError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start: see {out / 'embed_grpc_server.log'}")
                time.sleep(1)
        for i in range(30):  # warm
            client.embed(calls[i % len(calls)], model="m", truncate="right")
        raw_server, raw_client = out / "spy_server.txt", out / "spy_client.txt"
        spies = [
            subprocess.Popen([spy, "record", "-p", str(pid), "-r", str(args.rate), "-d", str(round(args.seconds)),
                              "-f", "raw", "-o", str(path), "--nonblocking", *extra],
                             stdout=subprocess.DEVNULL, stderr=errors)
            for pid, path, extra in ((server.pid, raw_server, ["--subprocesses"]), (os.getpid(), raw_client, []))
        ]  # fmt: skip
        time.sleep(1.0)
        latency, server_ms = [], []
        start = time.monotonic()
        n = 0
        while time.monotonic() - start < args.seconds - 2:
            t = time.perf_counter()
            result = client.embed(calls[n % len(calls)], model="m", truncate="right")
            latency.append(1e3 * (time.perf_counter() - t))
            server_ms.append(result.timing.total_ms)
            n += 1
        for s in spies:
            s.wait()
        latency.sort()
        server_ms.sort()
        report = [
            f"calls {n} of {args.batch_size} x {args.seq_len} tokens; client latency median "
            + f"{latency[n // 2]:.2f} ms ({1e3 * args.batch_size / latency[n // 2]:.0f} texts/s), "
            + f"server timing.total_ms median {server_ms[n // 2]:.2f}"
        ]
        for path in (raw_server, raw_client):
            if path.exists():
                report.append(summarize(path, args.top))
        text = "\n".join(report)
        (out / "embed_grpc_profile.txt").write_text(text + "\n")
        print(text)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
