"""Eviction policies: a registry of (metric source, budget split, paper defaults)
(no vLLM, no torch).

Every policy runs on the same machinery: prompt metrics scored inside attention, the
block-eviction schedule, MoveCache and page freeing. The scheduler decides how many
pages ``E_s`` a sequence frees (``kvcompress.budget``, the same for every policy); the
policy decides which heads give them back and which KVs go:

============== ======================== ========================================= ===========
policy         metric (prompt queries)  budget split over (layer, head)           paper
============== ======================== ========================================= ===========
kvc            L2, last 32, max-pool 31 global: cheapest blocks across all layers KV-Compress
               + word spans             and heads (block-eviction schedule)       (measured
                                                                                  defaults)
kvc-ea         kvc's, then each head's  global, as kvc (the values' multiset per  (this
               values re-ranked with    head is kept: same split)                 project,
               expected attention of                                              measured in
               the coming queries                                                 ppl_eviction_
                                                                                  ceiling.py)
kvc-paper      L2, last 8, max-pool 7   global, as kvc                            KV-Compress
kvc-full       L2, all queries but the  global, as kvc                            KV-Compress
               10 nearest, as kvc                                                 (KVC-full)
kvzip          max attention a pass     global, as kvc                            KVzip
               repeating the prompt                                               (its
               gives, max-pool 7 +                                                scoring)
               word spans
surprisal      mean surprisal of the    global, as kvc (every head scores its     (this
               KV's sentence, from the  KVs alike, so the heads keep the same     project)
               prefill's own logits     tokens); 4 sink tokens
snapkv         L1, last 32, max-pool 7  uniform: same count per head and layer    SnapKV
pyramidkv      L1, last 8, max-pool 7   per-layer arithmetic schedule (beta = 20),PyramidKV
                                        uniform heads
ada-snapkv     L1, last 32, max-pool 7  uniform layer totals; within a layer      Ada-KV
                                        top-k across heads + alpha = 0.5 floor
ada-pyramidkv  L1, last 32, max-pool 7  pyramid layer totals; Ada-KV within layer Ada-KV
xkv            L1, last 8, avg-pool 7   cross-layer top-N of layer-normalised     XKV
                                        scores (or a saved per-layer profile),
                                        uniform heads within a layer
h2o            L1, all queries, no pool uniform (heavy hitters + recent window)   H2O
streamingllm   position (oldest first)  uniform; 4 sink tokens + recent window    StreamingLLM
random         uniform random           uniform                                   (baseline)
============== ======================== ========================================= ===========

L1/L2: attention probabilities (or their squares) summed over the query heads of the KV
head's group (GQA); a sum and the papers' mean rank KVs identically. kvzip scores no prompt
query: once the prompt is prefilled, the model is asked to repeat it
(``kvcompress.vllm_glue.reconstruction``), and each KV keeps the largest probability a
repeating query of its group gives it, whatever the question. A ``--kv-compress-*``
metric flag given explicitly on the server overrides that setting for every policy.

Budgets are whole pages per (layer, head); see ``kvcompress.ops.budget_split`` for the
rounding rule. PyramidInfer is not offered: it drops tokens from the residual stream
during prefill (deeper layers never compute them), a change to the model forward rather
than a cache policy, and its nested per-layer sets need head-shared eviction.

Structure
---------
A policy is one :class:`PolicyDefinition` in ``POLICIES``: its name, a metric source
(:class:`AttentionScores`, :class:`ReconstructionScores`, :class:`SentenceSurprisal`, :class:`TokenPosition`,
:class:`RandomNoise`), a budget split
(:class:`GlobalSplit`, :class:`UniformSplit`, :class:`PyramidSplit`, :class:`AdaSplit`
over a layer split, :class:`XKVSplit`) and its paper defaults (a :class:`MetricSpec`,
sink tokens). The strategy objects here only carry parameters; their torch rules live
in ``kvcompress.ops.policy_scores`` (``RANKERS``: the values KVs are ranked by) and
``kvcompress.ops.budget_split`` (``SPLIT_RULES``: per-(layer, head) targets), keyed by
the strategy's class. ``policy_for`` / :func:`resolve_policy` turn a definition plus the
server's settings into a :class:`Policy` (frozen, picklable: it travels from the
scheduler process to the workers).

Adding a policy
---------------
One place: a ``PolicyDefinition(...)`` entry in the policy list at the end of this
module (name, metric source, split, paper defaults), plus its test (a case in
``tests/test_policies.py``'s brute-force reference when its split rule is new) and,
as documentation, its row in the table above and in README.md. Everything else
follows from the registry: ``POLICY_NAMES``, the ``--kv-compress-policy`` choices
and help, the per-policy defaults shown by ``--help``, the ``kv_compress_policy``
request field and the policies the scheduler resolves for each request. Only a policy that needs a *new kind* of metric
source or split also needs that strategy: a parameter class here and its torch rule,
registered with ``@ranks(...)`` in ``ops/policy_scores.py`` or ``@split_rule(...)`` in
``ops/budget_split.py`` (``tests/test_policies.py`` checks every registered policy has
both rules); a new metric source kind also has a glue half, its hooks into the engine
(``kvcompress.vllm_glue.scoring_kind``), registered in one row of
``kvcompress.vllm_glue.scoring_kinds.SCORING_KINDS`` (tests/test_scoring_kinds.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

PYRAMID_BETA = 20.0
"""PyramidKV's default beta (``--kv-compress-pyramid-beta``)."""
ADA_FLOOR = 0.5
"""Ada-KV's default safeguard alpha (``--kv-compress-ada-floor``)."""


