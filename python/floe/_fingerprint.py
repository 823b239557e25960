"""The identity of a Python function, for the plan's fingerprint.

`datasets`' rule: hash what the function *is* — its code (bytecode, constants, names, nested
code), its defaults, the values it closes over and the globals it uses — never its pickle,
whose bytes differ between runs of the same code. Re-running the same notebook cell then hits
the cache, and editing the function misses it. A value whose content cannot be hashed
deterministically makes the identity random (the step is never served from the cache), and
the reason is kept for `explain()`.

The walk uses an explicit stack, so deep or cyclic object graphs cannot overflow Python's.
"""

import hashlib
import pickle
import types
import uuid

# Packages whose objects pickle to the same bytes for the same content (arrays, tables,
# schemas), so their pickle is their content.
_PICKLED_BY_CONTENT = ("numpy", "pandas", "pyarrow")
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
# Class attributes that are bookkeeping, not behaviour.
_CLASS_SKIP = {"__dict__", "__weakref__", "__module__", "__doc__", "__qualname__",
               "__firstlineno__", "__static_attributes__"}


class Unhashable(Exception):
    """A value reachable from the function has no deterministic content hash."""


def code_identity(*roots):
    """`(identity, None)`, or `(random identity, reason)` when something cannot be hashed."""
    try:
        return "py:" + _digest(roots), None
    except Unhashable as reason:
        return "random:" + uuid.uuid4().hex, str(reason)


def _digest(roots):
    hasher = hashlib.sha256()
    # Items are values to walk or ("tag", bytes) markers already reduced to bytes.
    stack = [("value", root) for root in reversed(roots)]
    seen = {}
    while stack:
        kind, item = stack.pop()
        if kind == "bytes":
            hasher.update(len(item).to_bytes(8, "little"))
            hasher.update(item)
            continue
        if not isinstance(item, _SCALARS):
            # A cycle or a shared object: hash where it was first met, not its content again.
            if id(item) in seen:
                stack.append(("bytes", b"ref:%d" % seen[id(item)]))
                continue
            seen[id(item)] = len(seen)
        stack.extend(reversed(_children(item)))
    return hasher.hexdigest()


def _b(tag, text=""):
    return ("bytes", ("%s:%s" % (tag, text)).encode("utf-8", "surrogatepass"))


def _v(value):
    return ("value", value)


def _children(value):
    """What `value` is made of: byte markers and values still to walk, in a fixed order."""
    if isinstance(value, _SCALARS):
        return [("bytes", type(value).__name__.encode() + b":" + repr(value).encode())]
    if isinstance(value, types.CodeType):
        return [
            _b("code", value.co_name),
            ("bytes", value.co_code),
            _b("names", ",".join(value.co_names)),
            _b("varnames", ",".join(value.co_varnames)),
            _b("args", "%d,%d,%d" % (value.co_argcount, value.co_kwonlyargcount, value.co_flags)),
            _v(tuple(value.co_consts)),
        ]
    if isinstance(value, types.FunctionType):
        return _function(value)
    if isinstance(value, types.MethodType):
        return [_b("method"), _v(value.__func__), _v(value.__self__)]
    if isinstance(value, types.ModuleType):
        return [_b("module", value.__name__)]
    if isinstance(value, (types.BuiltinFunctionType, types.WrapperDescriptorType,
                          types.MethodDescriptorType)):
        owner = getattr(value, "__module__", None) or type(getattr(value, "__self__", None)).__name__
        return [_b("builtin", "%s.%s" % (owner, value.__qualname__))]
    if isinstance(value, type):
        return _class(value)
    if isinstance(value, (tuple, list)):
        return [_b(type(value).__name__, str(len(value)))] + [_v(item) for item in value]
    if isinstance(value, dict):
        return [_b("dict", str(len(value)))] + [
            _v(part) for key, item in value.items() for part in (key, item)
        ]
    if isinstance(value, (set, frozenset)):
        # Iteration order depends on the process's hash seed: sort the members' digests.
        members = sorted(_digest((member,)) for member in value)
        return [_b("set", ",".join(members))]
    if isinstance(value, (staticmethod, classmethod, property)):
        parts = [value.fget, value.fset, value.fdel] if isinstance(value, property) else [value.__func__]
        return [_b(type(value).__name__)] + [_v(part) for part in parts]
    module = type(value).__module__.split(".")[0]
    if module in _PICKLED_BY_CONTENT:
        try:
            return [_b("pickled", type(value).__qualname__), ("bytes", pickle.dumps(value, protocol=4))]
        except Exception as error:
            raise Unhashable("%s cannot be pickled (%s)" % (type(value).__qualname__, error))
    if module == "functools" and type(value).__name__ == "partial":
        return [_b("partial"), _v(value.func), _v(value.args), _v(value.keywords)]
    state = getattr(value, "__dict__", None)
    if state is not None and not isinstance(value, types.GeneratorType):
        return [_b("object"), _v(type(value)), _v(dict(sorted(state.items())))]
    raise Unhashable(
        "a %s.%s value has no content hash (it is neither data, code nor an object with "
        "attributes)" % (type(value).__module__, type(value).__qualname__)
    )


def _function(fn):
    parts = [_b("function", fn.__qualname__), _v(fn.__code__), _v(fn.__defaults__),
             _v(fn.__kwdefaults__)]
    if fn.__closure__:
        for cell in fn.__closure__:
            try:
                parts.append(_v(cell.cell_contents))
            except ValueError:  # an empty cell: a name assigned after the function
                parts.append(_b("empty-cell"))
    # The globals the code (and the code nested in it) reads, by name.
    names = set()
    codes = [fn.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    for name in sorted(names):
        if name in fn.__globals__:
            parts.extend([_b("global", name), _v(fn.__globals__[name])])
    return parts


def _class(cls):
    if cls.__module__ == "builtins" or cls.__module__.split(".")[0] in _PICKLED_BY_CONTENT:
        return [_b("class", "%s.%s" % (cls.__module__, cls.__qualname__))]
    parts = [_b("class", cls.__qualname__)]
    parts.extend(_v(base) for base in cls.__bases__ if base is not object)
    for name in sorted(vars(cls)):
        if name in _CLASS_SKIP:
            continue
        parts.extend([_b("attr", name), _v(vars(cls)[name])])
    return parts
