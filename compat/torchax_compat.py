"""Import torchax 0.0.13 under torch 2.13.

torch 2.13 removed the named-tensor (Dimname) overloads of aten ops; torchax 0.0.13 names 22 of
them in its amp and decomposition tables, so `import torchax` raises AttributeError
(google/torchax#102, fixed by d1a9349 after the 0.0.13 release). While torchax is imported and
its environment built, a missing overload whose name marks it as named-tensor resolves to an
inert placeholder; those ops can never be dispatched under torch 2.13, so nothing is lost.

Remove this module when a torchax release newer than 0.0.13 is pinned: `import torchax` then
works directly (the test in tests/test_torchax_compat.py says so when it does).
"""

from __future__ import annotations

import contextlib
import re

_NAMED_OVERLOAD = re.compile(r"(^|_)(dimname|Dimname|names)(_|$)|_names$|^names_")

patched_overloads: list[str] = []  # what the shim stood in for, for tests and diagnostics


class _RemovedOverload:
    """Stands for an aten overload this torch build no longer has."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"<removed overload {self.name}>"


@contextlib.contextmanager
def _named_overloads_tolerated():
    import torch._ops as ops

    original = ops.OpOverloadPacket.__getattr__

    def getattr_tolerant(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if not _NAMED_OVERLOAD.search(key):
                raise
            name = f"{self._qualified_op_name}.{key}"
            patched_overloads.append(name)
            return _RemovedOverload(name)

    ops.OpOverloadPacket.__getattr__ = getattr_tolerant
    try:
        yield
    finally:
        ops.OpOverloadPacket.__getattr__ = original


def import_torchax():
    """Return the torchax module with its default environment built."""
    with _named_overloads_tolerated():
        import torchax

        torchax.default_env()  # builds the op tables, which also name removed overloads
    return torchax
