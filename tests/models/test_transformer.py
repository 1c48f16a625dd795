"""Transformer: forward, causality, loss/grads, parameter counts and paths."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import (PRESETS, Transformer, count_params, get_preset, lm_loss,
                    param_shapes)

B, T = 2, 16


@pytest.fixture(scope='module')
def tiny():
  cfg = get_preset('tiny')
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, tok: nnx.merge(graphdef, state)(tok))
  tokens = jax.random.randint(jax.random.key(0), (B, T), 0, cfg.vocab_size)
  return dict(cfg=cfg, model=model, state=state, forward=forward, tokens=tokens)


def _flat_param_paths(model):
  """The contract's recipe, written independently of models.path_str."""
  leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
  out = {}
  for key_path, leaf in leaves:
    names = [str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k))))
             for k in key_path]
    if names[-1] == 'value':
      names = names[:-1]
    out['/'.join(names)] = leaf.shape
  return out


def test_forward_shape_dtype_finite(tiny):
  cfg = tiny['cfg']
  logits, aux = tiny['forward'](tiny['state'], tiny['tokens'])
  assert logits.shape == (B, T, cfg.vocab_size)
  assert logits.dtype == jnp.float32
  assert np.all(np.isfinite(logits))
  assert aux['lb_loss'].shape == () and aux['z_loss'].shape == ()
  assert np.isfinite(aux['lb_loss']) and np.isfinite(aux['z_loss'])
  assert aux['expert_fraction'].shape == (cfg.num_layers, cfg.num_experts)
  np.testing.assert_allclose(aux['expert_fraction'].sum(-1), 1.0, rtol=1e-6)


def test_causal(tiny):
  tokens = tiny['tokens']
  changed = tokens.at[:, T - 4].set((tokens[:, T - 4] + 1) % tiny['cfg'].vocab_size)
  a, _ = tiny['forward'](tiny['state'], tokens)
  b, _ = tiny['forward'](tiny['state'], changed)
  np.testing.assert_allclose(a[:, :T - 4], b[:, :T - 4], rtol=1e-5, atol=1e-5)
  assert np.abs(a[:, T - 4:] - b[:, T - 4:]).max() > 1e-3


def test_too_long_sequence_raises(tiny):
  with pytest.raises(ValueError, match='max_seq_len'):
    tiny['model'](jnp.zeros((1, tiny['cfg'].max_seq_len + 1), jnp.int32))


def test_lm_loss_grads_and_remat_equivalence(tiny):
  cfg = dataclasses.replace(tiny['cfg'], compute_dtype=jnp.float32)
  tokens = tiny['tokens']

  def loss_and_grads(remat):
    c = dataclasses.replace(cfg, remat=remat)
    graphdef, state = nnx.split(Transformer(c, rngs=nnx.Rngs(0)))
    f = lambda s: lm_loss(nnx.merge(graphdef, s), tokens[:, :-1], tokens[:, 1:])
    return jax.jit(jax.value_and_grad(f, has_aux=True))(state)

  (loss, metrics), grads = loss_and_grads(True)
  (loss2, _), grads2 = loss_and_grads(False)
  expected = (metrics['ce_loss'] + cfg.lb_loss_coef * metrics['lb_loss']
              + cfg.z_loss_coef * metrics['z_loss'])
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  # Near log(V) at init.
  assert abs(float(metrics['ce_loss']) - np.log(cfg.vocab_size)) < 1.0
  np.testing.assert_allclose(loss, loss2, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               grads, grads2)
  g = nnx.to_pure_dict(grads)
  for leaf in jax.tree.leaves(g):
    assert np.all(np.isfinite(leaf))
  router_g = np.asarray(g['layers']['moe']['router']['kernel'])
  assert np.all(np.abs(router_g).reshape(cfg.num_layers, -1).max(-1) > 0)


