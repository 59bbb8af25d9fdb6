"""Make the ROCm PJRT plugin load on a CPU-only host, for deviceless MI300X compiles only.

Why this exists (details and exact errors: shared/ROCM_DEVICELESS.md): ``jax-rocm7-pjrt``'s
``xla_rocm_plugin.so`` links against ROCm libraries that no CPU host has, and the plugin's Python
``initialize()`` refuses to start without an AMD GPU. A deviceless compile calls no ROCm function
(only HIP's fat-binary registration hooks run at load time), so two workarounds suffice:

1. Stand-in shared libraries, planned from the installed binaries themselves (``plan``): one per
   ROCm soname in the plugin's DT_NEEDED list that this host's loader cannot find, defining every
   symbol version node the plugin requires from that file (ld.so aborts on a missing node, even one
   no function uses) and exporting every function imported from it, as plain C functions returning
   100 (hipErrorNoDevice). The HIP functions ``jax_rocm7_plugin/rocm_plugin_extension.so`` imports
   are added to the HIP stand-in. Built with the system ``cc`` and a version script, cached under
   ``$XDG_CACHE_HOME/farskip_jax/rocm_standins/`` in a directory keyed by the plugin .so's size and
   mtime (a new plugin gets new stand-ins), and preloaded with ``ctypes.CDLL(..., RTLD_GLOBAL)``:
   glibc then satisfies the plugin's DT_NEEDED entries from the already-loaded sonames, no
   LD_LIBRARY_PATH needed.
2. Patch the private ``jax._src.hardware_utils.num_available_amd_gpus`` to return 1 (not 2: a count
   above 1 triggers a shared-memory size check) before plugin discovery.

Which library an imported function comes from: a versioned import names its version node, and the
plugin's version-needs table names the file that defines the node. An unversioned import is first
looked up in the system libraries the plugin also needs (the 0.12 plugin imports a few libstdc++
symbols without a version); what none of them defines goes to a ROCm library by name prefix
(``_PREFIX_RULES``). A symbol no rule covers is refused, naming it, rather than guessed.

Fragile: the patched function is private. Use: ``enable()`` before JAX touches any backend (it
restricts JAX to ``cpu`` itself, see farskip_jax/platforms.py); ``python -m
farskip_jax.xla.rocm_standins build`` prebuilds the cache and prints the manifest.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

# Unversioned ROCm imports are assigned to a library by name prefix (the C++ ones by the namespace
# inside the mangled name), longest first; the library is named by its soname stem, so a soname
# version bump (libamd_smi.so.26 -> .so.27) needs no change here.
_PREFIX_RULES = (
    ("hipblaslt_ext", "libhipblaslt"), ("hipblasLt", "libhipblaslt"), ("hipfft", "libhipfft"),
    ("rocblas", "librocblas"), ("nccl", "librccl"), ("rsmi", "librocm_smi64"), ("amdsmi", "libamd_smi"),
    ("rocprofiler", "librocprofiler-sdk"), ("miopen", "libMIOpen"), ("hsa_", "libhsa-runtime64"),
    ("__hip", "libamdhip64"), ("hip", "libamdhip64"),
)
# Linked by the plugin but part of every Linux host (the toolchain's C and C++ runtimes).
_SYSTEM_SONAME = re.compile(r"^(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|ld-linux[\w-]*)\.so")
_ENABLED = False


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


def extension_so_path() -> Path | None:
    """``jax_rocm7_plugin/rocm_plugin_extension.so`` (imported by the plugin's initialiser), if any."""
    spec = importlib.util.find_spec("jax_rocm7_plugin")
    if spec is None or not spec.submodule_search_locations:
        return None
    so = Path(list(spec.submodule_search_locations)[0]) / "rocm_plugin_extension.so"
    return so if so.exists() else None


@dataclass
class StandinPlan:
    """What to build: per missing soname, its version nodes and its functions (name, node or None)."""

    nodes: dict[str, set[str]] = field(default_factory=dict)
    functions: dict[str, set[tuple[str, str | None]]] = field(default_factory=dict)

    def sonames(self) -> list[str]:
        return sorted(self.nodes)


def _readelf(*args: str) -> str:
    if shutil.which("readelf") is None:
        raise RocmStandinError("readelf not found (apt-get install binutils)")
    return subprocess.run(["readelf", *args], check=True, capture_output=True, text=True).stdout


def needed_sonames(so: Path) -> list[str]:
    """The DT_NEEDED entries of `so`, in order."""
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _readelf("-d", "-W", str(so)))


def version_needs(so: Path) -> dict[str, set[str]]:
    """soname -> the version nodes `so` requires from it (the .gnu.version_r table)."""
    out: dict[str, set[str]] = {}
    current = None
    for line in _readelf("-V", "-W", str(so)).splitlines():
        m = re.search(r"Version: \d+\s+File: (\S+)", line)
        if m:
            current = m.group(1)
            out.setdefault(current, set())
            continue
        m = re.search(r"Name: (\S+)\s+Flags", line)
        if m and current:
            out[current].add(m.group(1))
    return out


def undefined_functions(so: Path) -> list[tuple[str, str | None]]:
    """(name, version node or None) of every undefined function `so` imports."""
    out = []
    for line in _readelf("--dyn-syms", "-W", str(so)).splitlines():
        parts = line.split()
        if len(parts) >= 8 and parts[6] == "UND" and parts[3] == "FUNC":
            name, _, ver = parts[7].partition("@")
            out.append((name, ver.lstrip("@") or None))
    return out


