"""SkewAdam: Adam's learning rule with per-tier moment storage for MoE models.

The public API:

* :func:`scale_by_skewadam` — the moment logic (an optax transformation).
* :func:`skewadam` — with decoupled weight decay and a learning rate.
* :class:`TierConfig` — how a tier stores its momentum and second moment.
* :func:`moe_param_labels` — the default path-regex labeller.
* :func:`state_bytes_by_tier`, :func:`abstract_state_bytes_by_tier`,
  :func:`tree_bytes` — exact state accounting.
* :func:`apply_updates_stochastic`, :func:`stochastic_round_to_bf16` —
  unbiased stochastic rounding of updates to bfloat16 parameters.
* :func:`state_shardings` — optimizer-state shardings from parameter shardings.
"""

from skewadam_jax.accounting import abstract_state_bytes_by_tier
from skewadam_jax.accounting import state_bytes_by_tier
from skewadam_jax.accounting import tree_bytes
from skewadam_jax.encodings import ENCODINGS
from skewadam_jax.encodings import Int8Momentum
from skewadam_jax.encodings import SignMomentum
from skewadam_jax.encodings import get_encoding
from skewadam_jax.factored import FactoredMoment
from skewadam_jax.labels import BACKBONE
from skewadam_jax.labels import EXPERT
from skewadam_jax.labels import ROUTER
from skewadam_jax.labels import TIERS
from skewadam_jax.labels import moe_param_labels
from skewadam_jax.rounding import apply_updates_stochastic
from skewadam_jax.rounding import stochastic_round_to_bf16
from skewadam_jax.sharding import state_shardings
from skewadam_jax.transform import DEFAULT_BACKBONE
from skewadam_jax.transform import DEFAULT_EXPERT
from skewadam_jax.transform import DEFAULT_ROUTER
from skewadam_jax.transform import ScaleBySkewAdamState
from skewadam_jax.transform import TierConfig
from skewadam_jax.transform import TierState
from skewadam_jax.transform import matrices_only
from skewadam_jax.transform import scale_by_skewadam
from skewadam_jax.transform import skewadam

__version__ = "0.1.0"

__all__ = [
    "BACKBONE", "DEFAULT_BACKBONE", "DEFAULT_EXPERT", "DEFAULT_ROUTER",
    "ENCODINGS", "EXPERT", "FactoredMoment", "Int8Momentum", "ROUTER",
    "ScaleBySkewAdamState", "SignMomentum", "TIERS", "TierConfig", "TierState",
    "abstract_state_bytes_by_tier", "apply_updates_stochastic", "get_encoding",
    "matrices_only", "moe_param_labels", "scale_by_skewadam", "skewadam",
    "state_bytes_by_tier", "state_shardings", "stochastic_round_to_bf16",
    "tree_bytes",
]
