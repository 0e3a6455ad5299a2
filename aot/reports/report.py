"""Human and machine views of build manifests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.builds.artifact import Manifest
from runtime.builds.loader import read_builds
from wan import residency, sparse_attention
from wan.interface import sparse_variant
from wan.models import attention as attention_lib

GiB = float(1 << 30)


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True))
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def _peak_text(manifest: Manifest) -> str:
    """The pipeline's resident peak per device (wan.residency), of the HBM, at its program."""
    name, peak = manifest.resident_peak_program, manifest.resident_peak_bytes
    hbm = (
        f" / {manifest.hbm_bytes / GiB:.0f} GiB ({100 * peak / manifest.hbm_bytes:.0f}%)"
        if manifest.hbm_bytes
        else ""
    )
    return f"{peak / GiB:.2f} GiB{hbm} [{name}]"


def _collectives_text(collectives: dict[str, dict[str, int]]) -> str:
    parts = [f"{kind}:{c['count']}" for kind, c in sorted(collectives.items()) if c["count"]]
    return " ".join(parts) or "none"


def _all_collectives(manifest: Manifest) -> dict[str, dict[str, int]]:
    total: dict[str, dict[str, int]] = {}
    for prog in manifest.programs.values():
        for kind, c in prog.collectives.items():
            slot = total.setdefault(kind, {"count": 0, "bytes": 0})
            slot["count"] += c["count"]
            slot["bytes"] += c["bytes"]
    return total


def _step_flops(manifest: Manifest) -> float:
    step = manifest.programs[manifest.key.step_program]
    return step.flops + step.kernel_flops


def _eight_bit_flops(manifest: Manifest) -> float:
    step = manifest.programs[manifest.key.step_program]
    return step.eight_bit_flops + step.eight_bit_kernel_flops


def _lower_bound_text(manifest: Manifest) -> str:
    bound = manifest.step_lower_bound()
    return "unknown peak" if bound is None else f"{bound:.3f} s"


def _status_text(result: Any) -> str:
    if result.skipped:
        return "up to date"
    reused = [n for n, st in result.programs.items() if st == "reused"]
    return f"built, reused {','.join(reused)}" if reused else "built"


def builds_table(results: Sequence[Any]) -> str:
    rows = []
    for r in results:
        m = r.manifest
        rows.append([
            r.folder.name,
            _status_text(r),
            _peak_text(m),
            f"{_step_flops(m) / 1e12:.3f}",
            _lower_bound_text(m),
            _collectives_text(_all_collectives(m)),
            f"{sum(m.programs[n].compile_seconds for n, st in r.programs.items() if st == 'compiled'):.1f}",
            f"{max((m.programs[n].peak_rss_bytes for n, st in r.programs.items() if st == 'compiled'), default=0) / GiB:.2f}",
        ])  # fmt: skip
    header = [
        "build",
        "status",
        "resident peak/device",
        "TFLOP/step/device",
        "step lower bound",
        "collectives",
        "compile s",
        "peak RSS GiB",
    ]
    return text_table(header, rows)


def builds_json(results: Sequence[Any]) -> list[dict[str, Any]]:
    return [
        {
            "folder": str(r.folder),
            "skipped": r.skipped,
            "found_by": r.found_by,  # how a skipped build was found up to date (BuildResult)
            "programs": r.programs,
            "manifest": r.manifest.to_json(),
        }
        for r in results
    ]


def list_table(folder: Path) -> str:
    """A row per build in `folder`; a build whose manifest does not read says why."""
    rows = []
    for build, m in read_builds(folder):
        if not isinstance(m, Manifest):
            rows.append([build.name, *["-"] * 7, f"unreadable: {m}"])
            continue
        k = m.key
        rows.append([
            build.name, k.model, f"{k.width}x{k.height}", str(k.frames), str(k.batch),
            k.target, ",".join(f"{a}={n}" for a, n in k.mesh if n > 1) or "1 device",
            f"{k.vae_mesh[0]}x{k.vae_mesh[1]} {k.vae_axis}", _peak_text(m),
        ])  # fmt: skip
    if not rows:
        return f"no builds in {folder} (make one with `aot build`)"
    return text_table(
        ["build", "model", "res", "frames", "batch", "target", "mesh", "vae", "resident peak"],
        rows,
    )


