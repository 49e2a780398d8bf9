"""tests/mpi runs only under an MPI launcher (`make test-mpi`):

    mpirun -n 4 python -m pytest --with-mpi tests/mpi

Anywhere else (plain `pytest tests`, `make test`) every test here is skipped with the reason:
no MPI runtime, or not started under mpirun with --with-mpi."""

from __future__ import annotations

import importlib.util

import pytest

RUN = "run them with `make test-mpi` (mpirun -n 4 python -m pytest --with-mpi tests/mpi)"


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("mpi4py") is None:
        why = f"no MPI runtime (mpi4py and an MPI library; `make test-mpi` installs them): {RUN}"
    elif not config.getoption("--with-mpi", default=False):
        why = f"MPI tests: {RUN}"
    else:
        return
    here = str(config.rootpath / "tests" / "mpi")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


@pytest.fixture()
def shared_dir(comm, tmp_path_factory):
    """One fresh directory for every rank (rank 0 makes it; one host: mpirun -n 4)."""
    d = str(tmp_path_factory.mktemp("mpi")) if comm.rank == 0 else None
    return comm.bcast(d, root=0)
