# smtpguard container image.
#   docker build -t smtpguard .
#   docker run -d --name smtpguard -p 587:587 -p 127.0.0.1:9587:9587 \
#     -v /srv/smtpguard/etc:/etc/smtpguard:ro -v smtpguard-state:/var/lib/smtpguard \
#     --env-file /srv/smtpguard/env --stop-timeout 40 smtpguard
# The config mounted at /etc/smtpguard/smtpguard.yaml should listen on 0.0.0.0:587 (starttls
# or implicit, with tls.cert/tls.key under /etc/smtpguard), keep its store under
# /var/lib/smtpguard (sqlite:////var/lib/smtpguard/state.db), and set
# metrics.address: 0.0.0.0:9587 so that Prometheus can scrape it. The HEALTHCHECK below
# works with or without `metrics:` (`smtpguard healthcheck`: /healthz, else the SMTP
# greeting). See docs/configuration.md.

# --- build: a self-contained virtualenv ------------------------------------------------------
FROM python:3.12-slim AS builder

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/smtpguard

WORKDIR /src
# Every runtime dependency ships manylinux wheels: no compiler, no apt-get.
COPY pyproject.toml README.md LICENSE ./
COPY smtpguard ./smtpguard
RUN /opt/smtpguard/bin/pip install --no-cache-dir ".[fast,redis,events,console,postgres]" \
    && /opt/smtpguard/bin/smtpguard --version

# --- runtime ---------------------------------------------------------------------------------
FROM python:3.12-slim AS runtime

LABEL org.opencontainers.image.title="smtpguard" \
      org.opencontainers.image.description="SMTP submission proxy that guarantees one upstream 250 per business event" \
      org.opencontainers.image.licenses="Apache-2.0"

# A fixed uid/gid, so volume ownership survives image rebuilds and runAsNonRoot can check it.
RUN groupadd --system --gid 10587 smtpguard \
    && useradd --system --uid 10587 --gid smtpguard --no-create-home \
       --home-dir /var/lib/smtpguard --shell /usr/sbin/nologin smtpguard \
    && mkdir -p /etc/smtpguard /var/lib/smtpguard \
    && chown smtpguard:smtpguard /var/lib/smtpguard \
    && chmod 0750 /var/lib/smtpguard

# Same interpreter path in both stages (/usr/local/bin/python3.12), so the venv moves as is.
COPY --from=builder /opt/smtpguard /opt/smtpguard

ENV PATH=/opt/smtpguard/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SMTPGUARD_CONFIG=/etc/smtpguard/smtpguard.yaml

WORKDIR /var/lib/smtpguard
VOLUME ["/etc/smtpguard", "/var/lib/smtpguard"]

# 587 as a non-root user: Docker (20.10+) sets net.ipv4.ip_unprivileged_port_start=0 inside
# a container's own network namespace, so no capability is needed. Where that does not
# hold (--network host, an older engine, Kubernetes without that sysctl), either listen on
# 2587 and publish it as 587 (-p 587:2587), or run with --cap-add NET_BIND_SERVICE and give
# the interpreter the capability (setcap cap_net_bind_service=+ep on
# /usr/local/bin/python3.12) — docs/runbook.md compares the options.
EXPOSE 587 9587

USER 10587:10587

# slim has no curl; smtpguard asks its own instance: GET /healthz when the config has
# `metrics:`, else the first listener's SMTP greeting (a config without metrics would
# otherwise fail the check forever). Exit 0 healthy, 1 not.
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["smtpguard", "healthcheck"]

# Exec form: smtpguard is PID 1 and gets SIGTERM itself; it drains in-flight submissions for
# limits.drain_timeout (30 s), so stop with a longer grace period (--stop-timeout 40, or
# stop_grace_period: 40s in compose). Docker's default of 10 s cuts the drain short.
# Operator commands: docker exec smtpguard smtpguard history ZONE KEY (SMTPGUARD_CONFIG is set).
ENTRYPOINT ["smtpguard", "serve", "-c", "/etc/smtpguard/smtpguard.yaml"]
