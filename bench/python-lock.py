#!/usr/bin/env python3
"""The cost of an uncontended ``with devlock.lock(...)`` against ``fcntl.flock``.

    python bench/python-lock.py [--rounds 41] [--batch 200] [--dir DIR] [--json FILE]

Needs the devlock package installed (``pip install ./python``). Three ways to
take and release one exclusive lock, uncontended, interleaved (the order
rotates every round), each round timing a batch and dividing by its size:

* ``devlock``: ``with devlock.lock("bench"):`` (opens the directory and the
  lock file, checks the line is empty, flocks, checks the path, writes the
  holder record; clears it and closes on the way out);
* ``flock``: ``fcntl.flock(fd, LOCK_EX)`` then ``LOCK_UN`` on a file opened
  once, outside the loop;
* ``open+flock``: ``os.open``, ``flock``, ``os.close`` each time (what
  ``flock FILE cmd`` does for a lock, without the command).

Then the delay from a real SIGINT to ``KeyboardInterrupt`` in another
interpreter waiting in ``devlock.lock`` (both ends read CLOCK_MONOTONIC).
Prints a markdown table: median and p90 per take and release in
microseconds, and the ratio of medians to ``flock``.

With ``--gpu`` (needs ``cc``), the block's end over ``gpu:0``, interleaved
likewise: ``release="device"`` (one driver query at the end: the fake NVML of
the tests, tests/fixtures/fake-nvml, in-process; then the fake
``nvidia-smi``, a subprocess) against ``release="block"`` (no query); and
``async with devlock.lock_async("bench")`` uncontended (one ``asyncio.run``
per batch) against the blocking block.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import devlock


def per_op(fn, batch: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(batch):
        fn()
    return (time.perf_counter_ns() - start) / batch / 1000.0


def pctl(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def interrupt_latency(dir: str, reps: int) -> list:
    script = (
        "import devlock, sys, time\n"
        "print('start', flush=True)\n"
        "try:\n"
        "    with devlock.lock('bench-int', quiet=True):\n"
        "        pass\n"
        "except KeyboardInterrupt:\n"
        "    print(time.monotonic(), flush=True)\n"
    )
    env = dict(os.environ, DEVLOCK_DIR=dir)
    delays = []
    with devlock.lock("bench-int", dir=dir):
        for _ in range(reps):
            child = subprocess.Popen(
                [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True
            )
            child.stdout.readline()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                view = devlock.status("bench-int", dir=dir, probe_timeout=None)
                if any(w["pid"] == child.pid for w in view["resources"][0]["waiters"]):
                    break
                time.sleep(0.01)
            # Registered, so waiting in its thread; let it settle in flock(2).
            time.sleep(0.05)
            sent = time.monotonic()
            os.kill(child.pid, signal.SIGINT)
            got = float(child.stdout.readline())
            child.wait(60)
            delays.append((got - sent) * 1000.0)
    return delays


def gpu_ends(dir: str, rounds: int, batch: int) -> dict:
    """The block's end over gpu:0 with the driver query and without, and
    lock_async against the blocking block (uncontended)."""
    import asyncio
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    fake = tempfile.mkdtemp(prefix="devlock-bench-nvml-")
    library = os.path.join(fake, "libnvidia-ml.so.1")
    subprocess.run(
        [shutil.which("cc") or "cc", "-shared", "-fPIC", "-fvisibility=hidden", "-o", library,
         os.path.join(root, "tests/fixtures/fake-nvml/fake_nvml.c"), "-lpthread"],
        check=True,
    )
    with open(os.path.join(fake, "scenario"), "w") as f:
        f.write("gpu 0 GPU-00000000-0000-4000-8000-000000000000 81920 0 0 NVIDIA H100\n")
    # Another process on gpu:0 (not ours): the query finds the device busy,
    # but not with this process, and lets go.
    with open(os.path.join(fake, "gpus"), "w") as f:
        f.write("0 81920\n")
    os.environ["DEVLOCK_USAGE_DIR"] = "none"

    def gpu_block(release: str):
        def fn() -> None:
            with devlock.lock("gpu:0", dir=dir, step="bench", release=release):
                pass
        return fn

    def plain() -> None:
        with devlock.lock("bench", dir=dir, step="bench"):
            pass

    async def async_batch() -> None:
        for _ in range(batch):
            async with devlock.lock_async("bench", dir=dir, step="bench"):
                pass

    def per_async() -> float:
        start = time.perf_counter_ns()
        asyncio.run(async_batch())
        return (time.perf_counter_ns() - start) / batch / 1000.0

    results = {}
    for source in ("nvml", "nvidia-smi"):
        if source == "nvml":
            os.environ.update(DEVLOCK_NVML=library, FAKE_NVML_PROCESSES=os.path.join(fake, "procs"))
            os.environ.pop("DEVLOCK_NVIDIA_SMI", None)
        else:
            os.environ.update(DEVLOCK_NVML="none", FAKE_GPU_DIR=fake,
                              DEVLOCK_NVIDIA_SMI=os.path.join(root, "contrib/fake-gpu/nvidia-smi"))
        with open(os.path.join(fake, "procs"), "w") as f:
            f.write("0 1 4096\n")
        with open(os.path.join(fake, "use.other"), "w") as f:
            f.write("0 1 4096\n")
        n = batch if source == "nvml" else max(1, batch // 20)
        ways = [(f"gpu:0 release=\"device\" ({source})", gpu_block("device")),
                (f"gpu:0 release=\"block\" ({source} set)", gpu_block("block"))]
        for _, fn in ways:
            per_op(fn, n)
        samples = {name: [] for name, _ in ways}
        for r in range(rounds):
            for name, fn in (ways if r % 2 else ways[::-1]):
                samples[name].append(per_op(fn, n))
        results.update(samples)
    ways = [("lock_async (uncontended)", per_async), ("lock (uncontended)", lambda: per_op(plain, batch))]
    per_async()
    samples = {name: [] for name, _ in ways}
    for r in range(rounds):
        for name, fn in (ways if r % 2 else ways[::-1]):
            samples[name].append(fn())
    results.update(samples)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--batch", type=int, default=200)
    ap.add_argument("--interrupts", type=int, default=9)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a fresh temp dir)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--gpu", action="store_true",
                    help="also the block's end with a driver query, and lock_async (needs cc)")
    args = ap.parse_args()
    dir = args.dir or tempfile.mkdtemp(prefix="devlock-bench-py-")
    os.makedirs(dir, exist_ok=True)
    path = os.path.join(dir, "bench-flock.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)

    def with_devlock() -> None:
        with devlock.lock("bench", dir=dir, step="bench"):
            pass

    def with_flock() -> None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        fcntl.flock(fd, fcntl.LOCK_UN)

    def with_open_flock() -> None:
        f = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        fcntl.flock(f, fcntl.LOCK_EX)
        os.close(f)

    ways = [("devlock", with_devlock), ("flock", with_flock), ("open+flock", with_open_flock)]
    for _, fn in ways:
        per_op(fn, args.batch)  # warm up
    samples = {name: [] for name, _ in ways}
    for r in range(args.rounds):
        order = ways[r % len(ways) :] + ways[: r % len(ways)]
        for name, fn in order:
            samples[name].append(per_op(fn, args.batch))
    delays = interrupt_latency(dir, args.interrupts) if args.interrupts else []

    base = statistics.median(samples["flock"])
    print(f"uncontended take + release, {args.rounds} rounds x {args.batch}, interleaved; "
          f"Python {sys.version.split()[0]}, devlock {devlock.__version__}, dir {dir}\n")
    print("| way | median µs | p90 µs | ratio to flock (medians) |")
    print("|---|---|---|---|")
    figures = {}
    for name, _ in ways:
        med = statistics.median(samples[name])
        figures[name] = {"median_us": med, "p90_us": pctl(samples[name], 0.9), "ratio": med / base}
        print(f"| {name} | {med:.2f} | {pctl(samples[name], 0.9):.2f} | {med / base:.1f} |")
    if delays:
        figures["sigint_to_keyboardinterrupt_ms"] = {
            "median": statistics.median(delays),
            "max": max(delays),
            "n": len(delays),
        }
        print(f"\nSIGINT to KeyboardInterrupt while waiting: median {statistics.median(delays):.1f} ms, "
              f"max {max(delays):.1f} ms over {len(delays)}")
    if args.gpu:
        ends = gpu_ends(dir, args.rounds, args.batch)
        print(f"\nthe block's end, {args.rounds} rounds, interleaved (take + release, µs):\n")
        print("| way | median µs | p90 µs |")
        print("|---|---|---|")
        for name, values in ends.items():
            med = statistics.median(values)
            figures[name] = {"median_us": med, "p90_us": pctl(values, 0.9)}
            print(f"| {name} | {med:.2f} | {pctl(values, 0.9):.2f} |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)


if __name__ == "__main__":
    main()
