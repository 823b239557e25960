"""The process's session: a cluster started by `init()` or reached by `connect()`."""

import atexit
import os
import shutil
import sys
import threading

from . import _floe

_lock = threading.Lock()
_session = None
# Whether the session's jobs read and write the fingerprint cache.
_cache = True


def _find_binary():
    binary = os.environ.get("FLOE_BINARY") or shutil.which("floe")
    if not binary:
        raise _floe.FloeError(
            "floe.init() starts a local cluster from the floe binary, and there is none: put "
            "`floe` on PATH (`cargo build --release`, then target/release) or set FLOE_BINARY"
        )
    return binary


def init(num_nodes=1, workers_per_node=0, node_settings=(), *, cache=True):
    """Starts a local cluster (a scheduler and `num_nodes` nodes of the `floe` binary on
    loopback, in a temporary directory) and makes it this process's session; it is stopped
    when the process exits, or by `floe.shutdown()`.

    Its nodes run Python functions (`map_batches(fn)`) with this interpreter, as inline code:
    the local cluster sets `node.udf_allow_inline = true` and `node.udf_commands` to
    `sys.executable` for that (docs/SECURITY_UDF.md). `cache=False` runs every job of the
    session without the fingerprint cache (neither reused nor written), as benchmarks need.
    """
    global _session, _cache
    with _lock:
        if _session is not None:
            raise _floe.FloeError("floe is already initialized; call floe.shutdown() first")
        settings = [
            "node.udf_allow_inline=true",
            "node.udf_commands=%s" % sys.executable,
            *node_settings,
        ]
        _session = _floe.Session.start_local(
            _find_binary(), num_nodes, workers_per_node, list(settings)
        )
        _cache = cache
        return _session


def connect(address=None, token=None, *, cache=True):
    """Connects to a running cluster: `address` is `"h1:7700,h2:7700"` (default
    `FLOE_ADDRESS`), `token` a client token (default `FLOE_TOKEN`, then `FLOE_CLIENT_TOKEN`).
    `cache=False` runs the session's jobs without the fingerprint cache."""
    global _session, _cache
    address = address or os.environ.get("FLOE_ADDRESS")
    token = token or os.environ.get("FLOE_TOKEN") or os.environ.get("FLOE_CLIENT_TOKEN")
    if not address:
        raise _floe.FloeError("no cluster address: pass floe.connect(address) or set FLOE_ADDRESS")
    if not token:
        raise _floe.FloeError("no client token: pass token= or set FLOE_TOKEN")
    addresses = [part.strip() for part in address.split(",") if part.strip()]
    with _lock:
        if _session is not None:
            raise _floe.FloeError("floe is already initialized; call floe.shutdown() first")
        _session = _floe.Session.connect(addresses, token)
        _cache = cache
        return _session


def cache_enabled():
    """Whether the session's jobs use the fingerprint cache (`init`/`connect`'s `cache`)."""
    return _cache


def is_initialized():
    return _session is not None


def shutdown():
    """Forgets the session, stopping the local cluster `init()` started."""
    global _session
    with _lock:
        session, _session = _session, None
    if session is not None:
        session.shutdown()


def session():
    """The session, connecting (`FLOE_ADDRESS`) or starting a local cluster on first use."""
    if _session is None:
        if os.environ.get("FLOE_ADDRESS"):
            connect()
        else:
            init()
    return _session


def python_command():
    """The interpreter a node runs Python functions with: this one on a local cluster (its
    packages are the client's), `python3` on the nodes' PATH otherwise (FLOE_PYTHON sets it)."""
    if _session is not None and _session.token is not None:
        return sys.executable
    return os.environ.get("FLOE_PYTHON", "python3")


atexit.register(shutdown)
