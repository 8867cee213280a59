"""Logging: human lines on a terminal, JSON lines otherwise; hivemind's logs routed through ours.

Structured events (``round_done``, ``node_ready``...) are ordinary log records with an
``event`` field in ``extra``; the JSON formatter writes every extra field, so tests and tools
read events from the log stream instead of polling.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from typing import Any

# Our own level names: hivemind renames WARNING to "WARN" process-wide.
LEVELS = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning", logging.ERROR: "error",
          logging.CRITICAL: "critical"}
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def strict_json(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None. Python's json writes them as
    ``NaN``/``Infinity``, which no JSON parser but Python's reads: one round without an eval
    (``eval_loss`` NaN) made the line unreadable to jq, Loki or Vector."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a number that is not finite (an eval that did not run, a
    diverged loss) is null."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": LEVELS.get(record.levelno, record.levelname.lower()),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(strict_json(entry), default=str)


class TerminalHandler(logging.StreamHandler):
    """Human lines on a terminal that may show the inner-phase progress bar (node/progress.py):
    each line is written above the bar instead of into it."""

    def emit(self, record: logging.LogRecord) -> None:
        from .progress import write_above  # tqdm only where there is a terminal to draw on

        with write_above(self.stream):
            super().emit(record)


class HumanFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        level = "" if record.levelno == logging.INFO else f"{LEVELS.get(record.levelno, record.levelname.lower())}: "
        text = f"{stamp} {level}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup_logging(fmt: str, level: str, stream=None) -> bool:
    """Configure the root logger; returns True when the output is human (a terminal or text)."""
    stream = stream or sys.stdout
    human = fmt == "text" or (fmt == "auto" and stream.isatty())
    handler = TerminalHandler(stream) if human else logging.StreamHandler(stream)
    handler.setFormatter(HumanFormatter() if human else JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Python's warnings (torch's, say) would go straight to stderr: through the bar on a
    # terminal, as raw text among JSON lines otherwise.
    logging.captureWarnings(True)
    try:
        from hivemind.utils.logging import use_hivemind_log_handler

        use_hivemind_log_handler("nowhere")  # hivemind records propagate to our root handler
    except ImportError:  # pragma: no cover - hivemind is a hard dependency
        pass
    # hivemind and gRPC are chatty at INFO (torch too: "FakeTensor cache stats" on a Ctrl-C
    # during its first compile); their warnings still come through.
    for noisy in ("hivemind", "grpc", "asyncio", "torch"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    return human
