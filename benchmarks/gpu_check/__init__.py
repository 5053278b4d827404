"""``make gpu-check``: P and D ranks as processes on one GPU (or, ``--cpu``, on torch CPU
tensors with NIXL on host memory), every way of moving a request timed and byte-checked.

Map: ``run.py`` (command line) → ``driver.py`` (the case, phase by phase) → rank processes
(``rank.py``: set-up and commands; ``methods.py``: the timed methods; ``vllm_like.py``:
the vLLM-like path) → ``report.py`` (table, targets, JSON). ``cases.py``: the case lists
and the allocator trace; ``pattern.py``: the byte pattern, filled and checked on the
device; ``memory.py``: the pools; ``wheels.py``: ``make gpu-wheels``. See ``README.md``."""
