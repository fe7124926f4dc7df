"""``tandem up``: the embedded default. One InferencePool manifest becomes a fleet of local processes,
one per replica and role, started with the same ``tandem serve`` command the pods run.

The router reads its peers' addresses from a discovery file that the fleet rewrites (write, then
rename) whenever a worker turns ready or starts draining, so it learns of workers without a restart.
Every process's output is kept, line by line, under a ``[role-i]`` prefix. A process that exits on its
own (a worker whose engine died exits with code 3) is restarted on the same port, with an exponential
backoff for one that keeps failing (1 s doubling to 30 s, forgotten after a minute up), as the kubelet
restarts a pod's container; the fleet says why from the process's last lines. Ctrl-C or SIGTERM stops the
router first, then drains and stops the workers (SIGTERM, which they treat as drain-then-exit), and
kills what is left after a grace period.

When a role has ``autoscaling.enabled``, the fleet runs the same autoscaler as the operator
(:mod:`tandem.operator.autoscaler.fleet_loop`): it scrapes every process's /metrics, asks the policy,
starts workers, and drains the least-loaded one before stopping it. A ``scaleToZero`` pool with
``minReplicas: 0`` starts with the router alone; the router is ready, holds the first request, and the
autoscaler wakes both roles.
"""
from __future__ import annotations

import base64
import collections
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tandem.operator.spec import SpecError, initial_replicas, load_manifest, worker_config
from tandem.worker.api import auth
from tandem.worker.api.config import cpu_threads
from tandem.worker.api.names import CPU_THREADS_ENV, PARENT_PID_ENV


#: the restart backoff of a process that exits on its own: first delay, cap, and the time up after
#: which its failures are forgotten (seconds)
RESTART_BACKOFF = (1.0, 30.0, 60.0)


@dataclass
class Proc:
    name: str
    role: str
    url: str
    popen: subprocess.Popen
    #: starting (not yet ready) | ready | draining (out of the discovery file, finishing its requests) |
    #: stopping (being stopped by the fleet) | restarting (exited on its own; restarted at restart_at)
    state: str = "starting"
    cmd: list = field(default_factory=list)    # how it was started (a restart runs the same)
    env: dict = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0                          # restarts in a row without a minute up
    restart_at: float = 0.0
    #: exited on its own and not ready since: its restart repairs a failure, it is no change rolling out
    #: (the autoscaler does not hold for it: tandem.operator.autoscaler.fleet_loop)
    crashed: bool = False
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4))   # last lines


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _pump(name: str, stream, out, tail: collections.deque) -> None:
    for line in iter(stream.readline, ""):
        tail.append(line.rstrip())
        out.write(f"[{name}] {line}")
        out.flush()


