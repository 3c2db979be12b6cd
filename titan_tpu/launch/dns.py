"""Wait for the rendezvous host's name to resolve before torchrun tries to reach it.

The pods of a GKE job start in any order, and a pod's name enters the cluster DNS (through the
job's headless Service) only once the pod exists; until then every other host's lookup fails at
once. torchrun would give up on the first failure, so the launcher retries the lookup with
exponential backoff, up to a bound, and then fails with one line that says what to check.
"""

from __future__ import annotations

import logging
import socket
import time

logger = logging.getLogger(__name__)

FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0


class HostNotResolved(RuntimeError):
    """The rendezvous host's name never resolved within the bound."""


def wait_for_host(host: str, timeout_s: float) -> None:
    """Return once `host` resolves; raise HostNotResolved when it has not after `timeout_s`."""
    start = time.monotonic()
    delay = FIRST_DELAY_S
    tries = 0
    while True:
        tries += 1
        try:
            socket.getaddrinfo(host, None)
        except socket.gaierror as error:
            last_error = error
        else:
            if tries > 1:
                logger.info("launch: %s resolved after %.0f s (%d tries)", host, time.monotonic() - start, tries)
            return
        waited = time.monotonic() - start
        if waited >= timeout_s:
            raise HostNotResolved(
                f"the rendezvous host {host!r} did not resolve within {timeout_s:g} s ({tries} tries, last: "
                f"{last_error.strerror or last_error}); its pod may not be running, or the job's headless "
                "Service (the pods' subdomain) is missing; raise --dns-timeout to wait longer"
            )
        if tries == 1:
            logger.info("launch: waiting up to %g s for %s to resolve (%s)", timeout_s, host, last_error)
        time.sleep(min(delay, timeout_s - waited))
        delay = min(2 * delay, MAX_DELAY_S)
