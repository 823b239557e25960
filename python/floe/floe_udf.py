"""floe_udf: write floe process UDFs in Python.

A process UDF is a long-lived Python process that a floe node starts and feeds Arrow record
batches; whatever it keeps in globals (a loaded model, a connection) persists from batch to
batch. The only dependency is pyarrow.

    import floe_udf
    import pyarrow.compute as pc

    @floe_udf.init
    def load():
        return {"offset": 10}          # kept as floe_udf.state

    @floe_udf.batch
    def add_offset(batch):
        doubled = pc.add(batch.column("x"), floe_udf.state["offset"])
        return batch.set_column(0, "x", doubled)

    if __name__ == "__main__":
        floe_udf.serve()

The node runs the script with the command and arguments given in the job (e.g. `python3
/abs/path/udf.py`) and puts this module on PYTHONPATH. The `init` hook runs once per process,
before the first batch. The `batch` function gets a `pyarrow.RecordBatch` and returns a
`RecordBatch` or a `Table`; an exception fails the task with its traceback.

Protocol (floe_udf/1). The node passes a listening Unix socket as the file descriptor named
by FLOE_UDF_FD. The process accepts one connection at a time; a connection is one task's
lease. Every message is a little-endian header (u32 kind, u64 length) and `length` bytes:
  HELLO  (1): process -> worker on accept, the bytes b"floe_udf/1";
  BATCH  (2): worker -> process, an Arrow IPC stream holding one record batch;
  RESULT (3): process -> worker, an Arrow IPC stream holding the result;
  ERROR  (4): process -> worker, UTF-8 text (the traceback).
The worker closes the connection when its task is done; the process then accepts the next.

`serve_pickled()` serves a Python function that the `floe` package's `map_batches` serialized
(cloudpickle, base64) into the command line, `python3 -c "import floe_udf;
floe_udf.serve_pickled()" CHUNK…`: inline code, which a node runs only with
`node.udf_allow_inline` (see docs/SECURITY_UDF.md).
"""

import os
import socket
import struct
import sys
import traceback

import pyarrow as pa

PROTOCOL = b"floe_udf/1"
HELLO, BATCH, RESULT, ERROR = 1, 2, 3, 4
_HEADER = struct.Struct("<IQ")

state = None
_init_hook = None
_batch_fn = None


def init(fn):
    """Registers `fn()` to run once per process before the first batch; its result becomes
    `floe_udf.state`."""
    global _init_hook
    _init_hook = fn
    return fn


def batch(fn):
    """Registers `fn(batch: pyarrow.RecordBatch) -> RecordBatch | Table` as the UDF."""
    global _batch_fn
    _batch_fn = fn
    return fn


def _read_exact(conn, n):
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        read = conn.recv_into(view[got:], n - got)
        if read == 0:
            return None
        got += read
    return buf


def _send(conn, kind, payload):
    conn.sendall(_HEADER.pack(kind, len(payload)))
    if len(payload):
        conn.sendall(payload)


def _encode(result):
    if isinstance(result, pa.Table):
        batches = result.to_batches()
        schema = result.schema
    elif isinstance(result, pa.RecordBatch):
        batches = [result]
        schema = result.schema
    else:
        raise TypeError(
            "a floe_udf.batch function must return a pyarrow.RecordBatch or Table, got "
            + type(result).__name__
        )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        for item in batches:
            writer.write_batch(item)
    return memoryview(sink.getvalue())


def _serve_connection(conn):
    _send(conn, HELLO, PROTOCOL)
    while True:
        header = _read_exact(conn, _HEADER.size)
        if header is None:
            return
        kind, length = _HEADER.unpack(header)
        payload = _read_exact(conn, length) if length else bytearray()
        if payload is None:
            return
        if kind != BATCH:
            _send(conn, ERROR, ("unexpected message kind %d" % kind).encode())
            return
        try:
            reader = pa.ipc.open_stream(pa.py_buffer(payload))
            result = _batch_fn(reader.read_next_batch())
            encoded = _encode(result)
        except Exception:
            _send(conn, ERROR, traceback.format_exc().encode("utf-8", "replace"))
            continue
        _send(conn, RESULT, encoded)


def _to_format(batch, batch_format):
    if batch_format == "pyarrow":
        return batch
    if batch_format == "pandas":
        return batch.to_pandas()
    if batch_format == "numpy":
        return {name: column.to_numpy(zero_copy_only=False)
                for name, column in zip(batch.schema.names, batch.columns)}
    raise ValueError("unknown batch_format %r: pyarrow, pandas or numpy" % batch_format)


def _from_format(result, schema):
    """A function's result as a Table with the plan's output `schema` (when it has the same
    columns: pandas and numpy results come back with their own types and nullability)."""
    if isinstance(result, pa.RecordBatch):
        result = pa.Table.from_batches([result])
    elif isinstance(result, dict):
        result = pa.table(result)
    elif not isinstance(result, pa.Table):
        if type(result).__module__.split(".")[0] != "pandas":
            raise TypeError(
                "map_batches functions return a pyarrow Table or RecordBatch, a pandas "
                "DataFrame or a dict of columns, got " + type(result).__name__)
        result = pa.Table.from_pandas(result, preserve_index=False)
    if schema is not None and result.schema != schema and set(result.schema.names) == set(schema.names):
        result = result.select(schema.names).cast(schema)
    return result


def serve_pickled():
    """Serves the function serialized into this process's arguments (see the module doc)."""
    import base64

    import cloudpickle

    spec = cloudpickle.loads(base64.b64decode("".join(sys.argv[1:])))
    function = spec["function"]
    batch_format = spec["batch_format"]
    schema = spec["schema"]

    @init
    def construct():
        # A callable class is constructed once per process, like Ray's actor-pool map.
        if spec["is_class"]:
            return function(*spec["args"], **spec["kwargs"])
        return function

    @batch
    def call(record_batch):
        return _from_format(state(_to_format(record_batch, batch_format)), schema)

    serve()


def serve():
    """Runs the init hook, then serves batches until the node closes the socket."""
    global state
    if _batch_fn is None:
        raise RuntimeError("no @floe_udf.batch function is defined")
    fd = os.environ.get("FLOE_UDF_FD")
    if fd is None:
        sys.exit("floe_udf: FLOE_UDF_FD is not set; this script is started by a floe node")
    listener = socket.socket(fileno=int(fd))
    # Processes the UDF starts must not hold the socket open after this one dies.
    os.set_inheritable(listener.fileno(), False)
    if _init_hook is not None:
        state = _init_hook()
    while True:
        conn, _ = listener.accept()
        with conn:
            try:
                _serve_connection(conn)
            except (BrokenPipeError, ConnectionResetError):
                pass
