"""Which package may import which (docs/architecture.md, "Who owns what"): shared pieces sit below their
users. Every `import` in a package's files is read, function-level ones included, since a lazy import
still ties the two packages together. Then two fresh interpreters import the router and the simulator
and report what they loaded: neither may load torch or Kopf."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
#: folder -> package name, as pyproject.toml's package-dir maps them
PACKAGES = {"worker": "tandem.worker", "operator": "tandem.operator", "kernels": "tandem.kernels"}

#: the trace file format is the one contract of `tandem bench` that the simulator reads (docs/bench.md)
TRACE_FORMAT = "tandem.worker.bench.trace"

RULES = [
    # (folder, forbidden prefixes, allowed exceptions, why)
    ("worker/api", ("tandem.",), ("tandem.worker.api",), "the contracts import nothing of tandem's"),
    ("worker/router", ("tandem.worker.engine", "tandem.worker.server", "tandem.worker.models",
                       "tandem.operator", "torch", "kopf"), (), "the router runs on the contracts alone"),
    ("operator/autoscaler", ("kopf", "tandem.worker.bench"), (),
     "the policy is shared by the operator, the local fleet and the simulator"),
    ("operator/autoscaler/loop.py", ("tandem.operator.kube", "kubernetes", "tandem.operator.local",
                                     "tandem.operator.autoscaler.kube_loop",
                                     "tandem.operator.autoscaler.fleet_loop"),
     (), "the scaling logic is written once and knows neither backend (a fix to it lands once)"),
    ("operator/autoscaler/fleet_loop.py", ("tandem.operator.kube", "kubernetes",
                                           "tandem.operator.autoscaler.kube_loop"),
     (), "the local fleet's backend needs no Kubernetes client"),
    ("operator/autoscaler/kube_loop.py", ("tandem.operator.local", "tandem.operator.autoscaler.fleet_loop"), (),
     "the Kubernetes backend knows nothing of the local fleet"),
    ("operator/simulate", ("kopf", "tandem.worker.bench"), (TRACE_FORMAT,),
     "the simulator runs without Kopf or the load generator"),
    ("worker/engine", ("tandem.operator", "kubernetes"), (), "the engine knows nothing of who deploys it"),
    ("worker/models", ("tandem.worker.engine", "tandem.operator"), (), "the engine imports the models"),
    ("worker/bench", ("tandem.worker.engine", "tandem.worker.server", "tandem.operator", "torch"), (),
     "the load generator talks HTTP to any server; it needs no engine"),
    ("worker/serve_cli.py", ("tandem.operator",), (), "`tandem serve` runs no operator code"),
    ("operator", ("tandem.worker.engine", "tandem.worker.serve_cli", "tandem.worker.cli", "torch"), (),
     "the operator image has no torch; `tandem up` starts `tandem serve` as a process"),
]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGES[parts[0]], *parts[1:]])


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, relative imports resolved to absolute names."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            found.add(stem)
            # `from . import x` and `from pkg import module` name modules too
            found.update(f"{stem}.{a.name}" for a in node.names)
    return found


def matches(name: str, prefix: str) -> bool:
    prefix = prefix.rstrip(".")
    return name == prefix or name.startswith(prefix + ".")


#: single files that may cross their folder's rule, and why: the chaos soak owns the fleet it injects
#: faults into (it starts `tandem up`'s LocalFleet and its autoscaler), unlike the rest of the load
#: generator, which talks HTTP to any server
FILE_EXCEPTIONS = {"worker/bench/chaos.py": ("tandem.operator.local", "tandem.operator.autoscaler")}


def violations(folder: str, forbidden, allowed) -> list[str]:
    bad = []
    where = ROOT / folder
    for path in sorted(where.rglob("*.py") if where.is_dir() else [where]):
        exempt = FILE_EXCEPTIONS.get(str(path.relative_to(ROOT)), ())
        for name in sorted(imports_of(path)):
            if any(matches(name, a) for a in (*allowed, *exempt)):
                continue
            if any(matches(name, f) or (f.endswith(".") and name.startswith(f)) for f in forbidden):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


@pytest.mark.parametrize("folder,forbidden,allowed,why", RULES, ids=[r[0] for r in RULES])
def test_import_direction(folder, forbidden, allowed, why):
    assert violations(folder, forbidden, allowed) == [], why


def test_the_rule_catches_a_wrong_import(tmp_path, monkeypatch):
    """The scan itself: a function-level import of the engine in a router file is found."""
    fake = ROOT / "worker" / "router" / "app.py"
    src = "def f():\n    from tandem.worker.engine.loader import x\n    from ..server import metrics\n"
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: src)
    assert imports_of(fake) >= {"tandem.worker.engine.loader", "tandem.worker.server.metrics"}


def test_packages_import_each_other_without_cycles():
    """No module-level or function-level cycle between operator/desired.py and operator/security.py, nor
    between worker/models and the engine's loader."""
    assert not any(matches(n, "tandem.operator.desired")
                   for n in imports_of(ROOT / "operator" / "security.py"))
    assert not any(matches(n, "tandem.worker.engine") for n in imports_of(ROOT / "worker" / "models" / "llama.py"))


LOADED = """
import json, sys
{imports}
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "kopf", "transformers", "tandem"))))
"""


def loaded(imports: str, *forbidden: str) -> list[str]:
    """The modules matching ``forbidden`` prefixes that a fresh interpreter loads for ``imports``."""
    out = subprocess.run([sys.executable, "-c", LOADED.format(imports=imports)], capture_output=True,
                         text=True, timeout=60, env={"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    mods = json.loads(out.stdout.strip().splitlines()[-1])
    return [m for m in mods if any(matches(m, f) for f in forbidden)]


NO_TORCH_NO_KOPF = ("torch", "kopf", "transformers")


def test_router_imports_load_no_torch_no_kopf():
    assert loaded("import tandem.worker.router.app, tandem.worker.router.discovery, tandem.worker.router.policy",
                  *NO_TORCH_NO_KOPF, "tandem.worker.engine", "tandem.worker.server", "tandem.operator") == []


def test_simulator_imports_load_no_torch_no_kopf():
    mods = loaded("import tandem.operator.simulate.cli, tandem.operator.simulate.run, "
                  "tandem.operator.simulate.tune, tandem.operator.autoscaler.policy, "
                  "tandem.operator.autoscaler.fleet_loop, tandem.operator.autoscaler.loop",
                  *NO_TORCH_NO_KOPF, "tandem.worker.bench", "tandem.worker.engine")
    assert [m for m in mods if m not in ("tandem.worker.bench", TRACE_FORMAT)] == []


def test_up_loads_no_engine():
    """`tandem up` starts `tandem serve` processes; it needs neither torch nor the engine itself."""
    assert loaded("import tandem.operator.local, tandem.operator.up_cli",
                  *NO_TORCH_NO_KOPF, "tandem.worker.engine", "tandem.worker.serve_cli") == []


def test_cli_entry_point_imports_only_the_chosen_subcommand():
    """`tandem --help` imports no subcommand; `tandem serve` imports no operator code."""
    assert loaded("import tandem.worker.cli as c; c.build_parser(commands=())", *NO_TORCH_NO_KOPF,
                  "tandem.operator", "tandem.worker.bench", "tandem.worker.serve_cli") == []
    assert loaded("import tandem.worker.cli as c; c.build_parser(commands=('serve',))", *NO_TORCH_NO_KOPF,
                  "tandem.operator", "tandem.worker.bench") == []
