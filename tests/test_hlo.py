"""aot.hlo and aot.hlo.cost: HLO text parsing, loop trip counts, collectives and FLOPs against
XLA's own counts."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from aot import hlo
from aot.hlo import cost as hlo_cost

LAYERS = 8

# A hand-written module in TPU style: tiled layouts, 6-tuples with /*index=5*/ comments,
# backend_config JSON with braces and quotes inside strings, async collectives (dedicated
# -start/-done and async-start wrapping), nested loops without known_trip_count (one counting
# down, its bound on the left), a loop whose trip count cannot be derived, and both inline
# and stack-frame source locations.
T6 = "(s32[]{:T(128)}, f32[8,128]{1,0:T(8,128)}, f32[8,128]{1,0:T(8,128)}, f32[8,128]{1,0:T(8,128)}, f32[8,128]{1,0:T(8,128)}, /*index=5*/f32[8,128]{1,0:T(8,128)})"
T2 = "(s32[]{:T(128)}, f32[8,128]{1,0:T(8,128)})"
T3 = "(s32[], s32[], f32[8,128]{1,0:T(8,128)})"
HANDMADE = f"""HloModule handmade, is_scheduled=true, entry_computation_layout={{(f32[8,128]{{1,0:T(8,128)}})->f32[8,128]{{1,0:T(8,128)}}}}

FileNames
1 "/src/train.py"

FunctionNames
1 "step"

FileLocations
1 {{file_name_id=1 function_name_id=1 line=7 end_line=7 column=2 end_column=9}}

StackFrames
1 {{file_location_id=1 parent_frame_id=1}}


%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[]{{:T(128)}} parameter(0)
  %b = f32[]{{:T(128)}} parameter(1)
  ROOT %sum = f32[]{{:T(128)}} add(%a, %b)
}}

%wrapped_reduce_scatter (p: f32[64,128]) -> f32[8,128] {{
  %p = f32[64,128]{{1,0:T(8,128)}} parameter(0)
  ROOT %rs = f32[8,128]{{1,0:T(8,128)}} reduce-scatter(%p), channel_id=3, replica_groups=[1,8]<=[8], dimensions={{0}}, to_apply=%add
}}

