"""Flax NNX decoder-only Mixture-of-Experts language model and presets.

Parameter path contract (the optimizer's default labeller relies on it; tested
in ``tests/test_models_transformer.py``): flatten
``nnx.state(model, nnx.Param)`` with ``jax.tree_util.tree_flatten_with_path``
and join the key names with '/' (ignoring a trailing ``value``). Then

* every router weight has a path component exactly ``router``
  (``layers/moe/router/kernel``) and shape [L, D, E];
* every expert weight has a path component exactly ``experts``
  (``layers/moe/experts/{w_gate,w_up,w_down}``) and shape [L, E, d_in, d_out];
* no other parameter has a component ``router`` or ``experts``.

Everything else (embeddings, attention, norms, unembedding) is backbone.
"""

from models.config import MOE_IMPLS, PRESETS, ModelConfig, get_preset
from models.moe import (
    EXPERT_IMPLS,
    MoE,
    Experts,
    Router,
    expert_fraction,
    experts_blocked,
    experts_dense,
    experts_ragged,
    load_balancing_loss,
    route,
    router_z_loss,
)
from models.transformer import (
    Attention,
    Block,
    RMSNorm,
    Transformer,
    apply_rope,
    count_params,
    chunked_cross_entropy,
    lm_loss,
    token_cross_entropy,
    param_shapes,
    param_tier,
    path_str,
    rope_tables,
)

__all__ = [
    'MOE_IMPLS', 'PRESETS', 'ModelConfig', 'get_preset',
    'EXPERT_IMPLS', 'MoE', 'Experts', 'Router', 'expert_fraction',
    'experts_blocked', 'experts_dense', 'experts_ragged',
    'load_balancing_loss', 'route', 'router_z_loss',
    'Attention', 'Block', 'RMSNorm', 'Transformer', 'apply_rope',
    'chunked_cross_entropy', 'count_params', 'lm_loss', 'token_cross_entropy', 'param_shapes', 'param_tier', 'path_str',
    'rope_tables',
]
