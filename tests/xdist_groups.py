"""The groups of the test command's pytest-xdist workers (scripts/test.sh: ``-n 3 --dist loadgroup``; the
scheduler is tests/conftest.py's ``pytest_xdist_make_scheduler``). A uniquely named module, not
conftest.py: `from conftest import` is ambiguous in a whole-tree run.

Each group's tests run in one worker, in collection order, so what the group shares starts once. The
operator suite and the e2e story share one test cluster at a time (the story's, then the operator
suite's); the serving files that use the `tandem up` fleet of tests/serving/conftest.py share it; the
transformers reference model (a session fixture, minutes to load) is loaded once. Every other file is
its own group (its module fixtures start once). While the cluster group waits on the API server and
on autoscaler windows, the other workers run the CPU-bound suites (bench/RESULTS.md, "Thirteenth
session: the test command's time"). tests/test_xdist_groups.py checks that every user of a shared
start is in its group.
"""

SHARED_GROUPS = {
    "tests/operator/": "cluster",
    "tests/e2e/": "cluster",
    "tests/serving/test_abuse.py": "serving-fleet",
    "tests/serving/test_bad_input.py": "serving-fleet",
    "tests/serving/test_engine_faults.py": "serving-fleet",
    "tests/serving/test_faults.py": "serving-fleet",
    "tests/serving/test_fleet.py": "serving-fleet",
    "tests/serving/test_stream_resume.py": "serving-fleet",
    "tests/engine/test_reference.py": "transformers",
    "tests/engine/test_cpu_dtypes.py": "transformers",
}


def xdist_group(path: str) -> str:
    """The group of a test file given by its path from the rootdir ("tests/...")."""
    for prefix, group in SHARED_GROUPS.items():
        if path.startswith(prefix):
            return group
    return path