%inner_body (t: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {{
  %t = {T2} parameter(0)
  %i = s32[]{{:T(128)}} get-tuple-element(%t), index=0
  %x = f32[8,128]{{1,0:T(8,128)}} get-tuple-element(%t), index=1
  %one = s32[]{{:T(128)}} constant(1)
  %next = s32[]{{:T(128)}} add(%i, %one)
  %ag-start = (f32[8,128]{{1,0:T(8,128)}}, f32[64,128]{{1,0:T(8,128)(2,1)S(1)}}) all-gather-start(%x), channel_id=1, replica_groups=mesh['axis_0'=8,'axis_1'=1] {{'axis_0'}}, metadata={{op_name="jit(f)/while/body/while/body/all_gather" source_file="/src/model.py" source_line=42}}, backend_config={{"flag_configs":[],"collective_algorithm_config":{{"emitter":"AllGather{{x}}","debug":"\\nsizes: {{1,2}} \\"quoted, (paren\\" /*not a comment*/"}}}}, dimensions={{0}}, use_global_device_ids=true
  %ag-done = f32[64,128]{{1,0:T(8,128)S(1)}} all-gather-done(%ag-start)
  %rs-start = ((f32[64,128]{{1,0}}), f32[8,128]{{1,0}}, s32[]) async-start(%ag-done), calls=%wrapped_reduce_scatter
  %rs-done = f32[8,128]{{1,0:T(8,128)}} async-done(%rs-start), calls=%wrapped_reduce_scatter
  ROOT %out = {T2} tuple(%next, %rs-done)
}}

%lt_computation (u: s32[], v: s32[]) -> pred[] {{
  %u = s32[] parameter(0)
  %v = s32[] parameter(1)
  ROOT %lt = pred[] compare(%u, %v), direction=LT
}}

%inner_cond (c: (s32[], f32[8,128])) -> pred[] {{
  %c = {T2} parameter(0)
  %ci = s32[]{{:T(128)}} get-tuple-element(%c), index=0
  %three = s32[]{{:T(128)}} constant(3)
  ROOT %lt-fusion = pred[]{{:T(512)}} fusion(%ci, %three), kind=kLoop, calls=%lt_computation
}}

%outer_body (o: {T6}) -> {T6} {{
  %o = {T6} parameter(0)
  %oi = s32[]{{:T(128)}} get-tuple-element(%o), index=0
  %oi.copy = s32[]{{:T(128)S(6)}} copy(%oi)
  %two = s32[]{{:T(128)}} constant(2)
  %onext = s32[]{{:T(128)}} subtract(%oi.copy, %two)
  %ox = f32[8,128]{{1,0:T(8,128)}} get-tuple-element(%o), index=5
  %zero = s32[]{{:T(128)}} constant(0)
  %inner-init = {T2} tuple(%zero, %ox)
  %inner = {T2} while(%inner-init), condition=%inner_cond, body=%inner_body
  %iy = f32[8,128]{{1,0:T(8,128)}} get-tuple-element(%inner), index=1
  %cp-start = (f32[8,128]{{1,0:T(8,128)}}, f32[8,128]{{1,0:T(8,128)}}, u32[]{{:S(2)}}, u32[]{{:S(2)}}) collective-permute-start(%iy), channel_id=2, source_target_pairs={{{{0,1}},{{1,2}},{{2,3}},{{3,4}},{{4,5}},{{5,6}},{{6,7}},{{7,0}}}}
  %cp-done = f32[8,128]{{1,0:T(8,128)}} collective-permute-done(%cp-start)
  ROOT %oout = {T6} tuple(%onext, %ox, %ox, %ox, %ox, /*index=5*/%cp-done)
}}

%outer_cond (q: {T6}) -> pred[] {{
  %q = {T6} parameter(0)
  %qi = s32[]{{:T(128)}} get-tuple-element(%q), index=0
  %qzero = s32[]{{:T(128)}} constant(0)
  ROOT %gt = pred[]{{:T(512)}} compare(%qzero, %qi), direction=LT
}}

%free_body (r: {T3}) -> {T3} {{
  %r = {T3} parameter(0)
  %ri = s32[] get-tuple-element(%r), index=0
  %rn = s32[] get-tuple-element(%r), index=1
  %rx = f32[8,128]{{1,0:T(8,128)}} get-tuple-element(%r), index=2
  %rone = s32[] constant(1)
  %ri1 = s32[] add(%ri, %rone)
  %rn2 = s32[] multiply(%rn, %rn)
  %ar = f32[8,128]{{1,0:T(8,128)}} all-reduce(%rx), channel_id=4, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, to_apply=%add, metadata={{op_name="jit(f)/psum" stack_frame_id=1}}
  ROOT %rout = {T3} tuple(%ri1, %rn2, %ar)
}}

%free_cond (w: {T3}) -> pred[] {{
  %w = {T3} parameter(0)
  %wi = s32[] get-tuple-element(%w), index=0
  %wn = s32[] get-tuple-element(%w), index=1
  ROOT %wlt = pred[] compare(%wi, %wn), direction=LT
}}

ENTRY %main (x: f32[8,128]) -> f32[8,128] {{
  %x = f32[8,128]{{1,0:T(8,128)}} parameter(0), sharding={{devices=[8,1]<=[8]}}
  %ten = s32[]{{:T(128)}} constant(10)
  %outer-init = {T6} tuple(%ten, %x, %x, %x, %x, /*index=5*/%x)
  %outer = {T6} while(%outer-init), condition=%outer_cond, body=%outer_body, backend_config={{"flag_configs":[],"scoped_memory_configs":[]}}
  %y = f32[8,128]{{1,0:T(8,128)}} get-tuple-element(%outer), index=5
  %s0 = s32[] constant(0)
  %n0 = s32[] constant(4)
  %free-init = {T3} tuple(%s0, %n0, %y)
  %free = {T3} while(%free-init), condition=%free_cond, body=%free_body
  %kernel = f32[8,128]{{1,0}} custom-call(%y), custom_call_target="tpu_custom_call", frontend_attributes={{kernel_metadata={{
"xprof_metadata":"{{\\"block_q\\": 128}}"
}}}}, backend_config="{{\\"custom_call_config\\": {{\\"body\\": \\"TUxJUu{{(\\"}}}}"
  %scratch = f32[8,128]{{1,0}} custom-call(), custom_call_target="AllocateBuffer"
  ROOT %z = f32[8,128]{{1,0:T(8,128)}} get-tuple-element(%free), index=2
}}
"""


def test_handmade_module_parses():
    m = hlo.parse(HANDMADE)
    assert m.entry == "main" and m.name == "handmade"
    ag = m.instructions["ag-start"]
    assert ag.opcode == "all-gather-start" and ag.operands == ("x",)
    assert ag.attrs["dimensions"] == "{0}" and ag.attrs["use_global_device_ids"] == "true"
    assert str(ag.shape) == "(f32[8,128], f32[64,128])"
    assert m.instructions["outer"].shape.tuple_shapes[5].dims == (8, 128)
    assert m.instructions["oout"].operands[-1] == "cp-done"
    assert m.computations["outer_body"].root.name == "oout"
    assert m.instructions["inner"].calls == (("condition", "inner_cond"), ("body", "inner_body"))
    # A Pallas kernel's attributes span lines; the instruction after it is still its own.
    assert m.instructions["kernel"].attrs["custom_call_target"] == '"tpu_custom_call"'
    assert m.instructions["scratch"].opcode == "custom-call"


def test_handmade_loops_and_multipliers():
    m = hlo.parse(HANDMADE)
    loops = {loop.name: (loop.trip_count, loop.source) for loop in hlo.loops(m)}
    assert loops == {
        "outer": (5, "condition"),
        "inner": (3, "condition"),
        "free": (None, "unknown"),
    }
    mult = m.multipliers
    assert mult["main"] == 1 and mult["outer_body"] == mult["outer_cond"] == 5
    assert mult["inner_body"] == mult["lt_computation"] == 15
    assert mult["wrapped_reduce_scatter"] == 15  # async-done does not run it again
    assert mult["add"] == 15 + 1  # reducer of the reduce-scatter and of the all-reduce
    assert mult["free_body"] == 1


def test_handmade_collectives():
    m = hlo.parse(HANDMADE)
    found = {c.name: c for c in hlo.collectives(m)}
    assert set(found) == {"ag-start", "rs", "cp-start", "ar"}
    ag, rs, cp, ar = found["ag-start"], found["rs"], found["cp-start"], found["ar"]
    assert (ag.kind, ag.count, ag.bytes, ag.dimensions) == ("all-gather", 15, 64 * 128 * 4, (0,))
    assert (ag.source_file, ag.source_line) == ("/src/model.py", 42)
    assert ag.replica_groups == "mesh['axis_0'=8,'axis_1'=1] {'axis_0'}"
    assert (rs.kind, rs.count, rs.bytes, rs.computation) == (
        "reduce-scatter",
        15,
        8 * 128 * 4,
        "wrapped_reduce_scatter",
    )
    assert (cp.kind, cp.count, cp.bytes) == ("collective-permute", 5, 8 * 128 * 4)
    assert (ar.kind, ar.count, ar.op_name, ar.source_file, ar.source_line) == (
        "all-reduce",
        1,
        "jit(f)/psum",
        "/src/train.py",
        7,
    )
    summary = hlo.collective_summary(found.values())
    assert summary["all-gather"] == {
        "count": 15,
        "bytes": 15 * 32768,
        "static_count": 1,
        "static_bytes": 32768,
    }


def test_handmade_flops():
    c = hlo_cost.cost(hlo.parse(HANDMADE))
    # inner: (add + compare) x 15; outer: (subtract + compare) x 5; unknown loop once:
    # add, multiply, compare and the all-reduce (XLA: one op per element).
    assert c.flops == 2 * 15 + 2 * 5 + 3 + 8 * 128
    assert c.unknown_loops == ("free",)
    assert c.custom_calls == {"kernel": "tpu_custom_call"}  # its work is not counted
    summary = hlo.collective_summary(hlo.parse(HANDMADE))
    assert summary["collective-permute"]["count"] == 5


def _compile(f, *args, **jit_kwargs):
    return jax.jit(f, **jit_kwargs).lower(*args).compile()


def _layer(x, wb):
    w, b = wb
    return jnp.tanh(x @ w + b) * 0.5 + x, None


def _stack(unroll):
    def f(x, w, b):
        y, _ = jax.lax.scan(_layer, x, (w, b), unroll=unroll)
        return y.sum()

    args = (
        jax.ShapeDtypeStruct((16, 32), jnp.float32),
        jax.ShapeDtypeStruct((LAYERS, 32, 32), jnp.float32),
        jax.ShapeDtypeStruct((LAYERS, 32), jnp.float32),
    )
    return _compile(f, *args)


def test_scan_flops_match_unrolled():
    scanned, unrolled = _stack(unroll=1), _stack(unroll=True)
    reference = unrolled.cost_analysis()["flops"]
    ours = hlo_cost.flops(hlo.parse(scanned.as_text()))
    assert ours == pytest.approx(reference, rel=0.01)
    assert hlo_cost.flops(hlo.parse(unrolled.as_text())) == pytest.approx(reference, rel=1e-6)
    # XLA counts the scan body once: about 1/LAYERS of the real work.
    assert scanned.cost_analysis()["flops"] * LAYERS == pytest.approx(ours, rel=0.05)
    (loop,) = hlo.loops(hlo.parse(scanned.as_text()))
    assert (loop.trip_count, loop.source) == (LAYERS, "known_trip_count")


def test_loop_free_flops_match_xla():
    # Strided, dilated and grouped convolutions, pooling, cumsum (reduce-window), batched dot,
    # sort and transcendentals: the counts must equal XLA's own for a program without loops.
    def f(x, k, kg, q):
        dn = ("NHWC", "HWIO", "NHWC")
        a = jax.lax.conv_general_dilated(x, k, (2, 2), "SAME", dimension_numbers=dn)
        b = jax.lax.conv_general_dilated(
            x,
            kg,
            (1, 1),
            [(1, 1), (1, 1)],
            lhs_dilation=(2, 2),
            rhs_dilation=(1, 2),
            feature_group_count=4,
            dimension_numbers=dn,
        )
        c = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
        d = jnp.cumsum(x, axis=1)
        e = jnp.einsum("bqd,bkd->bqk", q, q)
        t = (
            jnp.exp(q).sum()
            + jnp.log1p(jnp.abs(q)).sum()
            + jnp.sin(q).sum()
            + jax.nn.sigmoid(q).sum()
        )
        return a.sum() + b.mean() + c.max() + d.sum() + e.sum() + jnp.sort(q, axis=-1).sum() + t

    shapes = [(2, 16, 16, 8), (3, 3, 8, 16), (3, 3, 2, 8), (2, 10, 12)]
    compiled = _compile(f, *[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])
    c = hlo_cost.cost(hlo.parse(compiled.as_text()))
    xla = compiled.cost_analysis()
    assert c.flops == pytest.approx(xla["flops"], rel=1e-6)
    assert c.transcendentals == pytest.approx(xla["transcendentals"], rel=1e-6)


def test_trip_count_from_condition():
    text = _stack(unroll=1).as_text()
    stripped, n = re.subn(r'"known_trip_count":\{"n":"\d+"\},?', "", text)
    assert n == 1
    m = hlo.parse(stripped)
    (loop,) = hlo.loops(m)
    assert (loop.trip_count, loop.source) == (LAYERS, "condition")
    assert hlo_cost.flops(m) == hlo_cost.flops(hlo.parse(text))


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:8]), ("d",))


def test_reshard_width_to_height_is_all_to_all(mesh):
    wide, tall = NamedSharding(mesh, P(None, "d")), NamedSharding(mesh, P("d", None))

    def f(x):
        return jax.lax.with_sharding_constraint(x * 2, tall)

    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    m = hlo.parse(_compile(f, x, in_shardings=wide, out_shardings=tall).as_text())
    (a2a,) = [c for c in hlo.collectives(m) if c.kind == "all-to-all"]
    assert a2a.shape.is_tuple and len(a2a.shape.tuple_shapes) == 8  # CPU: tuple form
    assert a2a.bytes == 64 * 64 * 4 // 8 and a2a.count == 1
    assert a2a.source_file == __file__


def test_sharded_matmul_collectives(mesh):
    # Contracting dimension sharded: partial sums are all-reduced; replicated output of a
    # row-sharded input: all-gathered.
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    compiled = _compile(
        lambda x, w: x @ w,
        x,
        w,
        in_shardings=(NamedSharding(mesh, P(None, "d")), NamedSharding(mesh, P("d", None))),
        out_shardings=NamedSharding(mesh, P()),
    )
    summary = hlo.collective_summary(hlo.collectives(hlo.parse(compiled.as_text())))
    assert summary["all-reduce"] == {
        "count": 1,
        "bytes": 64 * 128 * 4,
        "static_count": 1,
        "static_bytes": 64 * 128 * 4,
    }

    gathered = _compile(
        lambda x: x + 1,
        x,
        in_shardings=NamedSharding(mesh, P("d", None)),
        out_shardings=NamedSharding(mesh, P()),
    )
    (ag,) = hlo.collectives(hlo.parse(gathered.as_text()))
    assert (ag.kind, ag.bytes, ag.dimensions) == ("all-gather", 64 * 64 * 4, (0,))


def test_collective_in_scan_counts_trips(mesh):
    trips = 5

    def f(x, ws):
        def body(x, w):
            return jnp.tanh(x @ w), None

        return jax.lax.scan(body, x, ws)[0]

    compiled = _compile(
        f,
        jax.ShapeDtypeStruct((64, 64), jnp.float32),
        jax.ShapeDtypeStruct((trips, 64, 64), jnp.float32),
        in_shardings=(NamedSharding(mesh, P(None, "d")), NamedSharding(mesh, P(None, "d", None))),
        out_shardings=NamedSharding(mesh, P()),
    )
    m = hlo.parse(compiled.as_text())
    (loop,) = hlo.loops(m)
    (in_loop,) = [c for c in hlo.collectives(m) if c.computation == loop.body]
    assert in_loop.kind == "all-reduce" and in_loop.count == trips
    summary = hlo.collective_summary(m)["all-reduce"]
    assert summary["count"] == trips and summary["static_count"] == 1
    assert summary["bytes"] == trips * in_loop.bytes


@pytest.fixture(scope="module")
def tpu_mesh():
    pytest.importorskip("libtpu", reason="needs the tpu extra")
    # Deviceless compile for a v6e:2x4 slice; libtpu reads these when the topology is first
    # asked for. Other processes on this host may have libtpu loaded too.
    settings = dict(
        TPU_SKIP_MDS_QUERY="1", TPU_ACCELERATOR_TYPE="v6e-8", ALLOW_MULTIPLE_LIBTPU_LOAD="1"
    )
    with pytest.MonkeyPatch.context() as mp:
        for key, value in settings.items():
            mp.setenv(key, os.environ.get(key, value))
        from jax.experimental import topologies

        topology = topologies.get_topology_desc(platform="tpu", topology_name="v6e:2x4")
    return Mesh(np.array(topology.devices), ("d",))


def test_tpu_hlo(tpu_mesh):
    wide, tall = NamedSharding(tpu_mesh, P(None, "d")), NamedSharding(tpu_mesh, P("d", None))
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    reshard = _compile(
        lambda x: jax.lax.with_sharding_constraint(x * 2, tall),
        x,
        in_shardings=wide,
        out_shardings=tall,
    )
    m = hlo.parse(reshard.as_text())
    (a2a,) = [c for c in hlo.collectives(m) if c.kind == "all-to-all"]
    assert not a2a.shape.is_tuple and a2a.dimensions is not None  # TPU: array form
    assert a2a.bytes == 256 * 256 * 4 // 8

    def mlp(x, w1, w2):
        return jax.nn.gelu(x @ w1) @ w2

    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(256, 128), (128, 512), (512, 128)]]
    rows, replicated = NamedSharding(tpu_mesh, P("d", None)), NamedSharding(tpu_mesh, P())
    compiled = _compile(mlp, *args, in_shardings=(rows, replicated, replicated), out_shardings=rows)
    assert hlo_cost.flops(hlo.parse(compiled.as_text())) == pytest.approx(
        compiled.cost_analysis()["flops"], rel=1e-6
    )


def test_tpu_scan_without_known_trip_count(tpu_mesh):
    # TPU HLO often lacks known_trip_count: the count comes from the loop condition.
    def f(x, ws):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]

    sharding = NamedSharding(tpu_mesh, P())
    args = (
        jax.ShapeDtypeStruct((128, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((LAYERS, 128, 128), jnp.bfloat16),
    )
    scanned = _compile(f, *args, in_shardings=(sharding, sharding), out_shardings=sharding)
    m = hlo.parse(scanned.as_text())
    assert [loop.trip_count for loop in hlo.loops(m)] == [LAYERS]
    assert hlo_cost.flops(m) == pytest.approx(LAYERS * scanned.cost_analysis()["flops"], rel=0.01)


def test_computation_on_another_execution_thread():
    """tpu7x puts copies on SparseCore: such a computation closes with an execution_thread and
    runs once per execution of the call-start that names it (to_apply)."""
    text = """HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%called (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %c = f32[4]{0} copy(%p)
}, execution_thread="sparsecore"

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %s = ((f32[4]{0}), f32[4]{0}, u32[]{:S(8)}) call-start(%x), async_execution_thread="sparsecore", to_apply=%called
  %d = f32[4]{0} call-done(%s)
  ROOT %a = f32[4]{0} add(%d, %d)
}
"""
    module = hlo.parse(text)
    assert set(module.computations) == {"called", "main"}
    assert module.multipliers == {"main": 1, "called": 1}
    assert module.entry == "main" and hlo_cost.flops(module) == 4