# --------------------------------------------------------------------------- metric sources


METRIC_SETTINGS = (
    "metric", "metric_queries", "observation_window", "full_skip_nearest", "pool", "pool_kernel", "pool_words",
)
"""The metric settings (``MetricSpec.settings()`` keys); attention-scored policies read all."""

RECONSTRUCTION_SETTINGS = ("pool", "pool_kernel", "pool_words")
"""The metric settings a reconstruction-scored policy reads (the scores are a maximum
over queries: no window, and a power does not change their order)."""

@dataclass(frozen=True)
class MetricSource:
    """Where the values a policy ranks KVs by come from (torch rule:
    ``kvcompress.ops.policy_scores.RANKERS[type(source)]``).

    How each kind scores KVs in the engine is its glue half
    (``kvcompress.vllm_glue.scoring_kinds.SCORING_KINDS``: one row per kind).

    Attributes:
        kind: a short name (logs, error messages).
        settings_read: the metric settings (``MetricSpec.settings()`` keys) that change
            what this kind evicts (help text, warnings); none by default.
    """

    kind: ClassVar[str] = "?"
    settings_read: ClassVar[tuple[str, ...]] = ()


@dataclass(frozen=True)
class AttentionScores(MetricSource):
    """The metrics scored by queries inside attention (L1/L2, pooled)."""

    kind: ClassVar[str] = "attention"
    settings_read: ClassVar[tuple[str, ...]] = METRIC_SETTINGS


@dataclass(frozen=True)
class ExpectedAttentionRanking(AttentionScores):
    """kvc's attention metrics, and at the prompt's end each head's values handed out
    again in the order of kvc's and the expected attention's distributions together
    (``kvcompress.ops.expected_attention``): the observation window's queries, moved by
    RoPE to the coming positions, estimate the attention still to come. The budget
    split is kvc's (each head keeps its values' multiset); only which KVs of a head go
    changes. Models without RoPE fall back to kvc's ranking (a warning at startup)."""

    kind: ClassVar[str] = "attention+expected"


@dataclass(frozen=True)
class ReconstructionScores(MetricSource):
    """The attention a context-reconstruction pass gives each KV (KVzip-style): after
    the prefill the model is asked to repeat the prompt, and each KV scores the largest
    probability a repeating query gives it (``kvcompress.ops.reconstruction``). No
    prompt query scores keys; the question plays no part."""

    kind: ClassVar[str] = "reconstruction"
    settings_read: ClassVar[tuple[str, ...]] = RECONSTRUCTION_SETTINGS


@dataclass(frozen=True)
class SentenceSurprisal(MetricSource):
    """How surprising each KV's sentence was to the model (``kvcompress.ops.surprisal``):
    the prefill's own logits give every prompt token's ``-log p``; a KV scores its
    sentence's mean, normalised to [0, 1] over the prompt, in every head alike. What
    the model could not predict (a code, a name, a fact out of place) is kept whole,
    whatever is asked later; no prompt query scores keys and no extra forward runs."""

    kind: ClassVar[str] = "surprisal"


