"""What a compiled SPMD program communicates: collective bytes read from its optimized HLO.

XLA's ``compiled.cost_analysis()`` counts a loop body once, so it cannot say
what a scanned layer stack communicates per step. :func:`collective_bytes`
reads the optimized HLO text instead (``compiled.as_text()``: the program one
device runs after SPMD partitioning) and sums, for each collective kind,

    bytes(instruction) = max(bytes of its operands, bytes of its result)

over every collective instruction, times how often its computation runs per
step. That is the size of the larger buffer the collective handles on one
device: an all-gather's gathered result, a reduce-scatter's unreduced input,
an all-reduce's, all-to-all's or collective-permute's buffer (same size in
and out). What crosses the wire is a fraction of it that depends on the
algorithm and the group size (a ring all-reduce sends ``2 (n−1)/n`` of it,
an all-gather ``(n−1)/n``); the figure is the buffer, per device, per step.

How often a computation runs: once for the entry computation; a ``while``
loop's body runs its trip count times per run of the loop, read from the
loop's ``known_trip_count`` (XLA's ``backend_config``, set by its
trip-count analysis on CPU, GPU and TPU), else from the one integer constant
its condition compares the induction variable with, else
``default_trip_count`` (e.g. the model's number of layers). Fusions, calls,
async wrappers and both branches of a conditional count once per run of
their caller (a conditional's branches are an upper bound). Nested loops
multiply.

Asynchronous collectives (XLA:GPU's ``all-gather-start`` /
``all-gather-done`` pairs) are counted once, at the ``-done``: its result
against the ``-start`` 's operands. Collectives wrapped in an
``async-start`` computation are counted inside it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Iterable

# The kinds reported, by HLO opcode.
KINDS = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\b(pred|token|bf16|c64|c128|[fsu]\d+\w*)\[([\d,]*)\]")
_CALLED = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation|"
    r"branch_computations|async_execution_thread)=(\{[^}]*\}|%?[\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def array_bytes(shape_text: str) -> int:
  """Bytes of every array shape in ``shape_text`` (a tuple's elements summed).

  Example:
    >>> array_bytes("(bf16[8,128]{1,0}, f32[4]{0}, pred[])")
    2065
  """
  total = 0
  for dtype, dims in _ARRAY.findall(shape_text):
    if dtype == "token":
      continue
    bits = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}.get(dtype)
    if bits is None:
      bits = int(re.match(r"[fsu](\d+)", dtype).group(1))
    elements = 1
    for d in filter(None, dims.split(",")):
      elements *= int(d)
    total += (elements * bits + 7) // 8
  return total


def _matching(text: str, start: int) -> int:
  """Index just past the bracket closing the one at ``text[start]``."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack = []
  for i in range(start, len(text)):
    c = text[i]
    if c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return i + 1
  return len(text)


@dataclasses.dataclass
class Instruction:
  """One HLO instruction: name, result shape, opcode, operands, attributes (all text)."""
  name: str
  shape: str
  opcode: str
  operands: list[str]
  arguments: str
  attributes: str


def _parse_instruction(line: str) -> Instruction | None:
  match = _INSTRUCTION.match(line)
  if not match:
    return None
  name, rest = match.groups()
  rest = rest.strip()
  if rest.startswith("("):
    end = _matching(rest, 0)
  else:
    end = rest.find(" ")
    end = len(rest) if end < 0 else end
  shape, rest = rest[:end], rest[end:].lstrip()
  opcode_match = re.match(r"([\w\-]+)\(", rest)
  if not opcode_match:
    return None
  open_at = opcode_match.end() - 1
  close_at = _matching(rest, open_at)
  arguments = rest[open_at + 1:close_at - 1]
  operands = re.findall(r"%([\w.\-]+)", arguments)
  return Instruction(name, shape, opcode_match.group(1), operands, arguments, rest[close_at:])


def parse_module(hlo_text: str) -> tuple[dict[str, list[Instruction]], str | None]:
  """``({computation name: its instructions}, entry computation name)``."""
  computations: dict[str, list[Instruction]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    stripped = line.strip()
    header = _COMPUTATION.match(stripped)
    if header and not _INSTRUCTION.match(stripped):
      current = header.group(1)
      computations[current] = []
      if stripped.startswith("ENTRY"):
        entry = current
      continue
    if stripped == "}":
      current = None
      continue
    if current is not None:
      instruction = _parse_instruction(line)
      if instruction is not None:
        computations[current].append(instruction)
  return computations, entry


def called(instruction: Instruction) -> list[tuple[str, str]]:
  """``(attribute, computation)`` for each computation ``instruction`` calls."""
  out = []
  for attribute, value in _CALLED.findall(instruction.attributes):
    if attribute == "async_execution_thread":
      continue
    for name in re.findall(r"%?([\w.\-]+)", value.strip("{}")):
      out.append((attribute, name))
  return out


def _condition_constant(computations, condition: str) -> int | None:
  """The one integer constant a loop condition (or what it calls) holds, if exactly one."""
  seen, todo, constants = set(), [condition], set()
  while todo:
    name = todo.pop()
    if name in seen or name not in computations:
      continue
    seen.add(name)
    for instruction in computations[name]:
      if (instruction.opcode == "constant" and re.fullmatch(r"[su]\d+\[\]", instruction.shape)
          and re.fullmatch(r"-?\d+", instruction.arguments.strip())):
        constants.add(int(instruction.arguments))
      todo.extend(callee for _, callee in called(instruction))
  return constants.pop() if len(constants) == 1 else None


@dataclasses.dataclass
class CollectiveReport:
  """Collective bytes per kind (per device, per step), and how the loops were counted.

  Attributes:
    bytes: ``{kind: bytes}`` for every kind of :data:`KINDS`.
    counts: ``{kind: instructions executed per step}``.
    trip_counts: ``{loop instruction name: trip count used}`` for loops
      whose body (or something it calls) holds a collective.
    assumed_trip_counts: the loops of ``trip_counts`` whose count was
      neither known to XLA nor read from their condition.
  """
  bytes: dict[str, int]
  counts: dict[str, int]
  trip_counts: dict[str, int]
  assumed_trip_counts: list[str]

  def to_json(self) -> dict:
    """A JSON-serialisable dict of the report."""
    return json.loads(json.dumps(dataclasses.asdict(self)))


# Instructions that run no kernel: they name or regroup buffers.
NO_KERNEL = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
                        "after-all", "optimization-barrier"})


