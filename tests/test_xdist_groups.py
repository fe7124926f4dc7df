"""The test command's pytest-xdist groups (tests/xdist_groups.py): a file that uses one of the
expensive shared starts lands in the group that holds it, so each starts once per run and the two
cluster suites never run two clusters at once. Read from the files' source (ast), not collected."""
import ast
from pathlib import Path

from xdist_groups import xdist_group

TESTS = Path(__file__).resolve().parent
# a session fixture -> (the folders its conftest.py makes it visible in, the group its users must share):
# the `tandem up` fleet of tests/serving/conftest.py, the transformers reference model of tests/conftest.py,
# the test cluster and its operator of tests/operator/ and tests/e2e/ (one at a time)
SHARED = {"fleet": (("tests/serving/",), "serving-fleet"),
          "smollm2_transformers": (("tests/",), "transformers"),
          "cluster": (("tests/operator/", "tests/e2e/"), "cluster"),
          "operator": (("tests/operator/", "tests/e2e/"), "cluster")}

def fixtures_used(path: Path) -> set[str]:
    """Names of the arguments of every function in the file (tests and their fixtures)."""
    tree = ast.parse(path.read_text())
    return {a.arg for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for a in node.args.args}


def test_every_user_of_a_shared_start_is_in_its_group():
    wrong, seen = [], set()
    for path in sorted(TESTS.rglob("test_*.py")):
        rel = path.relative_to(TESTS.parent).as_posix()
        for name in fixtures_used(path) & set(SHARED):
            folders, group = SHARED[name]
            if rel.startswith(folders):
                seen.add(name)
                if xdist_group(rel) != group:
                    wrong.append(f"{rel} uses {name} but is in group {xdist_group(rel)!r}")
    assert not wrong, "\n".join(wrong)
    assert seen == set(SHARED)   # the check found the users it is about

def test_a_file_that_shares_nothing_is_its_own_group():
    assert xdist_group("tests/kernels/test_kernel_attention.py") == "tests/kernels/test_kernel_attention.py"
    assert xdist_group("tests/operator/test_spec.py") == xdist_group("tests/e2e/test_story.py") == "cluster"
