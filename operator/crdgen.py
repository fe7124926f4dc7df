"""Generate the InferencePool CRD (crds/inferencepool.yaml) from the pydantic models of spec.py.

    python -m tandem.operator.crdgen > crds/inferencepool.yaml      # regenerate
    python -m tandem.operator.crdgen --check crds/inferencepool.yaml  # exit 1 when out of date

Each pydantic field becomes a structural-schema property with its type, enum, bounds, pattern,
default and description. Models with `extra="forbid"` are closed objects; the API server prunes
unknown fields (v1.20 prunes rather than rejects).
"""
from __future__ import annotations

import sys
import types
import typing
from typing import Any, Literal, Union

import annotated_types as at
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from . import spec as S

_NoneType = type(None)


def _constraints(meta: list, out: dict[str, Any]) -> None:
    for m in meta:
        if isinstance(m, at.Ge):
            out["minimum"] = m.ge
        elif isinstance(m, at.Gt):
            out["minimum"] = m.gt
            out["exclusiveMinimum"] = True
        elif isinstance(m, at.Le):
            out["maximum"] = m.le
        elif isinstance(m, at.Lt):
            out["maximum"] = m.lt
            out["exclusiveMaximum"] = True
        elif isinstance(m, at.MinLen):
            out["minLength"] = m.min_length
        elif isinstance(m, at.MaxLen):
            out["maxLength"] = m.max_length
        elif isinstance(m, FieldInfo):
            _constraints(m.metadata, out)
            extra = m.json_schema_extra
            if isinstance(extra, dict):
                out.update(extra)
        else:
            pat = getattr(m, "pattern", None)
            if isinstance(pat, str):
                out["pattern"] = pat


def _schema_of_type(tp: Any) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        base, *meta = typing.get_args(tp)
        s = _schema_of_type(base)
        _constraints(meta, s)
        if s.get("x-kubernetes-int-or-string"):
            s.pop("type", None)
        return s
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not _NoneType]
        if len(args) != 1:
            raise TypeError(f"unions other than Optional are not structural: {tp}")
        return _schema_of_type(args[0])
    if origin is Literal:
        vals = list(typing.get_args(tp))
        t = {str: "string", int: "integer", bool: "boolean", float: "number"}[type(vals[0])]
        return {"type": t, "enum": vals}
    if origin is dict:
        k, v = typing.get_args(tp)
        if v is Any:
            return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        return {"type": "object", "additionalProperties": _schema_of_type(v)}
    if origin is list:
        (v,) = typing.get_args(tp)
        return {"type": "array", "items": _schema_of_type(v)}
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return model_schema(tp)
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    if tp is Any:
        return {"x-kubernetes-preserve-unknown-fields": True}
    raise TypeError(f"no schema for {tp!r}")


def _field_schema(name: str, f: FieldInfo, owner: type) -> dict[str, Any]:
    s = _schema_of_type(f.annotation)
    _constraints(f.metadata, s)
    if isinstance(f.json_schema_extra, dict):
        s.update(f.json_schema_extra)
    if s.get("x-kubernetes-int-or-string"):
        s.pop("type", None)
    desc = f.description
    if not desc:
        ann = typing.get_args(f.annotation) or (f.annotation,)
        for a in ann:
            if isinstance(a, type) and issubclass(a, BaseModel) and a.__doc__:
                desc = a.__doc__
    if not desc:
        raise ValueError(f"{owner.__name__}.{name} has no description")
    s["description"] = " ".join(desc.split())
    if f.default_factory is not None:
        val = f.default_factory()
        if isinstance(val, BaseModel):
            val = val.model_dump(mode="json", exclude_none=True)
        s["default"] = val
    elif f.default is not None and f.default is not ... and not f.is_required():
        s["default"] = f.default
    return s


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    props: dict[str, Any] = {}
    required: list[str] = []
    for name, f in model.model_fields.items():
        props[name] = _field_schema(name, f, model)
        if f.is_required():
            required.append(name)
    out: dict[str, Any] = {"type": "object", "description": " ".join((model.__doc__ or "").split()),
                           "properties": props}
    if required:
        out["required"] = required
    return out


