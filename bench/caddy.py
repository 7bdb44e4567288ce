"""The Caddyfile for the reference HTTP/3 proxy (Caddy 2.6), as a pure function.

Each line is there for a reason:
- `admin off`: no admin endpoint (nothing listens but the site itself);
- `auto_https off`: no ACME, no HTTP->HTTPS redirect listener, no network;
- `servers { protocols h1 h2 h3 }`: HTTP/3 on the site's UDP port;
- `bind 127.0.0.1`: loopback only;
- `tls CERT KEY`: the same development certificate Pylon uses;
- `flush_interval -1`: write every upstream chunk at once, as Pylon does for
  SSE (Caddy already flushes text/event-stream immediately; this makes it
  explicit for every response);
- `log` (unless `access_log=False`): one JSON access line per request on
  stderr, as Pylon writes one, so both proxies do a production proxy's work
  (Caddy logs no requests without it).
Caddy keeps its state under XDG_DATA_HOME / XDG_CONFIG_HOME, which the bench
points into its temporary directory.
"""

from __future__ import annotations

from pathlib import Path


def caddyfile(*, port: int, upstream: str, cert: Path, key: Path, access_log: bool = True) -> str:
    """A site on https://127.0.0.1:`port` (TCP and UDP) proxying to `upstream` (HOST:PORT)."""
    log = "\tlog {\n\t\toutput stderr\n\t\tformat json\n\t}\n" if access_log else ""
    return f"""{{
	admin off
	auto_https off
	servers {{
		protocols h1 h2 h3
	}}
}}

https://:{port} {{
	bind 127.0.0.1
	tls {cert} {key}
{log}	reverse_proxy {upstream} {{
		flush_interval -1
	}}
}}
"""
