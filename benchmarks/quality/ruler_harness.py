"""NVIDIA's packaged RULER (PyPI ``nvidia-long-context-eval``) driven against ``vllm serve``.

The package brings the 13-task generator (``long_context_eval/synthetic.yaml``), its
OpenAI-endpoint client and its scorer; all three run as its own scripts in a venv of their
own (it pins its own dependencies), ``.venv-ruler`` by default, made on first use:

* :func:`ruler_env` creates that venv (pinned versions) and the sentence-splitter data that
  the essay haystacks need (``ruler_punkt.py``: NLTK's Punkt trained on the package's essays,
  since the ``punkt_tab`` download is not reachable here);
* :func:`prepare_samples` runs the generator once per (tokenizer, length, task, sample set,
  haystack) and caches the JSONL; every configuration reads the same samples;
* :func:`serving` starts ``vllm serve`` (stock or kvcompress) for one configuration;
* :func:`predict` runs the package's client over one task against it, resuming a partial
  prediction file, with a stall guard (the client retries a failed request forever);
* :func:`score` runs the package's scorer and returns its per-sample scores.

The data (essays, SQuAD, HotpotQA) ships inside the package and is never copied into the
repository. Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a file: `benchmarks` imports from the repository root
    sys.path.append(str(REPO_ROOT))

from benchmarks.common.offline_assets import build_once  # noqa: E402

RULER_REQUIREMENTS = ("nvidia-long-context-eval==26.3", "transformers==5.24.0", "pandas==3.1.1")
RULER_TASKS = (
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
    "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2",
)  # fmt: skip
MAX_NEW_TOKENS = 128  # the most any task generates (niah's tokens_to_generate)
SERVED_NAME = "ruler-model"


@dataclass(frozen=True)
class RulerEnv:
    """The RULER venv: its interpreter, the package's folder and the Punkt data."""

    python: Path
    package: Path
    nltk_data: Path

    def environ(self) -> dict[str, str]:
        """The environment for the package's scripts: they call ``python`` by name."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.python.parent}{os.pathsep}{env.get('PATH', '')}"
        env["NLTK_DATA"] = str(self.nltk_data)
        env["TOKENIZERS_PARALLELISM"] = "false"
        return env

    def script(self, relative: str) -> str:
        return str(self.package / relative)


def ruler_env(venv: Path, log: Callable[[str], None] = print) -> RulerEnv:
    """The RULER venv at ``venv`` (created with the pinned packages if missing) and its
    Punkt data (built once into the kvcompress cache)."""
    python = venv / "bin" / "python"
    if not _has_package(python):
        log(f"ruler: creating {venv} ({', '.join(RULER_REQUIREMENTS)}; ~1 min)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        _run_checked([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                      *RULER_REQUIREMENTS], "pip install into the RULER venv")
    package = Path(_run_checked([str(python), "-c", "import long_context_eval, os; "
                                 "print(os.path.dirname(long_context_eval.__file__))"], "import long_context_eval").strip())
    punkt_script = Path(__file__).with_name("ruler_punkt.py")
    nltk_data = build_once("ruler-punkt-v1", lambda out: _run_checked(
        [str(python), str(punkt_script), str(out)], "training Punkt on the RULER essays"))
    return RulerEnv(python=python, package=package, nltk_data=nltk_data)


def _has_package(python: Path) -> bool:
    if not python.exists():
        return False
    check = subprocess.run([str(python), "-c", "import long_context_eval, transformers, pandas"],
                           capture_output=True)
    return check.returncode == 0


def _run_checked(command: list[str], what: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


# --------------------------------------------------------------------------------------
# Samples


# The essay haystack of RULER's niah tasks (niah_single_2/3, niah_multikey_1, niah_multivalue,
# niah_multiquery): the package's Paul Graham essays, or a text no tuning here has read.
HAYSTACKS = ("essays", "sotu")
ESSAY_TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery")


@dataclass(frozen=True)
class SampleSet:
    """Which RULER samples: the generator's for ``model_dir``'s tokenizer at ``length``
    tokens (prompt and answer), ``samples`` per task. ``sample_set`` k > 0 draws another
    set: the generator's seed 42 + k and, for QA, other questions (the package's chunking:
    chunk k of k + 1); set 0 is the package's default. ``haystack`` "sotu" puts State of
    the Union addresses (1946 on) where the package puts its essays (``ESSAY_TASKS``)."""

    model_dir: Path
    length: int
    samples: int
    sample_set: int = 0
    haystack: str = "essays"

    def __post_init__(self) -> None:
        if self.haystack not in HAYSTACKS:
            raise ValueError(f"haystack {self.haystack!r}: one of {', '.join(HAYSTACKS)}")

    @property
    def key(self) -> str:
        tail = "" if self.haystack == "essays" else f"-{self.haystack}"
        return f"{self.model_dir.name}-L{self.length}-n{self.samples}-set{self.sample_set}{tail}"


ESSAYS_JSON = "data/synthetic/json/PaulGrahamEssays.json"  # {"text": ...}, read by niah.py


def package_with_haystack(env: RulerEnv, haystack: str) -> Path:
    """The package folder whose generator reads ``haystack``: the package itself for the
    essays, else a mirror of it (a symbolic link per file, made once per venv) whose
    ``ESSAYS_JSON`` holds the other text. The generator scripts find their data beside
    their own path, which in the mirror is the mirror's."""
    if haystack == "essays":
        return env.package
    from benchmarks.common.offline_assets import build_once, sotu_text

    def build(out: Path) -> None:
        for source in env.package.rglob("*"):
            if source.is_dir() or "__pycache__" in source.parts:
                continue
            target = out / source.relative_to(env.package)
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.relative_to(out).as_posix() == ESSAYS_JSON:
                target.write_text(json.dumps({"text": sotu_text()}))
            else:
                target.symlink_to(source)
        if not (out / ESSAYS_JSON).is_file():
            raise RuntimeError(f"no {ESSAYS_JSON} in {env.package}")

    venv_tag = hashlib.sha256(str(env.package).encode()).hexdigest()[:10]
    return build_once(f"ruler-package-{haystack}-{venv_tag}-v1", build)


