"""``cli.console.quiet_output`` (``up``/``demo`` without ``--verbose``): whatever this process and
the processes it spawns write to descriptors 1 and 2 goes to the log file; the terminal gets the
story, BubbleSpec's warnings and everyone's errors, and the traceback of a failure.

A real subprocess whose stdout and stderr are the "terminal", spawning a real child process the
way vLLM starts its engine processes.
"""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging, multiprocessing, os, sys
from pathlib import Path
from bubblespec.cli.console import quiet_output

def child():
    print("child stdout line", flush=True)
    os.write(2, b"child fd2 line\\n")

if __name__ == "__main__":
    logging.basicConfig(level="INFO")
    verbose, fail = sys.argv[2] == "verbose", sys.argv[3] == "fail"
    with quiet_output("test", verbose, log_path=Path(sys.argv[1])) as story:
        story.say("story line")
        print("print line", flush=True)
        os.write(1, b"fd1 line\\n")
        os.write(2, b"fd2 line\\n")
        logging.getLogger("vllm.x").warning("their warning line")
        logging.getLogger("vllm.x").error("their error line")
        logging.getLogger("bubblespec.x").info("our info line")
        logging.getLogger("bubblespec.x").warning("our warning line")
        p = multiprocessing.get_context("spawn").Process(target=child)
        p.start()
        p.join()
        if fail:
            raise RuntimeError("boom line")
    print("after line", flush=True)
"""

NOISE = ["print line", "fd1 line", "fd2 line", "their warning line", "our info line", "child stdout line",
         "child fd2 line"]


def run(tmp_path, verbose: bool = False, fail: bool = False):
    script = tmp_path / "quiet.py"
    script.write_text(SCRIPT)
    log = tmp_path / "logs" / "test.log"
    done = subprocess.run([sys.executable, str(script), str(log), "verbose" if verbose else "quiet",
                           "fail" if fail else "ok"], capture_output=True, text=True, timeout=120, check=False)
    return done, done.stdout + done.stderr, log


def test_quiet_output_sends_everything_but_the_story_to_the_log_file(tmp_path):
    done, terminal, log = run(tmp_path)
    assert done.returncode == 0, terminal
    for line in ("story line", "our warning line", "their error line", "after line"):
        assert terminal.count(line) == 1, (line, terminal)
    for line in NOISE:
        assert line not in terminal, (line, terminal)
    text = log.read_text()
    for line in (*NOISE, "story line", "our warning line", "their error line"):
        assert line in text, (line, text)
    assert "after line" not in text  # descriptors restored on leaving


def test_a_failure_names_the_log_file_and_its_traceback_reaches_the_terminal(tmp_path):
    done, terminal, log = run(tmp_path, fail=True)
    assert done.returncode != 0
    assert f"bubblespec test failed; its full output is in {log}" in terminal
    assert "RuntimeError: boom line" in terminal and "Traceback" in terminal
    assert "print line" not in terminal and "print line" in log.read_text()


def test_verbose_leaves_all_output_on_the_terminal(tmp_path):
    done, terminal, log = run(tmp_path, verbose=True)
    assert done.returncode == 0, terminal
    for line in ("story line", *NOISE, "after line"):
        assert line in terminal, (line, terminal)
    assert not log.exists()


async def test_the_progress_ticker_doubles_its_interval_and_skips_missed_ticks():
    """Few lines for a long wait (10, 20, 40 s...), and one line, not a burst, after the event
    loop was busy past several ticks (a blocking import). A fake clock drives it."""
    import asyncio

    from bubblespec.cli import console

    now = [0.0]
    said: list[str] = []
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds + (66.0 if len(sleeps) == 1 else 0.0)  # the loop was busy 66 s past the first tick
        if len(sleeps) > 3:
            raise asyncio.CancelledError
        await real_sleep(0)

    try:  # injected, not patched: asyncio.sleep is shared with every task on the test session's loop
        await console.ticker(said.append, "starting engines", first=10.0, clock=lambda: now[0], sleep=sleep)
    except asyncio.CancelledError:
        pass
    assert said == ["  starting engines... 76s", "  starting engines... 80s", "  starting engines... 160s"]
