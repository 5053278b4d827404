"""Read the API the vLLM connector relies on from a vLLM wheel, without installing it, and
write it as JSON for ``tests/unit/test_vllm_api.py`` (which checks the connector against
every snapshot in ``tests/data/vllm_api/``; docs/vllm.md, "vLLM versions").

    pip download vllm==0.33.0 --no-deps -d /tmp/vllm033
    .venv/bin/python tools/vllm_api_snapshot.py /tmp/vllm033/vllm-0.33.0-*.whl

Writes ``tests/data/vllm_api/vllm-<version>.json`` (``--out`` to choose): the connector
bases' methods (:func:`tests.support.vllm_api.ast_class`), the names of the classes whose
objects it reads, how the factory builds a connector, the ``Request`` fields of the
last-token rule and NixlConnector's edits of them (:mod:`tests.support.vllm_request`).
Python source only: nothing of the wheel is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.support.vllm_api import ast_class, factory_call, names, to_json
from tests.support.vllm_request import edits, request_facts

KV = "vllm/distributed/kv_transfer/kv_connector"
CLASSES = {
    "KVConnectorBase_V1": f"{KV}/v1/base.py",
    "SupportsHMA": f"{KV}/v1/base.py",
    "KVConnectorMetadata": f"{KV}/v1/base.py",
    "KVConnectorHandshakeMetadata": f"{KV}/v1/base.py",
    "KVConnectorStats": f"{KV}/v1/metrics.py",
    "KVConnectorPromMetrics": f"{KV}/v1/metrics.py",
}
"""The classes the connector's classes derive from, and the file of each in a wheel."""
NAMES = {
    "Request": "vllm/v1/request.py",
    "RequestStatus": "vllm/v1/request.py",
    "KVCacheBlocks": "vllm/v1/core/kv_cache_manager.py",
    "SchedulerOutput": "vllm/v1/core/sched/output.py",
    "KVCacheConfig": "vllm/v1/kv_cache_interface.py",
    "KVConnectorTransferResults": f"{KV}/v1/base.py",
}
"""Classes whose objects the connector reads or builds: only their names are kept."""
FACTORY = f"{KV}/factory.py"
REQUEST = "vllm/v1/request.py"
NIXL_SCHEDULER = f"{KV}/v1/nixl/base_scheduler.py"
"""Where vLLM's NixlConnector makes P prefill short (the same edit as ours)."""
OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "vllm_api"


def version(wheel: zipfile.ZipFile) -> str:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    return Parser().parsestr(wheel.read(meta).decode())["Version"]


def snapshot(path: Path) -> dict[str, Any]:
    with zipfile.ZipFile(path) as wheel:

        def text(name: str) -> str:
            return wheel.read(name).decode()

        return {
            "vllm": version(wheel),
            "made_by": f"tools/vllm_api_snapshot.py {path.name}",
            "classes": {name: to_json(ast_class(text(f), name)) for name, f in CLASSES.items()},
            "names": {name: names(ast_class(text(f), name)) for name, f in NAMES.items()},
            "factory": vars(factory_call(text(FACTORY))),
            "request": request_facts(text(REQUEST)),
            "nixl_edits": edits(text(NIXL_SCHEDULER)),
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", type=Path, help="a vllm-*.whl (pip download vllm==X --no-deps)")
    ap.add_argument("--out", type=Path, help="the JSON file (default: by version, see above)")
    args = ap.parse_args()
    snap = snapshot(args.wheel)
    out = args.out or OUT / f"vllm-{snap['vllm']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(snap, indent=1, sort_keys=True) + "\n")
    print(f"{out}: {out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
