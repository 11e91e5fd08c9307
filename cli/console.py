"""Terminal output of the commands that start vLLM engines (``up``, ``demo``): a short story on
the terminal, everything else in a log file.

vLLM writes a great deal: its loggers in this process and in every engine process, warnings
from Triton, PyTorch and NUMA binding (some from C++), progress bars, shutdown notices. Much
of it comes from child processes, which write to the file descriptors they inherit, so
``quiet_output`` redirects this process's descriptors 1 and 2 to the log file (every engine
process started inside it inherits them) and keeps a private handle on the terminal for:

* the ``Story`` (``story.say``): what the command is doing, in a few lines;
* log records of BubbleSpec's own loggers at ``terminal_level`` and above, and of any other
  logger at ERROR and above (nothing that fails is hidden).

The log file gets everything, the story included. ``verbose=True`` changes nothing: all output
goes where it always went. On leaving, descriptors 1 and 2 are restored, so a traceback that
ends the command still reaches the terminal.

Any command can adopt it: ``with quiet_output("bench", a.verbose) as story:`` around the part
that starts engines, ``story.say`` instead of ``print``, and ``Cluster(..., progress=story.say)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

__all__ = ["LOG_DIR", "Story", "quiet_output", "ticker"]

logger = logging.getLogger("bubblespec.cli")
LOG_DIR = Path.home() / ".cache" / "bubblespec" / "logs"


@dataclass
class Story:
    """Where a command tells the user what it is doing."""

    out: TextIO
    """The terminal (a private copy of it in quiet mode)."""
    log_path: Path | None = None
    """The log file that holds everything else; None with ``--verbose``."""

    def say(self, text: str = "") -> None:
        """One or more lines for the user (also logged to the log file in quiet mode)."""
        print(text, file=self.out, flush=True)
        if self.log_path is not None and text:
            logger.info("%s", text)


class _TerminalFilter(logging.Filter):
    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name == "bubblespec" or record.name.startswith("bubblespec.")
        if record.name == logger.name and record.levelno < logging.WARNING:
            return False  # the story itself: already on the terminal
        return record.levelno >= (self.level if ours else logging.ERROR)


def log_file_path(command: str, directory: Path = LOG_DIR) -> Path:
    """A new log file's path for one run of ``command``."""
    return directory / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


@contextlib.contextmanager
def quiet_output(command: str, verbose: bool = False, terminal_level: int = logging.WARNING,
                 log_path: Path | None = None) -> Iterator[Story]:
    """Send everything written to descriptors 1 and 2 (this process and the engine processes
    started inside the block) to a new log file, and yield the ``Story`` that still reaches
    the terminal. ``verbose``: leave all output as it is (the story goes to stdout)."""
    if verbose:
        yield Story(sys.stdout)
        return
    path = log_path or log_file_path(command)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(1), "w", buffering=1)
    handler = logging.StreamHandler(terminal)
    handler.addFilter(_TerminalFilter(terminal_level))
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.getLogger().addHandler(handler)
    try:
        yield Story(terminal, path)
    except BaseException:
        print(f"bubblespec {command} failed; its full output is in {path}", file=terminal, flush=True)
        raise
    finally:
        logging.getLogger().removeHandler(handler)
        sys.stdout.flush()
        sys.stderr.flush()
        for target, copy in zip((1, 2), saved):
            os.dup2(copy, target)
            os.close(copy)
        terminal.close()


async def ticker(say, what: str, first: float = 10.0, *, clock=time.monotonic, sleep=asyncio.sleep) -> None:
    """``say`` "<what>... <n>s" after ``first`` seconds, then each time the wait has doubled
    (10, 20, 40, 80 s...) until cancelled: progress of a long wait in a few lines. Ticks missed
    while the event loop was busy are skipped, not repeated. ``clock`` and ``sleep`` are seams
    for tests."""
    started = clock()
    at = first
    while True:
        await sleep(max(0.0, at - (clock() - started)))
        elapsed = clock() - started
        say(f"  {what}... {elapsed:.0f}s")
        while at <= elapsed:
            at *= 2
