"""Live monitoring and samples: routing health, TensorBoard event files, the
heatmap, text sampling and the sample command (experiments/training/monitoring.py,
experiments/training/sampling.py, experiments/sample.py)."""

import json
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import models
from experiments import sample
from experiments.training import monitoring
from experiments.training import sampling
from experiments.training import config as config_lib
from experiments.training import run as training


def test_routing_health_by_hand():
  fractions = [[0.25, 0.25, 0.25, 0.25],   # balanced
               [0.5, 0.5, 0.0, 0.0],       # collapsed onto k=2 of E=4
               [0.4, 0.3, 0.28, 0.02]]     # one expert at 8 % of its share
  health = monitoring.routing_health(fractions, [1.0, 2.0, 1.1], [0.5, 0.6, 0.7])
  assert health["routing/layer_00/max_mean_load"] == pytest.approx(1.0)
  assert health["routing/layer_00/starved_fraction"] == 0.0
  assert health["routing/layer_01/max_mean_load"] == pytest.approx(2.0)
  assert health["routing/layer_01/starved_fraction"] == 0.5
  assert health["routing/layer_02/max_mean_load"] == pytest.approx(1.6)
  assert health["routing/layer_02/starved_fraction"] == 0.25
  assert health["routing/layer_02/lb_loss"] == pytest.approx(1.1)
  assert health["routing/layer_01/z_loss"] == pytest.approx(0.6)
  assert health["routing/max_mean_load"] == pytest.approx(2.0)
  assert health["routing/starved_fraction"] == pytest.approx(0.25)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, corpus, cache_dir):
  out = tmp_path_factory.mktemp("monitored")
  config = config_lib.TrainConfig(preset="tiny", batch_size=4, seq_len=32, eval_batches=2,
                                  log_every=1, warmup_steps=2, steps=4, eval_every=2,
                                  ckpt_every=4, sample_tokens=6, data=corpus)
  summary = training.train(config, out, progress=False, cache_dir=cache_dir)
  return out, summary


def test_tensorboard_holds_every_scalar_the_jsonl_has(tiny_run):
  out, _ = tiny_run
  scalars = monitoring.read_scalars(out / "tensorboard")
  layers = models.get_preset("tiny").num_layers
  expected = {"train/loss", "train/ce_loss", "train/perplexity", "train/lb_loss",
              "train/z_loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_s",
              "train/skipped_steps", "val/loss", "val/perplexity",
              "routing/max_mean_load", "routing/starved_fraction"}
  expected |= {f"routing/layer_{l:02d}/{name}" for l in range(layers)
               for name in ("max_mean_load", "starved_fraction", "lb_loss", "z_loss")}
  assert expected <= set(scalars), expected - set(scalars)
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  losses = {r["step"]: r["loss"] for r in records if "loss" in r}
  assert [s for s, _ in scalars["train/loss"]] == sorted(losses) == [1, 2, 3, 4]
  for step, value in scalars["train/loss"]:
    assert value == pytest.approx(losses[step], rel=1e-6)
  val = {r["step"]: r["val_ppl"] for r in records if "val_ppl" in r}
  assert dict(scalars["val/perplexity"]) == pytest.approx(val)
  assert dict(scalars["val/loss"]) == pytest.approx({s: math.log(p) for s, p in val.items()})
  for step, ratio in scalars["routing/max_mean_load"]:
    assert 1.0 <= ratio <= models.get_preset("tiny").num_experts


def test_samples_and_heatmap_are_written(tiny_run):
  out, _ = tiny_run
  texts = monitoring.read_texts(out / "tensorboard")
  assert [step for step, _ in texts["sample"]] == [2, 4]
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  samples = [r for r in records if "sample" in r]
  assert [r["step"] for r in samples] == [2, 4]
  assert all(0 < len(r["sample"]) <= 200 for r in samples)
  assert (out / "expert_load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sample_command_is_deterministic_per_seed(tiny_run, capsys):
  out, _ = tiny_run
  flags = ["--run", str(out), "--prompt", "KING", "--max-tokens", "6"]
  texts = []
  for seed in ("1", "1", "2"):
    assert sample.main(flags + ["--seed", seed]) == 0
    texts.append(capsys.readouterr().out)
  assert texts[0] == texts[1] and texts[0].startswith("KING")
  assert sample.main(["--run", str(out / "nowhere"), "--prompt", "x"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ") and "holds no checkpoint" in err and "\n" not in err


def test_greedy_generation_equals_recomputing_the_model_by_hand():
  config = models.get_preset("tiny", compute_dtype=jnp.float32)
  model = models.Transformer(config, rngs=nnx.Rngs(3))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  next_token = sampling.make_next_token(graphdef, rest, temperature=0.0)
  prompt, window = [5, 17, 99], 4
  got = sampling.generate(next_token, nnx.as_pure(params), prompt, 4, window=window)
  tokens = list(prompt)
  for _ in range(4):  # the whole model on the last `window` tokens, no padding
    logits, _ = model(jnp.asarray([tokens[-window:]], jnp.int32))
    tokens.append(int(jnp.argmax(logits[0, -1])))
  assert got == tokens[len(prompt):]


def test_top_k_and_temperature():
  logits = jnp.array([3.0, 2.9, -1.0, 0.5, 2.0])
  draws = {int(sampling.sample_logits(logits, jax.random.key(i), temperature=1.0, top_k=2))
           for i in range(64)}
  assert draws == {0, 1}
  cold = [int(sampling.sample_logits(logits, jax.random.key(i), temperature=1e-3, top_k=0))
          for i in range(16)]
  assert cold == [0] * 16
  assert int(sampling.sample_logits(logits, jax.random.key(0), temperature=0.0, top_k=0)) == 0
  with pytest.raises(ValueError, match="no token"):
    sampling.generate(None, None, [], 3, window=4)
