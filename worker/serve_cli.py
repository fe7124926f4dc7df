"""``tandem serve``: one process of a pool, a worker of some role or the router."""
from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys

from aiohttp import web

from tandem.worker.api.http import DEFAULT_MAX_REQUEST_BYTES
from tandem.worker.server.site import DEFAULT_KEEPALIVE_SECONDS, DEFAULT_MAX_CONNECTIONS

log = logging.getLogger("tandem.serve")

# PARENT_PID_ENV: set by a parent that owns this process (``tandem up``), see exit_with_parent
from tandem.worker.api.names import PARENT_PID_ENV, SERVE_ROLES, WORKER_PORT  # noqa: E402


def exit_with_parent() -> None:
    """Ask Linux for SIGTERM when the parent named by ``TANDEM_PARENT_PID`` dies (prctl
    PR_SET_PDEATHSIG), and exit now if it is already gone. A no-op when the variable is not set."""
    want = os.environ.get(PARENT_PID_ENV)
    if not want:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this process will outlive its parent",
                    ctypes.get_errno())
    if os.getppid() != int(want):   # the parent died before the prctl took effect
        sys.exit(f"tandem serve: parent {want} is gone; exiting")


def model_source(cfg) -> str:
    """The engine's model source string (``package:PKG/FILE`` or a path) of a worker config.

    Raises ValueError for a PVC source (the operator mounts it and writes its path instead)."""
    src = cfg.model.source
    if src.package:
        return f"package:{src.package}"
    if src.path:
        return src.path
    raise ValueError("model.source.pvc must be mounted and given as a path in the worker config")


def engine_config(cfg):
    """The :class:`EngineConfig` of a worker config file (:class:`tandem.worker.api.config.WorkerConfig`)."""
    from tandem.worker.api.config import kv_cache_bytes
    from tandem.worker.engine.config import EngineConfig

    model = model_source(cfg)
    e = cfg.engine
    kw = {}
    if kv_cache_bytes(e) is not None:
        kw["kv_cache_bytes"] = kv_cache_bytes(e)
    if e.kvCache.gpuMemoryFraction is not None:
        kw["gpu_memory_fraction"] = e.kvCache.gpuMemoryFraction
    return EngineConfig(model=model, dtype=cfg.model.dtype, quantization=cfg.model.quantization,
                        max_model_len=cfg.model.maxModelLen or 0, block_size=e.blockSize,
                        max_num_batched_tokens=e.maxNumBatchedTokens, max_num_seqs=e.maxNumSeqs,
                        enable_prefix_caching=e.prefixCaching, attention_backend=e.attentionBackend,
                        model_name=cfg.model.name, **kw)


async def _run_site(app: web.Application, args, on_signal, background=None) -> None:
    """Serve ``app`` on ``args.host:args.port`` until ``on_signal(stop)`` (SIGTERM, SIGINT) sets
    ``stop``; ``background(stop)`` runs beside it (the worker's engine startup). Idle connections close
    after ``args.keepalive_timeout`` seconds, and at most ``args.max_connections`` are open
    (tandem.worker.server.site)."""
    from tandem.worker.server.site import CappedTCPSite, connection_limit
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           keepalive_timeout=args.keepalive_timeout)
    await runner.setup()
    limit = connection_limit(args.max_connections)
    await CappedTCPSite(runner, args.host, args.port, limit).start()
    log.info("HTTP: at most %d connections, idle ones closed after %.0f s", limit, args.keepalive_timeout)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(on_signal(stop)))
    print(f"tandem serve: listening on http://{args.host}:{args.port}", flush=True)
    task = asyncio.ensure_future(background(stop)) if background is not None else None
    await stop.wait()
    if task is not None and not task.done():
        task.cancel()
    await runner.cleanup()


