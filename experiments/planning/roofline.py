"""A step-time estimate from the compiled program: each kernel against the target's roofline.

For a program compiled for a target (``compiled.as_text()``, the optimized
HLO the device would run), every kernel ``k`` (a fusion, a library call, a
copy, a collective, in the entry computation or in a loop's body) is timed as

    t_k = max(F_k / P, B_k / W) + c

and the step as ``Σ_k runs_k · t_k``, where ``F_k`` is the kernel's
matrix-multiply FLOPs (:func:`experiments.planning.hlo.device_matmul_flops`'s
count of its dots and GEMM calls), ``B_k`` the bytes it reads and writes in
device memory, ``P`` the target's dense bf16 peak (its TF32 peak for a
float32 matmul, XLA:GPU's default precision), ``W`` its memory
bandwidth, ``runs_k`` how often its computation runs in a step (loops times
their trip counts), and ``c`` a fixed cost per kernel (launch and the gaps
between kernels; :data:`KERNEL_OVERHEAD_S`). A collective's bytes go
against the interconnect's bandwidth instead (one device's buffer,
:func:`experiments.planning.hlo.collective_bytes`'s size).

Bytes are counted as XLA's own cost analysis counts them, with the
exceptions that matter in a scanned MoE step: an operand a kernel only
slices (``dynamic-slice``, ``slice``, ``gather``: one expert's weights out
of the bank) counts the slice, and a kernel that updates a buffer in place
(``dynamic-update-slice``: a layer's gradient into the stacked gradients)
counts the update. Elementwise FLOPs are not counted (a transformer step's
elementwise kernels are bandwidth-bound, which the bytes capture).

What it leaves out: caches (a weight re-read from L2 costs bandwidth here),
overlap of kernels with each other and with collectives, and kernels below
their peak (small matmuls, attention). So it is a lower bound on the step
time except for the per-kernel constant, which is the one number calibrated
on a real GPU (docs/guides/step-time.md).
"""

from __future__ import annotations

import dataclasses

from experiments.planning import hlo


@dataclasses.dataclass(frozen=True)
class Roofline:
  """A device's roofline: dense bf16 peak, memory and interconnect bandwidth.

  Attributes:
    name: the target's name.
    peak_flops: dense bf16 matrix-multiply FLOP/s (datasheet, no sparsity).
    memory_bandwidth: device-memory bytes/s.
    interconnect_bandwidth: bytes/s a device sends over NVLink (one direction).
    f32_flops: FLOP/s of a float32 matmul (TF32 tensor cores, XLA:GPU's
      default precision); ``None``: ``peak_flops``.
  """
  name: str
  peak_flops: float
  memory_bandwidth: float
  interconnect_bandwidth: float
  f32_flops: float | None = None


# Datasheets: A100 SXM4 40GB (312 TFLOP/s bf16, 156 TF32, 1,555 GB/s, NVLink
# 600 GB/s both directions), H100 SXM5 (989 TFLOP/s bf16, 494 TF32, 3.35 TB/s,
# NVLink 900 GB/s), H200 SXM (as the H100, 4.8 TB/s).
TARGETS = {
    "a100-40gb": Roofline("a100-40gb", 312e12, 1.555e12, 300e9, 156e12),
    "h100-80gb": Roofline("h100-80gb", 989e12, 3.35e12, 450e9, 494e12),
    "h200": Roofline("h200", 989e12, 4.8e12, 450e9, 494e12),
}

# Seconds each kernel costs beyond its roofline time: launch and the gap to
# the next. Calibrated on the H200 steps of 2026-12-04 (docs/guides/step-time.md).
KERNEL_OVERHEAD_S = 2.6e-6

# Instructions that run no kernel of their own, and control flow whose work
# is its computations'.
_FREE = hlo.NO_KERNEL | {"while", "conditional", "call", "async-start", "async-update",
                          "async-done", "copy-start", "copy-done", "partition-id",
                          "replica-id", "get-dimension-size", "add-dependency", "domain"}
