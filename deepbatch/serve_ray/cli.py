"""``deepbatch serve --replicas N``: the same flags as one process, N engine replicas behind the
Ray Serve ingress on this machine (or on the Ray cluster that ``RAY_ADDRESS`` names).

Runs until SIGINT or SIGTERM, then deletes the application (and stops the local Ray instance
it started).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from deepbatch import envs

APP_NAME = "deepbatch"


def app_args_from_cli(args: argparse.Namespace):
    """The application's arguments from ``deepbatch serve``'s parsed flags."""
    from deepbatch.serve_ray.args import AppArgs, engine_arg_defaults

    defaults = engine_arg_defaults()
    engine_args = {k: getattr(args, k) for k in defaults
                   if hasattr(args, k) and getattr(args, k) != defaults[k] and k != "model"}
    return AppArgs(
        model=getattr(args, "model_tag", None) or args.model, engine_args=engine_args, num_replicas=args.replicas,
        served_model_name=args.served_model_name, api_key=args.api_key or envs.DEEPBATCH_API_KEY,
        api_keys_file=args.api_keys_file, max_request_body_bytes=envs.DEEPBATCH_MAX_REQUEST_BODY_BYTES,
        graceful_shutdown_timeout_s=args.shutdown_timeout,
    )


def serve_replicas(args: argparse.Namespace) -> int:
    """Serve ``args.replicas`` engine replicas; returns the exit status."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("--replicas needs Ray Serve: pip install 'deepbatch[ray]'") from None
    from deepbatch.api.auth import load_keys
    from deepbatch.serve_ray.app import build_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    if args.replicas < 1:
        raise ValueError(f"--replicas: must be >= 1, got {args.replicas}")
    if getattr(args, "otlp_traces_endpoint", None):
        logging.getLogger("deepbatch.serve_ray").warning("--otlp-traces-endpoint is not supported with --replicas; "
                                                         "no spans are sent")
    app_args = app_args_from_cli(args)
    load_keys(app_args.api_keys_file, app_args.api_key)  # a bad keys file fails before anything starts
    app = build_app(app_args)
    ray.init()  # the cluster RAY_ADDRESS names, else a local instance
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        logging.getLogger("deepbatch.serve_ray").info(
            "serving %d replica(s) on http://%s:%d (Ctrl-C stops)", args.replicas, args.host, args.port)
        stop.wait()
    finally:
        # Further signals only set the event again: a second Ctrl-C must not cut the clean-up short.
        try:
            serve.delete(APP_NAME)
        finally:
            ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return 0
