"""smtpguard: an SMTP submission proxy that guarantees one upstream 250 per business event."""

__version__ = "0.1.0"
