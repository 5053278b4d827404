"""``make gpu-wheels``: what a GPU machine without network needs to run the check, in one
folder (``.gpu-wheels/``, git-ignored, under :data:`LIMIT` bytes).

The machine has Python and a CUDA build of torch (with numpy); it lacks NIXL, msgspec and
pyzmq. So: the ``nixl-cu<N>`` wheel and the ``nixl`` meta package (which picks the build
matching torch's CUDA), unpacked, stripped of what the check never loads (headers,
scripts, the EP library, UCX's perftest, the storage and cloud plugins, the plugin copies
the loader does not use) and packed as one xz tarball; msgspec and pyzmq as wheels, at the
versions the test suite runs here. ``gpu_check.sh`` unpacks them into a temporary
directory put on ``PYTHONPATH``: nothing is installed there.

    python -m benchmarks.gpu_check.wheels [--out .gpu-wheels] [--python 3.12] [--cuda 13]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

LIMIT = 60 << 20
NIXL_VERSION = "1.5.1"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")  # fmt: skip
UNUSED_PLUGINS = ("AZURE_BLOB", "OBJ", "GUSLI", "INFINIA", "GPUNETIO", "LIBFABRIC", "GDS",
                  "GDS_MT")  # fmt: skip


def download(dest: Path, python: str, specs: Sequence[str]) -> list[Path]:
    """``pip download`` the wheels of ``specs`` for CPython ``python`` on x86-64 Linux."""
    abi = "cp" + python.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "--abi", abi,
           "-d", str(dest)]  # fmt: skip
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run([*cmd, *specs], check=True)
    return sorted(dest.glob("*.whl"))


def strip(site: Path, build: str) -> None:
    """Remove from the unpacked NIXL what the check does not load."""
    doomed = [
        *site.glob(f"{build}-*.data"),  # headers, example programs, pkg-config
        site / f"{build}.scripts",
        site / build.replace("nixl_", "nixl_ep_"),
        site / "nixl_ep",
        site / f"{build}.libs" / "nixl",  # plugin copies: the loader reads .mesonpy.libs
    ]
    doomed += (site / f"{build}.libs" / "ucx").glob("libucx_perftest*")
    plugins = site / f".{build}.mesonpy.libs" / "plugins"
    doomed += [plugins / f"libplugin_{name}.so" for name in UNUSED_PLUGINS]
    for path in doomed:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def pack_nixl(wheels: list[Path], out: Path, build: str) -> Path:
    """Unpack the NIXL wheels, strip them, pack them as ``out/<build>-site.tar.xz``."""
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp)
        for whl in wheels:
            with zipfile.ZipFile(whl) as z:
                z.extractall(site)
        strip(site, build)
        target = out / f"{build}-{NIXL_VERSION}-site.tar.xz"
        with tarfile.open(target, "w:xz") as tar:
            for path in sorted(site.iterdir()):
                tar.add(path, arcname=path.name)
    return target


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".gpu-wheels", help="the folder to fill (emptied first)")
    ap.add_argument("--python", default="3.12", help="the GPU machine's Python (X.Y)")
    ap.add_argument("--cuda", default="13", help="CUDA major version of its torch")
    args = ap.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    build = f"nixl_cu{args.cuda}"
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in ("msgspec", "pyzmq")]
    with tempfile.TemporaryDirectory() as tmp:
        nixl = [f"nixl-cu{args.cuda}=={NIXL_VERSION}", f"nixl=={NIXL_VERSION}"]
        packed = pack_nixl(download(Path(tmp), args.python, nixl), out, build)
        for whl in download(Path(tmp) / "other", args.python, pins):
            shutil.copy(whl, out / whl.name)
    size = folder_size(out)
    for p in sorted(out.iterdir()):
        print(f"{p.stat().st_size / (1 << 20):8.1f} MiB  {p.name}")
    print(f"{size / (1 << 20):8.1f} MiB  {out}/ (limit {LIMIT >> 20} MiB; NIXL in {packed.name})")
    if size > LIMIT:
        print(f"gpu-wheels: {out}/ holds {size} B, over the {LIMIT} B limit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
