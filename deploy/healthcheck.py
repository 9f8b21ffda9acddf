"""Container healthcheck: exit 0 when the rollout server answers ``GET /ready`` with 200.

Standard library only, so it runs in any image. The API key comes from ``ROLLOUT_API_KEY``
(every endpoint needs it when the server has one).

    python3 deploy/healthcheck.py [URL]    # default http://127.0.0.1:8000/ready
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def check(url: str, api_key: str | None, timeout_s: float = 5.0) -> tuple[bool, str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=timeout_s
        ):
            return True, "ready"
    except urllib.error.HTTPError as e:
        return False, f"HTTP {e.code}: {e.read(300).decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"unreachable: {e}"


def main(argv: list[str]) -> int:
    url = argv[1] if len(argv) > 1 else "http://127.0.0.1:8000/ready"
    ok, why = check(url, os.environ.get("ROLLOUT_API_KEY") or None)
    if not ok:
        print(f"{url}: {why}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
