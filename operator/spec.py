"""The InferencePool spec: the one definition read by the operator, the local fleet and the router.

The models mirror the InferencePool YAML (crds/, docs/operator.md) field for field (camelCase names, as
in the manifest).

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
import os
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# The worker config and the sections it shares with the spec live with the worker's contracts (the
# workers read them without importing the operator); re-exported here, where the spec is assembled.
from tandem.worker.api.config import (_CROSS_MARK, _CROSS_SEP, EngineSpec, ModelSource, ModelSpec,  # noqa: F401
                                      ResourceRequirements, RouterSpec, SpecError, WorkerConfig, _Model,
                                      kv_cache_bytes, load_worker_config, parse_quantity, problems_of)
# the pool's roles and the port each serves on: names the workers and the router share
from tandem.worker.api.names import POOL_ROLES as ROLES, WORKER_PORT  # noqa: F401

GROUP = "serving.tandem.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePool"
PLURAL = "inferencepools"
SINGULAR = "inferencepool"
SHORT_NAMES = ["tpool"]


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
# ---------------------------------------------------------------------------------------------
# Roles and per-role autoscaling

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

class PolicyPeer(_Model):
    """One source a NetworkPolicy admits (Kubernetes NetworkPolicyPeer, matchLabels only): pods
    matching podSelector in namespaces matching namespaceSelector, or an ipBlock."""
    podSelector: Optional[dict[str, str]] = Field(None, description="matchLabels of the source pods.")
    namespaceSelector: Optional[dict[str, str]] = Field(None, description=(
        "matchLabels of the source namespaces ({}: every namespace). Absent: the pool's namespace."))
    ipBlock: Optional[str] = Field(None, description="A CIDR, e.g. 10.0.0.0/8 (alone, without selectors).",
                                   pattern=r"^[0-9a-fA-F:.]+/[0-9]{1,3}$", max_length=64)


class NetworkPolicySpec(_Model):
    """NetworkPolicies of the pool (docs/security.md). They are enforced only where the cluster's
    network plugin enforces NetworkPolicy."""
    enabled: bool = Field(True, description=(
        "Make the pool's NetworkPolicies: workers admit only the pool's router, each other and "
        "workersFrom; the router admits routerFrom."))
    routerFrom: list[PolicyPeer] = Field(default_factory=list, description=(
        "Who may reach the router's port. Empty: anyone."))
    workersFrom: list[PolicyPeer] = Field(default_factory=list, description=(
        "Who else may reach the workers' HTTP port (metrics scrapers); the tandem operator's pods "
        "(label app.kubernetes.io/name=tandem-operator, in the operator's namespace) always may."))
    egressTo: list[PolicyPeer] = Field(default_factory=list, description=(
        "Where else the pool's pods may connect (any port), beyond DNS, the pool's own pods and "
        "(router) the API server: e.g. a tracing collector."))


class InferencePoolSpec(_Model):
    """A disaggregated serving pool: a router, a prefill pool and a decode pool."""
    model: ModelSpec = Field(description="The served model.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Worker engine settings.")
    prefill: RoleSpec = Field(default_factory=RoleSpec, description="The prefill pool.")
    decode: RoleSpec = Field(default_factory=RoleSpec, description="The decode pool.")
    router: RouterSpec = Field(default_factory=RouterSpec, description="The router.")
    autoscaling: PoolAutoscaling = Field(default_factory=PoolAutoscaling, description="Pool-wide autoscaling.")
    gateway: Optional[GatewaySpec] = Field(None, description="Optional Gateway API Inference Extension integration.")
    networkPolicy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec, description=(
        "Who may talk to the pool's pods (enforced where the network plugin enforces NetworkPolicy)."))


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


# ---------------------------------------------------------------------------------------------
# Cross-field rules (the webhook's and the reconciler's)

def _gpus(role: RoleSpec) -> int:
    q = role.resources.limits.get("nvidia.com/gpu") or role.resources.requests.get("nvidia.com/gpu")
    return parse_quantity(q) if q is not None else 0


#: the installation's allowlists (the chart's ``security.*`` values, docs/security.md "Who may create
#: pools"): comma-separated prefixes; unset (``tandem up``, tests run out of cluster) allows anything
ALLOWED_IMAGES_ENV = "TANDEM_ALLOWED_IMAGE_PREFIXES"
ALLOWED_METRICS_URLS_ENV = "TANDEM_ALLOWED_METRICS_URL_PREFIXES"


def _allowed(value: str, prefixes: list[str]) -> bool:
    """Whether ``value`` starts with one of ``prefixes`` at a boundary: a prefix that does not end in a
    separator must be followed by one, so ``http://prom:9090`` does not admit ``http://prom:9090.evil``."""
    for p in prefixes:
        if value == p or (value.startswith(p) and (p[-1] in "/:@" or value[len(p)] in "/:@?#")):
            return True
    return False


