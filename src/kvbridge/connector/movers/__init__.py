"""How a load's bytes move (``docs/gpu.md``, "Movers"): the movers by name
(:mod:`.registry`: ``kernel``, ``push``, ``pull``), AUTO's per-request choice
(:mod:`.choice`), READ (:mod:`.pull`) and WRITE (:mod:`.push`; P's half
:mod:`.push_gather`), staged rounds through a slot (:mod:`.staging`, :mod:`.spans`), the
kernel mover for P's memory mapped on one node (:mod:`.kernel`) and the local copies
(:mod:`.memory` by address; :mod:`.copies` with numpy, :mod:`.device_copies`,
:mod:`.triton_copy`, :mod:`.triton_kernels` with torch and Triton)."""
