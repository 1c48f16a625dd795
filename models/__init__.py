"""Flax NNX decoder-only Mixture-of-Experts language model and presets.

Every parameter declares its logical axes where it is created
(:mod:`models.axes`); tiers, matrix axes, weight-decay masks, Muon's
dimension numbers and shardings are all derived from that declaration.

The paths also follow a contract, for optimizers' path-based labellers such
as ``skewadam_jax.moe_param_labels`` (tested in
``tests/models/test_transformer.py``): flatten
``nnx.state(model, nnx.Param)`` with ``jax.tree_util.tree_flatten_with_path``
and join the key names with '/' (ignoring a trailing ``value``). Then

* every router weight has a path component exactly ``router``
  (``layers/moe/router/kernel``) and shape [L, D, E];
* every expert weight has a path component exactly ``experts``
  (``layers/moe/experts/{w_gate,w_up,w_down}``) and shape [L, E, d_in, d_out];
* no other parameter has a component ``router`` or ``experts``.

Everything else (embeddings, attention, norms, unembedding) is backbone.
"""

from models import axes
from models import grouped
from models.axes import logical_axes
from models.config import MOE_IMPLS, PRESETS, PRESETS_DIR, ModelConfig, get_preset, load_preset_file
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
    abstract_params,
    count_params,
    chunked_cross_entropy,
    lm_loss,
    loss_from_features,
    mean_aux,
    ROUTING_METRICS,
    token_cross_entropy,
    param_shapes,
    rope_tables,
)

__all__ = [
    'axes', 'grouped', 'logical_axes', 'abstract_params', 'MOE_IMPLS', 'PRESETS', 'PRESETS_DIR', 'ModelConfig', 'get_preset', 'load_preset_file',
    'EXPERT_IMPLS', 'MoE', 'Experts', 'Router', 'expert_fraction',
    'experts_blocked', 'experts_dense', 'experts_ragged',
    'load_balancing_loss', 'route', 'router_z_loss',
    'Attention', 'Block', 'RMSNorm', 'Transformer', 'apply_rope',
    'chunked_cross_entropy', 'count_params', 'lm_loss', 'loss_from_features', 'mean_aux',
    'ROUTING_METRICS',
    'token_cross_entropy', 'param_shapes',
    'rope_tables',
]