_SLICING = {"dynamic-slice", "slice", "gather"}
# Attributes through which a computation's instructions run as kernels of
# their own (not fused into their caller's kernel).
_SEQUENTIAL = {"body", "condition", "true_computation", "false_computation",
               "branch_computations"}


@dataclasses.dataclass
class StepEstimate:
  """:func:`estimate`'s result.

  Attributes:
    seconds: the estimated step time.
    compute_seconds, memory_seconds, collective_seconds, overhead_seconds:
      how the time splits (each kernel's bound counted where it binds).
    kernels: kernel launches per step.
    matmul_flops: device matmul FLOPs per step (as counted here).
    bytes: device-memory bytes per step.
  """
  seconds: float
  compute_seconds: float
  memory_seconds: float
  collective_seconds: float
  overhead_seconds: float
  kernels: int
  matmul_flops: int
  bytes: int

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def _flops(instruction, shapes) -> tuple[int, int]:
  """``(matmul FLOPs, of which on float32 operands)`` of one instruction."""
  flops = hlo.dot_flops(instruction, shapes)
  if not flops:
    return 0, 0
  lhs = shapes.get(instruction.operands[0], "") if instruction.operands else ""
  return flops, flops if lhs.startswith("f32") else 0


def _fused_flops(computations, name: str, shapes, seen=None) -> tuple[int, int]:
  """:func:`_flops` summed inside a fused computation (nested fusions included)."""
  seen = set() if seen is None else seen
  if name in seen or name not in computations:
    return 0, 0
  seen.add(name)
  total = f32 = 0
  for instruction in computations[name]:
    flops, flops_f32 = _flops(instruction, shapes)
    total, f32 = total + flops, f32 + flops_f32
    for attribute, callee in hlo.called(instruction):
      if attribute == "calls":
        flops, flops_f32 = _fused_flops(computations, callee, shapes, seen)
        total, f32 = total + flops, f32 + flops_f32
  return total, f32


def _parameter_reads(computations, fused: str, shapes) -> dict[int, int]:
  """Bytes a fused computation reads of each parameter it only slices."""
  body = computations.get(fused, [])
  number = {}
  for instruction in body:
    if instruction.opcode == "parameter":
      number[instruction.name] = int(instruction.arguments.strip())
  users: dict[str, list] = {}
  for instruction in body:
    for operand in instruction.operands:
      users.setdefault(operand, []).append(instruction)
  reads = {}
  for name, index in number.items():
    uses = users.get(name, [])
    if uses and all(u.opcode in _SLICING and u.operands[0] == name for u in uses):
      reads[index] = sum(hlo.array_bytes(u.shape) for u in uses)
  return reads


def _in_place_write(computations, fused: str, shapes) -> int | None:
  """Bytes a fused computation writes when its root updates a buffer in place."""
  body = computations.get(fused, [])
  if not body:
    return None
  root = body[-1]
  roots = ([next((i for i in body if i.name == o), None) for o in root.operands]
           if root.opcode == "tuple" else [root])
  if not roots or any(r is None or r.opcode != "dynamic-update-slice" for r in roots):
    return None
  return sum(hlo.array_bytes(shapes.get(r.operands[1], "")) for r in roots)


def _kernel_bytes(instruction, computations, shapes) -> int:
  operand_bytes = [hlo.array_bytes(shapes.get(o, "")) for o in instruction.operands]
  out = hlo.array_bytes(instruction.shape)
  if instruction.opcode in _SLICING:
    return 2 * out
  if instruction.opcode == "dynamic-update-slice":
    update = operand_bytes[1] if len(operand_bytes) > 1 else out
    return 2 * update
  if instruction.opcode == "fusion":
    fused = next((c for a, c in hlo.called(instruction) if a == "calls"), None)
    reads = _parameter_reads(computations, fused, shapes) if fused else {}
    operand_bytes = [reads.get(i, b) for i, b in enumerate(operand_bytes)]
    written = _in_place_write(computations, fused, shapes) if fused else None
    if written is not None:
      return sum(operand_bytes) - max(operand_bytes, default=0) + 2 * written
  return sum(operand_bytes) + out


