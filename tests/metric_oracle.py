"""An independent oracle for the attention-scored policies' prompt metrics (tests only):
Hugging Face's Llama run in float64 gives each layer's post-RoPE queries and keys, and
the metric is applied to them here, from its definition (KV-Compress, eq. 8 with
squared attention: ``docs/ARCHITECTURE.md``, the table of ``kvcompress/policies.py``),
with no kvcompress op:

    M[h, j] = weight * sum over the last w prompt queries i >= j and the query heads
              q of KV head h's group of softmax_j(q_i . k_j * scale) ** power
    pooled[h, j] = max of M[h, t] for |t - j| <= kernel // 2 (inside the prompt)

``weight`` is ``1 / decode_metric_stride``: prompt metrics are scaled so that the decode
queries, which add every stride-th token, share their scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetricDefinition:
    """How prompt queries score keys.

    Attributes:
        power: attention probabilities are raised to it (2 = L2, 1 = L1).
        observation_window: the last ``w`` prompt queries score the keys.
        pool_kernel: odd width (tokens) of the max pool over key positions; 1 = none.
        prompt_weight: factor on the prompt metrics (1 / the decode metric stride).
    """

    power: int
    observation_window: int
    pool_kernel: int
    prompt_weight: float


@dataclass(frozen=True)
class LayerQueriesKeys:
    """One layer's post-RoPE projections of a prompt, float64.

    Attributes:
        queries: ``[num_q_heads, T, D]``.
        keys: ``[num_kv_heads, T, D]``.
        scale: the softmax scale (``D ** -0.5`` for Llama).
    """

    queries: torch.Tensor
    keys: torch.Tensor
    scale: float


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [heads, T, D]`` rotated by Llama's (GPT-NeoX) RoPE: dimension ``d`` pairs with
    ``d + D/2``; ``cos``/``sin`` ``[T, D]`` are the model's angles."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def prompt_queries_keys(model_path: str, prompt: list[int]) -> list[LayerQueriesKeys]:
    """Each layer's queries and keys for ``prompt`` from Hugging Face's Llama in float64
    (not vLLM, not kvcompress): the attention's input recorded by a pre-hook, projected
    by its ``q_proj`` / ``k_proj`` and rotated by the model's RoPE angles."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="eager", dtype=torch.float64)
    layers: list[LayerQueriesKeys] = []

    def record(attention, args, kwargs) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # [1, T, hidden]
        cos, sin = kwargs["position_embeddings"]  # [1, T, D]
        dim = attention.head_dim
        q = attention.q_proj(hidden)[0].view(hidden.shape[1], -1, dim).transpose(0, 1)  # [Hq, T, D]
        k = attention.k_proj(hidden)[0].view(hidden.shape[1], -1, dim).transpose(0, 1)  # [Hkv, T, D]
        layers.append(LayerQueriesKeys(_rope(q, cos[0], sin[0]), _rope(k, cos[0], sin[0]), float(attention.scaling)))

    hooks = [layer.self_attn.register_forward_pre_hook(record, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt]))
    finally:
        for hook in hooks:
            hook.remove()
    return layers


def layer_metric(layer: LayerQueriesKeys, definition: AttentionMetricDefinition) -> torch.Tensor:
    """``[num_kv_heads, T]`` float64: one layer's pooled prompt metric per KV head and
    key position (the module docstring's formula)."""
    num_q_heads, length, _ = layer.queries.shape
    num_kv_heads = layer.keys.shape[0]
    group = num_q_heads // num_kv_heads
    first = length - definition.observation_window
    queries = layer.queries[:, first:]  # [Hq, w, D]
    keys = layer.keys.repeat_interleave(group, dim=0)  # query head j reads KV head j // group
    scores = queries @ keys.transpose(1, 2) * layer.scale  # [Hq, w, T]
    future = torch.arange(length).view(1, -1) > torch.arange(first, length).view(-1, 1)  # causal
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    per_query_head = (probs**definition.power).sum(dim=1)  # [Hq, T]
    metric = per_query_head.view(num_kv_heads, group, length).sum(dim=1) * definition.prompt_weight
    reach = definition.pool_kernel // 2
    pooled = torch.empty_like(metric)
    for position in range(length):
        pooled[:, position] = metric[:, max(0, position - reach) : position + reach + 1].amax(dim=1)
    return pooled


def prompt_metrics(model_path: str, prompt: list[int], definition: AttentionMetricDefinition) -> torch.Tensor:
    """``[num_layers * num_kv_heads, T]`` float64 pooled prompt metrics, heads in the
    engine's order (layer-major: index ``layer * num_kv_heads + kv_head``)."""
    per_layer = [layer_metric(layer, definition) for layer in prompt_queries_keys(model_path, prompt)]
    return torch.cat(per_layer, dim=0)
