"""``nixl`` on Ferry (the ``ferry-nixl`` package).

Makes ``nixl``, ``nixl._api``, ``nixl._bindings``, ``nixl._utils`` and ``nixl.logging``
the modules of ``ferry.nixl`` — the same module objects, so patching
``nixl._bindings.nixlAgent`` is seen by ``nixl._api`` — and exposes their public names
on ``nixl`` itself, as NIXL's meta package does. ``nixl.__ferry__`` is True here (and
absent on NIXL), for code that needs to know which one it got.

Installing it replaces NIXL's ``nixl`` package; ``pip uninstall ferry-nixl`` and
``pip install nixl`` switch back (engine/python/README.md, "Running code that
imports nixl").
"""

import sys

import ferry
import ferry.nixl as _impl
from ferry.nixl import _api, _bindings, _utils, logging  # noqa: F401

__ferry__ = True
__version__ = ferry.__version__

for _sub in ("_bindings", "_utils", "logging", "_api"):
    _module = getattr(_impl, _sub)
    sys.modules[f"{__name__}.{_sub}"] = _module
    for _attr in dir(_module):
        if not _attr.startswith("_"):
            globals()[_attr] = getattr(_module, _attr)
del _sub, _module, _attr
