"""The container's HEALTHCHECK: exit 0 when the node's ``/healthz`` answers 200, else 1.

The node's HTTP port is ``listen.http`` (8002 in deploy/node.yaml); ``INFERENCE_SERVER_LISTEN_HTTP``
overrides it, so the check reads the port from it too. Standard library only: it runs with the
image's Python every 30 s and must stay cheap.
"""
from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    listen = os.environ.get("INFERENCE_SERVER_LISTEN_HTTP") or "0.0.0.0:8002"
    port = listen.rsplit(":", 1)[-1]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=4) as reply:
            return 0 if reply.status == 200 else 1
    except (OSError, urllib.error.URLError) as exc:
        print(f"healthcheck: http://127.0.0.1:{port}/healthz: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