@dataclass(frozen=True)
class TokenPosition(MetricSource):
    """The token position: the oldest unprotected KV goes first (StreamingLLM)."""

    kind: ClassVar[str] = "position"


@dataclass(frozen=True)
class RandomNoise(MetricSource):
    """Uniform random values (a baseline)."""

    kind: ClassVar[str] = "random"


_METRIC_POWER = {"l2": 2, "l1": 1}
"""``--kv-compress-metric`` value -> exponent of the attention probabilities."""


@dataclass(frozen=True)
class MetricSpec:
    """How a policy scores KVs.

    Attributes:
        source: the metric source strategy (:class:`AttentionScores`: scored by
            queries; :class:`TokenPosition`: the oldest KV is evicted first;
            :class:`RandomNoise`).
        power: attention probabilities are raised to this power (2 = L2, 1 = L1).
        queries: ``window`` (the last ``observation_window`` prompt queries) or ``full``
            (every prompt query, each skipping its ``skip_nearest`` nearest keys).
        observation_window: prompt queries that score keys in ``window`` mode.
        skip_nearest: ``full`` mode only.
        pool: ``max`` or ``avg`` pooling over key positions, once the prompt is scored.
        pool_kernel: odd pooling width in tokens; 1 = none.
        pool_words: after the kernel, every token of a word span (digits of a number,
            pieces of a word: ``kvcompress.ops.word_spans``) gets the span's largest
            metric, so words are kept or evicted whole whatever the tokenizer.
    """

    source: MetricSource = field(default_factory=AttentionScores)
    power: int = 2
    queries: Literal["window", "full"] = "window"
    observation_window: int = 8
    skip_nearest: int = 10
    pool: Literal["max", "avg"] = "max"
    pool_kernel: int = 7
    pool_words: bool = False

    def settings(self) -> dict[str, Any]:
        """These values as the settings (flags) that would select them."""
        metric = next(name for name, power in _METRIC_POWER.items() if power == self.power)
        return {
            "metric": metric,
            "metric_queries": self.queries,
            "observation_window": self.observation_window,
            "full_skip_nearest": self.skip_nearest,
            "pool": self.pool,
            "pool_kernel": self.pool_kernel,
            "pool_words": self.pool_words,
        }

    def with_settings(self, values: dict[str, Any]) -> "MetricSpec":
        """A copy with the settings (``settings()`` keys) that are not None."""
        merged = {**self.settings(), **{k: v for k, v in values.items() if v is not None}}
        return replace(
            self,
            power=_METRIC_POWER[merged["metric"]],
            queries=merged["metric_queries"],
            observation_window=int(merged["observation_window"]),
            skip_nearest=int(merged["full_skip_nearest"]),
            pool=merged["pool"],
            pool_kernel=int(merged["pool_kernel"]),
            pool_words=bool(merged["pool_words"]),
        )


# --------------------------------------------------------------------------- budget splits


@dataclass(frozen=True)
class BudgetSplit:
    """How a policy splits a sequence's kept pages over its (layer, KV head) pairs
    (torch rule: ``kvcompress.ops.budget_split.SPLIT_RULES[type(split)]``).

    Attributes:
        kind: a short name (logs, error messages).
        is_global: the paper's order (cheapest blocks across all layers and heads)
            rather than per-(layer, head) targets.
        layer_profile: XKV's saved per-layer shares; None for every other split.
        knobs: server settings this split reads -> the attribute each sets.
    """

    kind: ClassVar[str] = "?"
    is_global: ClassVar[bool] = False
    layer_profile: ClassVar[tuple[float, ...] | None] = None
    knobs: ClassVar[dict[str, str]] = {}

    def tuned(self, **settings: Any) -> "BudgetSplit":
        """A copy with the server's settings for this split's ``knobs`` (None = keep)."""
        changes = {
            attribute: settings[name]
            for name, attribute in self.knobs.items()
            if settings.get(name) is not None
        }
        return replace(self, **changes) if changes else self

    def uses(self, setting: str) -> bool:
        """Whether this split reads the server setting ``setting``."""
        return setting in self.knobs


