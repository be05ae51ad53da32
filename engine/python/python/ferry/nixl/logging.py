"""NIXL's ``nixl.logging``: ``get_logger(name)``, one handler on the ``nixl`` logger,
level from ``NIXL_LOG_LEVEL`` (default INFO)."""

from __future__ import annotations

import logging as _logging
import os

_ROOT = "nixl"
_configured = False


def _configure() -> None:
    global _configured
    if _configured:
        return
    root = _logging.getLogger(_ROOT)
    level = os.environ.get("NIXL_LOG_LEVEL", "INFO").upper()
    root.setLevel(getattr(_logging, level, _logging.INFO))
    if not root.handlers:
        handler = _logging.StreamHandler()
        handler.setFormatter(
            _logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
        root.addHandler(handler)
    root.propagate = False
    _configured = True


def get_logger(name: str) -> _logging.Logger:
    """A logger under ``nixl`` (``nixl.<name>`` unless ``name`` already is one)."""
    _configure()
    if name != _ROOT and not name.startswith(_ROOT + "."):
        name = f"{_ROOT}.{name}"
    return _logging.getLogger(name)
