"""Count FLOPs and transcendentals of an optimized HLO module the way XLA's HloCostAnalysis
does, with while loops multiplied by their trip counts (`cost`, `flops`).

`compiled.cost_analysis()` counts a while loop's body once, so a 40-layer `scan` reports about
one layer. This counter walks the module parsed by `aot.hlo` from its entry, costs each
instruction by the rule for its opcode (a table from opcode to rule; other opcodes cost
nothing) and multiplies loop bodies and conditions by the trip counts `aot.hlo` derived.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable

from aot.hlo import Instruction, Module
from aot.hlo.text import ints, unquote

# Elementwise ops: HloCostAnalysis counts one op per output element, as a transcendental for
# the ops below and as a FLOP for the others.
_TRANSCENDENTAL = frozenset(
    [
        "atan2",
        "cbrt",
        "cosine",
        "erf",
        "exponential",
        "exponential-minus-one",
        "log",
        "log-plus-one",
        "logistic",
        "power",
        "rsqrt",
        "sine",
        "sqrt",
        "tan",
        "tanh",
    ]
)
_ELEMENTWISE = _TRANSCENDENTAL | frozenset(
    [
        "abs",
        "add",
        "and",
        "bitcast-convert",
        "ceil",
        "clamp",
        "compare",
        "complex",
        "convert",
        "count-leading-zeros",
        "divide",
        "floor",
        "imag",
        "is-finite",
        "maximum",
        "minimum",
        "multiply",
        "negate",
        "not",
        "or",
        "popcnt",
        "real",
        "reduce-precision",
        "remainder",
        "round-nearest-afz",
        "round-nearest-even",
        "select",
        "shift-left",
        "shift-right-arithmetic",
        "shift-right-logical",
        "sign",
        "stochastic-convert",
        "subtract",
        "xor",
    ]
)

# Custom-call targets known to do no arithmetic (TPU scratch allocation).
_BOOKKEEPING_CUSTOM_CALLS = frozenset(["AllocateBuffer"])
# GPU library calls that XLA's GPU compiler rewrites dots and convolutions into: counted as the
# dot or convolution they replace.
_CUBLAS_GEMMS = frozenset(["__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8"])
_CUDNN_CONVOLUTIONS = frozenset(
    ["__cudnn$convForward", "__cudnn$convBiasActivationForward", "__cudnn$convForwardGraph"]
)


@dataclasses.dataclass(frozen=True)
class Cost:
    """FLOPs and transcendentals per program execution, loop trip counts applied."""

    flops: float
    transcendentals: float
    unknown_loops: tuple[str, ...]  # while instructions counted once (trip count unknown)
    custom_calls: dict[str, str]  # custom-call name -> target: work not counted (see cost)


def _window(ins: Instruction) -> list[dict[str, int]]:
    """Per spatial dimension: size, stride, pad_lo, pad_hi, lhs_dilate, rhs_dilate."""
    text = ins.attrs.get("window", "").strip("{}")
    fields = dict(f.split("=", 1) for f in text.split() if "=" in f)
    if "size" not in fields:
        return []
    sizes = [int(x) for x in fields["size"].split("x")]
    n = len(sizes)

    def per_dim(key: str, default: int) -> list[int]:
        return [int(x) for x in fields[key].split("x")] if key in fields else [default] * n

    pads = (
        [tuple(int(p) for p in x.split("_")) for x in fields["pad"].split("x")]
        if "pad" in fields
        else [(0, 0)] * n
    )
    strides, base = per_dim("stride", 1), per_dim("lhs_dilate", 1)
    dilation = per_dim("rhs_dilate", 1)
    return [
        dict(
            size=sizes[d],
            stride=strides[d],
            pad_lo=pads[d][0],
            pad_hi=pads[d][1],
            lhs_dilate=base[d],
            rhs_dilate=dilation[d],
        )
        for d in range(n)
    ]


def _valid_positions(w: dict[str, int], in_size: int, out_size: int, k_size: int) -> int:
    """Number of (output, kernel) position pairs that read an input element, as XLA counts."""
    if (
        in_size == out_size == k_size == w["lhs_dilate"]
        and w["rhs_dilate"] == 1
        and max(1, in_size - 1) == w["stride"]
        and w["pad_lo"] == w["pad_hi"] == 0
    ):
        return in_size
    if (
        in_size == 1
        and k_size == out_size
        and w["rhs_dilate"] == w["lhs_dilate"] == w["stride"] == 1
        and w["pad_lo"] == w["pad_hi"] == out_size - 1
    ):
        return out_size
    count = 0
    for k in range(k_size):
        if w["stride"] == 1 and w["lhs_dilate"] == 1:
            base = w["pad_lo"] - k * w["rhs_dilate"]
            count += max(min(in_size + base, out_size) - max(base, 0), 0)
            continue
        for o in range(out_size):
            undilated = o * w["stride"] - w["pad_lo"] + k * w["rhs_dilate"]
            if undilated % w["lhs_dilate"] == 0 and 0 <= undilated // w["lhs_dilate"] < in_size:
                count += 1
    return count


def _convolution_flops(module: Module, ins: Instruction) -> float:
    lhs, rhs = module.operand(ins, 0).shape, module.operand(ins, 1).shape
    lhs_labels, rhs_out = ins.attrs["dim_labels"].split("_", 1)
    rhs_labels, out_labels = rhs_out.split("->")
    batch = lhs.dims[lhs_labels.index("b")]
    in_feature = lhs.dims[lhs_labels.index("f")]
    out_feature = ins.shape.dims[out_labels.index("f")]
    positions = 1
    for d, w in enumerate(_window(ins)):
        label = str(d)
        positions *= _valid_positions(
            w,
            lhs.dims[lhs_labels.index(label)],
            ins.shape.dims[out_labels.index(label)],
            rhs.dims[rhs_labels.index(label)],
        )
    groups = int(ins.attrs.get("feature_group_count", 1))
    batch_groups = int(ins.attrs.get("batch_group_count", 1))
    return 2.0 * (in_feature // groups) * out_feature * (batch // batch_groups) * positions


def _reduce_window_count(ins: Instruction) -> int:
    window = _window(ins)
    out = ins.shape.tuple_shapes[0] if ins.shape.is_tuple else ins.shape
    size = math.prod(w["size"] for w in window)
    count = (size - 1) * out.elements
    # XLA counts a reduce-window that is a reduce plus a broadcast along one dimension (a
    # cumulative op) as that reduce.
    reduced = [d for d, w in enumerate(window) if w["size"] != 1]
    padded = [d for d, w in enumerate(window) if w["pad_lo"] or w["pad_hi"]]
    if len(reduced) == 1 and len(padded) == 1 and not ins.shape.is_tuple:
        for d, w in enumerate(window):
            if (
                w["size"] != 1
                and w["pad_lo"] == w["pad_hi"] != 0
                and w["size"] == 2 * w["pad_lo"] + 1
            ):
                if w["pad_lo"] == out.dims[d] - 1:
                    size = out.dims[d]
                    count = out.elements // size + size - 1
                break
    return count


def _callees(ins: Instruction) -> list[str]:
    return [c for _, c in ins.calls]


def _first_output(ins: Instruction) -> Instruction:
    """A library call's instruction as the op it replaces: its result is the output tuple's
    first array (the others are workspace)."""
    shape = ins.shape.tuple_shapes[0] if ins.shape.is_tuple else ins.shape
    return dataclasses.replace(ins, shape=shape)


class _Counter:
    """HloCostAnalysis-style recursion over computations, with loop trip counts applied. Each
    opcode that costs anything has a rule in `RULES`; every other opcode costs nothing."""

    def __init__(self, module: Module):
        self.module = module
        self.memo: dict[str, tuple[float, float]] = {}
        self.unknown_loops: set[str] = set()
        self.custom_calls: dict[str, str] = {}

    def computation(self, name: str) -> tuple[float, float]:
        if name not in self.memo:
            totals = [self.instruction(ins) for ins in self.module.computations[name].instructions]
            self.memo[name] = (sum(t[0] for t in totals), sum(t[1] for t in totals))
        return self.memo[name]

    def scaled(self, name: str, n: float) -> tuple[float, float]:
        flops, trans = self.computation(name)
        return flops * n, trans * n

    def instruction(self, ins: Instruction) -> tuple[float, float]:
        rule = self.RULES.get(ins.opcode)
        return rule(self, ins) if rule is not None else (0.0, 0.0)

    # ------------------------------------------------------------------------ rules by opcode

    def elementwise(self, ins: Instruction) -> tuple[float, float]:
        return float(ins.shape.elements), 0.0

    def transcendental(self, ins: Instruction) -> tuple[float, float]:
        return 0.0, float(ins.shape.elements)

    def dot(self, ins: Instruction) -> tuple[float, float]:
        lhs = self.module.operand(ins, 0).shape
        width = math.prod(lhs.dims[d] for d in ints(ins.attrs.get("lhs_contracting_dims", "")))
        return 2.0 * ins.shape.elements * width, 0.0

    def convolution(self, ins: Instruction) -> tuple[float, float]:
        return _convolution_flops(self.module, ins), 0.0

    def fusion(self, ins: Instruction) -> tuple[float, float]:
        called = _callees(ins)
        inner = self.module.computations[called[0]].instructions
        if ins.attrs.get("kind") == "kCustom":  # XLA costs these by their gather/scatter
            for sub in inner:
                if sub.opcode == "gather":
                    return 0.0, 0.0
                if sub.opcode == "scatter":
                    return self.instruction(sub)
        return self.computation(called[0])

    def loop(self, ins: Instruction) -> tuple[float, float]:
        loop = self.module.loops[ins.name]
        if loop.trip_count is None:
            self.unknown_loops.add(ins.name)
        trips = loop.trip_count if loop.trip_count is not None else 1
        body, cond = self.computation(loop.body), self.computation(loop.condition)
        return (body[0] + cond[0]) * trips, (body[1] + cond[1]) * trips

    def call(self, ins: Instruction) -> tuple[float, float]:
        return self.computation(_callees(ins)[0])

    def conditional(self, ins: Instruction) -> tuple[float, float]:
        branches = [self.computation(c) for c in _callees(ins)]
        return max(b[0] for b in branches), max(b[1] for b in branches)

    def reduce(self, ins: Instruction) -> tuple[float, float]:
        out = ins.shape
        result = out.tuple_shapes[0] if out.is_tuple else out
        inputs = self.module.operand(ins, 0).shape.elements
        return self.scaled(_callees(ins)[0], inputs - result.elements)

    def reduce_window(self, ins: Instruction) -> tuple[float, float]:
        return self.scaled(_callees(ins)[0], _reduce_window_count(ins))

    def map_elements(self, ins: Instruction) -> tuple[float, float]:
        return self.scaled(_callees(ins)[0], ins.shape.elements)

    def scatter(self, ins: Instruction) -> tuple[float, float]:
        n = (len(ins.operands) - 1) // 2
        return self.scaled(_callees(ins)[0], self.module.operand(ins, n + 1).shape.elements)

    def select_and_scatter(self, ins: Instruction) -> tuple[float, float]:
        called = _callees(ins)
        source = self.module.operand(ins, 1).shape.elements
        window = math.prod(w["size"] for w in _window(ins))
        select = self.scaled(called[0], source * (window - 1))
        scatter = self.scaled(called[1], source)
        return select[0] + scatter[0], select[1] + scatter[1]

    def sort(self, ins: Instruction) -> tuple[float, float]:
        n = self.module.operand(ins, 0).shape.elements
        return float(n * (n - 1).bit_length()), 0.0  # n x ceil(log2 n)

    def all_reduce(self, ins: Instruction) -> tuple[float, float]:
        return float(ins.shape.elements), 0.0  # XLA assumes 2 replicas: 1 op per element

    def fft(self, ins: Instruction) -> tuple[float, float]:
        lengths = ints(ins.attrs.get("fft_length", ""))
        real = self.module.operand(ins, 0).shape
        log_factors = math.prod(n.bit_length() - 1 for n in lengths)  # floor(log2 n)
        return 8.0 * log_factors * real.elements, 0.0

    def triangular_solve(self, ins: Instruction) -> tuple[float, float]:
        a, b = self.module.operand(ins, 0).shape, self.module.operand(ins, 1).shape
        return 2.0 * a.dims[-1] * b.elements, 0.0

    def cholesky(self, ins: Instruction) -> tuple[float, float]:
        a = self.module.operand(ins, 0).shape
        return float(a.dims[-1] * a.elements // 3), 0.0

    def custom_call(self, ins: Instruction) -> tuple[float, float]:
        target = unquote(ins.attrs.get("custom_call_target", ""))
        if target in _CUBLAS_GEMMS:
            return self.cublas_gemm(ins), 0.0
        if target in _CUDNN_CONVOLUTIONS:  # keeps the convolution's window and dim_labels
            return _convolution_flops(self.module, _first_output(ins)), 0.0
        if target not in _BOOKKEEPING_CUSTOM_CALLS:
            self.custom_calls[ins.name] = target
        return 0.0, 0.0

    def cublas_gemm(self, ins: Instruction) -> float:
        """A dot XLA's GPU compiler gave to cuBLAS: 2 x output x contracted size, as the dot
        (the output is the tuple's first array, its second the workspace)."""
        numbers = json.loads(ins.attrs["backend_config"])["gemm_backend_config"]
        lhs = self.module.operand(ins, 0).shape
        contracted = numbers["dot_dimension_numbers"]["lhs_contracting_dimensions"]
        out = _first_output(ins).shape
        return 2.0 * out.elements * math.prod(lhs.dims[int(d)] for d in contracted)

    RULES: dict[str, Callable[[_Counter, Instruction], tuple[float, float]]] = {
        **dict.fromkeys(_ELEMENTWISE - _TRANSCENDENTAL, elementwise),
        **dict.fromkeys(_TRANSCENDENTAL, transcendental),
        "dot": dot,
        "scaled-dot": dot,
        "convolution": convolution,
        "fusion": fusion,
        "while": loop,
        "call": call,
        "async-start": call,
        "conditional": conditional,
        "reduce": reduce,
        "reduce-window": reduce_window,
        "map": map_elements,
        "scatter": scatter,
        "select-and-scatter": select_and_scatter,
        "sort": sort,
        "all-reduce": all_reduce,
        "all-reduce-start": all_reduce,
        "fft": fft,
        "triangular-solve": triangular_solve,
        "cholesky": cholesky,
        "rng": transcendental,
        "rng-bit-generator": transcendental,
        "custom-call": custom_call,
    }


# 8-bit operand types: the MXU's 8-bit path (int8 on v5e/v5p/v6e, fp8 on tpu7x, both on GPUs).
EIGHT_BIT = frozenset({"s8", "u8", "f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz"})


class _EightBitDots(_Counter):
    """Only the dots (and the convolutions TPU lowers dots to) whose two operands are 8-bit
    (`aot build --quant w8a8-*`), loop trip counts applied: the work at the 8-bit rate."""

    def _eight_bit(self, ins: Instruction) -> bool:
        return {self.module.operand(ins, i).shape.dtype for i in (0, 1)} <= EIGHT_BIT

    def dot(self, ins: Instruction) -> tuple[float, float]:
        return super().dot(ins) if self._eight_bit(ins) else (0.0, 0.0)

    def convolution(self, ins: Instruction) -> tuple[float, float]:
        # TPU lowers dots to convolutions.
        return super().convolution(ins) if self._eight_bit(ins) else (0.0, 0.0)

    RULES = {
        "dot": dot,
        "scaled-dot": dot,
        "convolution": convolution,
        "fusion": _Counter.fusion,
        "while": _Counter.loop,
        "call": _Counter.call,
        "conditional": _Counter.conditional,
    }


def eight_bit_flops(module: Module) -> float:
    """FLOPs of the dots on 8-bit operands per execution (part of `flops`)."""
    return _EightBitDots(module).computation(module.entry)[0]


def cost(module: Module) -> Cost:
    """FLOPs and transcendentals of one execution, counted like XLA's HloCostAnalysis (dots
    2 x output x contracted size, convolutions 2 x output x kernel window x input features per
    group, elementwise ops 1 per output element, reductions (input - output elements) x reducer)
    but with while bodies and conditions multiplied by their trip counts. Differences from XLA:
    a custom-call counts 0 (XLA: -1) and is listed unless it is known bookkeeping (a Pallas
    kernel's work is invisible here); a loop of unknown trip count counts once and is listed."""
    counter = _Counter(module)
    flops, trans = counter.computation(module.entry)
    return Cost(flops, trans, tuple(sorted(counter.unknown_loops)), counter.custom_calls)


def flops(module: Module) -> float:
    """FLOPs per execution with loop trip counts applied (see `cost`)."""
    return cost(module).flops