@dataclass(frozen=True)
class GlobalSplit(BudgetSplit):
    """KV-Compress: the cheapest blocks across all layers and heads of a sequence."""

    kind: ClassVar[str] = "global"
    is_global: ClassVar[bool] = True


@dataclass(frozen=True)
class UniformSplit(BudgetSplit):
    """The same count per head and layer."""

    kind: ClassVar[str] = "uniform"


@dataclass(frozen=True)
class PyramidSplit(BudgetSplit):
    """PyramidKV's arithmetic per-layer schedule, heads of a layer alike.

    Attributes:
        beta: the last layer keeps ``B / beta`` non-protected tokens per head, the
            first ``2B - B / beta`` (B = the average).
    """

    beta: float = PYRAMID_BETA
    kind: ClassVar[str] = "pyramid"
    knobs: ClassVar[dict[str, str]] = {"pyramid_beta": "beta"}


@dataclass(frozen=True)
class AdaSplit(BudgetSplit):
    """Ada-KV over a layer split: the layer totals of ``layers``, shared within a layer
    by a top-k across its heads with a floor.

    Attributes:
        layers: the split giving each layer's per-head average ``B'`` (uniform or
            pyramid).
        floor: the safeguard alpha: a head keeps ``alpha * B' + (1 - alpha) * f``
            non-protected tokens (f = the head's winners of the layer's top-k).
    """

    layers: BudgetSplit = field(default_factory=UniformSplit)
    floor: float = ADA_FLOOR
    kind: ClassVar[str] = "ada"
    knobs: ClassVar[dict[str, str]] = {"ada_floor": "floor"}

    def tuned(self, **settings: Any) -> "AdaSplit":
        own = super().tuned(**settings)
        return replace(own, layers=self.layers.tuned(**settings))

    def uses(self, setting: str) -> bool:
        return super().uses(setting) or self.layers.uses(setting)


@dataclass(frozen=True)
class XKVSplit(BudgetSplit):
    """XKV: a cross-layer top-N of layer-normalised metrics (or a saved per-layer
    profile), heads of a layer alike.

    Attributes:
        layer_profile: per-layer shares of the non-protected budget (normalised to
            sum 1) used instead of the per-request allocation; None = per request.
    """

    layer_profile: tuple[float, ...] | None = None
    kind: ClassVar[str] = "xkv"
    knobs: ClassVar[dict[str, str]] = {"layer_profile": "layer_profile"}


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Policy:
    """A resolved eviction policy: what the scheduler and the workers use."""

    name: str
    metric: MetricSpec
    split: BudgetSplit
    sink_tokens: int = 0


@dataclass(frozen=True)
class PolicyDefinition:
    """One eviction policy: its strategies and its paper's defaults.

    Attributes:
        name: the ``--kv-compress-policy`` / ``kv_compress_policy`` value.
        metric: the metric source and the paper's metric settings (each overridden by
            its server setting when that is given, e.g. ``--kv-compress-pool``).
        split: the budget split. Its knobs (PyramidKV's beta, Ada-KV's floor, XKV's
            profile) are server-wide settings, applied to every policy whose split
            reads them (``--kv-compress-pyramid-beta`` defaults to ``PYRAMID_BETA``
            for all), so leave them at their defaults here.
        sink_tokens: attention sinks never evicted (the paper's).
        paper: where the policy comes from (help text).
    """

    name: str
    metric: MetricSpec
    split: BudgetSplit
    sink_tokens: int = 0
    paper: str = ""

    def defaults(self) -> dict[str, Any]:
        """The paper defaults, as the values their settings (flags) would take."""
        return {**self.metric.settings(), "sink_tokens": self.sink_tokens}

    def reads(self, setting: str) -> bool:
        """Whether ``setting`` (a ``defaults()`` key) changes what this policy evicts:
        the metric settings only matter to attention-scored policies, and only the
        pooling ones to reconstruction-scored policies."""
        return setting == "sink_tokens" or setting in self.metric.source.settings_read

    def resolve(
        self,
        overrides: dict[str, Any] | None = None,
        **split_settings: Any,
    ) -> Policy:
        """This policy with every setting of ``overrides`` (``defaults()`` keys) that is
        not None, and the server's split knobs (``pyramid_beta``, ``ada_floor``,
        ``layer_profile``; None = the split's default)."""
        overrides = overrides or {}
        sinks = overrides.get("sink_tokens")
        return Policy(
            name=self.name,
            metric=self.metric.with_settings(overrides),
            split=self.split.tuned(**split_settings),
            sink_tokens=int(self.sink_tokens if sinks is None else sinks),
        )


