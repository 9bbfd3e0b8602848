"""Scale-out on Ray Serve: `cellserve serve --replicas N|auto:MIN-MAX` (optional extra: `pip install cellserve[ray]`).

- `routing`: ids -> replica, prefix keys, metrics/cache aggregation (no Ray, no torch)
- `router`: the engine deployment's Ray Serve `RequestRouter` (affinity, prefix, least loaded)
- `replica`: the engine deployment (`@serve.ingress`): one engine and the single server's app per replica
- `edge`: what a replica does before its app (aggregated routes, ids held elsewhere)
- `cluster`: the small deployment that asks every replica (aggregated routes, moves, drains)
- `moves`: moving fork families between replicas
- `proxy_headers`: Serve's HTTP proxy keeps the app's `X-Request-ID`
- `launch`: start or join Ray, run the application behind Serve's proxy, wait for SIGTERM, tear down

The single-process server never imports this package (`server.cli` imports it only with `--replicas`).
"""
