"""The pollers of benchmarks/load.py: a dashboard's polls from Python (``poller``, raw
keep-alive HTTP/1.1 so the generator costs little) or from ``wrk`` (``run_wrk``: one Lua
state per thread, the connections sharing the cursor, the ETags and an open log panel's
offset), and what they count (``Stats``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

LIST_LIMIT = 100  # the dashboard's job list (config.js: jobListLimit)


@dataclass
class Stats:
    latencies: dict[str, list[float]] = field(default_factory=dict)
    errors: int = 0
    requests: int = 0
    events: int = 0  # received by the listeners (--listen)

    def add(self, kind: str, seconds: float) -> None:
        self.latencies.setdefault(kind, []).append(seconds)
        self.requests += 1


class Connection:
    """One keep-alive HTTP/1.1 connection with just enough parsing for these polls. The
    pollers share this machine's two cores with the server and the training, so they must
    cost little: a general HTTP client costs more per request than the server's cached poll."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port, self.token = host, port, token
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, path: str, etag: str = "") -> tuple[int, dict[str, str], bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        extra = f"If-None-Match: {etag}\r\n" if etag else ""
        self.writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Authorization: Bearer {self.token}\r\n{extra}\r\n".encode()
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name:
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        body = await self.reader.readexactly(length) if length else b""
        return status, headers, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


async def conditional(conn: Connection, stats: Stats, kind: str, path: str, etag: str) -> str:
    """GET ``path`` with If-None-Match ``etag``; the ETag to send next time."""
    t = time.perf_counter()
    status, headers, _ = await conn.get(path, etag)
    stats.add(kind, time.perf_counter() - t)
    if status == 200:
        return headers.get("etag", "")
    if status != 304:
        stats.errors += 1
    return etag


async def poller(
    base: str,
    token: str,
    job_id: int,
    stats: Stats,
    stop: asyncio.Event,
    period: float,
    list_limit: int,
    after: int,
) -> None:
    host, port = base.removeprefix("http://").split(":")
    conn = Connection(host, int(port), token)
    etag = list_etag = ""
    await asyncio.sleep(period * (hash(asyncio.current_task()) % 1000) / 1000)  # spread starts
    while not stop.is_set():
        began = time.perf_counter()
        try:
            etag = await conditional(conn, stats, "job", f"/v1/jobs/{job_id}", etag)
            if list_limit:
                list_path = f"/v1/jobs?limit={list_limit}"
                list_etag = await conditional(conn, stats, "list", list_path, list_etag)
            t = time.perf_counter()
            status, _, body = await conn.get(
                f"/v1/jobs/{job_id}/history?after_step={after}&limit=1000"
            )
            stats.add("history", time.perf_counter() - t)
            if status == 200:
                after = json.loads(body)["next_after_step"]
            else:
                stats.errors += 1
        except (OSError, asyncio.IncompleteReadError, ValueError):
            stats.errors += 1
            conn.close()
        await asyncio.sleep(max(0.0, period - (time.perf_counter() - began)))
    conn.close()


WRK_SCRIPT = """
-- Each connection is a dashboard: it reads the job, then its new history rows (and the job
-- list), then waits; with --listen it only reads the list, its stream being elsewhere.
-- wrk keeps one Lua state per thread, so the connections share the cursor and the ETag: each
-- poll asks for the rows after the newest cursor any of them has seen.
local job_path = "/v1/jobs/%(job)d"
local token = "Bearer %(token)s"
local period_ms = %(period_ms)d
local after = %(after)d
local turn = 0
local errors = 0
local etag = ""
local list_etag = ""
local list_limit = %(list_limit)d
local log_offset = ""  -- the open log panel's byte offset (X-Log-Offset); "" before its first read
local plan = {%(plan)s}  -- what each connection asks for, in turn, once per period
local threads = {}

function setup(thread) table.insert(threads, thread) end

function request()
  turn = turn + 1
  local kind = plan[turn %% #plan + 1]
  -- The list is asked for in gzip, as a browser asks; the job and the history pages plain,
  -- so that a response tells which it answers and the cursor can be read.
  if kind == "job" then
    local headers = {["Authorization"] = token}
    if etag ~= "" then headers["If-None-Match"] = etag end
    return wrk.format("GET", job_path, headers)
  elseif kind == "list" then
    local headers = {["Authorization"] = token, ["Accept-Encoding"] = "gzip"}
    if list_etag ~= "" then headers["If-None-Match"] = list_etag end
    return wrk.format("GET", "/v1/jobs?limit=" .. list_limit, headers)
  elseif kind == "log" then
    -- As panels.js: the last 256 KiB first, then only what was appended since.
    local query = log_offset == "" and "tail=262144" or ("offset=" .. log_offset)
    return wrk.format("GET", job_path .. "/logs?" .. query, {["Authorization"] = token})
  end
  return wrk.format("GET", job_path .. "/history?limit=1000&after_step=" .. after,
                    {["Authorization"] = token})
end

function delay()
  -- the plan's requests spread over the period
  return period_ms / #plan
end

function response(status, headers, body)
  if status >= 400 then errors = errors + 1 return end
  if headers["x-log-offset"] ~= nil then log_offset = headers["x-log-offset"] return end
  -- uvicorn sends header names in lower case; a history page's ETag starts with "h
  local tag = headers["etag"]
  if status ~= 200 or tag == nil then return end
  if string.sub(tag, 2, 2) == "h" then
    local cursor = string.match(body, '"next_after_step":(%%-?%%d+)')
    if cursor ~= nil then after = tonumber(cursor) end
  elseif string.sub(body, 1, 2) == "\\31\\139" then  -- gzip: the list
    list_etag = tag
  else
    etag = tag
  end
end

function done(summary, latency, requests)
  local failed = 0
  for _, t in ipairs(threads) do failed = failed + (t:get("errors") or 0) end
  io.write(string.format("WRK requests=%%d errors=%%d socket_errors=%%d p50=%%.2f p99=%%.2f\\n",
    summary.requests, failed,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000))
end
"""


def lowered(args: argparse.Namespace) -> list[str]:
    """The command prefix that runs a load generator below the server and the training."""
    if args.generator_nice == "idle":  # only CPU time nothing else wants (Linux SCHED_IDLE)
        return ["chrt", "--idle", "0"]
    return ["nice", "-n", str(int(args.generator_nice))]


def run_wrk(
    base: str, token: str, job_id: int, args: argparse.Namespace, after: int = -1
) -> dict[str, float]:
    if args.listen:  # the job and its rows come through the streams: only the list is polled
        plan, period = ["list"], args.list_period
    else:
        plan, period = ["job", "history", *(["list"] if args.jobs else [])], args.period
    if args.log_panel:  # panels.js reads an open log panel once per poll_ms, as the list
        plan.append("log")
    script = Path(tempfile.mkdtemp()) / "poll.lua"
    script.write_text(
        WRK_SCRIPT
        % {
            "job": job_id,
            "after": after,
            "token": token,
            "period_ms": int(period * 1000),
            "list_limit": LIST_LIMIT,
            "plan": ", ".join(f'"{kind}"' for kind in plan),
        }
    )
    out = subprocess.run(
        [
            *lowered(args),
            "wrk",
            "-t1",
            f"-c{args.pollers}",
            f"-d{int(args.seconds)}s",
            "--timeout",
            "30s",
            "-s",
            str(script),
            base,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return figures_line(out, "WRK ")


def figures_line(out: str, prefix: str) -> dict[str, float]:
    line = next(x for x in out.splitlines() if x.startswith(prefix))
    return {k: float(v) for k, v in (item.split("=") for item in line.split()[1:])}