def prepare_samples(env: RulerEnv, spec: SampleSet, tasks: list[str], log: Callable[[str], None] = print) -> Path:
    """The folder of ``<task>/validation.jsonl`` for ``tasks`` (generated on first use)."""
    from benchmarks.common.offline_assets import cache_dir

    data_dir = cache_dir() / "ruler-data" / spec.key
    for task in tasks:
        if (data_dir / task / "validation.jsonl").exists():
            continue
        log(f"ruler: generating {spec.samples} {task} samples ({spec.key})")
        chunks = spec.sample_set + 1
        _run_checked([
            str(env.python), str(package_with_haystack(env, spec.haystack) / "data/prepare.py"), "--save_dir", str(data_dir),
            "--benchmark", "synthetic", "--task", task, "--tokenizer_path", str(spec.model_dir),
            "--tokenizer_type", "hf", "--max_seq_length", str(spec.length), "--model_template_type", "base",
            "--num_samples", str(spec.samples * chunks), "--chunk_amount", str(chunks),
            "--chunk_idx", str(spec.sample_set),
        ], f"RULER data preparation for {task}", env.environ())  # fmt: skip
        if not (data_dir / task / "validation.jsonl").exists():  # prepare.py swallows its child's failure
            raise RuntimeError(f"RULER data preparation wrote no {data_dir / task / 'validation.jsonl'}")
    return data_dir


def tokens_to_generate(env: RulerEnv, tasks: list[str]) -> dict[str, int]:
    """Each task's answer length in tokens, as the package's client asks for it."""
    code = (
        "import json, sys, yaml; from long_context_eval.data.synthetic.constants import TASKS; "
        "custom = yaml.safe_load(open(sys.argv[1])); "
        "print(json.dumps({t: TASKS[c['task']]['tokens_to_generate'] for t, c in custom.items()}))"
    )
    every = json.loads(_run_checked([str(env.python), "-c", code, env.script("synthetic.yaml")],
                                    "reading the RULER task table", env.environ()))
    return {task: every[task] for task in tasks}


