"""Ferry: a data-movement engine for AI inference.

``ferry.Agent`` is Ferry's own agent (NIXL's method names, errors as exceptions, a
batched command buffer in ``ferry.Batch``). ``ferry.nixl_agent`` and
``ferry.nixl_agent_config`` are NIXL 1.5.1's Python API on top of it, behaviour for
behaviour (``ferry.nixl``; ``ferry.nixl._bindings`` and ``ferry.nixl._utils`` stand in
for ``nixl._bindings`` and ``nixl._utils``).
"""

from ferry._ferry import *  # noqa: F401,F403
from ferry._ferry import __version__  # noqa: F401

from ferry.nixl._api import (  # noqa: F401  (NIXL's names, NIXL's behaviour)
    DEFAULT_COMM_PORT,
    nixl_agent,
    nixl_agent_config,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)