async def _serve_worker(args, cfg) -> None:
    from tandem.worker.engine.async_engine import AsyncEngine
    from tandem.worker.engine.llm_engine import LLMEngine
    from tandem.worker.server.app import WorkerServer
    from tandem.worker.server.startup import StartingWorker, StartupStatus
    from tandem.worker.transfer.tcp import KVTransferServer
    from tandem.worker.api import peer_claim

    if cfg.engine.attentionBackend == "flash-attn":
        # before the model load: a pod without flash-attn then crash-loops in seconds, and its
        # termination message names the backend rather than whatever loading met first
        from tandem.kernels import flash
        flash.require()
    from tandem.worker.engine.cpu_features import CPU_THREADS_ENV, apply_cpu_threads
    threads = apply_cpu_threads()
    if threads:
        log.info("torch threads: %d (%s)", threads, CPU_THREADS_ENV)
    # The port answers from the start: /health shows the startup phase (503) while the engine loads.
    status = StartupStatus()
    front = StartingWorker(args.role, status)
    state: dict = {}

    async def on_signal(stop: asyncio.Event) -> None:
        """SIGTERM: drain (stop admitting, turn not-ready), wait for in-flight work, then exit."""
        server, kv_server, aengine = state.get("server"), state.get("kv_server"), state.get("aengine")
        if server is None:   # still starting: nothing to drain, and the load thread cannot be stopped
            log.info("signal while starting (%s); exiting", status.phase)
            logging.shutdown()
            os._exit(0)
        server.start_drain()
        t_end = asyncio.get_running_loop().time() + args.drain_timeout
        while server.pending() and asyncio.get_running_loop().time() < t_end:
            await asyncio.sleep(0.1)
        log.info("drained (%d left); exiting", server.pending())
        if kv_server:
            await kv_server.stop()
        aengine.stop()
        stop.set()

    async def start_engine(stop: asyncio.Event) -> None:
        try:
            engine = await asyncio.to_thread(LLMEngine, engine_config(cfg), None, status.update)
        except BaseException as e:
            front.error = f"{type(e).__name__}: {e}"
            state["error"] = e
            stop.set()
            return
        aengine = AsyncEngine(engine, on_dead=_exit_on_engine_death)
        aengine.start()
        kv_server, kv_port = None, None
        if args.role == "prefill":
            kv_server = KVTransferServer(aengine, engine.kv_layout(), secret=args.pool_secret)
            kv_port = await kv_server.start(args.host, args.kv_port if args.kv_port is not None else args.port + 1)
            log.info("KV transfer server on %s:%d", args.host, kv_port)
        server = WorkerServer(args.role, aengine, cfg.pool, engine.model_name, kv_server, kv_port,
                              max_request_bytes=args.max_request_bytes, api_keys=args.api_keys,
                              pool_secret=args.pool_secret, startup=status,
                              own_url=peer_claim.own_url(args.host, args.port, os.environ.get("POD_IP")))
        state.update(server=server, kv_server=kv_server, aengine=aengine)
        await front.attach(server)
        status.ready()

    await _run_site(front.app(args.max_request_bytes, args.api_keys, args.pool_secret), args,
                    on_signal, start_engine)
    if "error" in state:   # the load failed: exit with its error (the termination message names it)
        raise state["error"]


#: the exit code of a worker whose engine died: its supervisor (the kubelet, `tandem up`) restarts it
ENGINE_DEAD_EXIT = 3


def _exit_on_engine_death(error: BaseException) -> None:
    """The engine thread died (a fault in shared state: the model or the KV cache) and every request it
    held has been failed: exit non-zero a moment later (the failed requests' error responses go out
    first), so the pod's container restarts at once, not after the liveness probe's window."""
    message = f"engine died: {type(error).__name__}: {error}"
    log.critical("%s; exiting with code %d so that the worker is restarted", message, ENGINE_DEAD_EXIT)
    _write_termination_message(message)

    def leave():
        logging.shutdown()
        os._exit(ENGINE_DEAD_EXIT)
    asyncio.get_running_loop().call_later(0.5, leave)


async def _serve_router(args, cfg) -> None:
    from tandem.worker.api.tokenizer import load_tokenizer
    from tandem.worker.router.app import Router
    from tandem.worker.router.discovery import make_discovery

    source = model_source(cfg)
    router = Router(cfg.pool, cfg.model.name, source, cfg.model.dtype, cfg.model.quantization,
                    load_tokenizer(source), cfg.engine.blockSize, make_discovery(cfg.discovery),
                    cfg.router.remotePrefillMinTokens, cfg.router.routing,
                    queue_timeout=args.queue_timeout or cfg.router.queueTimeoutSeconds,
                    max_model_len=cfg.model.maxModelLen, max_request_bytes=args.max_request_bytes,
                    api_keys=args.api_keys, pool_secret=args.pool_secret,
                    ready_without_workers=bool((cfg.discovery or {}).get("scaleToZero")),
                    unavailable_timeout=cfg.router.unavailableTimeoutSeconds,
                    stream_resume_grace=cfg.router.streamResumeGraceSeconds)

    async def on_signal(stop: asyncio.Event) -> None:
        stop.set()

    await _run_site(router.app(), args, on_signal)