POLICIES: dict[str, PolicyDefinition] = {}
"""Every policy by name, in registration order."""


def register_policy(definition: PolicyDefinition) -> PolicyDefinition:
    """Add a policy to ``POLICIES`` (names are unique)."""
    if definition.name in POLICIES:
        raise ValueError(f"policy {definition.name!r} is already registered")
    POLICIES[definition.name] = definition
    return definition


def policy_definition(name: str) -> PolicyDefinition:
    """The registered policy ``name``; ``ValueError`` naming the known ones."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})") from None


def policy_defaults(name: str) -> dict:
    """The paper defaults of a policy, as the values its flags would take."""
    return policy_definition(name).defaults()


POLICY_SETTINGS = tuple(MetricSpec().settings()) + ("sink_tokens",)
"""Server settings whose default is the policy's (None = the policy's paper value)."""


def resolve_policy(
    name: str,
    *,
    metric: str | None = None,
    metric_queries: str | None = None,
    observation_window: int | None = None,
    full_skip_nearest: int | None = None,
    pool: str | None = None,
    pool_kernel: int | None = None,
    pool_words: bool | None = None,
    sink_tokens: int | None = None,
    pyramid_beta: float = PYRAMID_BETA,
    ada_floor: float = ADA_FLOOR,
    layer_profile: tuple[float, ...] | None = None,
) -> Policy:
    """The policy ``name`` with its paper defaults, overridden by any value not None."""
    return policy_definition(name).resolve(
        {
            "metric": metric, "metric_queries": metric_queries,
            "observation_window": observation_window, "full_skip_nearest": full_skip_nearest,
            "pool": pool, "pool_kernel": pool_kernel, "pool_words": pool_words,
            "sink_tokens": sink_tokens,
        },
        pyramid_beta=float(pyramid_beta),
        ada_floor=float(ada_floor),
        layer_profile=layer_profile,
    )


def default_summary(setting: str) -> str:
    """Each policy's default of ``setting`` (a ``POLICY_SETTINGS`` key), for help text:
    the most common value first, then the others with their policies, e.g.
    ``"max; avg for xkv"`` (policies the setting does not affect are left out)."""
    by_value: dict[Any, list[str]] = {}
    for name, definition in POLICIES.items():
        if definition.reads(setting):
            by_value.setdefault(definition.defaults()[setting], []).append(name)
    common = max(by_value, key=lambda value: len(by_value[value]))
    others = [f"{value} for {', '.join(names)}" for value, names in by_value.items() if value != common]
    return "; ".join([str(common), *others])


def policies_using(setting: str) -> tuple[str, ...]:
    """The policies whose budget split reads the server setting ``setting``."""
    return tuple(name for name, definition in POLICIES.items() if definition.split.uses(setting))


def load_layer_profile(path: str | Path) -> tuple[float, ...]:
    """Read an XKV per-layer allocation profile.

    The file is JSON: either a list of per-layer weights or an object with a
    ``"layer_shares"`` list (what ``benchmarks/quality/xkv_profile.py`` writes). Weights are
    non-negative, finite, not all zero; they are normalised to sum 1.

    Raises ``ValueError`` naming the file and the problem.
    """
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"cannot read XKV profile {path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"XKV profile {path} is not JSON: {error}") from None
    shares = data.get("layer_shares") if isinstance(data, dict) else data
    if not isinstance(shares, list) or not shares:
        raise ValueError(
            f"XKV profile {path}: expected a non-empty list of per-layer weights "
            "(or an object with 'layer_shares')"
        )
    values = []
    for index, value in enumerate(shares):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"XKV profile {path}: layer {index} weight {value!r} is not a finite number >= 0")
        values.append(float(value))
    total = sum(values)
    if total <= 0:
        raise ValueError(f"XKV profile {path}: all layer weights are 0")
    return tuple(v / total for v in values)


# --------------------------------------------------------------------------- the policies
# One entry per policy; their order is POLICY_NAMES.

KVC_DEFAULT_METRIC = MetricSpec(power=2, observation_window=32, pool="max", pool_kernel=31, pool_words=True)
"""kvc's defaults. The paper's (L2, last 8 queries, max-pool 7: ``kvc-paper``) were set
on Llama tokenizers, where a number is 2-3 tokens; on tokenizers that write one token
per digit (SmolLM, Qwen, ...) they keep 2-3 digits of a number and answers come out
truncated: SmolLM2 needle tasks at rate 8 fell to 6% of the full cache's score.
Measured on SmolLM2-135M (``benchmarks/quality/eval_quality.py``; ``benchmarks/results/README.md``, "Quality"):
pooling over 31 tokens keeps a fact's whole sentence (key, verb and value together,
which copying the answer needs; word spans or 15 tokens alone reached about half the
needles), word spans keep a number that is longer than that reach whole, and a
32-query window holds the question. Perplexity did not drop with the wider pooling
(same windows: 91% of full at rate 8 vs 88% with the paper's)."""

KVZIP_METRIC = MetricSpec(source=ReconstructionScores(), pool="max", pool_kernel=7, pool_words=True)
"""kvzip's defaults: the reconstruction pass's scores, max-pooled over 7 tokens and
over word spans (a number is kept or evicted whole)."""

for _definition in (
    PolicyDefinition(
        "kvc", KVC_DEFAULT_METRIC, GlobalSplit(),
        paper="KV-Compress, defaults measured to hold on per-digit tokenizers",
    ),
    PolicyDefinition(
        "kvc-ea", replace(KVC_DEFAULT_METRIC, source=ExpectedAttentionRanking()), GlobalSplit(),
        paper="kvc's split, each head ranked with the expected attention of the coming queries",
    ),
    PolicyDefinition(
        "kvc-paper", MetricSpec(power=2, observation_window=8, pool="max"), GlobalSplit(),
        paper="KV-Compress, the paper's exact settings",
    ),
    PolicyDefinition(
        "kvc-full", replace(KVC_DEFAULT_METRIC, queries="full", skip_nearest=10), GlobalSplit(),
        paper="KV-Compress KVC-full: every prompt query scores keys, question-agnostic",
    ),
    PolicyDefinition(
        "kvzip", KVZIP_METRIC, GlobalSplit(),
        paper="KVzip-style: scored by a pass that repeats the prompt, question-agnostic",
    ),
    PolicyDefinition(
        "surprisal", MetricSpec(source=SentenceSurprisal(), pool_kernel=1), GlobalSplit(), sink_tokens=4,
        paper="question-agnostic: each KV scored by how surprising its sentence was to the model",
    ),
    PolicyDefinition(
        "snapkv", MetricSpec(power=1, observation_window=32, pool="max"), UniformSplit(),
        paper="SnapKV",
    ),
    PolicyDefinition(
        "pyramidkv", MetricSpec(power=1, observation_window=8, pool="max"), PyramidSplit(),
        paper="PyramidKV",
    ),
    PolicyDefinition(
        "ada-snapkv", MetricSpec(power=1, observation_window=32, pool="max"), AdaSplit(UniformSplit()),
        paper="Ada-KV over SnapKV",
    ),
    PolicyDefinition(
        "ada-pyramidkv", MetricSpec(power=1, observation_window=32, pool="max"), AdaSplit(PyramidSplit()),
        paper="Ada-KV over PyramidKV",
    ),
    PolicyDefinition(
        "xkv", MetricSpec(power=1, observation_window=8, pool="avg"), XKVSplit(),
        paper="XKV",
    ),
    PolicyDefinition(
        "h2o", MetricSpec(power=1, queries="full", skip_nearest=0, pool_kernel=1), UniformSplit(),
        paper="H2O",
    ),
    PolicyDefinition(
        "streamingllm", MetricSpec(source=TokenPosition(), pool_kernel=1), UniformSplit(),
        sink_tokens=4, paper="StreamingLLM",
    ),
    PolicyDefinition(
        "random", MetricSpec(source=RandomNoise(), pool_kernel=1), UniformSplit(),
        paper="baseline",
    ),
):
    register_policy(_definition)
del _definition

POLICY_NAMES = tuple(POLICIES)
"""The registered policy names, in registration order."""
