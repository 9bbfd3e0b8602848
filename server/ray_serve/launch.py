"""`cellserve serve --replicas N|auto:MIN-MAX`: start (or join) Ray, run the application on Ray Serve with Serve's
HTTP proxy on `--host:--port` (on every node), wait for SIGTERM/SIGINT, then tear down what this command started.

The application: the `engine` deployment (`replica.Engine`, `@serve.ingress`, routed by `router.CellserveRouter`;
N replicas, or Serve's autoscaling between MIN and MAX) and the `cluster` deployment (`cluster.Cluster`).
Without `--ray-address` a local Ray instance is started with `num_cpus` enough for the replicas x threads and a
capped object store (`OBJECT_STORE_BYTES`), without Ray's dashboard; with an address the command joins that
cluster and on exit deletes only its own application (the cluster and Serve's proxies keep running).
"""

import argparse
import logging
import os
import signal
import threading
import time

from server.config import KEEP_ALIVE_S
from server.ray_serve.routing import parse_replicas

log = logging.getLogger("cellserve")
APP_NAME = "cellserve"
ENGINE, CLUSTER = "engine", "cluster"
OBJECT_STORE_BYTES = 256 * 2**20  # responses are small; Ray's default (30% of RAM) is far too much here
PROXY_CALLBACK = "server.ray_serve.proxy_headers.middlewares"  # see proxy_headers
DELETE_WAIT_S = 5.0  # joined: how long SIGTERM waits for Serve to delete the application before exiting


class JoinError(RuntimeError):
    """`--ray-address` names a cluster this process could not join."""


def start_ray(address: str | None, replicas: int, threads: int) -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", PROXY_CALLBACK)  # a local Ray's proxy
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


def build_application(args: argparse.Namespace):
    """The engine deployment (ingress) over the cluster deployment; `args` are the serve flags."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from server.ray_serve.cluster import Cluster
    from server.ray_serve.replica import STATS_PERIOD_S, Engine

    threads = args.threads_per_replica or args.threads or 1
    args = argparse.Namespace(**{**vars(args), "threads": threads})
    cluster = serve.deployment(Cluster, name=CLUSTER, num_replicas=1, max_ongoing_requests=10_000,
                               ray_actor_options={"num_cpus": 0}).bind(ENGINE, APP_NAME)
    scale = parse_replicas(str(args.replicas))
    count = {"num_replicas": scale} if isinstance(scale, int) else {"autoscaling_config": {
        "min_replicas": scale[0], "max_replicas": scale[1], "initial_replicas": scale[0],
        "target_ongoing_requests": args.target_ongoing_requests, "upscale_delay_s": 3.0,
        "downscale_delay_s": args.downscale_delay, "metrics_interval_s": 1.0, "look_back_period_s": 5.0}}
    router = RequestRouterConfig(request_router_class="server.ray_serve.router.CellserveRouter",
                                 request_routing_stats_period_s=STATS_PERIOD_S, request_routing_stats_timeout_s=5.0)
    deployment = serve.deployment(Engine, name=ENGINE, max_ongoing_requests=100_000, health_check_period_s=2.0,
                              health_check_timeout_s=30.0, graceful_shutdown_timeout_s=60.0,
                              graceful_shutdown_wait_loop_s=0.5, request_router_config=router,
                              ray_actor_options={"num_cpus": threads}, **count)
    return deployment.bind(args, cluster, ENGINE, APP_NAME)


def deploy(args: argparse.Namespace) -> None:
    """Start Serve's proxies on `--host:--port` and run the application (returns when every replica is up)."""
    from ray import serve

    serve.start(proxy_location="EveryNode", http_options={
        "host": args.host, "port": args.port, "keep_alive_timeout_s": KEEP_ALIVE_S})
    serve.run(build_application(args), name=APP_NAME, route_prefix="/")


def teardown(joined: bool) -> None:
    """Tell the replicas not to move families (the whole application stops), then delete it (joined) or shut
    Serve and Ray down."""
    import ray
    from ray import serve

    try:
        try:
            serve.get_deployment_handle(CLUSTER, app_name=APP_NAME).stop.remote().result(timeout_s=2)
        except Exception as exc:  # noqa: BLE001 -- stopping anyway
            log.warning("could not reach the cluster deployment (%s); stopping anyway", type(exc).__name__)
        if joined:  # the controller finishes the deletion; waiting is bounded (a dead node's replica can stall it)
            serve.delete(APP_NAME, _blocking=False)
            deadline = time.monotonic() + DELETE_WAIT_S
            while APP_NAME in serve.status().applications and time.monotonic() < deadline:
                time.sleep(0.5)
        else:
            serve.shutdown()
    finally:
        ray.shutdown()


def wait_for_signal() -> None:
    """Block until SIGTERM or SIGINT (a second SIGINT exits at once)."""
    stop = threading.Event()

    def handler(sig, _frame) -> None:
        if stop.is_set() and sig == signal.SIGINT:
            os._exit(130)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    while not stop.wait(1.0):
        pass


def run_replicated(args: argparse.Namespace) -> int:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        log.error("--replicas needs Ray Serve: pip install 'cellserve[ray]' (or pip install 'ray[serve]')")
        return 2
    scale = parse_replicas(str(args.replicas))
    threads = args.threads_per_replica or args.threads or 1
    try:
        start_ray(args.ray_address, scale if isinstance(scale, int) else scale[1], threads)
    except JoinError as exc:
        log.error("%s", exc)
        return 1
    try:
        log.info("deploying %s replica(s) x %d thread(s); the endpoint opens when they have loaded the model",
                 args.replicas, threads)
        deploy(args)
        log.info("cellserve (%s replicas) listening on http://%s:%d (Ray Serve's proxy)", args.replicas,
                 args.host, args.port)
        wait_for_signal()
        log.info("stopping: %s", "deleting the application" if args.ray_address else "shutting Ray down")
    finally:
        teardown(joined=bool(args.ray_address))
    return 0
