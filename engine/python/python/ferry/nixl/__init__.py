"""NIXL 1.5.1's Python API on Ferry.

``ferry.nixl._api`` (``nixl_agent``, ``nixl_agent_config`` …), ``ferry.nixl._bindings``
(``nixlAgent``, descriptor lists, enums, exception classes), ``ferry.nixl._utils`` and
``ferry.nixl.logging`` stand in for the modules of the same names under ``nixl``. Code
written for NIXL runs with ``from nixl._api import ...`` changed to
``from ferry.nixl._api import ...``; the ``ferry-nixl`` package (engine/python/nixl-shim)
installs the ``nixl`` names themselves, for code that cannot be edited.
"""

from ferry.nixl import _bindings, _utils, logging  # noqa: F401
from ferry.nixl._api import (  # noqa: F401
    DEFAULT_COMM_PORT,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)
from ferry.nixl import _api  # noqa: F401,E402
