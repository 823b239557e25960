"""Tests run against a real local cluster of the `floe` binary: FLOE_BINARY, or the one cargo
built in this repository (release, then debug)."""

import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _binary():
    if os.environ.get("FLOE_BINARY"):
        return os.environ["FLOE_BINARY"]
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    for profile in ("release", "debug"):
        candidate = target / profile / "floe"
        if candidate.is_file():
            return str(candidate)
    pytest.exit("no floe binary: `cargo build -p floe` first, or set FLOE_BINARY", returncode=2)


@pytest.fixture(scope="session")
def cluster():
    import floe

    os.environ["FLOE_BINARY"] = _binary()
    session = floe.init(num_nodes=1, workers_per_node=2)
    yield session
    floe.shutdown()
