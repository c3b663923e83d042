"""The SMTP listeners (`listen:`), the certificate they share (`tls:`) and their `limits:`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from smtpguard.config.base import (
    Duration,
    FieldProblem,
    FilePath,
    Size,
    _Listening,
    _Strict,
    is_loopback,
)
from smtpguard.policy.message import HeaderLimits


class ListenerConfig(_Listening):
    tls: Literal["starttls", "implicit", "none"] = "starttls"

    @model_validator(mode="after")
    def _clear_auth_only_on_loopback(self) -> ListenerConfig:
        if self.tls == "none" and not is_loopback(self.host):
            raise FieldProblem(
                ("tls",),
                "tls: none is allowed only on loopback addresses (AUTH would cross the network "
                "in clear); use starttls or implicit",
            )
        return self


class TLSFiles(_Strict):
    cert: FilePath
    key: FilePath


class LimitsConfig(_Strict):
    max_message_size: Size = 25_000_000
    max_recipients: int = Field(100, ge=1)
    auth_failures: int = Field(5, ge=1)
    auth_failure_window: Duration = 300.0
    max_connections: int = Field(1000, ge=1)
    max_connections_per_ip: int = Field(100, ge=1)
    max_errors: int = Field(20, ge=1)
    """Error replies (4xx, 5xx) one session may get since it last had a message accepted,
    before `421 4.7.0` and disconnect (Postfix's smtpd_hard_error_limit). A refused recipient
    is not one: the client sends DATA for the others (RFC 5321)."""
    max_junk_commands: int = Field(100, ge=1)
    """NOOP, RSET, VRFY, EXPN, HELP and a repeated HELO or EHLO one session may send since it
    last had a message accepted; each one past it counts as an error (smtpd_junk_command_limit):
    `idle_timeout` alone would let a NOOP every few seconds hold a connection for good."""
    idle_timeout: Duration = 300.0
    max_header_size: Size = 64 * 1024
    max_header_count: int = Field(500, ge=1)
    max_line_length: int = Field(1000, ge=1000, le=1_000_000)
    """Octets per command or DATA line, CRLF included (RFC 5321 §4.5.3.1.6 sets 1000 as the
    minimum a server must accept)."""
    data_timeout: Duration = Field(600.0, gt=0)
    """Cap on one DATA transfer from `354` to the final dot, however steadily a slow client
    trickles bytes; `idle_timeout` alone would let a slowloris hold the connection forever."""
    drain_timeout: Duration = 30.0

    @property
    def headers(self) -> HeaderLimits:
        """The header block's limits, as the message parser takes them."""
        return HeaderLimits(self.max_header_size, self.max_header_count)
