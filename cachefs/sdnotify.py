"""systemd's readiness protocol (sd_notify(3)): the few lines `cachefs mount --systemd` needs.

A service of `Type=notify` is started with $NOTIFY_SOCKET, the address of a unix datagram
socket: a path, or a name in the abstract namespace written with a leading '@'. The service
sends newline-separated assignments to it: `READY=1` once it serves (systemd then starts the
units ordered after it), `STOPPING=1` when it begins to shut down, `STATUS=...` for
`systemctl status`. One datagram per message, from the service's main process (systemd's
default NotifyAccess=main): `cachefs mount --systemd` stays in the foreground, so the daemon
is that process.

The variable is taken out of the environment when read, as sd_notify's unset_environment
does, so that the daemon's child processes (the fanotify marker) do not inherit it. Sending
never fails the mount: a notification that cannot be sent is a warning in the log, and systemd
reports the service's start as timed out.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

ENV_NAME = "NOTIFY_SOCKET"


class Notifier:
    """Sends notifications to one systemd socket, or logs why it cannot."""

    def __init__(self, address: str | None):
        self.address = address

    @classmethod
    def from_environment(cls) -> Notifier:
        address = os.environ.pop(ENV_NAME, None) or None
        if address is None:
            log.warning("--systemd: $%s is not set (not started by systemd as a Type=notify "
                        "service?); no readiness is reported", ENV_NAME)
        elif not address.startswith(("/", "@")):
            log.warning("--systemd: $%s=%s is not a unix socket path or abstract name; no "
                        "readiness is reported", ENV_NAME, address)
            address = None
        return cls(address)

    def send(self, *assignments: str) -> bool:
        """Send `READY=1`, `STATUS=...` (one datagram); False (and a warning) if it failed."""
        if self.address is None:
            return False
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto("\n".join(assignments).encode(), target)
        except OSError as exc:
            log.warning("could not notify systemd at %s: %s", self.address,
                        exc.strerror or exc)
            return False
        log.debug("notified systemd: %s", ", ".join(assignments))
        return True