def _system_library_paths() -> dict[str, Path]:
    """soname -> path of the libraries this host's loader knows (``ldconfig -p``)."""
    ldconfig = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None)
    if ldconfig is None:
        return {}
    text = subprocess.run([ldconfig, "-p"], capture_output=True, text=True).stdout
    found: dict[str, Path] = {}
    for m in re.finditer(r"^\s*(\S+) \(([^)]*)\) => (\S+)", text, re.M):
        if "x86-64" in m.group(2) or "x86_64" in m.group(2) or not found.get(m.group(1)):
            found.setdefault(m.group(1), Path(m.group(3)))
    return found


def _defined_functions(lib: Path) -> set[str]:
    names = set()
    for line in _readelf("--dyn-syms", "-W", str(lib)).splitlines():
        parts = line.split()
        if len(parts) >= 8 and parts[6] != "UND" and parts[3] in ("FUNC", "IFUNC"):
            names.add(parts[7].split("@")[0])
    return names


def _library_for(name: str, missing: list[str]) -> str | None:
    bare = re.sub(r"^_ZNK?\d+", "", name)  # C++: the namespace or class is the first name component
    for prefix, stem in _PREFIX_RULES:
        if bare.startswith(prefix):
            return next((s for s in missing if s.split(".so")[0] == stem), None)
    return None


def plan(so: Path, extension: Path | None = None) -> StandinPlan:
    """The stand-ins the installed plugin needs on this host, read from its own ELF tables."""
    system = _system_library_paths()
    needed = needed_sonames(so)
    missing = [s for s in needed if not _SYSTEM_SONAME.match(s) and s not in system]
    present = [system[s] for s in needed if s not in missing and s in system]
    needs = version_needs(so)
    node_file = {node: f for f, nodes in needs.items() for node in nodes}
    result = StandinPlan({s: set(needs.get(s, ())) for s in missing}, {s: set() for s in missing})
    system_defined: set[str] | None = None
    imports = undefined_functions(so)
    if extension is not None:  # its HIP imports only: the other ROCm modules stay unloadable on purpose
        imports += [(n, v) for n, v in undefined_functions(extension)
                    if _library_for(n, missing) == next((s for s in missing if s.startswith("libamdhip64")),
                                                        None)]
    for name, ver in imports:
        if ver is not None:
            owner = node_file.get(ver)
            if owner in result.functions:
                result.functions[owner].add((name, ver))
            continue  # glibc / libstdc++ / a ROCm library the host really has
        owner = _library_for(name, missing)
        if owner is None:
            if system_defined is None:
                system_defined = set().union(*(_defined_functions(p) for p in present))
            if name in system_defined or name.startswith(("_ITM", "__gmon", "__cxa", "_Jv")):
                continue
            raise RocmStandinError(f"{so.name} imports {name!r} without a version, no system library it "
                                   f"links defines it and no ROCm prefix rule matches it; extend "
                                   f"_PREFIX_RULES (missing libraries: {missing})")
        result.functions[owner].add((name, None))
    return result


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
    todo = plan(so, extension_so_path())
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rocm_standins_") as tmp:
        for soname in todo.sonames():
            syms = sorted(todo.functions[soname], key=lambda sv: (sv[0], sv[1] or ""))
            c_file, script = Path(tmp) / f"{soname}.c", Path(tmp) / f"{soname}.map"
            # every stand-in returns 100 = hipErrorNoDevice, an honest answer on a GPU-less host
            names = sorted({s for s, _ in syms})
            body = "".join(f"long {s}(void) {{ return 100; }}\n" for s in names)
            c_file.write_text(body or "static int unused;\n")  # a version-node-only library
            by_node: dict[str, list[str]] = {node: [] for node in todo.nodes[soname]}
            for s, v in syms:
                if v:
                    by_node[v].append(s)
            cmd = [cc, "-shared", "-fPIC", "-O0", f"-Wl,-soname,{soname}", "-o", str(out_dir / soname),
                   str(c_file)]
            if by_node:
                lines = [f"{v} {{ {'global: ' + ' '.join(f'{s};' for s in ss) if ss else ''} }};\n"
                         for v, ss in sorted(by_node.items())]
                script.write_text("".join(lines))
                cmd.insert(4, f"-Wl,--version-script={script}")
            if verbose:
                print(" ".join(cmd), file=sys.stderr)
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                raise RocmStandinError(f"building {soname} failed:\n{res.stderr[-2000:]}")
    manifest.write_text(json.dumps({**key, "sonames": todo.sonames(),
                                    "version_nodes": {s: sorted(todo.nodes[s]) for s in todo.sonames()},
                                    "functions": {s: len(todo.functions[s]) for s in todo.sonames()}},
                                   indent=1))
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m farskip_jax.xla.rocm_standins", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or reuse) the stand-in libraries and print their manifest")
    b.add_argument("--force", action="store_true", help="rebuild even if the cache matches the plugin")
    sub.add_parser("plan", help="print what the installed plugin needs (libraries, version nodes, functions)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "build":
            d = build(force=args.force, verbose=True)
            print(d)
            print((d / "manifest.json").read_text())
        else:
            todo = plan(plugin_so_path(), extension_so_path())
            print(json.dumps({s: {"version_nodes": sorted(todo.nodes[s]), "functions": len(todo.functions[s])}
                              for s in todo.sonames()}, indent=1))
    except RocmStandinError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
