"""Evidence kinds, one module each, in a registry (see :mod:`.base`).

Importing this package registers the built-in kinds: ``mass`` (the window's attention),
``key_norms`` and ``expected_attention`` (query-agnostic). Every name of the registry
(``base.__all__``) is importable from here.
"""

from . import expected_attention, key_norms, mass  # noqa: F401  (registers the kinds)
from .base import *  # noqa: F403  (the registry's names, as base.__all__ lists them)
from .base import __all__ as __all__