def write_predictions(pred_dir: Path, task: str, samples: list[dict], texts: list[str]) -> None:
    """``texts`` (one answer per sample, in order) as the package's client writes them,
    for :func:`score`."""
    pred_dir.mkdir(parents=True, exist_ok=True)
    with open(pred_dir / f"{task}.jsonl", "w", encoding="utf-8") as handle:
        for sample, text in zip(samples, texts, strict=True):
            line = {"index": sample["index"], "pred": text, "input": sample["input"], "outputs": sample["outputs"],
                    "others": sample.get("others", {}), "truncation": -1, "length": sample.get("length", -1)}
            handle.write(json.dumps(line) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


# --------------------------------------------------------------------------------------
# Serving and predictions


@dataclass(frozen=True)
class ServeConfig:
    """One server: stock vLLM (``policy`` None) or kvcompress at ``policy`` / ``rate``."""

    policy: str | None = None
    rate: float | None = None

    @property
    def label(self) -> str:
        return "stock" if self.policy is None else f"{self.policy} r{self.rate:g}"

    def flags(self) -> list[str]:
        if self.policy is None:
            return []
        return ["--kv-compress-rate", f"{self.rate:g}", "--kv-compress-policy", self.policy]


@contextlib.contextmanager
def serving(config: ServeConfig, model_dir: Path, common_flags: list[str], log_path: Path,
            startup_timeout: float = 600.0) -> Iterator[str]:
    """``vllm serve`` for ``config`` on a free port; yields its completions URL."""
    from benchmarks.serving.soak import Server, free_port

    port = free_port()
    vllm = str(Path(sys.executable).parent / "vllm")
    command = [vllm, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", SERVED_NAME, *common_flags, *config.flags()]
    server = Server(command, log_path, dict(os.environ))
    try:
        server.wait_healthy(f"http://127.0.0.1:{port}", startup_timeout)
        yield f"http://127.0.0.1:{port}/v1/completions"
    finally:
        server.stop(timeout=60)


def predict(env: RulerEnv, data_dir: Path, pred_dir: Path, task: str, url: str, concurrency: int,
            progress: Callable[[int], None], stall_s: float = 900.0) -> None:
    """The package's client over ``task``'s samples (greedy, completion mode); appends to
    ``pred_dir/<task>.jsonl`` and skips samples already there. ``progress(n)`` gets the
    count of new predictions as they land; no new one for ``stall_s`` s stops the run."""
    pred_file = pred_dir / f"{task}.jsonl"
    command = [
        str(env.python), env.script("pred/call_api.py"), "--data_dir", str(data_dir), "--save_dir", str(pred_dir),
        "--benchmark", "synthetic", "--task", task, "--server_type", "generic_oai_server",
        "--model_name_or_path", SERVED_NAME, "--temperature", "0", "--top_p", "1",
        "--generic_oai_server_url", url, "--generic_oai_server_mode", "completion",
        "--timeout", "600", "--threads", str(concurrency),
    ]  # fmt: skip
    pred_dir.mkdir(parents=True, exist_ok=True)
    with open(pred_dir / f"{task}.client.log", "ab") as client_log:
        client = subprocess.Popen(command, stdout=client_log, stderr=subprocess.STDOUT, env=env.environ())
        try:
            _follow(client, pred_file, progress, stall_s, task)
        finally:  # stopped, stalled or interrupted: no client is left behind
            if client.poll() is None:
                client.kill()
                client.wait()
    if client.returncode != 0:
        raise RuntimeError(f"RULER client failed on {task} (exit {client.returncode}); see {client_log.name}")


def _follow(client: subprocess.Popen, pred_file: Path, progress: Callable[[int], None], stall_s: float,
            task: str) -> None:
    """Report new lines of ``pred_file`` while ``client`` runs; raise if none come for ``stall_s``."""
    seen, last_change = count_lines(pred_file), time.monotonic()
    while client.poll() is None:
        time.sleep(1.0)
        now_seen = count_lines(pred_file)
        if now_seen != seen:
            progress(now_seen - seen)
            seen, last_change = now_seen, time.monotonic()
        elif time.monotonic() - last_change > stall_s:
            raise RuntimeError(f"RULER client made no progress on {task} for {stall_s:.0f} s "
                               f"(see {pred_file.with_suffix('.client.log')})")
    progress(count_lines(pred_file) - seen)


def count_lines(path: Path) -> int:
    """Non-empty lines of a JSONL file (0 when it does not exist yet)."""
    if not path.exists():
        return 0
    with open(path, "rb") as handle:
        return sum(1 for line in handle if line.strip())


def score(env: RulerEnv, pred_dir: Path, tasks: list[str]) -> dict[str, dict[int, float]]:
    """The package's scorer over ``pred_dir``: per task, sample index -> score in [0, 100]."""
    _run_checked([str(env.python), env.script("eval/evaluate.py"), "--data_dir", str(pred_dir),
                  "--benchmark", "synthetic"], "RULER evaluation", env.environ())
    per_sample = json.loads((pred_dir / "per_sample_scores.json").read_text())
    scores = {}
    for task in tasks:
        indices = [line["index"] for line in read_jsonl(pred_dir / f"{task}.jsonl")]
        if len(indices) != len(per_sample[task]):  # the scorer keeps the file's order
            raise RuntimeError(f"{task}: {len(per_sample[task])} scores for {len(indices)} predictions")
        scores[task] = dict(zip(indices, map(float, per_sample[task])))
    return scores


def reset_dir(path: Path, stamp: dict) -> None:
    """Keep ``path`` (a partial run to resume) only if it was made for ``stamp``."""
    meta = path / "run.json"
    if meta.exists() and json.loads(meta.read_text()) != stamp:
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps(stamp, sort_keys=True))