def _status_schema() -> dict[str, Any]:
    role = {"type": "object", "description": "Replicas of one role.", "properties": {
        "desiredReplicas": {"type": "integer", "description": "Replicas the operator (or autoscaler) wants."},
        "replicas": {"type": "integer", "description": "Pods that exist."},
        "readyReplicas": {"type": "integer", "description": "Pods that are ready."},
        "summary": {"type": "string", "description": "ready/desired, for the printer columns."},
        "configHash": {"type": "string", "description": "Hash of the role's config in its pod template."},
    }}
    cond = {"type": "object", "description": "A condition (Ready, Progressing, Degraded, ScalingLimited).",
            "required": ["type", "status"], "properties": {
                "type": {"type": "string", "description": "Condition type."},
                "status": {"type": "string", "enum": ["True", "False", "Unknown"], "description": "Condition status."},
                "reason": {"type": "string", "description": "One-word CamelCase reason."},
                "message": {"type": "string", "description": "Human-readable details."},
                "lastTransitionTime": {"type": "string", "format": "date-time",
                                       "description": "When the status last changed."},
                "observedGeneration": {"type": "integer", "description": "Generation the condition was set for."},
            }}
    return {"type": "object", "description": "Observed state, written by the operator.",
            "x-kubernetes-preserve-unknown-fields": True, "properties": {
                "observedGeneration": {"type": "integer", "description": "The spec generation last reconciled."},
                "message": {"type": "string", "description": (
                    "One line for kubectl get: why the pool is Degraded (reason: message), else where it stands.")},
                "conditions": {"type": "array", "description": "Ready, Progressing, Degraded and ScalingLimited.",
                               "items": cond},
                "prefill": role, "decode": role, "router": role,
                "observed": {"type": "object", "description": "Observed latency of the pool (at the router).",
                             "properties": {
                                 "ttftSeconds": {"type": "number", "description": "Observed TTFT percentile."},
                                 "tpotSeconds": {"type": "number", "description": "Observed TPOT percentile."},
                                 "ttft": {"type": "string", "description": "TTFT for the printer column."},
                                 "tpot": {"type": "string", "description": "TPOT for the printer column."}}},
                "lastScalingDecisions": {"type": "array", "description": "Latest autoscaler decisions with reasons.",
                                         "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                                                   "description": "One decision."}},
            }}


def crd() -> dict[str, Any]:
    spec_schema = model_schema(S.InferencePoolSpec)
    root = {
        "type": "object",
        "description": "A disaggregated LLM serving pool: router, prefill and decode workers.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "API version."},
            "kind": {"type": "string", "description": "Kind."},
            "metadata": {"type": "object"},  # the apiserver allows nothing else here
            "spec": spec_schema,
            "status": _status_schema(),
        },
    }
    cols = [
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
         "description": "Whether every role has its ready replicas."},
        {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.summary",
         "description": "Ready/desired prefill replicas."},
        {"name": "Decode", "type": "string", "jsonPath": ".status.decode.summary",
         "description": "Ready/desired decode replicas."},
        {"name": "TTFT", "type": "string", "jsonPath": ".status.observed.ttft", "description": "Observed TTFT."},
        {"name": "TPOT", "type": "string", "jsonPath": ".status.observed.tpot", "description": "Observed TPOT."},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        {"name": "Status", "type": "string", "jsonPath": ".status.message",
         "description": "Why the pool is Degraded, else where it stands."},
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{S.PLURAL}.{S.GROUP}",
                     "annotations": {"tandem.dev/generated-by": "python -m tandem.operator.crdgen"}},
        "spec": {
            "group": S.GROUP,
            "scope": "Namespaced",
            "names": {"kind": S.KIND, "listKind": S.KIND + "List", "plural": S.PLURAL,
                      "singular": S.SINGULAR, "shortNames": list(S.SHORT_NAMES), "categories": ["tandem"]},
            "versions": [{"name": S.VERSION, "served": True, "storage": True,
                          "schema": {"openAPIV3Schema": root},
                          "subresources": {"status": {}},
                          "additionalPrinterColumns": cols}],
        },
    }


HEADER = ("# Generated from operator/spec.py by `python -m tandem.operator.crdgen`; do not edit.\n"
          "# Apply with: kubectl apply --server-side -f crds/\n")


def render() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=110)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--check":
        with open(argv[1]) as f:
            ok = f.read() == render()
        if not ok:
            print(f"{argv[1]} is out of date: run python -m tandem.operator.crdgen > {argv[1]}", file=sys.stderr)
        return 0 if ok else 1
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
