"""Fixtures for the whole suite. Helpers that tests import live in tests/helpers/.

Every folder under tests/ is a package (an __init__.py), tests/ included: test modules are
imported as tests.<folder>.<name>, so files of the same name in different folders do not
collide, and `from tests.helpers... import ...` works wherever pytest is started."""

from __future__ import annotations

import pytest

from nemo_dcr_callback.core import kernels


@pytest.fixture
def reference_only(monkeypatch):
    """Run with the pure-torch/numpy paths (as when the compiled library is missing)."""
    monkeypatch.setattr(kernels, "native", lambda: None)


@pytest.fixture(scope="session", autouse=True)
def _native_built():
    assert kernels.native() is not None, "the compiled CPU kernels must build for the test suite"


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """A real S3 server (SeaweedFS on loopback, with credentials it checks), one per session
    (tests/faults starts its own)."""
    from nemo_dcr_callback.transport.seaweed import SeaweedS3

    with SeaweedS3(tmp_path_factory.mktemp("seaweed")) as s3:
        yield s3


@pytest.fixture
def s3_store(seaweed, request):
    """An S3Store on a prefix of the seaweed server of this test's own (named after its module
    and itself: one server serves the whole session)."""
    name = request.node.name.replace("[", "-").replace("]", "")
    return seaweed.store(f"{request.module.__name__.rsplit('.', 1)[-1]}-{name}")
