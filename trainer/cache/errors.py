"""The cache layer's error: a UserError (printed without a traceback) that names the entry or file and the fix."""
from __future__ import annotations

from ..errors import UserError


class CacheError(UserError, ValueError):
    """A cache entry that cannot be used as it is, or an input whose identity cannot be established."""
