"""Scale-out on Ray Serve: `cellserve serve --replicas N` (optional extra: `pip install cellserve[ray]`).

- `routing`: ids -> replica, least-loaded and prefix policies, metrics/cache aggregation (no Ray, no torch)
- `replica`: one engine replica running the single server's own app, driven through ASGI
- `ingress`: the one HTTP endpoint (Ray Serve ingress) that routes, relays and aggregates
- `launch`: start or join Ray, deploy, wait for SIGTERM, tear down

The single-process server never imports this package (`server.cli` imports it only with `--replicas`).
"""
