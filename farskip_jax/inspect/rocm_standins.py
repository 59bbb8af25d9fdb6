"""Make the ROCm PJRT plugin load on a CPU-only host, for deviceless MI300X compiles only.

Why this exists (details and exact errors: shared/ROCM_DEVICELESS.md): ``jax-rocm7-pjrt``'s
``xla_rocm_plugin.so`` links against 8 ROCm libraries that no CPU host has, and the plugin's Python
``initialize()`` refuses to start without an AMD GPU. A deviceless compile calls no ROCm function
(only HIP's fat-binary registration hooks run at load time), so two workarounds suffice:

1. Stand-in shared libraries: one per soname, exporting every function the plugin imports from it,
   each under its exact symbol version node (ld.so aborts on a missing node), as plain C functions
   returning 100 (hipErrorNoDevice). Built with the system ``cc`` and a version script, cached under
   ``$XDG_CACHE_HOME/farskip_jax/rocm_standins/`` with a manifest keyed by the plugin .so's size and
   mtime, and preloaded with ``ctypes.CDLL(..., RTLD_GLOBAL)``: glibc then satisfies the plugin's
   DT_NEEDED entries from the already-loaded sonames, no LD_LIBRARY_PATH needed.
2. Patch the private ``jax._src.hardware_utils.num_available_amd_gpus`` to return 1 (not 2: a count
   above 1 triggers a shared-memory size check) before plugin discovery.

The import list ships as ``farskip_jax/targets/rocm7_plugin_imports_0.10.2.txt`` (format: ``##
<soname>: N functions`` headers, then ``name`` or ``name@version`` lines). If the installed plugin
is another version, the list is regenerated from the .so itself with ``readelf --dyn-syms`` and
``readelf -V`` (undefined symbols; versioned ones go to the library that defines their version,
unversioned ones by name prefix), so stand-ins always match the installed plugin.

Fragile: the patched function is private; an unknown soname in a future plugin needs a new prefix
rule (we refuse rather than guess). Use: ``enable()`` before JAX touches any backend (it restricts
JAX to ``cpu`` itself, see farskip_jax/platforms.py); ``python -m farskip_jax.inspect.rocm_standins
build`` prebuilds the cache.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from farskip_jax.targets import load_target_file

IMPORTS_FILE = "rocm7_plugin_imports_0.10.2.txt"
IMPORTS_VERSION = "0.10.2"
# Unversioned imports are assigned to a library by name prefix, longest (most specific) first.
_PREFIX_RULES = (
    ("hipblaslt_ext", "libhipblaslt.so.1"), ("hipblasLt", "libhipblaslt.so.1"),
    ("hipfft", "libhipfft.so.0"), ("rocblas", "librocblas.so.5"), ("nccl", "librccl.so.1"),
    ("rsmi", "librocm_smi64.so.1"), ("rocprofiler", "librocprofiler-sdk.so.1"),
    ("miopen", "libMIOpen.so.1"), ("__hip", "libamdhip64.so.7"), ("hip", "libamdhip64.so.7"),
)
_ROCM_SONAME = re.compile(r"^lib(amdhip64|MIOpen|hipblaslt|rocblas|rccl|hipfft|rocprofiler-sdk|"
                          r"rocm_smi64)\.so")
_ENABLED = False

Imports = dict[str, list[tuple[str, str | None]]]  # soname -> [(symbol, version or None)]


class RocmStandinError(RuntimeError):
    """The ROCm deviceless setup cannot be completed; the message says what is missing."""


def plugin_so_path() -> Path:
    spec = importlib.util.find_spec("jax_plugins.xla_rocm7")
    if spec is None or not spec.submodule_search_locations:
        raise RocmStandinError("jax-rocm7-pjrt is not installed (pip install jax-rocm7-plugin==<jaxlib "
                               "version> jax-rocm7-pjrt==<jaxlib version>)")
    so = Path(list(spec.submodule_search_locations)[0]) / "xla_rocm_plugin.so"
    if not so.exists():
        raise RocmStandinError(f"ROCm plugin library missing: {so}")
    return so


def parse_imports_text(text: str) -> Imports:
    """Parse the shipped imports list into soname -> [(symbol, version)]."""
    out: Imports = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        m = re.match(r"## (lib[\w.\-]+\.so[\w.]*): \d+ functions$", line)
        if m:
            current = m.group(1)
            out[current] = []
        elif line and not line.startswith("#"):
            if current is None:
                raise RocmStandinError(f"symbol before any '## soname' header: {line!r}")
            sym, _, ver = line.partition("@")
            out[current].append((sym, ver or None))
    return out


def imports_from_so(so: Path) -> Imports:
    """Regenerate the import list from the plugin binary with readelf (binutils)."""
    if shutil.which("readelf") is None:
        raise RocmStandinError("readelf not found (apt-get install binutils)")
    ver_text = subprocess.run(["readelf", "-V", "-W", str(so)], check=True, capture_output=True,
                              text=True).stdout
    version_file: dict[str, str] = {}
    current_file = None
    for line in ver_text.splitlines():
        m = re.search(r"File: (\S+)", line)
        if m:
            current_file = m.group(1)
            continue
        m = re.search(r"Name: (\S+)\s+Flags", line)
        if m and current_file:
            version_file[m.group(1)] = current_file
    syms = subprocess.run(["readelf", "--dyn-syms", "-W", str(so)], check=True, capture_output=True,
                          text=True).stdout
    out: Imports = {}
    for line in syms.splitlines():
        parts = line.split()
        if len(parts) < 8 or parts[6] != "UND" or parts[3] != "FUNC":
            continue
        sym, _, ver = parts[7].partition("@")
        if ver:
            soname = version_file.get(ver, "")
            if not _ROCM_SONAME.match(soname):
                continue  # glibc / libstdc++ etc.
        else:
            # C++ imports are mangled (_ZN13hipblaslt_ext...): match the namespace inside the name
            bare = re.sub(r"^_ZNK?\d+", "", sym)
            soname = next((s for p, s in _PREFIX_RULES if bare.startswith(p)), "")
            if not soname:
                if sym.startswith(("_ITM", "__gmon", "__cxa", "_Jv")) or "GLIBC" in sym:
                    continue
                raise RocmStandinError(f"unversioned import {sym!r} matches no ROCm prefix rule; "
                                       "extend _PREFIX_RULES for this plugin version")
        out.setdefault(soname, []).append((sym, ver or None))
    return {k: sorted(set(v)) for k, v in sorted(out.items())}


def expected_imports(so: Path) -> tuple[Imports, str]:
    """The shipped list when the installed plugin is the version it was made for, else readelf's."""
    try:
        installed = importlib.metadata.version("jax-rocm7-pjrt")
    except importlib.metadata.PackageNotFoundError:
        installed = ""
    if installed == IMPORTS_VERSION:
        return parse_imports_text(load_target_file(IMPORTS_FILE)), IMPORTS_FILE
    return imports_from_so(so), f"readelf:{so}"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "farskip_jax" / "rocm_standins"