def estimate(hlo_text: str, target: str | Roofline, *, default_trip_count: int | None = None,
             kernel_overhead_s: float = KERNEL_OVERHEAD_S) -> StepEstimate:
  """The step time of a compiled program on ``target`` (module docstring).

  Args:
    hlo_text: the optimized HLO (``compiled.as_text()``).
    target: a key of :data:`TARGETS` or a :class:`Roofline`.
    default_trip_count: a loop's trip count where XLA's and the condition's
      are unknown (the layer count).
    kernel_overhead_s: the fixed cost per kernel.

  Example:
    >>> text = '''ENTRY %main (a: bf16[1024,1024], b: bf16[1024,1024]) -> bf16[1024,1024] {
    ...   %a = bf16[1024,1024]{1,0} parameter(0)
    ...   %b = bf16[1024,1024]{1,0} parameter(1)
    ...   ROOT %d = bf16[1024,1024]{1,0} dot(bf16[1024,1024]{1,0} %a, bf16[1024,1024]{1,0} %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ... }'''
    >>> e = estimate(text, "a100-40gb", kernel_overhead_s=0.0)
    >>> e.matmul_flops == 2 * 1024**3, round(e.seconds * 1e6, 2)  # compute-bound
    (True, 6.88)
  """
  roof = TARGETS[target] if isinstance(target, str) else target
  computations, entry = hlo.parse_with_entry(hlo_text)
  shapes = {i.name: i.shape for body in computations.values() for i in body}
  by_name = {i.name: i for body in computations.values() for i in body}
  runs, _, _ = hlo.runs_per_step(computations, entry, default_trip_count)
  sequential = {entry}
  for body in computations.values():
    for instruction in body:
      for attribute, callee in hlo.called(instruction):
        if attribute in _SEQUENTIAL or (attribute == "calls" and instruction.opcode
                                        in ("call", "async-start")):
          sequential.add(callee)
  compute = memory = collective = overhead = 0.0
  kernels = flops_total = bytes_total = 0
  for name in sorted(sequential):  # a fixed order: the same sums every run
    times = runs.get(name, 0)
    if not times:
      continue
    for instruction in computations.get(name, []):
      if instruction.opcode in _FREE or instruction.opcode.endswith("-start"):
        continue
      kind, size = hlo.collective(instruction, shapes, by_name)
      if kind is not None:
        collective += times * size / roof.interconnect_bandwidth
        overhead += times * kernel_overhead_s
        kernels += times
        continue
      flops, flops_f32 = _flops(instruction, shapes)
      for attribute, callee in hlo.called(instruction):
        if attribute == "calls" and instruction.opcode == "fusion":
          inner, inner_f32 = _fused_flops(computations, callee, shapes)
          flops, flops_f32 = flops + inner, flops_f32 + inner_f32
      nbytes = _kernel_bytes(instruction, computations, shapes)
      t_compute = ((flops - flops_f32) / roof.peak_flops
                   + flops_f32 / (roof.f32_flops or roof.peak_flops))
      t_memory = nbytes / roof.memory_bandwidth
      if t_compute >= t_memory:
        compute += times * t_compute
      else:
        memory += times * t_memory
      overhead += times * kernel_overhead_s
      kernels += times
      flops_total += times * flops
      bytes_total += times * nbytes
  return StepEstimate(seconds=compute + memory + collective + overhead,
                      compute_seconds=compute, memory_seconds=memory,
                      collective_seconds=collective, overhead_seconds=overhead,
                      kernels=kernels, matmul_flops=flops_total, bytes=bytes_total)


def throughput(seconds: float, *, tokens: int, useful_flops: int, target: str | Roofline,
               devices: int = 1) -> dict:
  """Tokens/s and MFU (useful FLOPs over the devices' peak) of a step of ``seconds``."""
  roof = TARGETS[target] if isinstance(target, str) else target
  return {"step_seconds": seconds, "tokens_per_second": tokens / seconds,
          "mfu": useful_flops / (seconds * devices * roof.peak_flops)}