def _write_termination_message(message: str) -> None:
    """Write a fatal error where Kubernetes reads it (the container's terminationMessagePath, named by
    TANDEM_TERMINATION_LOG): the kubelet reports it in the pod's lastState.terminated.message and
    the operator shows it in the pool's status. At most 4096 bytes are read, so the message is trimmed."""
    path = os.environ.get("TANDEM_TERMINATION_LOG")
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(message[:4000])
    except OSError as e:  # not on Kubernetes, or no such mount: the log has it anyway
        log.debug("termination message not written to %s: %s", path, e)


def _serve(args) -> int:
    from tandem.worker.api.config import SpecError, load_worker_config

    try:
        cfg = load_worker_config(args.config)
    except (OSError, SpecError) as e:
        print(f"error: {args.config}: {e}", file=sys.stderr)
        _write_termination_message(f"{args.config}: {e}")
        return 2
    from tandem.worker.api.auth import AuthConfigError, KeyStore, TokenKey, load_pool_secret
    try:
        args.api_keys = KeyStore.from_env(path=args.api_key_file)
        args.pool_secret = load_pool_secret(path=args.pool_secret_file)
        if isinstance(args.pool_secret, TokenKey) and args.role != "router":
            # a worker proves the pool in the KV handshake: the token key alone cannot
            raise AuthConfigError(f"a {args.role} worker needs the pool secret itself, not "
                                  f"TANDEM_POOL_TOKEN_KEY_FILE (the router's token key)")
    except (OSError, AuthConfigError) as e:   # the message names the file, never a key
        print(f"error: {e}", file=sys.stderr)
        _write_termination_message(str(e))
        return 2
    log.info("API keys: %s; pool secret: %s", "required" if args.api_keys else "off",
             "on" if args.pool_secret else "off")
    exit_with_parent()
    main = _serve_router if args.role == "router" else _serve_worker
    try:
        asyncio.run(main(args, cfg))
    except Exception as e:
        _write_termination_message(f"{args.role}: {type(e).__name__}: {e}")
        raise
    return 0


def add_serve_command(sub) -> None:
    """Register ``tandem serve`` on the top-level subparsers."""
    s = sub.add_parser("serve", help="run one process of a pool: a worker or the router")
    s.add_argument("--role", required=True, choices=SERVE_ROLES)
    s.add_argument("--config", required=True, help="the worker config file (model, engine, router, discovery)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=WORKER_PORT)
    s.add_argument("--kv-port", type=int, default=None,
                   help="prefill role: the KV transfer port (default: --port + 1; 0 picks a free one)")
    s.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds SIGTERM waits for in-flight requests before exiting")
    s.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"the largest request body accepted; larger ones get 413 (default {DEFAULT_MAX_REQUEST_BYTES})")
    s.add_argument("--keepalive-timeout", type=float, default=DEFAULT_KEEPALIVE_SECONDS, metavar="SECONDS",
                   help=f"close a connection idle this long (default {DEFAULT_KEEPALIVE_SECONDS:.0f})")
    s.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help=f"the most open HTTP connections, lowered to fit the file descriptor limit; at the "
                        f"limit the oldest idle ones are closed (default {DEFAULT_MAX_CONNECTIONS})")
    s.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="client API keys (Authorization: Bearer): a file, or a folder whose every file holds "
                        "keys, one per line (a mounted Secret). Also: TANDEM_API_KEY_FILE, TANDEM_API_KEYS")
    s.add_argument("--pool-secret-file", default=None, metavar="PATH",
                   help="the pool's shared secret (router -> worker token, KV handshake). "
                        "Also: TANDEM_POOL_SECRET_FILE, TANDEM_POOL_SECRET; a router may "
                        "have only TANDEM_POOL_TOKEN_KEY_FILE (its token key, 64 hex digits)")
    s.add_argument("--queue-timeout", type=float, default=None, metavar="SECONDS",
                   help="router: seconds a request waits for a ready decode worker before a 503 "
                        "(default: the config's router.queueTimeoutSeconds, 300)")
    s.set_defaults(func=_serve)
