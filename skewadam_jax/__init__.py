"""SkewAdam: Adam's learning rule with per-tier moment storage for MoE models.

The public API:

* :func:`scale_by_skewadam` — the moment logic (an optax transformation).
* :func:`skewadam` — with decoupled weight decay and a learning rate.
* :func:`skewadam_orthogonal` — the same with Muon's direction in the backbone
  and expert tiers: the configuration that measured best at SkewAdam's memory
  (:func:`orthogonal_settings`: its arguments, for :func:`plan_table`).
* :func:`skewadam_article` — the article's optimizer as its public code
  computes it (:mod:`skewadam_jax.article`; :func:`scale_by_skewadam_article`):
  the reference mode the library's forms are compared with.
* :class:`TierConfig` — how a tier stores its momentum and second moment.
* :class:`MatrixAxes` — which two axes of a leaf form its matrix
  (:func:`named_matrix_axes`: those of a named pattern set's trees).
* :func:`moe_param_labels`, :data:`PATTERNS`, :func:`label_fn`,
  :func:`label_names` — path-regex labellers (trees, or lists with names).
* :func:`plan_table` — the first thing to run on a new model: every leaf's
  tier, matrix axes, encodings and decay, as a table (:func:`leaf_plans`:
  the same as records).
* :func:`matrices_only`, :func:`add_decayed_weights_to_matrices` — weight
  decay on declared matrices.
* :func:`state_bytes_by_tier`, :func:`abstract_state_bytes_by_tier`,
  :func:`state_bytes_per_param`, :func:`tree_bytes` — exact state accounting.
* :func:`apply_updates_stochastic`, :func:`stochastic_round_to_bf16` —
  unbiased stochastic rounding of updates to bfloat16 parameters.
* :func:`state_shardings` — optimizer-state shardings from parameter shardings.
* :func:`layerwise_step` — the update inside the backward pass of any scanned
  layer stack (:mod:`skewadam_jax.layerwise`; :class:`LayerwiseStep`,
  :class:`LayerwiseState`, :func:`check_separable`,
  :func:`scanned_matrix_axes`).

Importing the package changes nothing outside it: no environment variable, no
JAX option, no redirected stream (as optax).
"""

from skewadam_jax.accounting import abstract_state_bytes_by_tier
from skewadam_jax.accounting import state_bytes_by_tier
from skewadam_jax.accounting import state_bytes_per_param
from skewadam_jax.accounting import tree_bytes
from skewadam_jax.alias import EMBEDDING_PATTERNS
from skewadam_jax.alias import ORTHOGONAL_EXPERT_MOMENTUM
from skewadam_jax.alias import ORTHOGONAL_TIER_SETTINGS
from skewadam_jax.alias import orthogonal_settings
from skewadam_jax.alias import skewadam_orthogonal
from skewadam_jax.article import ScaleByArticleState
from skewadam_jax.article import scale_by_skewadam_article
from skewadam_jax.article import skewadam_article
from skewadam_jax.axes import MatrixAxes
from skewadam_jax.axes import named_matrix_axes
from skewadam_jax.encodings import ENCODINGS
from skewadam_jax.encodings import get_encoding
from skewadam_jax.labels import BACKBONE
from skewadam_jax.labels import EXPERT
from skewadam_jax.labels import PATTERNS
from skewadam_jax.labels import ROUTER
from skewadam_jax.labels import TIERS
from skewadam_jax.labels import label_fn
from skewadam_jax.labels import label_names
from skewadam_jax.labels import moe_param_labels
from skewadam_jax.layerwise import LayerwiseState
from skewadam_jax.layerwise import LayerwiseStep
from skewadam_jax.layerwise import check_separable
from skewadam_jax.layerwise import layerwise_step
from skewadam_jax.layerwise import scanned_matrix_axes
from skewadam_jax.orthogonal import newton_schulz
from skewadam_jax.orthogonal import newton_schulz_in_subspace
from skewadam_jax.plans import plan_table
from skewadam_jax.rounding import apply_updates_stochastic
from skewadam_jax.rounding import stochastic_round_to_bf16
from skewadam_jax.sharding import state_shardings
from skewadam_jax.transform import DEFAULT_BACKBONE
from skewadam_jax.transform import DEFAULT_EXPERT
from skewadam_jax.transform import DEFAULT_ROUTER
from skewadam_jax.transform import DIRECTIONS
from skewadam_jax.transform import DecayScheduleState
from skewadam_jax.transform import LeafPlan
from skewadam_jax.transform import MATRICES
from skewadam_jax.transform import ScaleBySkewAdamState
from skewadam_jax.transform import TierConfig
from skewadam_jax.transform import add_decayed_weights_to_matrices
from skewadam_jax.transform import leaf_plans
from skewadam_jax.transform import matrices_only
from skewadam_jax.transform import scale_by_skewadam
from skewadam_jax.transform import skewadam

__version__ = "0.3.0"

__all__ = [
    "BACKBONE", "DEFAULT_BACKBONE", "EMBEDDING_PATTERNS", "DEFAULT_EXPERT", "DEFAULT_ROUTER", "DIRECTIONS",
    "ORTHOGONAL_EXPERT_MOMENTUM", "ORTHOGONAL_TIER_SETTINGS",
    "DecayScheduleState",
    "ENCODINGS", "EXPERT", "LayerwiseState", "LayerwiseStep", "LeafPlan", "MATRICES",
    "MatrixAxes", "PATTERNS",
    "ROUTER", "ScaleByArticleState", "ScaleBySkewAdamState", "TIERS", "TierConfig",
    "abstract_state_bytes_by_tier", "add_decayed_weights_to_matrices",
    "apply_updates_stochastic", "check_separable", "get_encoding", "label_fn", "label_names",
    "layerwise_step", "leaf_plans",
    "matrices_only", "moe_param_labels", "named_matrix_axes", "newton_schulz",
    "newton_schulz_in_subspace", "orthogonal_settings", "plan_table",
    "scale_by_skewadam", "scale_by_skewadam_article", "skewadam_article",
    "scanned_matrix_axes", "skewadam", "skewadam_orthogonal",
    "state_bytes_by_tier", "state_bytes_per_param", "state_shardings", "stochastic_round_to_bf16",
    "tree_bytes",
]
