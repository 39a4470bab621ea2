"""Moved to expertcache.spec.model_config (a leaf package); this name stays for code written against it."""

from ..spec.model_config import *  # noqa: F401,F403
