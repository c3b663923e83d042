"""The SMTP submission listener: aiosmtpd's protocol narrowed (protocol.py), its hooks
(handler.py) and the masking of client secrets in aiosmtpd's log (redaction.py).

Importing the package installs that masking, whichever module is asked for.
"""

from smtpguard.connection_table import Connections
from smtpguard.listener import redaction as redaction
from smtpguard.listener.handler import Handler
from smtpguard.listener.protocol import GuardSession, GuardSMTP

__all__ = ["Connections", "GuardSMTP", "GuardSession", "Handler"]
