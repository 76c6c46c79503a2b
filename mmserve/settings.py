"""Settings declared once: a config dataclass field made with `setting(...)` carries its
default, help text and parser, and everything users see is derived from it: the
`mmserve serve` flag (mmserve/server/cli.py), the `mmserve bench` engine flags
(mmserve/bench/engine_flags.py), the MMSERVE_* variable (mmserve/envs.py) and the LLM(...)
keyword (EngineConfig.from_settings). A setting's name is its flag without the dashes,
its variable without MMSERVE_ and its keyword; it is the field's name unless given.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any, TypeVar

T = TypeVar("T")

_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'536870912', '512MiB', '512M', '2g' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if m is None:
        raise ValueError(f"not a size: {text!r} (e.g. 512MiB, 2G, 1048576)")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)]


def format_bytes(size: int) -> str:
    """536870912 -> '512MiB': the largest binary unit that divides it (parse_bytes reads it)."""
    for unit in "tgmk":
        if size and size % _SIZE_UNITS[unit] == 0:
            return f"{size // _SIZE_UNITS[unit]}{unit.upper()}iB"
    return str(size)


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true or false)")


def parse_list(text: str) -> list[str]:
    """Comma-separated items; blanks dropped."""
    return [item.strip() for item in text.split(",") if item.strip()]


def env_name(name: str) -> str:
    """'max_model_len' or '--max-model-len' -> 'MMSERVE_MAX_MODEL_LEN'."""
    return "MMSERVE_" + name.lstrip("-").replace("-", "_").upper()


# parsers by annotation (config modules use `from __future__ import annotations`, so a field's
# type is its annotation's text); other types name their parser in setting(parse=...)
_PARSERS: dict[str, Callable[[str], Any]] = {
    "int": int,
    "float": float,
    "str": str,
    "bool": parse_bool,
}


def setting(
    default: T,
    help: str,
    *,
    name: str | None = None,
    parse: Callable[[str], Any] | None = None,
    shown: str | None = None,
    cli: bool = True,
) -> T:
    """A dataclass field that is a setting. name: the flag/variable/keyword name when it is not
    the field's (e.g. num_kv_blocks for CacheConfig.num_blocks); parse: text -> value when the
    annotation does not say (e.g. parse_bytes); shown: the default as help and README show it
    when the value alone does not say it (e.g. None = "the model's"); cli: False = an LLM(...)
    keyword only, no flag and no variable."""
    meta = {"help": help, "name": name, "parse": parse, "shown": shown, "cli": cli}
    return field(default=default, metadata={"setting": meta})


@dataclass(frozen=True)
class Setting:
    """One setting as the command line, the environment and LLM(...) see it."""

    name: str  # flag without dashes, variable without MMSERVE_, LLM keyword: "num_kv_blocks"
    owner: type  # the config dataclass that holds it
    field: str  # its field there: "num_blocks"
    default: Any
    help: str
    parse: Callable[[str], Any]  # a flag's or variable's text -> the field's value
    is_bool: bool  # a --x / --no-x flag
    shown: str  # the default, as --help and the README show it
    cli: bool  # a `mmserve serve` flag and an MMSERVE_* variable

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return env_name(self.name)

    @property
    def flag_help(self) -> str:
        return f"{self.help} (default {self.shown}) [env {self.env}]"


def settings_of(cls: type) -> list[Setting]:
    """The settings among a config dataclass's fields, in field order."""
    return [_from_field(cls, f) for f in fields(cls) if "setting" in f.metadata]


def _from_field(cls: type, f: Field[Any]) -> Setting:
    meta = f.metadata["setting"]
    annotation = str(f.type).removesuffix(" | None")
    parse = meta["parse"] or _PARSERS.get(annotation)
    if parse is None:
        raise TypeError(f"{cls.__name__}.{f.name}: no parser for {f.type!r}; give parse=")
    return Setting(
        name=meta["name"] or f.name,
        owner=cls,
        field=f.name,
        default=f.default,
        help=meta["help"],
        parse=parse,
        is_bool=annotation == "bool",
        shown=meta["shown"] or _shown(f.default, parse),
        cli=meta["cli"],
    )


def _shown(default: Any, parse: Callable[[str], Any]) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    if default is None:
        return "none"
    return format_bytes(default) if parse is parse_bytes else str(default)


def build(cls: type[T], values: Mapping[str, Any], **fixed: Any) -> T:
    """A `cls` from the values (by setting name) of its own settings; the others are ignored."""
    given = {s.field: values[s.name] for s in settings_of(cls) if s.name in values}
    return cls(**given, **fixed)


def add_flag(
    parser: argparse.ArgumentParser, s: Setting, default: Any = None, help: str | None = None
) -> None:
    """The setting's flag on parser, its dest the setting's name (default None: not given);
    a bool setting is a --x / --no-x pair. help: the text, when not s.flag_help."""
    text = (help or s.flag_help).replace("%", "%%")  # argparse %-formats help texts
    if s.is_bool:
        parser.add_argument(
            s.flag, action=argparse.BooleanOptionalAction, default=default, help=text
        )
    else:
        parser.add_argument(s.flag, type=s.parse, default=default, help=text)


def check_known(values: Iterable[str], settings: Iterable[Setting]) -> None:
    """TypeError naming the unknown setting names and listing the valid ones."""
    valid = [s.name for s in settings]
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise TypeError(f"unknown setting(s) {unknown}; valid: {', '.join(valid)}")
