"""Keep one CPU core busy, as a noisy neighbour does, to check that the test command has no timing-
sensitive test (issue 27: one of three clean-clone runs goes beside it).

    python3 scripts/burn_cpu.py [--seconds N] &   # N = 0 (the default): until killed
    bash scripts/test.sh; kill %1

A pure-Python busy loop in one process holds one core at 100% (the GIL keeps it to one), at normal
priority, so the scheduler shares that core with the tests as it would with any other process.
"""
import argparse
import time

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: until killed)")
end = time.monotonic() + (ap.parse_args().seconds or float("inf"))
x = 0
while time.monotonic() < end:
    for _ in range(100_000):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