def installation_problems(spec: InferencePoolSpec, env=None) -> list[tuple[str, str]]:
    """What the operator's installation forbids: an image outside ``TANDEM_ALLOWED_IMAGE_PREFIXES``
    (whoever may create a pool runs its image with the Secrets it names mounted), a metrics URL outside
    ``TANDEM_ALLOWED_METRICS_URL_PREFIXES`` (the operator GETs it). Each variable unset: no limit."""
    env = os.environ if env is None else env
    out: list[tuple[str, str]] = []
    images = env.get(ALLOWED_IMAGES_ENV)
    if images is not None:
        allowed = [p.strip() for p in images.split(",") if p.strip()]
        if not _allowed(spec.engine.image, allowed):
            out.append(("spec.engine.image", f"{spec.engine.image!r} is not an allowed image here (the operator "
                                             f"allows images under {allowed}: chart value security.allowedImagePrefixes)"))
    urls, url = env.get(ALLOWED_METRICS_URLS_ENV), spec.autoscaling.metrics.url
    if urls is not None and url:
        allowed = [p.strip() for p in urls.split(",") if p.strip()]
        if not _allowed(url, allowed):
            out.append(("spec.autoscaling.metrics.url", f"{url!r} is not an allowed metrics URL here (the operator "
                                                        f"allows {allowed or 'none'}: chart value "
                                                        f"security.allowedMetricsURLPrefixes)"))
    return out


def cross_field_problems(spec: InferencePoolSpec) -> list[tuple[str, str]]:
    """Rules that span fields, and the installation's allowlists (:func:`installation_problems`).
    Returns (field path, message) pairs; empty when the spec is sound."""
    out: list[tuple[str, str]] = installation_problems(spec)
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
    for field in ("routerFrom", "workersFrom", "egressTo"):
        for i, peer in enumerate(getattr(spec.networkPolicy, field)):
            sel = peer.podSelector is not None or peer.namespaceSelector is not None
            if sel == (peer.ipBlock is not None):
                out.append((f"spec.networkPolicy.{field}[{i}]",
                            "set ipBlock, or podSelector and/or namespaceSelector (exactly one kind)"))
    if pool_as.gpuBudget is not None:
        need = (initial_replicas(spec.prefill) * _gpus(spec.prefill)
                + initial_replicas(spec.decode) * _gpus(spec.decode))
        if need > pool_as.gpuBudget:
            out.append(("spec.autoscaling.gpuBudget",
                        f"the starting replicas need {need} GPUs, more than the budget of {pool_as.gpuBudget}"))
    return out


# ---------------------------------------------------------------------------------------------
# Loading

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


# ---------------------------------------------------------------------------------------------
# The worker's config file (`tandem serve --role R --config FILE`)

def service_name(pool: str, role: str) -> str:
    """Name of a role's Service (headless for prefill/decode): <pool>-<role>."""
    return f"{pool}-{role}"


def kubernetes_discovery(pool: InferencePool) -> dict[str, Any]:
    name = pool.metadata.name
    d = {"mode": "kubernetes", "namespace": pool.metadata.namespace or "default",
         "prefillService": service_name(name, "prefill"), "decodeService": service_name(name, "decode"),
         "port": WORKER_PORT}
    if pool.spec.autoscaling.scaleToZero:   # the router is ready with no worker, to hold the first request
        d["scaleToZero"] = True
    return d


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
