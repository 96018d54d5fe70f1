"""`helm test`: every operator and node agent pod answers /metrics with kvshare metrics.

Arguments: a timeout in seconds, then HOST:PORT targets. Each host is resolved to all of its
addresses (a headless Service gives one per pod), and each address must answer.
"""

import socket
import sys
import urllib.request


def check(host: str, port: int, timeout: float) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return [f"{host}: no ready pod behind this name ({exc})"]
    problems = []
    for address in sorted({info[4][0] for info in infos}):
        shown = f"[{address}]" if ":" in address else address
        url = f"http://{shown}:{port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                body = response.read().decode("utf-8", "replace")
        except OSError as exc:
            problems.append(f"{url} ({host}): {exc}")
            continue
        samples = [line for line in body.splitlines() if line.startswith("kvshare_")]
        if not samples:
            problems.append(f"{url} ({host}): answered, but with no kvshare_ metrics")
        else:
            print(f"ok {url} ({host}): {len(samples)} kvshare samples")
    return problems


def main() -> int:
    timeout = float(sys.argv[1])
    problems = []
    for target in sys.argv[2:]:
        host, port = target.rsplit(":", 1)
        problems += check(host, int(port), timeout)
    for problem in problems:
        print(f"FAILED {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