class LocalFleet:
    """Starts, watches and stops the processes of one pool.

    Args:
        manifest: path of an InferencePool YAML.
        host: the address every process binds (loopback by default).
        router_port: the router's port (0: a free one).
        log_stream: where prefixed process output goes.
        pool_secret: give the pool a fresh shared secret (workers then serve only this fleet's router
            and each other; docs/security.md). False: no pool credential, as a test that plays the
            router needs.

    Raises SpecError for an invalid manifest, or for an ``apiKeySecretRef`` that neither the manifest
    file nor ``TANDEM_API_KEYS`` / ``TANDEM_API_KEY_FILE`` can satisfy.
    """

    def __init__(self, manifest: str, host: str = "127.0.0.1", router_port: int = 8000, log_stream=None,
                 pool_secret: bool = True):
        self.pool = load_manifest(manifest)
        self.api_keys = local_api_keys(manifest, self.pool)
        self.host, self.router_port = host, router_port or free_port(host)
        self.out = log_stream or sys.stdout
        remove_stale_dirs()
        self.dir = Path(tempfile.mkdtemp(prefix=f"{FLEET_DIR_PREFIX}{self.pool.metadata.name}-"))
        (self.dir / OWNER_FILE).write_text(str(os.getpid()))
        self.procs: list[Proc] = []
        self.secret_file = self.token_key_file = self.api_key_file = None
        if pool_secret:
            self.secret_file = _private_file(self.dir / "pool-secret", secrets.token_urlsafe(32))
            # the router gets the pool-token key alone: it cannot make a KV proof (docs/security.md)
            self.token_key_file = _private_file(self.dir / "pool-token-key", auth.router_token_key(
                self.secret_file.read_bytes().strip()).text())
        if self.api_keys:
            self.api_key_file = _private_file(self.dir / "api-keys", "\n".join(self.api_keys) + "\n")
        self.lock = threading.RLock()   # procs and the discovery file: the autoscaler's thread changes them
        self.discovery_file = self.dir / "discovery.json"
        self._serial = {"prefill": 0, "decode": 0}
        self.stopping = False
        self._supervisor: threading.Thread | None = None
        #: the autoscaler's last burst-absorption decision, passed to the router in the discovery file
        self.absorb_bursts = False

    @property
    def worker_headers(self) -> dict[str, str]:
        """The headers this fleet's router sends its workers (the pool token), for callers that play
        the router."""
        return auth.pool_headers(self.secret_file.read_bytes().strip()) if self.secret_file else {}

    def _credential_env(self, role: str) -> dict[str, str]:
        """The process's credentials by file, never on the command line (``ps`` shows that): the pool
        secret for the workers, the pool-token key alone and the API keys for the router."""
        env = {k: v for k, v in os.environ.items() if k not in (
            auth.API_KEYS_ENV, auth.API_KEY_FILE_ENV, *auth.POOL_CREDENTIAL_ENVS)}
        if self.secret_file and role == "router":
            env[auth.POOL_TOKEN_KEY_FILE_ENV] = str(self.token_key_file)
        elif self.secret_file:
            env[auth.POOL_SECRET_FILE_ENV] = str(self.secret_file)
        if self.api_key_file and role == "router":
            env[auth.API_KEY_FILE_ENV] = str(self.api_key_file)
        return env

    @property
    def autoscaled(self) -> bool:
        """Whether a worker role has autoscaling enabled (then :meth:`run_autoscaler` applies)."""
        return any(r.autoscaling is not None and r.autoscaling.enabled
                   for r in (self.pool.spec.prefill, self.pool.spec.decode))

    def workers(self, role: str | None = None) -> list[Proc]:
        with self.lock:
            return [p for p in self.procs if p.role != "router" and (role is None or p.role == role)]

    def write_discovery(self) -> None:
        """The router's view: ready workers only (a starting one is not ready, a draining one is leaving),
        and under ``resumable`` the decode workers a stream may still be resumed on (ready or draining)."""
        with self.lock:
            d = {role: [p.url for p in self.procs if p.role == role and p.state == "ready"]
                 for role in ("prefill", "decode")}
            d["absorbBursts"] = self.absorb_bursts
            # a draining decode worker still holds streams a client may resume (the router's resume)
            d["resumable"] = [p.url for p in self.procs if p.role == "decode" and p.state in ("ready", "draining")]
            tmp = self.discovery_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(d))
            os.replace(tmp, self.discovery_file)

    def start_worker(self, role: str) -> Proc:
        """Start one worker process of ``role`` (it turns ready later: see :meth:`refresh`)."""
        with self.lock:
            i = self._serial[role]
            self._serial[role] += 1
        extra = ["--kv-port", "0"] if role == "prefill" else []
        return self._start(f"{role}-{i}", role, worker_config(self.pool, role), free_port(self.host), extra)

    def stop_worker(self, p: Proc, grace: float = 30.0) -> None:
        """Stop one worker (SIGTERM: drain, then exit; SIGKILL after ``grace`` s) and forget it."""
        with self.lock:
            if p.state != "draining":
                p.state = "stopping"   # its exit is not a crash: not restarted
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
            try:
                p.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
        with self.lock:
            if p in self.procs:
                self.procs.remove(p)
        self.write_discovery()

    def refresh(self) -> list[Proc]:
        """Mark starting processes that answer /ready as ready (and tell the router); restart those that
        exited on their own (after their backoff), and forget those the fleet stopped. Returns the
        processes found exited in this call."""
        exited, now = [], time.monotonic()
        with self.lock:
            for p in list(self.procs):
                if p.state == "restarting":
                    if now >= p.restart_at and not self.stopping:
                        self._respawn(p)
                elif p.popen.poll() is not None:
                    exited.append(p)
                    if p.state in ("draining", "stopping") or self.stopping:
                        self.procs.remove(p)
                    else:
                        self._crashed(p, now)
        if exited:
            self.write_discovery()
        with self.lock:
            procs = list(self.procs)
        for p in procs:
            if p.state == "starting" and p.popen.poll() is None and _ready(p.url):
                with self.lock:
                    if p.state == "starting":
                        p.state, p.crashed = "ready", False
                if p.role != "router":
                    self.write_discovery()
        return exited

    def _crashed(self, p: Proc, now: float) -> None:
        """``p`` exited on its own: say why and schedule its restart (under ``lock``)."""
        first, cap, forget = RESTART_BACKOFF
        if now - p.started > forget:
            p.restarts = 0
        delay = min(cap, first * 2 ** p.restarts)
        p.restarts += 1
        p.state, p.restart_at, p.crashed = "restarting", now + delay, True
        why = " | ".join(p.tail) or "no output"
        self.out.write(f"tandem up: {p.name} exited with code {p.popen.returncode} (last output: {why}); "
                       f"restarting it in {delay:.0f} s (restart {p.restarts} in a row)\n")
        self.out.flush()

    def _respawn(self, p: Proc) -> None:
        self.out.write(f"tandem up: restarting {p.name}\n")
        self.out.flush()
        p.popen = self._spawn(p.name, p.cmd, p.env, p.tail)
        p.state, p.started = "starting", time.monotonic()

    def supervise(self, interval: float = 0.5) -> None:
        """Run :meth:`refresh` every ``interval`` s on a thread of its own until :meth:`stop`: processes
        turn ready and crashed ones come back without anyone polling."""
        def loop():
            while not self.stopping:
                try:
                    self.refresh()
                except Exception as e:   # keep supervising whatever one round hit
                    self.out.write(f"tandem up: supervision round failed: {e!r}\n")
                time.sleep(interval)
        self._supervisor = threading.Thread(target=loop, name="supervisor", daemon=True)
        self._supervisor.start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.router_port}"

    def _start(self, name: str, role: str, cfg, port: int, extra: list[str] = ()) -> Proc:
        path = self.dir / f"{name}.yaml"
        path.write_text(cfg.to_yaml())
        # the console script beside this interpreter, so `ps` shows `tandem serve ...`
        script = Path(sys.executable).with_name("tandem")
        launcher = [str(script)] if script.is_file() else [sys.executable, "-m", "tandem.worker.cli"]
        cmd = [*launcher, "serve", "--role", role, "--config", str(path), "--host", self.host, "--port", str(port),
               *extra]
        # PYTHONSAFEPATH: `python -m` must not put the working directory on sys.path, where a checkout's
        # top-level operator/ folder would shadow the standard library's `operator`
        env = {**self._credential_env(role), "PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1",
               PARENT_PID_ENV: str(os.getpid())}   # the process exits with this one (see serve_cli)
        threads = cpu_threads((getattr(self.pool.spec, role).resources.requests or {}).get("cpu")) \
            if role in ("prefill", "decode") else None
        if threads:   # the role's CPU share, as its pod would have it (desired.py's Downward API env)
            env[CPU_THREADS_ENV] = str(threads)
        tail: collections.deque = collections.deque(maxlen=4)
        proc = Proc(name, role, f"http://{self.host}:{port}", self._spawn(name, cmd, env, tail), cmd=cmd,
                    env=env, tail=tail)
        with self.lock:
            self.procs.append(proc)
        return proc

    def _spawn(self, name: str, cmd: list, env: dict, tail: collections.deque) -> subprocess.Popen:
        popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env=env, start_new_session=True)
        threading.Thread(target=_pump, args=(name, popen.stdout, self.out, tail), daemon=True).start()
        return popen

    def _wait_ready(self, procs: list[Proc], timeout: float) -> None:
        t_end = time.monotonic() + timeout
        pending = list(procs)
        while pending:
            for p in list(pending):
                if p.popen.poll() is not None:
                    raise RuntimeError(f"{p.name} exited with code {p.popen.returncode} before it was ready")
                try:
                    with urllib.request.urlopen(p.url + "/ready", timeout=2) as r:
                        if r.status == 200:
                            pending.remove(p)
                except (urllib.error.URLError, OSError):
                    pass
            if pending and time.monotonic() > t_end:
                raise RuntimeError(f"not ready after {timeout:.0f} s: {', '.join(p.name for p in pending)}")
            time.sleep(0.3)

    def start(self, timeout: float = 600.0) -> None:
        """Start every worker (minReplicas of an autoscaled role, possibly 0), wait until they are
        ready, then start the router and wait for it."""
        spec = self.pool.spec
        workers = [self.start_worker(role) for role, role_spec in (("prefill", spec.prefill), ("decode", spec.decode))
                   for _ in range(initial_replicas(role_spec))]
        self._wait_ready(workers, timeout)
        for p in workers:
            p.state = "ready"
        self.write_discovery()
        discovery = {"mode": "static", "file": str(self.discovery_file)}
        if spec.autoscaling.scaleToZero:
            discovery["scaleToZero"] = True
        router = self._start("router", "router", worker_config(self.pool, "router", discovery),
                             self.router_port)
        self._wait_ready([router], timeout)
        router.state = "ready"
        self.supervise()

    def stop(self, grace: float = 30.0) -> None:
        """Router first, then workers: SIGTERM (drain, then exit), SIGKILL after ``grace`` seconds.
        Then the temporary config folder goes."""
        with self.lock:
            self.stopping = True   # the supervisor restarts nothing from here on
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        for group in ([p for p in self.procs if p.role == "router"],
                      [p for p in self.procs if p.role != "router"]):
            for p in group:
                if p.popen.poll() is None:
                    p.popen.send_signal(signal.SIGTERM)
            t_end = time.monotonic() + grace
            for p in group:
                try:
                    p.popen.wait(timeout=max(0.1, t_end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def ask(self, question: str, max_tokens: int = 64) -> str:
        """One chat completion through the router; returns the answer's text."""
        body = json.dumps({"model": self.pool.spec.model.name, "max_tokens": max_tokens, "temperature": 0,
                           "messages": [{"role": "user", "content": question}]}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_keys:
            headers["Authorization"] = f"Bearer {self.api_keys[0]}"
        req = urllib.request.Request(self.endpoint + "/v1/chat/completions", data=body, headers=headers)
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())["choices"][0]["message"]["content"]


FLEET_DIR_PREFIX = "tandem-"
#: the PID of the `tandem up` that made a fleet folder (credentials inside): a folder whose owner is gone
#: (SIGKILLed, so ``stop`` never ran) is removed by the next fleet on the machine
OWNER_FILE = "owner.pid"


def remove_stale_dirs(tmp: str | None = None) -> list[Path]:
    """Remove the fleet folders (pool secret, API keys, configs) of fleets whose process is gone; returns
    them. Only folders with an :data:`OWNER_FILE` naming a dead process of this user are touched."""
    removed = []
    for d in Path(tmp or tempfile.gettempdir()).glob(FLEET_DIR_PREFIX + "*"):
        try:
            if not d.is_dir() or d.stat().st_uid != os.getuid():
                continue
            pid = int((d / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        try:
            os.kill(pid, 0)
            continue   # alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue   # alive, another user's
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def _private_file(path: Path, text: str) -> Path:
    """Write a credential readable by this user only (0600 from creation, never wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def local_api_keys(manifest: str, pool) -> list[str]:
    """The API keys of a local fleet: the Secret that ``spec.router.apiKeySecretRef`` names, read from
    the manifest file itself (a ``kind: Secret`` document, ``stringData`` or base64 ``data``), plus
    ``TANDEM_API_KEYS`` / ``TANDEM_API_KEY_FILE``. Empty: the router is open.

    Raises SpecError when the reference cannot be satisfied."""
    env_keys = auth.KeyStore.from_env()
    keys = env_keys.keys() if env_keys else []
    ref = pool.spec.router.apiKeySecretRef
    if ref is None:
        return keys
    docs = [d for d in yaml.safe_load_all(Path(manifest).read_text()) if isinstance(d, dict)]
    found = next((d for d in docs if d.get("kind") == "Secret" and (d.get("metadata") or {}).get("name") == ref.name),
                 None)
    if found is not None:
        for v in (found.get("stringData") or {}).values():
            keys += auth.parse_keys(str(v))
        for v in (found.get("data") or {}).values():
            keys += auth.parse_keys(base64.b64decode(v).decode())
    if not keys:
        raise SpecError([("spec.router.apiKeySecretRef", f"names Secret {ref.name!r}, which this manifest file "
                          f"does not hold (or holds no key); add it, or set {auth.API_KEYS_ENV}")])
    return keys


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def run_up(args) -> int:
    """The ``tandem up`` command."""
    if not Path(args.manifest).is_file():
        print(f"error: {args.manifest}: no such file", file=sys.stderr)
        return 2
    try:
        fleet = LocalFleet(args.manifest, args.host, args.port)
    except (OSError, SpecError) as e:
        print(f"error: {args.manifest}: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    name = fleet.pool.metadata.name
    try:
        print(f"tandem up: starting pool {name} (process configs under {fleet.dir})", flush=True)
        fleet.start()
        print(f"tandem up: pool {name} is ready. OpenAI endpoint: {fleet.endpoint}/v1 "
              f"(model {fleet.pool.spec.model.name!r})", flush=True)
        if args.ask:
            print(f"Q: {args.ask}\nA: {fleet.ask(args.ask)}", flush=True)
            return 0
        loop = None
        if fleet.autoscaled:
            from tandem.operator.autoscaler.fleet_loop import FleetAutoscaler
            cal = None
            if getattr(args, "calibration", None):
                from tandem.worker.api.calibration import Calibration
                cal = Calibration.load(args.calibration)
            loop = FleetAutoscaler(fleet, window_s=getattr(args, "autoscale_window", 30.0),
                                   interval_s=getattr(args, "autoscale_interval", 5.0), calibration=cal)
            loop.start()
        try:
            while not stop.wait(1.0):   # the fleet's supervisor restarts what exits (LocalFleet.supervise)
                pass
        finally:
            if loop is not None:
                loop.stop()
        return 0
    except RuntimeError as e:
        print(f"tandem up: {e}", file=sys.stderr)
        return 1
    finally:
        print("tandem up: stopping", flush=True)
        fleet.stop()
