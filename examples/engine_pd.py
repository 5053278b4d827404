"""The reference engine as P and D servers with rank processes over NIXL, and a router;
D's tokens checked against a colocated run. docs/engine.md shows this file; a test runs it.

    UCX_MODULES=^ib python examples/engine_pd.py
"""

import secrets
from contextlib import closing

from kvbridge.api import SideConfig
from refengine import encode, generate
from refengine.pd import DecodeServer, PrefillServer, Router

if __name__ == "__main__":  # rank processes import this file again
    secret = secrets.token_bytes(16)  # shared by P and D: handshakes are authenticated
    with (
        closing(PrefillServer("kimi-linear", SideConfig(2, 16, "hnd"), secret)) as p,
        closing(DecodeServer("kimi-linear", SideConfig(1, 32, "block-major"), secret)) as d,
    ):
        out = Router(p, d).generate("r1", encode("hello"), n_new=16)
        # Decoded(tokens, bytes, descriptors, seconds, recomputed, error)
    assert out.tokens == generate("kimi-linear", "hello", n_new_tokens=16)
    print(f"{out.bytes} bytes in {out.descriptors} descriptors, {out.seconds * 1e3:.1f} ms")
