"""``bubblespec loadtest --http``: the scheduler's ``/v1/completions`` under thousands of HTTP
connections, with the step mode's harness (``cli/loadtest.py``: redis-server, the scheduler in a
child process, simulated-engine workers in processes of their own).

The load: ``connections`` clients (4,096 by default), each one rollout that sends one call per
round and waits for its answer; a round ends when every connection has its answer. The clients
run in ``client_processes`` processes of their own (``python -m bubblespec.cli.loadtest_http
'<config>'``; HTTP/1.1 on asyncio's streams, no client library: ``_Clients``), a keep-alive
connection each, opened before the first round and opened anew by a call that finds it idle
near the scheduler's keep-alive (``KEEP_ALIVE_MARGIN_SECONDS``), which the load-test process drives over
stdin/stdout like the worker processes (``loadtest_workers.ChildProcesses``). A call: a token-id prompt
unique to its connection and round (no tokenizer needed, no two calls grouped), temperature 1,
``max_tokens``, a seed, ``n`` = ``choices``, ``return_token_ids``. A 429 is counted and retried
after its ``Retry-After``; any other status, or no answer, is a lost call.

Measured per round: completions per second (choices answered over the round's wall time, from
the round's start to its last answer), call latency, the engine's time and what the gateway
adds to it, the scheduler's CPU and RSS (``/proc``), the clients' and workers' CPU. Every
engine records when it took a request and when its final output was ready
(``loadtest_workers.TimedEngine``, ``time.monotonic()``: one clock for every process of the
machine) with its prompt's key and its tokens' key; a call is paired with its engine runs by its
prompt. For a call, engine time = last run's end - first run's start; gateway-added = call
latency - engine time, split into *to engine* (first run's start - call sent: HTTP in, the
pool, dispatch, gRPC, the agent) and *from engine* (answer - last run's end: the agent's
completion window, gRPC, delivery, HTTP out). A request that moved between workers (only one
past the scheduler's ``min_tokens_to_move``, 256 tokens by default) is not followed: its call
would count as misrouted.

The count check: every call answered 200 once, with ``n`` choices of indices 0..n-1, each
choice's tokens those an engine made for that call's prompt (none misrouted), no engine run
answered twice, and the scheduler's ``bubblespec_completions_total`` equal to the choices
answered (the workers' completions are reported beside it, with any engine runs beyond the
choices). ``http_loadtest`` exits 1 when it fails.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bubblespec.cli.loadtest import (
    LoadResult,
    LoadSettings,
    common_summary,
    finite_json,
    format_row,
    machine_text,
    memory_text,
    percentile,
    started,
    store_lines,
    table_header,
)
from bubblespec.cli.loadtest_workers import ChildProcesses, prompt_key

__all__ = ["HTTP_ENGINE", "KEEP_ALIVE_MARGIN_SECONDS", "RoundRecord", "http_loadtest", "http_settings", "run_http_loadtest"]

WARM_UP_ROUNDS = 5
"""With ``--trace-memory``, the scheduler's allocations are compared with a snapshot taken after
this many rounds (the middle of the memory verdict's rounds 3-7)."""
KEEP_ALIVE_MARGIN_SECONDS = 3.0
"""The clients reopen a connection idle this much less than the scheduler keeps one
(``LoadSettings.keep_alive_seconds``): under load the server closed some just as a call came on
them, and with a margin of 1 s (the clients' loop seconds late at times) thousands of calls a
round failed so (``ServerDisconnectedError``)."""
HTTP_ENGINE = {"step_seconds": 0.002, "batch_slope_seconds": 0.0, "median_tokens": 8, "max_tokens": 32,
               "worker_store": "memory"}
"""The HTTP mode's workers, unless the flags say otherwise: fast, short responses, so that the
gateway, not the engines' tail, sets the pace of a round (a round waits for its slowest call);
in-process draft stores, so that no Redis round trip of the agents (64 at once on each, at
capacity 64) counts as the gateway's."""


def http_settings(settings: LoadSettings, argv: list[str], env) -> LoadSettings:
    """``settings`` with the HTTP mode's defaults for what the command line (``argv``) and the
    environment (``BUBBLESPEC_<FLAG>``) left unset: ``HTTP_ENGINE``, and a capacity that gives
    every connection's choices a slot (connections x choices / workers)."""
    preset = {**HTTP_ENGINE, "capacity": max(1, math.ceil(settings.connections * settings.choices / settings.workers))}

    def given(name: str) -> bool:
        flag = "--" + name.replace("_", "-")
        return (f"BUBBLESPEC_{name.upper()}" in env
                or any(arg == flag or arg.startswith(flag + "=") for arg in argv))

    return replace(settings, **{k: v for k, v in preset.items() if not given(k)})


# ------------------------------------------------------------------- the client processes --


def _call_prompt(settings: LoadSettings, rnd: int, conn: int) -> list[int]:
    """Connection ``conn``'s prompt in round ``rnd``: led by the two, so no two calls share one."""
    rng = random.Random(f"{settings.seed}/{rnd}/{conn}")
    lo, hi = max(3, settings.prompt_tokens // 2), max(3, 3 * settings.prompt_tokens // 2)
    lead = [3 + conn % 30000, 3 + conn // 30000, 3 + rnd % 30000]
    return lead + [rng.randrange(3, 32000) for _ in range(rng.randint(lo, hi) - len(lead))]


class _Connection:
    """One keep-alive HTTP/1.1 connection on asyncio's streams: a request's bytes out, its
    answer's status line, headers and ``Content-Length`` body (or chunks) back."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.used = 0.0  # when its last answer came (monotonic)

    async def open(self) -> None:
        self.close()
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=2**20)
        self.used = time.monotonic()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def request(self, data: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
        """Send ``data`` (a whole request) and read the answer: status, headers (lower-case
        names), body. Raises ``ConnectionError`` / ``asyncio.IncompleteReadError`` when the
        connection fails under it, ``ValueError`` for an answer that is not HTTP/1.1."""
        if self.reader is None or self.writer is None:
            raise ConnectionError("not open")
        self.writer.write(data)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        version, status, _ = (lines[0] + b"  ").split(b" ", 2)
        if not version.startswith(b"HTTP/1."):
            raise ValueError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            body = b""
            while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
                body += (await self.reader.readexactly(size + 2))[:-2]
            await self.reader.readuntil(b"\r\n")
        else:
            body = await self.reader.readexactly(int(headers.get(b"content-length", b"0")))
        if headers.get(b"connection", b"").lower() == b"close":
            self.close()
        self.used = time.monotonic()
        return int(status), headers, body


_CONNECTION_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError)
"""A connection failing under a call (``ConnectionError`` is an ``OSError``; ``ValueError``:
an answer that is not HTTP/1.1)."""


class _Clients:
    """The connections of one client process, one call per connection a round: HTTP/1.1 on
    asyncio's streams (``_Connection``), each call's request bytes built whole, no HTTP client
    library (aiohttp's per-call work was the largest part of the clients' CPU, on the cores the
    scheduler uses)."""

    def __init__(self, config: dict) -> None:
        from urllib.parse import urlsplit

        self.settings = LoadSettings(**config["settings"])
        self.url, self.first, self.count = config["url"], config["first"], config["count"]
        url = urlsplit(self.url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.conns = {c: _Connection(self.host, self.port) for c in range(self.first, self.first + self.count)}
        self.lags: list[float] = []
        self.opened = 0  # connections opened
        self.errors: Counter = Counter()  # connection failures under a call, by exception class
        self.idle_limit = max(0.5, self.settings.keep_alive_seconds - KEEP_ALIVE_MARGIN_SECONDS)

    async def start(self) -> None:
        self._lag_task = asyncio.create_task(self._lag())
        todo = list(self.conns.values())
        for _ in range(3):  # open every connection before the first round (a burst may overflow the backlog)
            ok = await asyncio.gather(*(self._open(conn) for conn in todo))
            todo = [conn for conn, good in zip(todo, ok, strict=True) if not good]
            if not todo:
                return
        raise RuntimeError(f"{len(todo)} of {self.count} connections to {self.url} failed to open")

    async def _open(self, conn: _Connection) -> bool:
        health = f"GET /health HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n".encode()
        try:
            await conn.open()
            status, _, _ = await conn.request(health)
            return status == 200
        except _CONNECTION_ERRORS:
            conn.close()
            return False

    async def _lag(self, period: float = 0.05) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(period)
            self.lags.append(time.monotonic() - before - period)

    async def run_round(self, rnd: int) -> dict:
        self.lags, self.opened = [], 0
        self.errors.clear()
        cpu0 = time.process_time()
        calls = await asyncio.gather(*(self._call(rnd, c) for c in range(self.first, self.first + self.count)))
        return {"calls": calls, "cpu": time.process_time() - cpu0, "lags": self.lags, "opened": self.opened,
                "errors": dict(self.errors)}

    async def _call(self, rnd: int, c: int) -> list:
        """[connection, prompt key, sent, answered, status, 429s, reconnects, choice token keys or error]."""
        s = self.settings
        prompt = _call_prompt(s, rnd, c)
        body = json.dumps({"prompt": prompt, "max_tokens": s.max_tokens, "temperature": 1.0, "n": s.choices,
                           "seed": s.seed * 100_000_000 + rnd * s.connections + c, "return_token_ids": True},
                          separators=(",", ":")).encode()
        data = (f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        conn = self.conns[c]
        sent = time.monotonic()
        refused = reconnects = 0
        while True:
            try:
                # a connection idle near the scheduler's keep-alive (or closed) opens anew before the call
                if conn.writer is None or time.monotonic() - conn.used > self.idle_limit:
                    await conn.open()
                    self.opened += 1
                status, headers, raw = await conn.request(data)
                answered = time.monotonic()
            except _CONNECTION_ERRORS as exc:
                conn.close()
                self.errors[type(exc).__name__] += 1
                if reconnects < 3:  # e.g. a keep-alive connection the server closed as the call went
                    reconnects += 1
                    continue
                return [c, prompt_key(prompt), sent, time.monotonic(), 0, refused, reconnects, repr(exc)[:200]]
            if status == 429:
                refused += 1
                await asyncio.sleep(float(headers.get(b"retry-after", b"1")))
                continue
            break
        out: list | str
        if status != 200:
            out = raw[:200].decode(errors="replace")
        else:
            out = _choice_keys(json.loads(raw), s.choices)
        return [c, prompt_key(prompt), sent, answered, status, refused, reconnects, out]

    async def stop(self) -> None:
        self._lag_task.cancel()
        for conn in self.conns.values():
            conn.close()


def _choice_keys(answer: dict, n: int) -> list | str:
    """Each choice's token key, by index; an error text when the choices are not indices 0..n-1."""
    choices = answer.get("choices") or []
    indices = sorted(c.get("index") for c in choices)
    if indices != list(range(n)):
        return f"choices {indices[:8]}, expected indices 0..{n - 1}"
    return [hash(tuple(c["token_ids"])) for c in sorted(choices, key=lambda c: c["index"])]


async def _serve(config: dict) -> None:
    """Body of a client process: open the connections, then answer commands from stdin."""
    clients = _Clients(config)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        await clients.start()
        print(json.dumps({"ready": True}), flush=True)
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["cmd"] == "stop":
                print(json.dumps({"ok": True}), flush=True)
                return
            print(json.dumps(await clients.run_round(cmd["round"])), flush=True)
    finally:
        await clients.stop()


class ClientProcesses(ChildProcesses):
    """The HTTP clients' processes, each a share of the connections."""

    def __init__(self, settings: LoadSettings, url: str) -> None:
        n = max(1, min(settings.client_processes, settings.connections))
        c = settings.connections
        configs = [{"settings": asdict(settings), "url": url, "first": k * c // n, "count": (k + 1) * c // n - k * c // n}
                   for k in range(n)]
        super().__init__("bubblespec.cli.loadtest_http", configs, "client")

    async def run_round(self, rnd: int) -> dict:
        answers = await self.call({"cmd": "round", "round": rnd}, timeout=1800.0)
        return {"calls": [c for a in answers for c in a["calls"]], "cpu": sum(a["cpu"] for a in answers),
                "lags": [x for a in answers for x in a["lags"]], "opened": sum(a["opened"] for a in answers),
                "errors": sum((Counter(a["errors"]) for a in answers), Counter())}


# ------------------------------------------------------------------------------ a round --


@dataclass
class RoundRecord:
    round: int
    calls: int
    answered: int
    """Calls answered 200 with the right choices, none misrouted."""
    completions: int
    """Choices in those answers."""
    seconds: float
    completions_per_second: float
    call_p50_ms: float
    call_p99_ms: float
    engine_p50_ms: float
    added_p50_ms: float
    added_p99_ms: float
    to_engine_p50_ms: float
    from_engine_p50_ms: float
    lost: int
    """Calls not answered 200 (another status, no answer) or with the wrong choices."""
    misrouted: int
    """Choices whose tokens no engine made for the call's prompt."""
    duplicates: int
    """Choices answered with an engine run of their call that another choice got too. (Calls
    have prompts of their own, so a run answered to another call counts as misrouted.)"""
    refused_429: int
    reconnects: int
    """Calls sent again after their connection failed under them (before any answer)."""
    connections_opened: int
    """Connections the clients opened in the round (idle ones reopen, ``KEEP_ALIVE_MARGIN_SECONDS``)."""
    engine_reruns: int
    """Engine runs beyond the choices answered (a request run again after a worker failed, a
    lost call's runs)."""
    worker_completions_sent: int
    scheduler_rss_mib: float
    scheduler_rss_peak_mib: float
    scheduler_cpu_share: float
    scheduler_cpu_ms_per_completion: float
    clients_cpu_share: float
    clients_lag_p99_ms: float
    workers_cpu_share: float
    workers_lag_p99_ms: float
    statuses: dict
    connection_errors: dict = field(default_factory=dict)
    """Connection failures under a call, by exception class (each sent again, or lost after 3)."""
    core_probe_ms: float | None = None


async def _run_round(h, clients: ClientProcesses, rnd: int, latencies: dict[str, list[float]]) -> RoundRecord:
    from bubblespec.bench.machine import mean_of_cores

    h.sampler.reset()
    await h.workers.step_started()
    workers_cpu0 = (await h.workers.collect(0.0))["cpu"]
    cpu0 = h.scheduler.cpu_seconds()
    began = time.monotonic()
    got = await clients.run_round(rnd)
    cpu = h.scheduler.cpu_seconds() - cpu0
    probe = await h.workers.collect(began)
    calls = got["calls"]
    ended = max((c[3] for c in calls), default=began)
    seconds = max(ended - began, 1e-9)
    record = _round_record(rnd, calls, probe["spans"], seconds, latencies)
    record.worker_completions_sent, record.connections_opened = probe["sent"], got["opened"]
    record.connection_errors = dict(got["errors"])
    record.scheduler_rss_mib, record.scheduler_rss_peak_mib = h.scheduler.rss_mib(), h.sampler.rss_peak
    record.scheduler_cpu_share = cpu / seconds
    record.scheduler_cpu_ms_per_completion = 1000 * cpu / max(1, record.completions)
    record.clients_cpu_share = got["cpu"] / seconds
    record.clients_lag_p99_ms = 1000 * percentile(got["lags"], 99)
    record.workers_cpu_share = (probe["cpu"] - workers_cpu0) / seconds
    record.workers_lag_p99_ms = 1000 * percentile(probe["lags"], 99)
    record.core_probe_ms = mean_of_cores(h.speed.median_ms(began, ended))
    return record


def _round_record(rnd: int, calls: list, spans: list, seconds: float, latencies: dict[str, list[float]]) -> RoundRecord:
    """Pair each call with its engine runs (by prompt key) and count; ``latencies`` (ms) gathers
    every round's call, engine, added, to- and from-engine latencies."""
    runs: dict[int, list] = {}
    for key, took, done, out in spans:
        runs.setdefault(key, []).append((took, done, out))
    lat: dict[str, list[float]] = {"call": [], "engine": [], "added": [], "to_engine": [], "from_engine": []}
    answered = completions = lost = misrouted = duplicates = 0
    statuses: Counter = Counter()
    for _conn, key, sent, at, status, _refused, _reconnects, out in calls:
        statuses[str(status)] += 1
        if status != 200 or isinstance(out, str):
            lost += 1
            continue
        mine = runs.get(key, [])
        made = Counter(r[2] for r in mine)
        extra = Counter(out) - made  # answered beyond what the engines made for this prompt
        if extra:
            duplicates += sum(n for o, n in extra.items() if o in made)  # one engine run in two choices
            misrouted += sum(n for o, n in extra.items() if o not in made)  # made for another call
            lost += 1
            continue
        answered += 1
        completions += len(out)
        took, done = min(r[0] for r in mine), max(r[1] for r in mine)
        call, engine = at - sent, done - took
        for name, value in (("call", call), ("engine", engine), ("added", call - engine),
                            ("to_engine", took - sent), ("from_engine", at - done)):
            lat[name].append(1000 * value)
    for name, values in lat.items():
        latencies.setdefault(name, []).extend(values)
    return RoundRecord(
        round=rnd + 1, calls=len(calls), answered=answered, completions=completions, seconds=seconds,
        completions_per_second=completions / seconds, call_p50_ms=percentile(lat["call"], 50),
        call_p99_ms=percentile(lat["call"], 99), engine_p50_ms=percentile(lat["engine"], 50),
        added_p50_ms=percentile(lat["added"], 50), added_p99_ms=percentile(lat["added"], 99),
        to_engine_p50_ms=percentile(lat["to_engine"], 50), from_engine_p50_ms=percentile(lat["from_engine"], 50),
        lost=lost, misrouted=misrouted, duplicates=duplicates,
        refused_429=sum(c[5] for c in calls), reconnects=sum(c[6] for c in calls), connections_opened=0,
        engine_reruns=len(spans) - completions,
        worker_completions_sent=0, scheduler_rss_mib=math.nan, scheduler_rss_peak_mib=math.nan,
        scheduler_cpu_share=math.nan, scheduler_cpu_ms_per_completion=math.nan, clients_cpu_share=math.nan,
        clients_lag_p99_ms=math.nan, workers_cpu_share=math.nan, workers_lag_p99_ms=math.nan, statuses=dict(statuses))


# ------------------------------------------------------------------------------- the run --


async def run_http_loadtest(settings: LoadSettings, on_round=None) -> LoadResult:
    """Run the HTTP mode; ``on_round(record)`` is called as each round ends. ``result.steps``
    holds the rounds."""
    result = LoadResult(asdict(settings), "")
    latencies: dict[str, list[float]] = {}
    async with started(settings) as h:
        result.redis = h.redis_url or "memory (no Redis)"
        clients = ClientProcesses(settings, f"http://127.0.0.1:{h.scheduler.http_port}")
        try:
            await clients.start(timeout=300.0)
            began = time.monotonic()
            for rnd in range(settings.rounds):
                record = await _run_round(h, clients, rnd, latencies)
                result.steps.append(record)
                if rnd == WARM_UP_ROUNDS - 1:
                    h.scheduler.mark_memory()  # --trace-memory: growth is measured from here
                if on_round is not None:
                    on_round(record)
            total = time.monotonic() - began
        finally:
            await clients.stop()
        result.summary = await _summarize(h, result.steps, latencies, total)
    if h.memory_trace:
        result.summary["scheduler_memory_trace"] = h.memory_trace
    return result


async def _summarize(h, rounds: list[RoundRecord], latencies: dict[str, list[float]], total: float) -> dict:
    s = h.settings
    completions = sum(r.completions for r in rounds)
    seconds = sum(r.seconds for r in rounds)
    cpu = sum(r.scheduler_cpu_share * r.seconds for r in rounds)
    statuses: Counter = Counter()
    errors: Counter = Counter()
    for r in rounds:
        statuses.update(r.statuses)
        errors.update(r.connection_errors)
    out = {
        "calls": sum(r.calls for r in rounds), "calls_expected": s.connections * s.rounds,
        "answered": sum(r.answered for r in rounds), "completions": completions,
        "completions_expected": s.connections * s.rounds * s.choices,
        **{name: sum(getattr(r, name) for r in rounds)
           for name in ("lost", "misrouted", "duplicates", "refused_429", "reconnects", "engine_reruns",
                        "worker_completions_sent", "connections_opened")},
        "statuses": dict(statuses), "connection_errors": dict(errors), "round_seconds": seconds, "total_seconds": total,
        "completions_per_second": completions / seconds if seconds else math.nan,
        "completions_per_second_median_of_rounds": statistics.median(r.completions_per_second for r in rounds),
        "scheduler_cpu_ms_per_completion": 1000 * cpu / completions if completions else math.nan,
        "clients_cpu_share_median_of_rounds": statistics.median(r.clients_cpu_share for r in rounds),
        "workers_cpu_share_median_of_rounds": statistics.median(r.workers_cpu_share for r in rounds),
        **await common_summary(h, rounds),
    }
    for name, values in latencies.items():
        out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = percentile(values, 50), percentile(values, 99)
    return out


def failed(s: dict) -> bool:
    """Whether the count check failed: a call lost, a choice misrouted or answered twice, or the
    scheduler's count of deliveries disagreeing with the choices answered."""
    return bool(s["lost"] or s["misrouted"] or s["duplicates"] or s["answered"] != s["calls_expected"]
                or s["metrics_completions_total"] != s["completions"])


# ------------------------------------------------------------------------------- printing --

COLUMNS = (  # (field, title, width, format): loadtest._COLUMNS' shape
    ("round", "round", 5, "d"), ("completions", "compl", 6, "d"), ("seconds", "secs", 6, ".2f"),
    ("completions_per_second", "compl/s", 8, ".1f"), ("call_p50_ms", "call p50", 8, ".1f"),
    ("call_p99_ms", "call p99", 8, ".1f"), ("engine_p50_ms", "engine p50", 10, ".1f"),
    ("added_p50_ms", "added p50", 9, ".1f"), ("added_p99_ms", "added p99", 9, ".1f"),
    ("scheduler_rss_mib", "sched RSS MiB", 13, ".1f"), ("scheduler_cpu_share", "sched CPU", 9, ".0%"),
    ("scheduler_cpu_ms_per_completion", "ms/compl", 8, ".3f"), ("clients_cpu_share", "clients CPU", 11, ".0%"),
    ("clients_lag_p99_ms", "lag p99 ms", 10, ".1f"), ("workers_cpu_share", "workers CPU", 11, ".0%"),
    ("workers_lag_p99_ms", "lag p99 ms", 10, ".1f"),
)


def round_row(r: RoundRecord) -> str:
    return format_row(r, COLUMNS, [f"{r.lost} lost" if r.lost else "", f"{r.misrouted} misrouted" if r.misrouted else "",
                                   f"{r.duplicates} dup" if r.duplicates else "",
                                   f"{r.refused_429} 429s" if r.refused_429 else "",
                                   f"{r.reconnects} reconnects" if r.reconnects else "",
                                   f"{r.connections_opened} connects" if r.connections_opened else "",
                                   f"{r.engine_reruns} reruns" if r.engine_reruns else ""])


def summary_text(result: LoadResult) -> str:
    s = result.summary
    lines = [
        (f"calls: {s['calls']} of {s['calls_expected']} sent, {s['answered']} answered 200 with the right choices, "
         f"{s['lost']} lost, {s['misrouted']} choices misrouted, {s['duplicates']} answered twice; statuses "
         f"{s['statuses']}; {s['refused_429']} 429s retried after Retry-After, {s['reconnects']} calls sent again "
         f"after their connection failed{' ' + str(s['connection_errors']) if s['connection_errors'] else ''}, "
         f"{s['connections_opened']} connections opened in the rounds"),
        (f"completions: {s['completions']} of {s['completions_expected']} (scheduler's bubblespec_completions_total: "
         f"{s['metrics_completions_total']:.0f}; workers sent {s['worker_completions_sent']}, "
         f"{s['engine_reruns']} engine runs beyond the choices; the scheduler's event loop ran its ticks "
         f"{s.get('scheduler_loop_stall_seconds', math.nan):.1f} s late in all)"),
        (f"throughput: {s['completions_per_second']:.1f} completions/s over the rounds' {s['round_seconds']:.1f} s "
         f"(median round {s['completions_per_second_median_of_rounds']:.1f}/s); scheduler CPU "
         f"{s['scheduler_cpu_ms_per_completion']:.3f} ms per completion; clients' CPU "
         f"{s['clients_cpu_share_median_of_rounds']:.0%}, workers' {s['workers_cpu_share_median_of_rounds']:.0%} "
         f"(median of rounds); {machine_text(s, 'rounds')}"),
        (f"latency over all answered calls: call p50 {s['call_p50_ms']:.1f} / p99 {s['call_p99_ms']:.1f} ms; "
         f"on the engine p50 {s['engine_p50_ms']:.1f} / p99 {s['engine_p99_ms']:.1f} ms; added by the gateway "
         f"p50 {s['added_p50_ms']:.1f} / p99 {s['added_p99_ms']:.1f} ms (to the engine p50 "
         f"{s['to_engine_p50_ms']:.1f} / p99 {s['to_engine_p99_ms']:.1f} ms, from it p50 "
         f"{s['from_engine_p50_ms']:.1f} / p99 {s['from_engine_p99_ms']:.1f} ms)"),
        memory_text(s, "round"),
    ]
    return "\n".join(lines + store_lines(result))


def http_loadtest(settings: LoadSettings, json_path: str = "") -> int:
    """``bubblespec loadtest --http``: run, print the table and the summary; exit 1 when the
    count check fails."""
    s = settings
    print(f"load test over HTTP: {s.connections} connections x {s.rounds} rounds of /v1/completions (n={s.choices}) "
          f"in {s.client_processes} client process(es); {s.workers} simulated-engine workers x capacity {s.capacity}, "
          f"engine step {s.step_seconds * 1000:g} ms + {s.batch_slope_seconds * 1000:g} ms per further request, "
          f"median {s.median_tokens} tokens, max_tokens {s.max_tokens}", flush=True)
    print(table_header(COLUMNS), flush=True)
    result = asyncio.run(run_http_loadtest(settings, on_round=lambda r: print(round_row(r), flush=True)))
    print(summary_text(result), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(finite_json(asdict(result)), indent=2))
    return 1 if failed(result.summary) else 0


if __name__ == "__main__":
    import logging

    from bubblespec.scheduler.server import _tune_gc

    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _tune_gc()
    if os.environ.get("BUBBLESPEC_LOADTEST_CLIENT_PROFILE"):  # diagnosis: cProfile of each client process, at exit
        import cProfile

        _config = json.loads(sys.argv[1])
        cProfile.run("asyncio.run(_serve(_config))", f"{os.environ['BUBBLESPEC_LOADTEST_CLIENT_PROFILE']}.{_config['first']}")
    else:
        asyncio.run(_serve(json.loads(sys.argv[1])))