def _manifest_key(so: Path) -> dict[str, object]:
    st = so.stat()
    return {"plugin": str(so), "size": st.st_size, "mtime": int(st.st_mtime)}


def build(force: bool = False, verbose: bool = False) -> Path:
    """Build (or reuse) the stand-ins for the installed plugin; returns their directory."""
    so = plugin_so_path()
    key = _manifest_key(so)
    out_dir = cache_root() / f"{key['size']}_{key['mtime']}"
    manifest = out_dir / "manifest.json"
    if not force and manifest.exists():
        m = json.loads(manifest.read_text())
        if all(m.get(k) == v for k, v in key.items()) and all((out_dir / s).exists() for s in m["sonames"]):
            return out_dir
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise RocmStandinError("no C compiler: `cc` not found (apt-get install gcc) to build ROCm stand-ins")
    imports, source = expected_imports(so)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rocm_standins_") as tmp:
        for soname, syms in imports.items():
            c_file, script = Path(tmp) / f"{soname}.c", Path(tmp) / f"{soname}.map"
            # every stand-in returns 100 = hipErrorNoDevice, an honest answer on a GPU-less host
            c_file.write_text("".join(f"long {s}(void) {{ return 100; }}\n" for s, _ in syms))
            nodes: dict[str, list[str]] = {}
            for s, v in syms:
                if v:
                    nodes.setdefault(v, []).append(s)
            cmd = [cc, "-shared", "-fPIC", "-O0", f"-Wl,-soname,{soname}", "-o",
                   str(out_dir / soname), str(c_file)]
            if nodes:
                script.write_text("".join(f"{v} {{ global: {' '.join(f'{s};' for s in ss)} }};\n"
                                          for v, ss in sorted(nodes.items())))
                cmd.insert(4, f"-Wl,--version-script={script}")
            if verbose:
                print(" ".join(cmd), file=sys.stderr)
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                raise RocmStandinError(f"building {soname} failed:\n{res.stderr[-2000:]}")
    manifest.write_text(json.dumps({**key, "imports": source, "sonames": sorted(imports),
                                    "functions": sum(len(v) for v in imports.values())}, indent=1))
    return out_dir


