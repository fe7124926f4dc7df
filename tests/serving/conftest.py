"""The serving suites share one `tandem up` fleet of examples/smollm2.yaml (router, 1 prefill, 1 decode
worker, remotePrefillMinTokens 0): starting one costs tens of seconds on 2 cores."""
import pytest

from fleet_utils import start_fleet


@pytest.fixture(scope="session")
def fleet():
    f = start_fleet()
    yield f
    f.stop(grace=10)