def kernel_bytes(hlo_text: str) -> int:
  """Bytes the kernels of a compiled program read and write, from its HLO text.

  Every top-level instruction of the entry computation that runs (a fusion, a
  copy, a custom call) counts its operands and its result in full; tuples,
  bitcasts and parameters move nothing. That is how XLA's own cost analysis
  counts ``bytes accessed``; this version also works for a program compiled
  for a GPU target without a device, whose cost analysis is empty.

  Example:
    >>> kernel_bytes('''ENTRY %main (p: f32[4]) -> f32[4] {
    ...   %p = f32[4]{0} parameter(0)
    ...   ROOT %n = f32[4]{0} negate(f32[4]{0} %p)
    ... }''')
    32
  """
  computations, entry = parse_module(hlo_text)
  sizes, total = {}, 0
  for instruction in computations[entry]:
    sizes[instruction.name] = array_bytes(instruction.shape)
    if instruction.opcode not in NO_KERNEL:
      total += sizes[instruction.name] + sum(sizes.get(o, 0) for o in instruction.operands)
  return total


def collective_bytes(hlo_text: str, default_trip_count: int | None = None) -> CollectiveReport:
  """Bytes each collective kind handles per device per step (module docstring).

  Args:
    hlo_text: an optimized HLO module's text (``compiled.as_text()``).
    default_trip_count: the trip count of a loop whose count XLA does not
      know and its condition does not show (``None``: such a loop counts
      once and is listed in ``assumed_trip_counts``).

  Raises:
    ValueError: if the text holds no entry computation.
  """
  computations, entry = parse_with_entry(hlo_text)
  shapes = {i.name: i.shape for instructions in computations.values() for i in instructions}
  by_name = {i.name: i for instructions in computations.values() for i in instructions}
  runs, trip_counts, assumed = runs_per_step(computations, entry, default_trip_count)

  totals = {kind: 0 for kind in KINDS}
  counts = {kind: 0 for kind in KINDS}
  holding = set()
  for name, instructions in computations.items():
    for instruction in instructions:
      kind, size = collective(instruction, shapes, by_name)
      if kind is None:
        continue
      totals[kind] += runs.get(name, 0) * size
      counts[kind] += runs.get(name, 0)
      holding.add(name)
  loops = {n: c for n, c in trip_counts.items()
           if _reaches(computations, by_name[n], holding)}
  return CollectiveReport(bytes=totals, counts=counts, trip_counts=loops,
                          assumed_trip_counts=[n for n in assumed if n in loops])


def parse_with_entry(hlo_text: str):
  """:func:`parse_module`, refusing a text without an entry computation."""
  computations, entry = parse_module(hlo_text)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return computations, entry


