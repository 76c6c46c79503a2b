"""The access log: one INFO line per RPC on the `mmserve.access` logger (method, model,
request id, status, prompt / cached / output tokens, TTFT, total time, peer), and the
formatters of `--log-format`: text (the access line as key=value pairs) or json (one object
per record, the access fields as keys). Prompts and outputs appear only with --log-requests;
API keys never do (the record holds no metadata values it logs)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from mmserve.server.calls import CallRecord

access_logger = logging.getLogger("mmserve.access")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def access_fields(record: CallRecord, log_requests: bool) -> dict[str, Any]:
    """The access line's fields, in order."""
    ttft = record.ttft_s
    fields: dict[str, Any] = {
        "method": record.method,
        "model": record.model,
        "request_id": record.request_id,
        "status": record.code.name,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "output_tokens": record.output_tokens,
        "ttft_ms": None if ttft is None else round(ttft * 1000, 1),
        "total_ms": round(record.total_s * 1000, 1),
        "peer": record.peer,
    }
    if log_requests:
        fields["prompt"] = record.prompt
        fields["output"] = record.output_text() if record.choices else None
    return fields


def text_line(fields: dict[str, Any]) -> str:
    """key=value pairs; strings JSON-quoted when they hold spaces, quotes or control
    characters (a request id cannot forge a second log line)."""

    def value(v: Any) -> str:
        if v is None:
            return "-"
        text = str(v)
        plain = text and text.isprintable() and not any(c in text for c in ' "=')
        return text if plain else json.dumps(text)

    return " ".join(f"{k}={value(v)}" for k, v in fields.items())


class AccessLog:
    """A CallObserver writing one line per ended call."""

    def __init__(self, log_requests: bool = False) -> None:
        self.log_requests = log_requests

    def started(self, record: CallRecord) -> None:
        pass

    def ended(self, record: CallRecord) -> None:
        if not access_logger.isEnabledFor(logging.INFO):
            return
        fields = access_fields(record, self.log_requests)
        access_logger.info("%s", text_line(fields), extra={"access": fields})


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message; an access line's fields
    as keys of their own (its message is then left out: the fields say it all)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
        }
        access = getattr(record, "access", None)
        if isinstance(access, dict):
            out.update(access)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str, log_format: str) -> None:
    """The root logger at `level`, in `log_format` ("text" or "json") on stderr."""
    handler = logging.StreamHandler()
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    handler.setFormatter(formatter)
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
