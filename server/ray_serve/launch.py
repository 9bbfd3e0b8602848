"""`cellserve serve --replicas N`: start (or join) Ray, deploy N replicas as one Ray Serve application,
serve the ingress (uvicorn, this process) on `--host:--port` until SIGTERM/SIGINT, then tear down
what this command started.

Without `--ray-address` a local Ray instance is started with `num_cpus` enough for N replicas x T
threads and a capped object store (`OBJECT_STORE_BYTES`), without Ray's dashboard; with an address
the command joins that cluster and on exit deletes only its own application (the cluster keeps
running). Serve's own HTTP proxy is not started: the ingress here is the one endpoint.
"""

import argparse
import logging
import os
import signal

from server.config import KEEP_ALIVE_S, limits_of

log = logging.getLogger("cellserve")
APP_NAME = "cellserve"
OBJECT_STORE_BYTES = 256 * 2**20  # responses are small; Ray's default (30% of RAM) is far too much here


class JoinError(RuntimeError):
    """`--ray-address` names a cluster this process could not join."""


def start_ray(address: str | None, replicas: int, threads: int) -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address:
        try:
            ray.init(address=address, log_to_driver=False)
        except Exception as exc:  # said in one line, with the usual cause
            hint = ""
            if "auth" in repr(exc).lower() or "auth" in repr(exc.__cause__).lower():
                hint = (" (the cluster uses token authentication: run with RAY_AUTH_MODE=token and the "
                        "cluster's token in RAY_AUTH_TOKEN or ~/.ray/auth_token, as `ray start --address` needs)")
            raise JoinError(f"could not join the Ray cluster at {address}: {type(exc).__name__}{hint}") from exc
    else:
        # "local": always a new instance. Without it ray.init() joins a cluster found through RAY_ADDRESS
        # or /tmp/ray/ray_current_cluster (any `ray start` on this machine), and the exit would then shut
        # down Serve on a cluster this command did not start.
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, replicas * threads),
                 object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False, log_to_driver=False)


def deploy(args: argparse.Namespace):
    """Deploy the replicas (returns when every replica has loaded its model); the ingress app over them."""
    from ray import serve

    from server.ray_serve.ingress import build_ingress_app, replica_handles
    from server.ray_serve.replica import build_application

    serve.start(proxy_location="Disabled")
    serve.run(build_application(args), name=APP_NAME, route_prefix=None)
    return build_ingress_app(replica_handles(APP_NAME, args.replicas), limits_of(args))


def teardown(joined: bool) -> None:
    import ray
    from ray import serve

    try:
        if joined:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
    finally:
        ray.shutdown()


def ingress_server():
    import uvicorn

    class IngressServer(uvicorn.Server):
        """uvicorn whose SIGTERM/SIGINT only ends serving: it is not re-raised afterwards (uvicorn's own
        handler re-raises it, and Ray's driver handler turns that into exit status 15), so the command
        tears Ray down and exits 0. A second SIGINT forces the exit."""

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    return IngressServer


def run_replicated(args: argparse.Namespace) -> int:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        log.error("--replicas needs Ray Serve: pip install 'cellserve[ray]' (or pip install 'ray[serve]')")
        return 2

    import uvicorn

    threads = args.threads_per_replica or args.threads or 1
    try:
        start_ray(args.ray_address, args.replicas, threads)
    except JoinError as exc:
        log.error("%s", exc)
        return 1
    try:
        log.info("deploying %d replica(s) x %d thread(s); the endpoint opens when every replica has loaded "
                 "its model", args.replicas, threads)
        app = deploy(args)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_keep_alive=KEEP_ALIVE_S,
                                timeout_graceful_shutdown=max(1, int(args.shutdown_grace)))
        log.info("cellserve (%d replicas) listening on http://%s:%d", args.replicas, args.host, args.port)
        ingress_server()(config).run()  # SIGTERM/SIGINT: stop accepting, finish in-flight, return
        log.info("stopping: %s", "deleting the application" if args.ray_address else "shutting Ray down")
    finally:
        teardown(joined=bool(args.ray_address))
    return 0
