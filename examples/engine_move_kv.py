"""The reference engine in one process: a colocated run, then P → D with ``move_kv``
(loopback transport), and D's tokens checked against the colocated ones.
docs/engine.md shows this file; a test runs it.

    python examples/engine_move_kv.py
"""

from refengine import Instance, encode, generate, move_kv

if __name__ == "__main__":  # TP 2 starts rank processes, which import this file again
    tokens = generate("kimi-linear", "hello", tp=2, n_new_tokens=16)  # colocated, greedy

    p = Instance("kimi-linear", tp=1, block_size=16, layout="hnd", num_blocks=64)
    d = Instance("kimi-linear", tp=1, block_size=32, layout="shared-pool")
    pre = p.prefill("r1", encode("hello"))  # Prefilled(first_token, n_tokens, tables)
    d.reserve("r1", encode("hello"), n_cached=0)  # D's block tables; n_cached computed on D
    moved = move_kv(p, d, "r1")  # Geometry + plan + LoopbackTransport; Moved(bytes, descriptors)
    d.start_decode("r1", pre.first_token)
    rest = d.decode("r1", 15)
    assert [pre.first_token, *rest] == tokens  # D continues exactly as the colocated run
    p.free("r1"), d.free("r1"), p.close(), d.close()
    print(f"{moved.bytes} bytes in {moved.descriptors} descriptors; tokens {tokens}")