def test_count_moe_6_78b():
  counts = count_params(get_preset('moe-6.78b'))
  assert counts == {'total': 6_775_424_000, 'backbone': 167_822_336,
                    'expert': 6_606_028_800, 'router': 1_572_864}


def test_count_moe_47b():
  # Mixtral-8x7B's shape with full multi-head attention (no grouped-query heads).
  counts = count_params(get_preset('moe-47b'))
  assert counts == {'total': 47_508_099_072, 'backbone': 2_409_893_888,
                    'expert': 45_097_156_608, 'router': 1_048_576}


def _check_contract(paths, cfg):
  L, D, E, F = cfg.num_layers, cfg.d_model, cfg.num_experts, cfg.d_ff
  routers = {p: s for p, s in paths.items() if 'router' in p.split('/')}
  experts = {p: s for p, s in paths.items() if 'experts' in p.split('/')}
  assert routers == {'layers/moe/router/kernel': (L, D, E)}
  assert experts == {'layers/moe/experts/w_gate': (L, E, D, F),
                     'layers/moe/experts/w_up': (L, E, D, F),
                     'layers/moe/experts/w_down': (L, E, F, D)}
  # No backbone path smuggles in a look-alike component either.
  for p in set(paths) - set(routers) - set(experts):
    assert not re.search(r'(^|/)(router|experts)(/|$)', p), p


def test_param_path_contract_tiny(tiny):
  cfg = tiny['cfg']
  paths = _flat_param_paths(tiny['model'])
  _check_contract(paths, cfg)
  L, D, V = cfg.num_layers, cfg.d_model, cfg.vocab_size
  assert paths == {
      'embed/embedding': (V, D),
      'layers/attn_norm/scale': (L, D),
      'layers/attn/query/kernel': (L, D, D),
      'layers/attn/key/kernel': (L, D, D),
      'layers/attn/value/kernel': (L, D, D),
      'layers/attn/out/kernel': (L, D, D),
      'layers/moe_norm/scale': (L, D),
      'layers/moe/router/kernel': (L, D, cfg.num_experts),
      'layers/moe/experts/w_gate': (L, cfg.num_experts, D, cfg.d_ff),
      'layers/moe/experts/w_up': (L, cfg.num_experts, D, cfg.d_ff),
      'layers/moe/experts/w_down': (L, cfg.num_experts, cfg.d_ff, D),
      'final_norm/scale': (D,),
      'unembed/kernel': (D, V),
  }
  assert param_shapes(cfg) == paths
  for leaf in jax.tree.leaves(nnx.state(tiny['model'], nnx.Param)):
    assert leaf.dtype == cfg.param_dtype


@pytest.mark.parametrize('name', sorted(PRESETS))
def test_param_path_contract_presets(name):
  cfg = get_preset(name)
  _check_contract(param_shapes(cfg), cfg)


def test_get_preset_errors():
  with pytest.raises(ValueError, match=r"'nope'.*tiny"):
    get_preset('nope')
  with pytest.raises(ValueError, match='bogus'):
    get_preset('tiny', bogus=1)
  assert get_preset('tiny', param_dtype='bfloat16').param_dtype == jnp.bfloat16


def test_chunked_cross_entropy_matches_whole_logits_and_grads():
  cfg = get_preset('tiny', compute_dtype=jnp.float32)
  chunked_cfg = dataclasses.replace(cfg, loss_chunk_size=7)  # 2*16 tokens: 5 chunks, padded
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 17), 0, cfg.vocab_size)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]

  def loss_and_grads(config):
    model = Transformer(config, rngs=nnx.Rngs(0))
    return nnx.value_and_grad(lambda m: lm_loss(m, inputs, targets)[0])(model)

  (loss_a, grads_a), (loss_b, grads_b) = loss_and_grads(cfg), loss_and_grads(chunked_cfg)
  np.testing.assert_allclose(loss_b, loss_a, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               nnx.state(grads_a), nnx.state(grads_b))
