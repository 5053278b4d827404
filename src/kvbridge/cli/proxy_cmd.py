"""``kvbridge proxy``: an OpenAI-compatible P/D front (see src/kvbridge/serve/proxy.py)."""

from __future__ import annotations

import argparse
import logging

from kvbridge.cli.args import port


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "proxy",
        help="OpenAI-compatible front: prefill on a P server, decode on a D server",
        description="Each request is prefilled on a P server (max_tokens 1) and decoded on a "
        "D server with P's kv_transfer_params. Serves /v1/completions, /v1/chat/completions "
        "(streaming too), /v1/models, /health and /metrics (Prometheus). A P or D server "
        "that is down answers 502 (504 after a timeout) with an OpenAI-style error "
        '{"error": {"message", "type", "code", "backend": URL}}; one log line each. A D '
        "server failing mid-stream ends the stream with that error as an SSE event and a "
        "cut connection (never a complete-looking answer).",
    )
    p.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="a P server, e.g. http://127.0.0.1:8100 (repeat for several)",
    )
    p.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="a D server (repeat for several)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="port to bind (default 8000)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvbridge.serve.proxy import run as serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    serve(args.prefill, args.decode, args.host, args.port)
    return 0