def _patch_gpu_count() -> None:
    from jax._src import hardware_utils

    def one_gpu(stop_at: int | None = None) -> int:
        # 1, not more: a count >= 2 makes the plugin check /dev/shm size as for multi-GPU hosts
        return 1

    hardware_utils.num_available_amd_gpus = one_gpu


def enable() -> Path:
    """Patch the GPU-count check and preload the stand-ins. Call before any JAX backend use."""
    global _ENABLED
    if _ENABLED:
        return build()
    from jax._src import xla_bridge

    from farskip_jax import platforms

    platforms.use_cpu_for_deviceless_compile()
    if platforms.current() != "cpu":
        raise RocmStandinError(f"JAX backends already started with platforms {platforms.current()!r}; "
                               "a deviceless ROCm compile needs 'cpu' (use a fresh process)")
    if getattr(xla_bridge, "_plugins_registered", False):
        raise RocmStandinError("JAX already discovered its plugins in this process, so the ROCm plugin "
                               "was skipped; call rocm_standins.enable() first (use a fresh process)")
    out_dir = build()
    # With the CUDA plugin in the same venv, importing the ROCm plugin's extension re-registers a
    # Triton type that the CUDA one registered; nanobind warns, and nothing else happens
    # (ROCM_DEVICELESS.md). Keep the inspector's output to what matters.
    warnings.filterwarnings("ignore", category=RuntimeWarning,
                            message="nanobind: type 'TritonCompilationResult' was already registered")
    names = json.loads((out_dir / "manifest.json").read_text())["sonames"]
    for soname in sorted(names, key=lambda s: not s.startswith("libamdhip64")):
        ctypes.CDLL(str(out_dir / soname), mode=ctypes.RTLD_GLOBAL)
    _patch_gpu_count()
    _ENABLED = True
    return out_dir


def write_imports(path: Path, imports: Imports, so: Path) -> None:
    lines = [f"# ROCm functions imported by {so.name} (regenerated with readelf --dyn-syms / -V)",
             f"# total: {sum(len(v) for v in imports.values())} functions in {len(imports)} libraries", ""]
    for soname, syms in imports.items():
        lines.append(f"## {soname}: {len(syms)} functions")
        lines += [f"{s}@{v}" if v else s for s, v in syms]
        lines.append("")
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m farskip_jax.inspect.rocm_standins", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or reuse) the stand-in libraries")
    b.add_argument("--force", action="store_true")
    i = sub.add_parser("imports", help="regenerate the import list from the installed plugin")
    i.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        if args.cmd == "build":
            d = build(force=args.force, verbose=True)
            print(d)
            print((d / "manifest.json").read_text())
        else:
            so = plugin_so_path()
            imports = imports_from_so(so)
            if args.out:
                write_imports(args.out, imports, so)
            print(json.dumps({k: len(v) for k, v in imports.items()}, indent=1))
    except RocmStandinError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