def runs_per_step(computations, entry: str, default_trip_count: int | None):
  """(runs per step by computation, trip count by loop, loops whose count was assumed)."""
  runs: dict[str, int] = {entry: 1}
  trip_counts: dict[str, int] = {}
  assumed: list[str] = []
  for name in _topological(computations, entry):  # callers before callees (HLO is a DAG)
    for instruction in computations.get(name, []):
      callees = called(instruction)
      if not callees:
        continue
      times = 1
      if instruction.opcode == "while":
        times = _trip_count(computations, instruction, default_trip_count, assumed)
        trip_counts[instruction.name] = times
      for attribute, callee in callees:
        factor = times if attribute == "body" else 1
        runs[callee] = runs.get(callee, 0) + runs.get(name, 0) * factor
  return runs, trip_counts, assumed


def _dims(shape_text: str) -> list[int]:
  match = _ARRAY.search(shape_text)
  return [int(d) for d in match.group(2).split(",") if d] if match else []


def dot_flops(instruction: Instruction, shapes) -> int:
  """``2 · |output| · |contracted|`` of a ``dot`` or a cuBLAS GEMM custom call, else 0."""
  if instruction.opcode == "dot":
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.attributes)
  elif (instruction.opcode == "custom-call"
        and re.search(r'custom_call_target="__cublas\$(gemm|lt\$matmul)"', instruction.attributes)):
    contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instruction.attributes)
  else:
    return 0
  if not contracting or not instruction.operands:
    return 0
  lhs = _dims(shapes.get(instruction.operands[0], ""))
  axes = [int(a) for a in re.findall(r"\d+", contracting.group(1))]
  out = 1
  for d in _dims(instruction.shape):  # a GEMM custom call's result: (output, workspace)
    out *= d
  contracted = 1
  for a in axes:
    contracted *= lhs[a] if a < len(lhs) else 1
  return 2 * out * contracted


def device_matmul_flops(hlo_text: str, default_trip_count: int | None = None) -> int | None:
  """Matrix-multiply FLOPs one device runs per step, from its optimized HLO.

  ``2 · |output| · |contracted|`` for every ``dot`` (fused or not) and cuBLAS
  GEMM custom call, times how often its computation runs (loops as in
  :func:`collective_bytes`). This counts what the partitioned program does:
  work repeated on devices that share a data shard, and the recomputation
  XLA kept. ``None`` when the program has convolutions instead (XLA:TPU
  lowers matrix multiplies to them), which this does not count.
  """
  computations, entry = parse_with_entry(hlo_text)
  shapes = {i.name: i.shape for instructions in computations.values() for i in instructions}
  runs, _, _ = runs_per_step(computations, entry, default_trip_count)
  total = 0
  for name, instructions in computations.items():
    for instruction in instructions:
      if instruction.opcode == "convolution":
        return None
      total += runs.get(name, 0) * dot_flops(instruction, shapes)
  return total


def collective(instruction: Instruction, shapes, by_name) -> tuple[str | None, int]:
  """``(kind, bytes)`` of a collective instruction (module docstring), else ``(None, 0)``."""
  opcode = instruction.opcode
  if opcode in KINDS:
    inputs = sum(array_bytes(shapes.get(o, "")) for o in instruction.operands)
    return opcode, max(inputs, array_bytes(instruction.shape))
  if opcode.endswith("-done") and opcode[:-len("-done")] in KINDS:
    start = by_name.get(instruction.operands[0]) if instruction.operands else None
    inputs = sum(array_bytes(shapes.get(o, "")) for o in start.operands) if start else 0
    return opcode[:-len("-done")], max(inputs, array_bytes(instruction.shape))
  return None, 0


def _trip_count(computations, loop: Instruction, default: int | None, assumed: list) -> int:
  known = _TRIP_COUNT.search(loop.attributes)
  if known:
    return int(known.group(1))
  condition = dict(called(loop)).get("condition")
  constant = _condition_constant(computations, condition) if condition else None
  if constant is not None and constant > 0:
    return constant
  assumed.append(loop.name)
  return default if default is not None else 1


def _topological(computations, entry: str) -> list[str]:
  order, seen = [], set()

  def visit(name):
    if name in seen or name not in computations:
      return
    seen.add(name)
    for instruction in computations[name]:
      for _, callee in called(instruction):
        visit(callee)
    order.append(name)

  visit(entry)
  return order[::-1]


def _reaches(computations, instruction: Instruction, targets: Iterable[str]) -> bool:
  targets, seen = set(targets), set()
  todo = [callee for _, callee in called(instruction)]
  while todo:
    name = todo.pop()
    if name in targets:
      return True
    if name in seen or name not in computations:
      continue
    seen.add(name)
    todo.extend(c for i in computations[name] for _, c in called(i))
  return False
