"""The identity of Python functions: what the code is, not its pickle."""

import subprocess
import sys
import textwrap
import threading

from floe._fingerprint import code_identity


def _identity_in_new_process(source):
    """The identity of `fn` defined by `source`, computed in a fresh interpreter (a new hash
    seed, new object ids: what a re-run notebook cell sees)."""
    program = textwrap.dedent(source) + textwrap.dedent("""
        from floe._fingerprint import code_identity
        print(code_identity(fn)[0])
    """)
    return subprocess.run([sys.executable, "-c", program], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_the_same_code_has_the_same_identity_across_processes():
    source = """
        import pyarrow.compute as pc
        SCALE = {"a": 2, "b": {1, 2, 3}}
        def helper(x):
            return x * SCALE["a"]
        def fn(batch):
            return batch.set_column(0, "v", pc.add(helper(batch.column(0)), len(SCALE["b"])))
    """
    first = _identity_in_new_process(source)
    assert first.startswith("py:")
    assert _identity_in_new_process(source) == first
    # An edit anywhere it reaches changes it: the function, a helper, a global it reads.
    assert _identity_in_new_process(source.replace("len(SCALE", "1 + len(SCALE")) != first
    assert _identity_in_new_process(source.replace("x * SCALE", "x - SCALE")) != first
    assert _identity_in_new_process(source.replace('"a": 2', '"a": 3')) != first
    assert _identity_in_new_process(source.replace("{1, 2, 3}", "{1, 2, 4}")) != first


def test_closed_over_values_and_classes_are_part_of_the_identity():
    def make(offset):
        def fn(batch):
            return batch + offset
        return fn

    assert code_identity(make(1))[0] == code_identity(make(1))[0]
    assert code_identity(make(1))[0] != code_identity(make(2))[0]

    class Model:
        def __init__(self, scale):
            self.scale = scale

        def __call__(self, batch):
            return batch * self.scale

    class Edited:
        def __init__(self, scale):
            self.scale = scale

        def __call__(self, batch):
            return batch * self.scale + 1

    assert code_identity(Model, (2,))[0] == code_identity(Model, (2,))[0]
    assert code_identity(Model, (2,))[0] != code_identity(Model, (3,))[0]
    assert code_identity(Model, (2,))[0] != code_identity(Edited, (2,))[0]


def test_a_value_without_a_content_hash_makes_the_identity_random():
    lock = threading.Lock()

    def fn(batch):
        with lock:
            return batch

    first, reason = code_identity(fn)
    assert first.startswith("random:")
    assert "lock" in reason.lower()
    assert code_identity(fn)[0] != first
