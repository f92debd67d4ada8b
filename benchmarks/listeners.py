"""N dashboards listening to one job's event stream, for ``load.py --listen``: run as its own
process (so that load.py can lower it to SCHED_IDLE, as it does wrk, and count its CPU), it
prints one line of figures when ``--seconds`` have passed.

Each listener is a raw keep-alive socket: a general HTTP client would cost this shared
machine more CPU per event than the server spends sending it. The figures:

- ``events``: events received, all listeners together (keepalive comments not counted);
- ``errors``: streams that were refused or ended before the time was up;
- ``ids``: distinct event ids seen (about one a tick);
- ``spread p50/p99``: for each event id, the time between the first and the last listener
  receiving it, which is what fanning one read out to every listener adds;
- ``cpu``: this process's CPU seconds since READY (``lifetime_cpu``: in all).

    python benchmarks/listeners.py --base http://127.0.0.1:8000 --token T --job 1 --count 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request


class Tally:
    def __init__(self) -> None:
        self.answering = 0  # streams that have sent their first event
        self.events = 0
        self.errors = 0
        self.bytes = 0
        self.first: dict[bytes, float] = {}
        self.last: dict[bytes, float] = {}

    def reset(self) -> None:
        """Forget what came while the streams were opening."""
        self.events = self.bytes = 0
        self.first.clear()
        self.last.clear()

    def seen(self, event_id: bytes, at: float) -> None:
        self.events += 1
        self.first.setdefault(event_id, at)
        self.last[event_id] = at

    def spreads_ms(self) -> list[float]:
        return sorted((self.last[k] - self.first[k]) * 1000 for k in self.first)


async def listen(host: str, port: int, path: str, token: str, tally: Tally) -> None:
    """One stream, read until it is cancelled (a plain read each time: a timeout per read
    would cost a task per read)."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        tally.errors += 1
        return
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n"
        "Accept: text/event-stream\r\n\r\n".encode()
    )
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            tally.errors += 1
            return
        buffered = b""
        answering = False
        while True:
            chunk = await reader.read(1 << 16)
            if not chunk:  # the server ended the stream early
                tally.errors += 1
                return
            now = time.monotonic()
            tally.bytes += len(chunk)
            buffered += chunk
            *blocks, buffered = buffered.split(b"\n\n")
            for block in blocks:
                at = block.find(b"\nid: ")
                if at >= 0:  # chunked framing lines may precede "event:"; ids follow it
                    tally.seen(block[at + 5 :].split(b"\n", 1)[0], now)
                    if not answering:
                        answering = True
                        tally.answering += 1
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        tally.errors += 1
    finally:
        writer.close()


def last_step(base: str, token: str, job_id: int) -> int:
    request = urllib.request.Request(
        f"{base}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        step = json.load(response)["summary"]["last_step"]
    return -1 if step is None else int(step)


async def main(args: argparse.Namespace) -> None:
    host, port = args.base.removeprefix("http://").split(":")
    # A dashboard that has drawn the history so far listens from its last step on.
    after = (
        last_step(args.base, args.token, args.job) if args.after_step is None else args.after_step
    )
    path = f"/v1/jobs/{args.job}/events?after_step={after}"
    tally = Tally()
    listeners = []
    for _ in range(args.count):  # connect a few at a time, as dashboards open over time
        listeners.append(asyncio.create_task(listen(host, int(port), path, args.token, tally)))
        await asyncio.sleep(args.ramp / args.count)
    # Every stream open and answering: from here on the figures are those of listening.
    while tally.answering + tally.errors < args.count:
        await asyncio.sleep(0.1)
    tally.reset()
    ready_cpu = time.process_time()
    print("READY", flush=True)
    await asyncio.sleep(args.seconds)
    for task in listeners:
        task.cancel()
    await asyncio.gather(*listeners, return_exceptions=True)
    spreads = tally.spreads_ms() or [0.0]
    p50 = spreads[len(spreads) // 2]
    p99 = spreads[min(len(spreads) - 1, int(0.99 * len(spreads)))]
    print(
        f"LISTEN events={tally.events} errors={tally.errors} bytes={tally.bytes} "
        f"ids={len(tally.first)} p50={p50:.2f} p99={p99:.2f} "
        f"cpu={time.process_time() - ready_cpu:.3f} lifetime_cpu={time.process_time():.3f}",
        flush=True,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--job", type=int, required=True)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument(
        "--after-step", type=int, default=None, help="Where they start (default: the last step)."
    )
    parser.add_argument("--ramp", type=float, default=2.0, help="Seconds to open them all.")
    asyncio.run(main(parser.parse_args()))
