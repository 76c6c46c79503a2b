"""`mmserve serve [MODEL ...]` and friends. The flags are derived from the settings of the
config dataclasses (mmserve.config.serve_settings); each can also come from the environment as
MMSERVE_<FLAG> (mmserve/envs.py), and the command line wins. Unset flags take their defaults
from the dataclasses, the one place defaults live."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from mmserve import envs
from mmserve.config import EngineConfig, ServeOptions, engine_settings, serve_settings
from mmserve.server.config import ModelSpec, ServerConfig, embedded_defaults
from mmserve.settings import Setting, add_flag, build

logger = logging.getLogger("mmserve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmserve", description="mmserve: LLM inference over gRPC")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve models over gRPC until SIGTERM / Ctrl-C")
    for s in serve_settings():
        _add_argument(serve, s)
    # the environment's values are the defaults, so a flag on the command line wins
    serve.set_defaults(**envs.serve_env(), func=_serve)
    # Listed for --help only: main() hands `bench ...` to mmserve.bench.cli untouched.
    sub.add_parser("bench", help="engine benchmarks: mmserve bench KIND --help")
    return parser


def _add_argument(parser: argparse.ArgumentParser, s: Setting) -> None:
    """One setting's flag; its dest is the setting's name and its default None (= not given)."""
    if _is_model_list(s):
        parser.add_argument("model", nargs="*", metavar="MODEL", help=s.flag_help.replace("%", "%%"))
    else:
        add_flag(parser, s)


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings that were set (command line or environment), by setting name."""
    values = {s.name: getattr(args, s.name, None) for s in serve_settings()}
    return {name: value for name, value in values.items() if value is not None}


def serve_options(args: argparse.Namespace) -> ServeOptions:
    return build(ServeOptions, _given(args))


def engine_template(args: argparse.Namespace) -> EngineConfig:
    """Engine settings shared by every served model (the model path is filled in per model)."""
    names = {s.name for s in engine_settings()}
    given = {name: value for name, value in _given(args).items() if name in names}
    config = EngineConfig.from_settings("", **given)
    return replace(config, multiprocess=_engine_process(args))


def _engine_process(args: argparse.Namespace) -> bool:
    """--engine-process as given, else on (ServeOptions.engine_process's default)."""
    return True if args.engine_process is None else bool(args.engine_process)


def server_config(args: argparse.Namespace) -> ServerConfig:
    return build(ServerConfig, _given(args))


def model_specs(args: argparse.Namespace) -> list[ModelSpec]:
    return [ModelSpec.parse(m) for m in args.model] if args.model else embedded_defaults()


def _serve(args: argparse.Namespace) -> int:
    from mmserve.server.access_log import configure_logging
    from mmserve.server.grpc_server import serve
    from mmserve.server.models import load_models

    options = serve_options(args)
    configure_logging(options.log_level, options.log_format)
    config, template, specs = server_config(args), engine_template(args), model_specs(args)
    if _torchrun_follower(template, specs):
        return 0
    logger.info(
        "loading %d model(s): %s", len(specs), ", ".join(f"{s.name}={s.path}" for s in specs)
    )
    registry = load_models(specs, template, config)
    asyncio.run(serve(registry, config))
    return 0


def _torchrun_follower(template: EngineConfig, specs: list[ModelSpec]) -> bool:
    """Under torchrun with --tensor-parallel-size: ranks > 0 run rank 0's steps (rank 0 is
    the server) and return True once it stops them. One model per launch: its ranks are all
    of torchrun's."""
    from mmserve import envs

    launched = envs.torchrun_rank()
    if launched is None or template.parallel.tensor_parallel_size == 1:
        return False
    if len(specs) != 1:
        raise SystemExit("under torchrun, serve exactly one model (its ranks are torchrun's)")
    if launched[0] == 0:
        return False
    from mmserve.engine.tp_workers import follow_torchrun
    from mmserve.server.models import engine_config_for

    follow_torchrun(engine_config_for(specs[0], template))
    return True


def settings_table() -> str:
    """README's table of `mmserve serve` flags (tests/server/test_settings.py checks it)."""
    rows = ["| flag | variable | default | what |", "|---|---|---|---|"]
    for s in serve_settings():
        rows.append(f"| `{_flag_text(s)}` | `{s.env}` | {s.shown} | {s.help} |")
    return "\n".join(rows) + "\n"


def _is_model_list(s: Setting) -> bool:
    """ServeOptions.model: the positional MODEL arguments, not a flag."""
    return s.owner is ServeOptions and s.name == "model"


def _flag_text(s: Setting) -> str:
    if _is_model_list(s):
        return "MODEL ..."
    return f"--[no-]{s.flag[2:]}" if s.is_bool else s.flag


def _bench(argv: list[str]) -> int:
    """mmserve.bench.cli, imported only when asked for (it needs torch)."""
    from mmserve.bench import cli as bench_cli

    parser = argparse.ArgumentParser(prog="mmserve")
    bench_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    bench_cli.run(parser.parse_args(["bench", *argv]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["bench"]:
            return _bench(argv[1:])
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except (ValueError, OSError) as e:  # bad settings, files or port: say which, no traceback
        print(f"mmserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
