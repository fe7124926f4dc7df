"""Credentials on disk (docs/security.md, "Rotation"): revoked API keys stop working without a restart,
the webhook's private key is never readable by others, and a SIGKILLed `tandem up` leaves no secret
behind once another fleet starts. Real files, real processes."""
import os
import stat
import subprocess
import sys
import shutil
import tempfile
from pathlib import Path

import pytest

from fleet_utils import ROOT
from tandem.worker.api.auth import KeyStore

pytestmark = pytest.mark.timeout(120)


def test_deleting_the_api_key_file_revokes_its_keys(tmp_path):
    f = tmp_path / "keys"
    f.write_text("sk-old-0123456789\n")
    ks = KeyStore(path=str(f), reload_seconds=0)
    assert ks.check("sk-old-0123456789")
    f.unlink()
    assert not ks.check("sk-old-0123456789")   # before the fix: kept until a restart
    f.write_text("sk-new-0123456789\n")
    assert ks.check("sk-new-0123456789") and not ks.check("sk-old-0123456789")


def test_the_webhook_key_is_private_from_its_creation(tmp_path, monkeypatch):
    """With chmod disabled the key file must still be 0600 (before the fix it was written with the umask's
    0644 and narrowed by a chmod afterwards)."""
    from tandem.operator import webhook
    monkeypatch.setattr(os, "chmod", lambda *a, **k: None)
    old = os.umask(0o022)
    try:
        _, _, key = webhook.ensure_certs(tmp_path / "certs", ["localhost"])
    finally:
        os.umask(old)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_a_killed_fleets_secrets_are_removed_by_the_next_one():
    """A fleet folder whose `tandem up` is gone (SIGKILL: its stop never ran) is removed when the next
    fleet is made; a live one's is not."""
    from tandem.operator.local import OWNER_FILE, LocalFleet
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Path(tempfile.mkdtemp(prefix="tandem-killed-"))
    (stale / OWNER_FILE).write_text(str(dead.pid))
    (stale / "pool-secret").write_text("x" * 43)
    alive = Path(tempfile.mkdtemp(prefix="tandem-alive-"))
    (alive / OWNER_FILE).write_text(str(os.getpid()))
    fleet = LocalFleet(str(ROOT / "examples" / "smollm2.yaml"), router_port=0)
    try:
        assert not stale.exists()
        assert alive.exists() and fleet.secret_file.exists()
        assert (fleet.dir / OWNER_FILE).read_text() == str(os.getpid())
    finally:
        fleet.stop(grace=1)
        shutil.rmtree(alive, ignore_errors=True)
        shutil.rmtree(stale, ignore_errors=True)
