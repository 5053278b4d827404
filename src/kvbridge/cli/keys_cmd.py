"""``kvbridge keys``: per-instance CURVE identities of the side channel (``docs/security.md``)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "keys",
        help="make and show per-instance side-channel keys",
        description="Each P and D instance has its own CURVE key pair in a key file; each "
        "file lists its peers' public keys by engine id (P: the D instances it serves; D: "
        "the P instances it loads from). Give the file as keys_file (vLLM) or "
        "keys=Keys.load(file).",
    )
    how = p.add_subparsers(dest="keys_command", required=True)
    new = how.add_parser("new", help="write a fresh key pair for an engine id (mode 0600)")
    new.add_argument("engine_id")
    new.add_argument("file", help="key file to create (never overwritten)")
    new.set_defaults(run=run_new)
    show = how.add_parser("show", help="print 'ENGINE_ID PUBLIC_KEY' of a key file")
    show.add_argument("file")
    show.add_argument("--peers", action="store_true", help="also list its peers ('peer ID KEY')")
    show.set_defaults(run=run_show)
    allow = how.add_parser(
        "allow",
        help="list a peer instance in a key file: "
        'kvbridge keys allow FILE "$(kvbridge keys show PEER_FILE)"',
    )
    allow.add_argument("file")
    allow.add_argument(
        "peer",
        nargs="+",
        metavar="'ENGINE_ID PUBLIC'",
        help="the peer's engine id and public key (Z85, 40 characters; quote it: Z85 "
        "has shell characters), as 'kvbridge keys show' prints them",
    )
    allow.set_defaults(run=run_allow)


def run_new(args: argparse.Namespace) -> int:
    from kvbridge.control.security import Keys

    keys = Keys.new_identity(args.file, args.engine_id)
    print(keys.engine_id, keys.server_public.decode())
    return 0


def run_show(args: argparse.Namespace) -> int:
    from kvbridge.control.security import Keys

    keys = Keys.load(args.file)
    if not keys.engine_id:  # explicit keys: the public halves, by role
        for name in ("server_public", "client_public"):
            if getattr(keys, name):
                print(name, getattr(keys, name).decode())
        return 0
    print(keys.engine_id, keys.server_public.decode())
    for eid, key in keys.peers if args.peers else ():
        print("peer", eid, key.decode())
    return 0


def run_allow(args: argparse.Namespace) -> int:
    from kvbridge.control.security import Keys
    from kvbridge.errors import ConfigError

    words = " ".join(args.peer).split()
    if len(words) != 2:
        raise ConfigError(f"expected 'ENGINE_ID PUBLIC', got {len(words)} words: {words}")
    keys = Keys.add_peers(args.file, {words[0]: words[1]})
    n = len(keys.peers)
    print(f"{keys.engine_id}: {n} peer{'' if n == 1 else 's'}")
    return 0
