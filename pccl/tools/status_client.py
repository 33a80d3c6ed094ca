"""Reading a master's ``/status.json`` (for ``pccl status``): a blocking HTTP GET.

Failures become pccl errors with a message for the person at the terminal: nothing listening
(``ConnectionRefused``), no answer in time (``ConnectTimeout``), a wrong or missing token
(``AuthenticationFailed``), or something that is not a pccl status endpoint (``ProtocolError``).
"""

from __future__ import annotations

import json
import logging
import socket
import urllib.error
import urllib.request
from typing import Any

from ..errors import AuthenticationFailed, ConnectionRefused, ConnectTimeout, ProtocolError, TransportError
from ..master import STATUS_SCHEMA as SCHEMA, split_status_address

__all__ = ["fetch_status"]

log = logging.getLogger(__name__)


def fetch_status(address: str, *, token: str | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """The status snapshot served at ``http://address/status.json`` (``address``: ``HOST:PORT``
    or ``PORT`` on loopback)."""
    host, port = split_status_address(address)
    url = f"http://[{host}]:{port}/status.json" if ":" in host else f"http://{host}:{port}/status.json"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise AuthenticationFailed(f"{url} refused the request: it needs the run's token "
                                       f"({'the one given is wrong' if token else 'give --token, --token-file or $PCCL_TOKEN'})"
                                       ) from None
        raise ProtocolError(f"{url} answered HTTP {exc.code} {exc.reason}: is this a pccl master's --status "
                            "address?") from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, ConnectionRefusedError):
            raise ConnectionRefused(f"nothing listens on {host}:{port} (is the master running with --status "
                                    f"{address}?)") from None
        if isinstance(reason, (socket.timeout, TimeoutError)):
            raise ConnectTimeout(f"{url} did not answer within {timeout:g} s") from None
        raise TransportError(f"cannot reach {url}: {reason}") from None
    except (TimeoutError, socket.timeout):
        raise ConnectTimeout(f"{url} did not answer within {timeout:g} s") from None
    except OSError as exc:
        raise TransportError(f"reading {url} failed: {exc}") from None
    try:
        status = json.loads(body)
    except ValueError:
        raise ProtocolError(f"{url} did not answer JSON: is this a pccl master's --status address?") from None
    if not isinstance(status, dict) or status.get("schema") != SCHEMA:
        got = status.get("schema") if isinstance(status, dict) else None
        raise ProtocolError(f"{url} answered status schema {got!r}; this pccl reads schema {SCHEMA}")
    return status
