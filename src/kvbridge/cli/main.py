"""``kvbridge`` command line: one module per subcommand, each with ``register(sub)``.

Exit codes: 0 success, 1 a failed check (e.g. demo mismatch), 2 bad input.
"""

# A command module imports only argparse and kvbridge.cli.args at the top: building the
# parser must stay cheap (``kvbridge --help`` loads no numpy, torch, vllm or aiohttp);
# each ``run`` imports what its work needs.

from __future__ import annotations

import argparse
import importlib
import sys

from kvbridge.errors import KVBridgeError

COMMANDS = ("plan", "bench", "demo", "proxy", "keys")
ABOUT = (
    "kvbridge moves a request's KV cache from a prefill instance (P) to a decode\n"
    "instance (D) over NIXL, whatever their TP, PP, block sizes and memory layouts."
)
EPILOG = (
    "Run 'kvbridge COMMAND --help' for a command's flags.\n"
    "Exit codes: 0 success, 1 a failed check, 2 bad input."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbridge",
        description=ABOUT,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"kvbridge.cli.{name}_cmd").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a flag's value refused (argparse printed why)
        return e.code if isinstance(e.code, int) else 2
    try:
        return int(args.run(args))
    except KVBridgeError as e:
        print(f"kvbridge: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
