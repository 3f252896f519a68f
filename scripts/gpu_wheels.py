"""Download the wheels the GPU machine lacks for sweeps and the notebook suite, into .whl/.

The GPU machine (Python 3.12, x86_64, no package index) has torch, numpy, matplotlib,
pyyaml, tqdm, cython, pytest, hypothesis, transformers and their dependencies, but not
papermill, nbclient, nbformat, ipykernel, ipywidgets, jupyter-client or Dask. This resolves those for
Python 3.12 on manylinux x86_64 with pip, keeps only what the machine does not already
have, and prints the install line to run there. pip evaluates dependency markers
(``python_version == "3.12"``) for the interpreter it runs in, so this runs pip with a
Python 3.12 (``python3.12`` on the PATH, or ``--python``):

    python scripts/gpu_wheels.py [--dest .whl] [--python /path/to/python3.12]
    # on the GPU machine, in the repository root:
    pip install --no-index --find-links .whl papermill nbformat ipykernel ipywidgets distributed filelock setuptools
    pip install --no-deps --no-build-isolation -e .
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

WANTED = ["papermill>=2.6", "nbclient", "nbformat>=5", "ipykernel>=6", "jupyter-client", "ipywidgets>=8.0.5",
          "distributed>=2024.1", "dask>=2024.1", "filelock>=3.12", "setuptools>=68",
          "transformers==5.17.0"]  # the models extra (make model-pools)
# Already on the GPU machine's image (torch's, matplotlib's, pytest's and hypothesis' trees).
PRESENT = {"torch", "triton", "numpy", "pyyaml", "tqdm", "cython", "matplotlib", "contourpy", "cycler", "fonttools",
           "kiwisolver", "pillow", "pyparsing", "packaging", "python-dateutil", "six", "sortedcontainers",
           "hypothesis", "attrs", "pytest", "pytest-timeout", "iniconfig", "pluggy", "sympy", "mpmath", "networkx",
           "jinja2", "markupsafe", "fsspec", "typing-extensions",
           # transformers and what it and Dask need, also on the image
           "transformers", "tokenizers", "safetensors", "huggingface-hub", "hf-xet", "regex", "requests", "urllib3",
           "certifi", "idna", "charset-normalizer", "filelock", "click", "cloudpickle", "msgpack", "psutil", "toolz",
           "pygments", "rich", "markdown-it-py", "mdurl", "typer", "shellingham", "annotated-doc", "setuptools",
           "anyio", "h11", "httpcore", "httpx", "aiohttp", "aiosignal", "aiohappyeyeballs", "frozenlist", "multidict",
           "propcache", "yarl"}
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64"]
LIMIT_MB = 40


def find_python312() -> str | None:
    """python3.12 on the PATH if it runs, else a pyenv-installed 3.12."""
    candidates = [shutil.which("python3.12"), *sorted(map(str, (Path.home() / ".pyenv" / "versions").glob("3.12*/bin/python3.12")))]
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", "pass"], capture_output=True).returncode == 0:
            return candidate
    return None


def project_name(wheel: Path) -> str:
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=Path(".whl"))
    parser.add_argument("--python", default=None,
                        help="a Python 3.12 interpreter with pip (default: python3.12 on the PATH, or pyenv's)")
    args = parser.parse_args(argv)
    args.python = args.python or find_python312()
    if not args.python:
        raise SystemExit("no python3.12 on the PATH; pass --python /path/to/python3.12 (pip must resolve "
                         "dependency markers for the GPU machine's Python 3.12)")
    probe = subprocess.run([args.python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise SystemExit(f"{args.python} does not run ({probe.stderr.strip()}); pass --python /path/to/python3.12")
    version = probe.stdout.strip()
    if version != "3.12":
        raise SystemExit(f"{args.python} is Python {version}; the GPU machine runs 3.12")
    shutil.rmtree(args.dest, ignore_errors=True)
    cmd = [args.python, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", "3.12",
           *[f"--platform={p}" for p in PLATFORMS], "-d", str(args.dest), *WANTED]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    kept = []
    for wheel in sorted(args.dest.glob("*.whl")):
        if project_name(wheel) in PRESENT:
            wheel.unlink()
        else:
            kept.append(wheel)
    if any(project_name(w).startswith("nvidia-") for w in kept):
        raise SystemExit("a CUDA library was pulled in; something depends on torch: check WANTED")
    total = sum(w.stat().st_size for w in kept) / 2**20
    for wheel in kept:
        print(f"{wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
    print(f"{len(kept)} wheels, {total:.1f} MiB in {args.dest}/")
    if total > LIMIT_MB:
        raise SystemExit(f"{total:.1f} MiB is over the {LIMIT_MB} MiB the GPU machine's carry allows")
    names = " ".join(re.sub(r"[<>=].*", "", w) for w in WANTED if not w.startswith(("nbclient", "jupyter-client", "dask>")))
    print(f"\non the GPU machine:\n  pip install --no-index --find-links {args.dest} {names}\n"
          f"  pip install --no-deps --no-build-isolation -e .")
    return 0


if __name__ == "__main__":
    sys.exit(main())