def _sparse_lines(m: Manifest) -> list[str]:
    """A --sparse-attention build's settings, its sparse step's self-attention and bound."""
    settings = sparse_attention.parse(m.key.option("sparse_attention"))
    if settings is None:
        return []
    name = sparse_variant(m.key.step_program)
    dense, sparse = m.programs[m.key.step_program], m.programs[name]
    bounds = [m.step_lower_bound(p) for p in (m.key.step_program, name)]
    bound = (
        f"; step lower bound {bounds[1]:.3f} s against {bounds[0]:.3f} s dense" if bounds[0] else ""
    )
    kernel = attention_lib.kernel_name(m.key.attention)
    blocks = ""
    if kernel in attention_lib.TPU_KERNELS:
        b = attention_lib.call_blocks(m.key.attention, settings.block)
        blocks = f"; its Radial calls run {kernel} at blocks {b.q}/{b.kv}/{b.kv_compute}"
    return [
        f"sparse     {settings.text()}: the first {settings.dense_steps} steps dense, then "
        f"{name} with {settings.dense_layers} dense layer(s){blocks}",
        f"           {name}'s self-attention kernel computes {sparse.attention_density:.4f} "
        f"of its blocks: {sparse.self_attention_flops / 1e12:.4f} of "
        f"{dense.self_attention_flops_dense / 1e12:.4f} TFLOP per device{bound}",
    ]


def _memory_line(m: Manifest) -> str:
    """Where the runtime keeps each component's weights, the peak that makes, and with every
    component resident (what a runtime without placement would need)."""
    weights = ", ".join(
        f"{c} {b / GiB:.2f} GiB {m.placement[c]}" for c, b in m.weight_bytes.items()
    )
    line = f"memory     resident peak {_peak_text(m)}; weights per device: {weights}"
    if residency.TRANSIENT in m.placement.values():
        peak, at = m.resident_peak(dict.fromkeys(m.placement, residency.RESIDENT))
        line += f"; all resident: {peak / GiB:.2f} GiB [{at}]"
    return line


def _inspect_head(m: Manifest) -> list[str]:
    """The build's lines above its programs' table."""
    k = m.key
    return [
        f"build      {k.folder_name()}",
        f"model      {k.model} (config {m.model_hash})",
        f"video      {k.width}x{k.height} (WxH), {k.frames} frames, batch {k.batch}, cfg {'on' if k.cfg else 'off'}",
        f"target     {k.target}: {m.platform} {m.device_kind}, devices {m.device_ids}, {m.process_count} process(es)",
        f"mesh       {m.mesh_axes}; vae {m.vae_mesh_axes}, spatial axis {k.vae_axis}",
        f"attention  {k.attention}, context parallelism {k.context_parallel}",
        *([f"quant      {k.option('quant')} (wan.quant)"] if k.option("quant") != "none" else []),
        *(
            [
                f"attention  self-attention in {k.option('attention_quant')} (wan.models.attention_quant)"
            ]
            if k.option("attention_quant") != "none"
            else []
        ),
        *([f"vae vmem   {k.vae_vmem_mib} MiB scoped VMEM (--vae-vmem)"] if k.vae_vmem_mib else []),
        *(
            [
                f"roofline   step lower bound {_lower_bound_text(m)}: {_step_flops(m) / 1e12:.3f} "
                f"TFLOP per device at {m.peak_flops / 1e12:.0f} TFLOP/s bf16"
                + (
                    f" ({_eight_bit_flops(m) / 1e12:.3f} of them 8-bit, at "
                    f"{m.peak_8bit_flops / 1e12:.0f} TOP/s)"
                    if _eight_bit_flops(m) and m.peak_8bit_flops
                    else ""
                )
            ]
            if m.peak_flops
            else []
        ),
        *_sparse_lines(m),
        _memory_line(m),
        f"versions   {', '.join(f'{n} {v}' for n, v in m.versions.items())}",
        *(f"note       {n}" for n in m.notes),
        *(
            f"vae        all-gathered {p.gathered_bytes_per_latent_frame / 1e6:.1f} MB per device "
            "per latent frame"
            for p in m.programs.values()
            if p.gathered_bytes_per_latent_frame is not None
        ),
        "",
    ]


def inspect_text(m: Manifest) -> str:
    head = _inspect_head(m)
    rows = []
    for name, p in m.programs.items():
        mem = p.memory
        rows.append([
            name, f"{p.compile_seconds:.1f}", f"{p.peak_rss_bytes / GiB:.2f}",
            f"{mem['argument'] / GiB:.3f}", f"{mem['output'] / GiB:.3f}", f"{mem['temp'] / GiB:.3f}",
            f"{mem['peak'] / GiB:.3f}", f"{p.replicated_param_bytes / GiB:.3f}",
            f"{p.flops / 1e12:.4f}", f"{p.eight_bit_flops / 1e12:.4f}",
            f"{p.kernel_flops / 1e12:.4f}", f"{p.xla_flops / 1e12:.4f}",
            _collectives_text(p.collectives), f"{p.executable.size / 1e6:.1f}",
        ])  # fmt: skip
    header = [
        "program", "compile s", "RSS GiB", "args GiB", "out GiB", "temp GiB", "peak GiB",
        "replicated weights GiB", "HLO TFLOP/device", "of it 8-bit", "kernel TFLOP/device",
        "XLA TFLOP",
        "collectives", "exec MB",
    ]  # fmt: skip
    return "\n".join(head) + text_table(header, rows)
