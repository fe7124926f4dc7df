"""Who may call a tandem process: client API keys and the pool's shared secret (docs/security.md).

Two credentials, checked by one aiohttp middleware (:func:`auth_middleware`):

- **API keys** (``Authorization: Bearer <key>``), vLLM's ``--api-key``: the router's clients, or the
  clients of a worker run alone. Keys come from ``TANDEM_API_KEYS`` (comma or whitespace separated) and
  ``TANDEM_API_KEY_FILE`` (a file, or a folder such as a mounted Secret whose every file holds keys, one
  per line). A folder or file is read again at most every ``KeyStore.reload_seconds``, so a rotated
  Secret takes effect without a restart.
- **The pool secret**: random bytes every process of one pool shares (the operator's per-pool Secret,
  or a file ``tandem up`` writes). The router proves it to a worker with the header
  ``X-Tandem-Pool-Token``: a fresh token per request (time, nonce, HMAC under a key derived from the
  secret for this purpose only), accepted once within a minute of its time (:class:`TokenVerifier`),
  so a token seen on the wire cannot be used again. The KV transfer handshake
  (tandem.worker.transfer.handshake) uses keys of its own, derived from the same secret. It comes from
  ``TANDEM_POOL_SECRET_FILE`` or ``TANDEM_POOL_SECRET``. The router needs only the token key
  (:class:`TokenKey`, ``TANDEM_POOL_TOKEN_KEY_FILE``): holding it, a compromised router can make pool
  tokens but no KV proof.

A protected request passes with a valid API key or a valid pool token; with neither credential
configured the process is open (as before). ``/health``, ``/ready``, ``/metrics`` and ``GET /drain``
stay open for probes and scrapers. Comparisons use :func:`hmac.compare_digest`; keys and tokens are
never logged. A refusal is a 401 in OpenAI's error format, counted in ``tandem:auth_failures_total``
with the refused ``endpoint``.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Optional

from aiohttp import web

from tandem.worker.api.keys import ROUTER_TOKEN, derive
from tandem.worker.api.errors import error_body

log = logging.getLogger(__name__)

POOL_TOKEN_HEADER = "X-Tandem-Pool-Token"
API_KEYS_ENV = "TANDEM_API_KEYS"
API_KEY_FILE_ENV = "TANDEM_API_KEY_FILE"
POOL_SECRET_ENV = "TANDEM_POOL_SECRET"
POOL_SECRET_FILE_ENV = "TANDEM_POOL_SECRET_FILE"
POOL_TOKEN_KEY_FILE_ENV = "TANDEM_POOL_TOKEN_KEY_FILE"
#: every variable that names a pool credential (a parent drops them from its children's environment)
POOL_CREDENTIAL_ENVS = (POOL_SECRET_ENV, POOL_SECRET_FILE_ENV, POOL_TOKEN_KEY_FILE_ENV)

#: paths anyone may GET: probes, scrapers, drain status
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
#: the ``endpoint`` label values of refusals; any other path counts as "other" (a scanner must not
#: make a series per path it tries)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/drain", "/absorb-bursts", "other", "kv")
#: paths only the pool may call (the operator's control of a router): the pool token, never an API key;
#: their handlers check it (:func:`pool_only`), since a router's middleware takes API keys alone
POOL_ONLY_PATHS = frozenset({"/absorb-bursts", "/v1/streams/resume", "/v1/streams/cancel"})
_SPLIT = re.compile(r"[\s,]+")


class AuthConfigError(ValueError):
    """A credential source that is set but unusable (missing file, empty secret)."""


def parse_keys(text: str) -> list[str]:
    """The keys in a text: separated by whitespace, newlines or commas."""
    return [k for k in _SPLIT.split(text) if k]


class KeyStore:
    """The accepted API keys, from a literal list and/or a file or folder (re-read every
    ``reload_seconds``, so a rotated Kubernetes Secret applies without a restart; a key removed, or
    the file deleted, is refused from the next reload on).

    Raises AuthConfigError when the file or folder is missing or holds no key."""

    def __init__(self, keys: list[str] = (), path: Optional[str] = None, reload_seconds: float = 10.0):
        self.literal = [k for k in keys if k]
        self.path = Path(path) if path else None
        self.reload_seconds = reload_seconds
        self._loaded_at = 0.0
        self._keys: list[bytes] = []
        self._load()
        if not self._keys:
            raise AuthConfigError(f"no API key in {self.path or 'the given list'}")

    def _load(self, first: bool = True) -> None:
        keys = list(self.literal)
        if self.path is not None:
            if not self.path.exists():
                if first:
                    raise AuthConfigError(f"API key file {self.path} does not exist")
                # deleted: its keys are revoked (fail closed; a Kubernetes Secret volume swaps its
                # files atomically, so a mounted folder is never missing mid-update)
                log.warning("API key file %s is gone: its keys are no longer accepted", self.path)
                self._keys = [k.encode() for k in keys]
                self._loaded_at = time.monotonic()
                return
            files = ([p for p in sorted(self.path.iterdir()) if p.is_file() and not p.name.startswith(".")]
                     if self.path.is_dir() else [self.path])
            for f in files:
                keys += parse_keys(f.read_text())
        self._keys = [k.encode() for k in keys]
        self._loaded_at = time.monotonic()

    def keys(self) -> list[str]:
        """The keys as loaded (for a parent that hands them to its router by file)."""
        return [k.decode() for k in self._keys]

    def check(self, presented: str) -> bool:
        """Whether ``presented`` is one of the keys; every key is compared (constant time each)."""
        if self.path is not None and time.monotonic() - self._loaded_at > self.reload_seconds:
            try:
                self._load(first=False)
            except OSError as e:   # unreadable for a moment: keep the last set
                log.warning("API keys not reloaded: %s", e)
        p = _header_bytes(presented)
        ok = False
        for k in self._keys:
            ok |= hmac.compare_digest(p, k)
        return ok

    @classmethod
    def from_env(cls, env=os.environ, path: Optional[str] = None) -> Optional["KeyStore"]:
        """The keys named by ``TANDEM_API_KEYS`` / ``TANDEM_API_KEY_FILE`` (or ``path``); None when
        neither is set."""
        literal = parse_keys(env.get(API_KEYS_ENV, ""))
        path = path or env.get(API_KEY_FILE_ENV) or None
        if not literal and not path:
            return None
        return cls(literal, path)


class TokenKey(bytes):
    """The pool-token key alone (32 bytes), what the router is given instead of the pool secret: it
    makes and checks pool tokens (:func:`token_key` returns it as it is) and derives nothing, so its
    holder cannot make a KV proof or frame tag (tandem.worker.api.keys). Written as 64 hex digits."""

    def text(self) -> str:
        return self.hex()


def router_token_key(secret: bytes) -> TokenKey:
    """The :class:`TokenKey` of a pool secret (what the operator and ``tandem up`` give the router)."""
    return TokenKey(token_key(secret))


def load_pool_secret(env=os.environ, path: Optional[str] = None) -> Optional[bytes]:
    """The pool secret from ``path``, ``TANDEM_POOL_SECRET_FILE`` or ``TANDEM_POOL_SECRET``, else the
    token key alone from ``TANDEM_POOL_TOKEN_KEY_FILE`` (a :class:`TokenKey`: the router's); None when
    none is set. Surrounding whitespace is dropped. Raises AuthConfigError for a missing, empty or
    malformed one."""
    path = path or env.get(POOL_SECRET_FILE_ENV)
    if not path and not env.get(POOL_SECRET_ENV) and env.get(POOL_TOKEN_KEY_FILE_ENV):
        kpath = env[POOL_TOKEN_KEY_FILE_ENV]
        try:
            text = Path(kpath).read_text().strip()
            key = bytes.fromhex(text)
        except OSError as e:
            raise AuthConfigError(f"pool token key file {kpath}: {e.strerror}") from None
        except ValueError:
            raise AuthConfigError(f"pool token key file {kpath}: not hexadecimal") from None
        if len(key) != 32:
            raise AuthConfigError(f"pool token key file {kpath}: {len(key)} bytes, not 32")
        return TokenKey(key)
    if path:
        try:
            data = Path(path).read_bytes().strip()
        except OSError as e:
            raise AuthConfigError(f"pool secret file {path}: {e.strerror}") from None
    elif env.get(POOL_SECRET_ENV):
        data = env[POOL_SECRET_ENV].strip().encode()
    else:
        return None
    if len(data) < 16:
        raise AuthConfigError("the pool secret is shorter than 16 bytes")
    return data


#: seconds a pool token stays valid either side of its timestamp (clock skew between nodes included)
TOKEN_WINDOW_SECONDS = 60
_TOKEN_RE = re.compile(r"(\d{1,12}):([0-9a-f]{32}):([0-9a-f]{64})")


def token_key(secret: bytes) -> bytes:
    """The key pool tokens are made with: HKDF of the pool secret for this purpose alone (not the KV
    handshake's keys: tandem.worker.api.keys); a :class:`TokenKey` is that key already."""
    return bytes(secret) if isinstance(secret, TokenKey) else derive(secret, ROUTER_TOKEN)


def pool_token(secret: bytes, now: Optional[float] = None) -> str:
    """A fresh value of ``X-Tandem-Pool-Token``: ``<unix time>:<128-bit nonce>:<HMAC-SHA256>`` of the
    first two under :func:`token_key`. Each is accepted once, within ``TOKEN_WINDOW_SECONDS`` of its
    time (:class:`TokenVerifier`): make one per request."""
    ts, nonce = str(int(time.time() if now is None else now)), secrets.token_hex(16)
    return f"{ts}:{nonce}:{hmac.new(token_key(secret), f'{ts}:{nonce}'.encode(), hashlib.sha256).hexdigest()}"


class TokenVerifier:
    """Checks pool tokens: the MAC, the time window, and that the nonce was not seen before (a replay
    cache holding each nonce until its token expires, at most ``max_entries``, oldest dropped first)."""

    def __init__(self, secret: bytes, window: float = TOKEN_WINDOW_SECONDS, max_entries: int = 1_000_000):
        self.key, self.window, self.max_entries = token_key(secret), window, max_entries
        self.seen: "OrderedDict[str, float]" = OrderedDict()

    def check(self, presented: str, now: Optional[float] = None) -> bool:
        now = time.time() if now is None else now
        m = _TOKEN_RE.fullmatch(presented)
        if m is None:
            return False
        ts, nonce, mac = m.groups()
        want = hmac.new(self.key, f"{ts}:{nonce}".encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, mac) or abs(now - int(ts)) > self.window:
            return False
        while self.seen and next(iter(self.seen.values())) < now:
            self.seen.popitem(last=False)
        if nonce in self.seen:
            log.warning("a replayed pool token was refused")
            return False
        self.seen[nonce] = int(ts) + self.window
        if len(self.seen) > self.max_entries:
            self.seen.popitem(last=False)
        return True


_verifiers: dict[bytes, TokenVerifier] = {}


def verifier_for(secret: bytes) -> TokenVerifier:
    """This process's verifier (one replay cache) for a pool secret or its :class:`TokenKey`."""
    k = token_key(secret)
    if k not in _verifiers:
        _verifiers[k] = TokenVerifier(secret)
    return _verifiers[k]


def pool_headers(secret: Optional[bytes]) -> dict[str, str]:
    """The headers a process of the pool sends to a worker (empty without a secret), with a fresh token:
    call it for every request."""
    return {POOL_TOKEN_HEADER: pool_token(secret)} if secret else {}


def _bearer(request: web.Request) -> Optional[str]:
    h = request.headers.get("Authorization", "")
    scheme, _, value = h.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def is_open(request: web.Request) -> bool:
    """Probes, scrapes and the drain status need no credential; pool-only paths are checked by their
    handlers (:func:`pool_only`)."""
    return request.path in OPEN_PATHS or request.path in POOL_ONLY_PATHS or \
        (request.path == "/drain" and request.method == "GET")


def pool_only(request: web.Request, secret: Optional[bytes],
              on_refused: Optional[Callable[[str], None]] = None,
              keys: Optional[KeyStore] = None) -> Optional[web.Response]:
    """None when ``request`` carries the pool token of ``secret`` (or the process has no credential at
    all: an open local fleet); otherwise the 401 to send, counted by ``on_refused``. An API key never
    passes, and a process with API keys but no pool secret refuses every call (nothing could prove
    to be the pool)."""
    if secret is None and keys is None:
        return None
    if secret is not None and _has_token(request, verifier_for(secret)):
        return None
    if on_refused is not None:
        on_refused(request.path if request.path in ENDPOINTS else "other")
    return web.json_response(error_body("Only the pool's operator may call this (no valid pool token).", 401,
                                        None, "invalid_request_error"), status=401)


FROM_POOL = web.RequestKey("tandem.from_pool", bool)


def from_pool(request: web.Request, secret: Optional[bytes]) -> bool:
    """Whether ``request`` came from a process of the pool: it carried a valid pool token, or the
    process has no pool secret (an open local fleet). A client's API key is not the pool: what only
    the router may ask (naming a prefill peer) is ignored on such a request."""
    return secret is None or bool(request.get(FROM_POOL))


def _has_token(request: web.Request, verifier: TokenVerifier) -> bool:
    """Whether ``request`` carries a valid, unused token in :data:`POOL_TOKEN_HEADER`."""
    presented = request.headers.get(POOL_TOKEN_HEADER)
    return presented is not None and verifier.check(presented)


def _header_bytes(value: str) -> bytes:
    """A header value as the bytes the client sent: aiohttp decodes them as UTF-8 with surrogateescape,
    so a non-UTF-8 credential must not raise (a 500, uncounted) but compare unequal (a 401, counted)."""
    return value.encode("utf-8", "surrogateescape")


def auth_middleware(keys: Optional[KeyStore], secret: Optional[bytes],
                    on_refused: Optional[Callable[[str], None]] = None):
    """An aiohttp middleware that refuses (401, OpenAI's error format) a protected request without a
    valid API key or pool token, before its body is read. ``on_refused(endpoint)`` counts it.
    Returns None when neither credential is configured (nothing to check)."""
    if keys is None and secret is None:
        return None
    verifier = verifier_for(secret) if secret else None

    @web.middleware
    async def check(request: web.Request, handler):
        if is_open(request):
            return await handler(request)
        if verifier is not None and _has_token(request, verifier):
            request[FROM_POOL] = True
            return await handler(request)
        bearer = _bearer(request)
        if keys is not None and bearer is not None and keys.check(bearer):
            return await handler(request)
        if on_refused is not None:
            on_refused(request.path if request.path in ENDPOINTS else "other")
        why = ("Incorrect API key provided." if bearer is not None else
               "Missing credentials: send 'Authorization: Bearer <API key>'.")
        if keys is None:
            why = "This worker serves only its own pool (no valid pool token)."
        return web.json_response(error_body(why, 401, None, "invalid_request_error"), status=401,
                                 headers={"WWW-Authenticate": "Bearer"})
    return check


def install(app: web.Application, keys: Optional[KeyStore], secret: Optional[bytes],
            on_refused: Optional[Callable[[str], None]] = None) -> web.Application:
    """Put the auth check first among ``app``'s middlewares (before any body is read)."""
    mw = auth_middleware(keys, secret, on_refused)
    if mw is not None:
        app.middlewares.insert(0, mw)
    return app
