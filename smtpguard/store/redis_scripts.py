"""Where the Redis store's script loader was: it is smtpguard/store/redis/scripts.py now."""

from smtpguard.store.redis.scripts import ScriptError, assemble, load, names

__all__ = ["ScriptError", "assemble", "load", "names"]
