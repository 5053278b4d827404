"""The fused copy kernel's source, in two forms (:mod:`kvbridge.connector.movers.triton_copy`
chooses): a program per tile of ``RUNS`` runs, ``BLOCK`` words of each per step. Word
offsets are int64, so a tensor may exceed 2³¹ words; ``n`` (runs) is never specialised:
a compile per run count would be unbounded. Kept at module level: Triton (and its
interpreter) resolve the shared body by its global name."""

import triton
import triton.language as tl


@triton.jit
def body(dst, d_w, src, s_w, n, row, RUNS: tl.constexpr, BLOCK: tl.constexpr):
    runs = tl.program_id(0) * RUNS + tl.arange(0, RUNS)
    live = runs < n
    d = tl.load(d_w + runs, mask=live, other=0)[:, None]
    s = tl.load(s_w + runs, mask=live, other=0)[:, None]
    for start in range(0, row, BLOCK):
        col = start + tl.arange(0, BLOCK)[None, :]
        mask = live[:, None] & (col < row)
        tl.store(dst + d + col, tl.load(src + s + col, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["n", "row"])
def generic(dst, d_w, src, s_w, n, row, RUNS: tl.constexpr, BLOCK: tl.constexpr):
    """``row`` words a run, given at run time: one compile per word type and alignment."""
    body(dst, d_w, src, s_w, n, row, RUNS, BLOCK)


@triton.jit(do_not_specialize=["n"])
def fixed(dst, d_w, src, s_w, n, ROW: tl.constexpr, RUNS: tl.constexpr, BLOCK: tl.constexpr):
    """``ROW`` words a run, a constant of the compile: one compile per length."""
    body(dst, d_w, src, s_w, n, ROW, RUNS, BLOCK)


@triton.jit
def grid_body(dst, d_t, d_id, d_str, src, s_t, s_id, s_str, nb, n, row, RUNS: tl.constexpr,
              BLOCK: tl.constexpr):  # fmt: skip
    # run i = (t, b), t major: from s_t[t] + s_id[b]·s_str to d_t[t] + d_id[b]·d_str (words)
    runs = tl.program_id(0) * RUNS + tl.arange(0, RUNS)
    live = runs < n
    t = runs // nb
    b = runs - t * nb
    d = tl.load(d_t + t, mask=live, other=0) + tl.load(d_id + b, mask=live, other=0) * d_str
    s = tl.load(s_t + t, mask=live, other=0) + tl.load(s_id + b, mask=live, other=0) * s_str
    d, s = d[:, None], s[:, None]
    for start in range(0, row, BLOCK):
        col = start + tl.arange(0, BLOCK)[None, :]
        mask = live[:, None] & (col < row)
        tl.store(dst + d + col, tl.load(src + s + col, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["d_str", "s_str", "nb", "n", "row"])
def grid_generic(dst, d_t, d_id, d_str, src, s_t, s_id, s_str, nb, n, row, RUNS: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    """``nb`` tiles × ``n / nb`` pattern runs of ``row`` words, offsets made here."""
    grid_body(dst, d_t, d_id, d_str, src, s_t, s_id, s_str, nb, n, row, RUNS, BLOCK)


@triton.jit(do_not_specialize=["d_str", "s_str", "nb", "n"])
def grid_fixed(dst, d_t, d_id, d_str, src, s_t, s_id, s_str, nb, n, ROW: tl.constexpr,
               RUNS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """:func:`grid_generic` with ``ROW`` a constant of the compile."""
    grid_body(dst, d_t, d_id, d_str, src, s_t, s_id, s_str, nb, n, ROW, RUNS, BLOCK)


FORMS = {"runs": (generic, fixed), "grid": (grid_generic, grid_fixed)}
"""Each kind of copy's (generic, fixed) forms."""
