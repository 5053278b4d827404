"""First requests on new P/D pairs in real vLLM, nothing else timed: per connector, three
requests through a fresh pair (llama 128 -> 128, P and D of every connector up at once,
as in ``kvbridge bench vllm``), P's and D's call and, for kvbridge, the load's stages.

    PYTHONPATH=.:src python -m benchmarks.vllm_first [kvbridge] [nixl]

The first request pays the handshake (docs/vllm.md, "First request")."""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

from benchmarks import vllm_bench as vb
from tests.support.tiny_models import make_tiny_model


def main() -> None:
    conns = tuple(sys.argv[1:]) or vb.CONNECTORS
    case = vb.CASES[0]
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(case.model, Path(tmp) / case.model))
        site = Path(tmp) / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(vb.SITECUSTOMIZE)
        cfgs = {
            c: pair for c, pair in vb.engine_configs(case, model, str(site)).items() if c in conns
        }
        rng = random.Random(1)
        with vb.engines(cfgs) as eng:
            for conn in conns:
                p, d = eng[conn]
                d.rpc(vb.install_recorder)
                for i in range(3):
                    (x,) = vb.make_prompts(rng, (case.timed_len,))
                    _, t_p, t_d = vb.run_pd(p, d, [x], 1)
                    stages = vb.first_load(vb.records(d)) if conn == "kvbridge" else {}
                    ms = f"P {t_p * 1e3:.0f} ms, D {t_d * 1e3:.0f} ms"
                    print(f"{conn} request {i}: {ms} {stages}")


if __name__ == "__main__":
    main()
