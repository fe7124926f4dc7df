"""What one unauthenticated HELLO costs a prefill worker's KV port (issue 26, High 1).

A KV server with a pool secret (tiny random Llama engine) runs in a child process; a client without
the secret connects and sends a HELLO whose JSON is ``--mib`` MiB (a long array of ``{}``, as the
review's probe did). Printed: the seconds until the server ends the connection, how many bytes it took,
and the server's peak RSS growth (VmHWM). Run it with this checkout's Python and with an older
checkout's to compare (the client uses whichever ``tandem`` is importable, so the wire format matches):

    PYTHONSAFEPATH=1 .venv/bin/python bench/kv_hello_flood.py --mib 60
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time

SERVER = r"""
import asyncio, pathlib, sys, tempfile
sys.path.insert(0, sys.argv[1])
from tiny_models import build_model
from tandem.worker.engine.async_engine import AsyncEngine
from tandem.worker.engine.config import EngineConfig
from tandem.worker.engine.llm_engine import LLMEngine
from tandem.worker.transfer.tcp import KVTransferServer
pe = LLMEngine(EngineConfig(model=str(build_model(pathlib.Path(tempfile.mkdtemp()), "llama")), block_size=4))
async def main():
    pa = AsyncEngine(pe)
    server = KVTransferServer(pa, pe.kv_layout(), secret=b"s" * 32)
    pa.start()
    print(await server.start("127.0.0.1", 0), flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def hwm_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    from pathlib import Path

    from tandem.worker.transfer.protocol import FrameType, encode_frame
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=60)
    a = ap.parse_args()
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    child = subprocess.Popen([sys.executable, "-c", SERVER, tests], stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.strip().isdigit():   # the model builder may print first
            line = child.stdout.readline()
            if not line:
                raise SystemExit("the KV server did not start")
        port = int(line)
        time.sleep(1.0)
        base = hwm_mib(child.pid)
        data = b"".join(bytes(x) for x in encode_frame(FrameType.HELLO, {"x": [{}] * (a.mib * 2**20 // 3)}))
        s = socket.create_connection(("127.0.0.1", port))
        s.recv(4096)   # the CHALLENGE
        t0, sent = time.monotonic(), 0
        try:
            view = memoryview(data)
            while sent < len(view):
                sent += s.send(view[sent:sent + (1 << 20)])
            s.shutdown(socket.SHUT_WR)
            answer = s.recv(4096)
            while s.recv(65536):
                pass
        except (ConnectionError, OSError):
            answer = b""
        seconds = time.monotonic() - t0
        time.sleep(0.5)
        print(f"| HELLO {a.mib} MiB, no secret | {seconds:.2f} s to refusal | {sent / 2**20:.1f} MiB taken | "
              f"peak RSS +{hwm_mib(child.pid) - base:.0f} MiB | answer {answer[:4]!r} |")
    finally:
        child.kill()
        child.wait()


if __name__ == "__main__":
    asyncio.set_event_loop(asyncio.new_event_loop())
    main()
