"""Is the model hub there? One bounded probe, so an offline machine fails in one line, at once.

Without it, transformers retries every file of a hub model for tens of seconds (12 retry lines in
46 s were seen for `calibrate --model r1-distill-qwen-7b` on a machine without network) before the
error. One TCP connection to the hub's endpoint, bounded to a second including the name lookup,
decides; when nothing answers, the process switches to `HF_HUB_OFFLINE` so that nothing later
(revision look-ups, a second model) waits for the network again.
"""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlsplit

import huggingface_hub.constants as hub

PROBE_SECONDS = 1.0


def _connects(host: str, port: int, timeout: float) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def hub_answers(timeout: float = PROBE_SECONDS) -> bool:
    """True when the hub endpoint (`HF_ENDPOINT`) accepts a TCP connection within `timeout` seconds.

    False at once in offline mode. On False the process is switched to offline mode (said by the
    caller's error line)."""
    if hub.HF_HUB_OFFLINE:
        return False
    url = urlsplit(hub.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    result: list[bool] = []
    # A thread bounds the name lookup too (getaddrinfo has no timeout of its own).
    probe = threading.Thread(target=lambda: result.append(_connects(url.hostname or "", port, timeout)), daemon=True)
    probe.start()
    probe.join(timeout)
    if result and result[0]:
        return True
    os.environ["HF_HUB_OFFLINE"] = "1"
    hub.HF_HUB_OFFLINE = True
    return False
