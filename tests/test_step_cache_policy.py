"""runtime.generation.step_cache against diffusers' MagCache hook on a tiny WanTransformer3DModel: the same
skipped steps and the same calibrated ratios; the ratio files' hostile cases; the shipped
ratios; the program each step runs and the options' checks."""

import ast
import json

import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.hooks import MagCacheConfig
from diffusers.hooks.mag_cache import nearest_interp

from runtime.generation.step_cache import (
    ALWAYS_COMPUTE,
    CACHE_STEP,
    CACHED_STEP,
    FBCACHE,
    FULL_STEP,
    KINDS,
    MAGCACHE,
    MAX_RATIOS,
    MAX_RATIOS_FILE_BYTES,
    CacheRequest,
    MagCache,
    MagCacheSettings,
    MagCalibration,
    StepCache,
    StepCacheError,
    from_options,
    interpolate_ratios,
    read_mag_ratios,
    shipped_mag_ratios,
    write_mag_ratios,
)

ONE = ["transformer"]
TWO = ["transformer", "transformer_2"]
WAN21_14B = shipped_mag_ratios("wan2.1-t2v-14b", ONE)["transformer"]
WAN21_1_3B = shipped_mag_ratios("wan2.1-t2v-1.3b", ONE)["transformer"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3,
    ).eval()  # fmt: skip


def _inputs(step: int, rows: int = 1, text_seed: int = 0) -> dict:
    """A denoise call of step `step`: latents and timestep move with the step, as in a run."""
    rng = np.random.default_rng(step)
    text = np.random.default_rng(100 + text_seed).standard_normal((rows, 5, 16))
    return dict(
        hidden_states=torch.tensor(rng.standard_normal((rows, 4, 1, 4, 4)), dtype=torch.float32),
        timestep=torch.full((rows,), 999.0 - 40 * step),
        encoder_hidden_states=torch.tensor(text, dtype=torch.float32),
        return_dict=False,
    )


def diffusers_skips(model, ratios, steps: int, settings: MagCacheSettings) -> list[int]:
    """The steps diffusers' MagCache hook skips: those where the last block's FFN never ran."""
    config = MagCacheConfig(
        threshold=settings.threshold,
        max_skip_steps=settings.max_skip,
        retention_ratio=settings.retention,
        num_inference_steps=steps,
        mag_ratios=list(ratios),
    )
    model.enable_cache(config)
    ran = []
    hook = model.blocks[-1].ffn.register_forward_hook(lambda *_: ran.append(True))
    skipped = []
    try:
        for step in range(steps):
            before = len(ran)
            with torch.no_grad(), model.cache_context("cond"):
                model(**_inputs(step))
            if len(ran) == before:
                skipped.append(step)
    finally:
        hook.remove()
        model.disable_cache()
    return skipped


def ours(ratios, steps: int, settings: MagCacheSettings) -> list[int]:
    cache = MagCache(settings, ratios, steps)
    return [step for step in range(steps) if cache.skip_next()]


def skipped_steps(settings: MagCacheSettings, ratios, step_experts: list[str]) -> tuple[int, ...]:
    """The (global) steps a generation runs as CACHED_STEP (runtime.generation.step_cache.StepCache),
    `step_experts[i]` naming the expert that runs step i."""
    request = CacheRequest(kind=MAGCACHE, **settings.to_json(), mag_ratios=ratios)
    cache = StepCache(request, CACHE_STEP, step_experts, num_layers=3)
    return tuple(i for i, e in enumerate(step_experts) if cache.choose(e)[0] == CACHED_STEP)


NEAR_ONE = tuple(np.random.default_rng(1).uniform(0.94, 1.03, 15).round(5).tolist())
EXACT_ONES = (1.0, 1.0, 1.0, 0.99, 1.0, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0)
S = MagCacheSettings
# (settings, ratios, steps, whether steps are skipped): interpolation down (50 -> 12, 20) and up
# (15 -> 23, 12 -> 30), the same length, one step, retention 0 and 1, max_skip 0 and 1,
# thresholds that skip a lot and none; threshold 0 skips exactly where the ratio is 1.0.
CASES = [
    (S(), WAN21_14B, 12, True),
    (S(), WAN21_14B, 20, True),
    (S(), WAN21_14B, 50, True),
    (S(threshold=0.3, max_skip=6, retention=0.0), WAN21_14B, 20, True),
    (S(threshold=0.3, max_skip=1, retention=0.0), WAN21_14B, 20, True),
    (S(threshold=0.3, max_skip=0, retention=0.0), WAN21_14B, 20, False),
    (S(threshold=0.001), WAN21_14B, 20, False),
    # MagCache's authors' setting for the 1.3B at 832x480 (E012K4R02), which docs/speed.md
    # recommends for its 50 steps.
    (S(threshold=0.12, max_skip=4), WAN21_1_3B, 50, True),
    (S(threshold=10.0, max_skip=100, retention=0.0), NEAR_ONE, 15, True),
    (S(threshold=10.0, max_skip=100, retention=1.0), NEAR_ONE, 15, False),
    (S(threshold=0.08, max_skip=2, retention=0.1), NEAR_ONE, 23, True),
    (S(threshold=0.08, max_skip=3, retention=0.5), NEAR_ONE, 15, True),
    (S(threshold=0.0, max_skip=3, retention=0.0), EXACT_ONES, 12, True),
    (S(threshold=0.0, max_skip=3, retention=0.0), EXACT_ONES, 30, True),
    (S(threshold=0.05, retention=0.0), (0.97,), 6, True),
    (S(retention=0.0), NEAR_ONE, 1, False),
    (S(retention=0.0), (0.99, 0.98), 1, False),
]


@pytest.mark.parametrize("settings, ratios, steps, skips", CASES)
def test_decisions_match_diffusers(model, settings, ratios, steps, skips):
    expected = diffusers_skips(model, ratios, steps, settings)
    assert ours(ratios, steps, settings) == expected
    assert bool(expected) == skips  # the grid covers both


def test_ties_decide_as_diffusers_float32(model):
    """A threshold within float64 rounding of the accumulated error: diffusers compares in
    float32 (its ratios are a float32 tensor), so a float64 comparison would decide otherwise."""
    ratios = (1.0, 0.95, 0.97, 1.02, 0.9)
    for ratio in ratios[1:]:
        error = float(abs(np.float32(1.0) - np.float32(ratio)))
        for threshold in (error, error - 1e-12, error + 1e-12, np.nextafter(error, 0)):
            settings = S(threshold=float(threshold), max_skip=1, retention=0.0)
            assert ours(ratios, 5, settings) == diffusers_skips(model, ratios, 5, settings)
    tie = S(threshold=float(abs(np.float32(1.0) - np.float32(0.95))) - 1e-12, retention=0.0)
    assert ours((1.0, 0.95), 2, tie) == [1]  # float64 arithmetic would compute step 1


def test_two_experts_keep_one_cache_each(model):
    """Wan 2.2: each expert's hook counts its own steps; the second starts at the switch."""
    shipped = shipped_mag_ratios("wan2.2-t2v-a14b", TWO)
    settings = S(threshold=0.1, max_skip=2)
    for high, steps in ((26, 40), (7, 12), (13, 20)):
        step_experts = ["transformer"] * high + ["transformer_2"] * (steps - high)
        first = diffusers_skips(model, shipped["transformer"], high, settings)
        second = diffusers_skips(model, shipped["transformer_2"], steps - high, settings)
        expected = tuple(first + [high + i for i in second])
        assert skipped_steps(settings, shipped, step_experts) == expected
        assert first and second


def test_interpolation_matches_nearest_interp():
    for source in range(1, 41):
        for target in range(1, 61):
            expected = nearest_interp(torch.arange(source, dtype=torch.float32), target)
            np.testing.assert_array_equal(
                interpolate_ratios(np.arange(source), target), expected.numpy()
            )


def test_calibration_matches_diffusers(model, capsys):
    """diffusers' calibrate mode (prompt rows under "cond", the negative under "uncond") prints
    the ratios; ours from each step's per-token residual norms of the prompt rows agree."""
    steps, rows = 8, 2
    first_input, residuals = [], []
    pre = model.blocks[0].register_forward_pre_hook(lambda _, args: first_input.append(args[0]))
    post = model.blocks[-1].register_forward_hook(
        lambda _, args, out: residuals.append(out - first_input[-1])
    )
    model.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=steps))
    calibration = MagCalibration()
    try:
        for step in range(steps):
            with torch.no_grad():
                with model.cache_context("cond"):
                    model(**_inputs(step, rows))
                norms = torch.linalg.norm(residuals[-1].float(), dim=-1).numpy()
                calibration.record("transformer", norms)
                with model.cache_context("uncond"):
                    model(**_inputs(step, rows, text_seed=1))
    finally:
        pre.remove()
        post.remove()
        model.disable_cache()
    printed = capsys.readouterr().out.split("[MagCache] Calibration Complete")
    cond, uncond = (ast.literal_eval(p.splitlines()[1]) for p in printed[1:])
    ratios = calibration.ratios()["transformer"]
    assert norms.shape == (rows, 4) and len(ratios) == steps and ratios[0] == 1.0
    np.testing.assert_allclose(ratios, cond, rtol=1e-5)
    assert not np.allclose(ratios, uncond, rtol=1e-3)  # the prompt rows' ratios, not the others


def test_calibration_per_expert_round_trips(tmp_path):
    calibration = MagCalibration()
    rng = np.random.default_rng(0)
    for expert in ["transformer"] * 3 + ["transformer_2"] * 2:
        calibration.record(expert, rng.uniform(1, 2, (2, 6)).astype(np.float32))
    ratios = calibration.ratios()
    assert [len(v) for v in ratios.values()] == [3, 2]
    assert ratios["transformer"][0] == ratios["transformer_2"][0] == 1.0
    write_mag_ratios(tmp_path / "two.json", ratios)
    assert read_mag_ratios(tmp_path / "two.json", TWO) == ratios
    write_mag_ratios(tmp_path / "one.json", {"transformer": ratios["transformer"]})
    assert isinstance(json.loads((tmp_path / "one.json").read_text()), list)
    assert read_mag_ratios(tmp_path / "one.json", ONE) == {"transformer": ratios["transformer"]}


def test_writing_a_diverged_calibration_writes_nothing(tmp_path):
    with pytest.raises(StepCacheError, match="entry 1 is NaN"):
        write_mag_ratios(tmp_path / "out.json", {"transformer": (1.0, float("nan"))})
    (tmp_path / "out.json").write_text("old")
    with pytest.raises(StepCacheError, match="entry 0 is 0.0"):
        write_mag_ratios(tmp_path / "out.json", {"transformer": (0.0,)})
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]
    assert (tmp_path / "out.json").read_text() == "old"


HOSTILE_ONE = {
    "not JSON": b"[1.0, 0.9",
    "not UTF-8": b"\xff\xfe[1.0]",
    "an object": b'{"transformer": [1.0]}',
    "a number": b"1.0",
    "empty": b"[]",
    "a string entry": b'[1.0, "0.9"]',
    "a bool entry": b"[1.0, true]",
    "a null entry": b"[1.0, null]",
    "a list entry": b"[1.0, [0.9]]",
    "zero": b"[1.0, 0]",
    "negative": b"[1.0, -0.9]",
    "NaN": b"[1.0, NaN]",
    "Infinity": b"[1.0, Infinity]",
    "overflowing float": b"[1.0, 1e999]",
    "overflowing int": b"[1.0, 1" + b"0" * 400 + b"]",
    "too long": json.dumps([1.0] * (MAX_RATIOS + 1)).encode(),
    "too big": b"[" + b" " * MAX_RATIOS_FILE_BYTES + b"1.0]",
    "nested too deeply": b"[" * 100_000 + b"]" * 100_000,
}
HOSTILE_TWO = {
    "a list": b"[1.0, 0.9]",
    "a missing expert": b'{"transformer": [1.0]}',
    "an extra key": b'{"transformer": [1.0], "transformer_2": [1.0], "x": [1.0]}',
    "a bad second list": b'{"transformer": [1.0], "transformer_2": [1.0, -1]}',
    "a second list not a list": b'{"transformer": [1.0], "transformer_2": 1.0}',
}


@pytest.mark.parametrize(
    "experts, content",
    [(ONE, c) for c in HOSTILE_ONE.values()] + [(TWO, c) for c in HOSTILE_TWO.values()],
    ids=list(HOSTILE_ONE) + [f"two: {name}" for name in HOSTILE_TWO],
)
def test_hostile_ratio_files_are_one_line_errors(tmp_path, experts, content):
    path = tmp_path / "ratios.json"
    path.write_bytes(content)
    with pytest.raises(StepCacheError) as error:
        read_mag_ratios(path, experts)
    assert "\n" not in str(error.value) and str(path) in str(error.value)
    assert len(str(error.value)) < 300


def test_not_a_file_is_a_one_line_error(tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo")  # a read would wait forever
    for path in (tmp_path / "missing.json", tmp_path, tmp_path / "fifo"):
        with pytest.raises(StepCacheError, match="is not a file") as error:
            read_mag_ratios(path, ONE)
        assert "\n" not in str(error.value)


def test_a_good_file_reads(tmp_path):
    (tmp_path / "r.json").write_text("[1, 0.99, 1.01e0]")
    assert read_mag_ratios(tmp_path / "r.json", ONE) == {"transformer": (1.0, 0.99, 1.01)}


@pytest.mark.parametrize(
    "settings, flag",
    [
        (dict(threshold=-0.01), "--cache-threshold"),
        (dict(threshold=float("nan")), "--cache-threshold"),
        (dict(threshold=float("inf")), "--cache-threshold"),
        (dict(threshold="0.1"), "--cache-threshold"),
        (dict(max_skip=-1), "--cache-max-skip"),
        (dict(max_skip=2.0), "--cache-max-skip"),
        (dict(max_skip=True), "--cache-max-skip"),
        (dict(retention=1.5), "--cache-retention"),
        (dict(retention=-0.1), "--cache-retention"),
        (dict(retention=float("nan")), "--cache-retention"),
    ],
)
def test_bad_settings_are_one_line_errors(settings, flag):
    with pytest.raises(StepCacheError, match=f"^{flag} .* give {flag} ") as error:
        MagCacheSettings(**settings)
    assert "\n" not in str(error.value)


def test_settings_defaults_are_diffusers():
    config = MagCacheConfig(mag_ratios=[1.0])
    assert MagCacheSettings() == MagCacheSettings(
        threshold=config.threshold,
        max_skip=config.max_skip_steps,
        retention=config.retention_ratio,
    )
    assert MagCacheSettings(threshold=0, max_skip=0, retention=1).to_json() == {
        "threshold": 0,
        "max_skip": 0,
        "retention": 1,
    }


def test_shipped_ratios_load_for_the_presets():
    lengths = {
        ("wan2.1-t2v-1.3b", "transformer"): 50,
        ("wan2.1-t2v-14b", "transformer"): 50,
        ("wan2.2-t2v-a14b", "transformer"): 26,
        ("wan2.2-t2v-a14b", "transformer_2"): 14,
    }
    for model_name, experts in [("wan2.1-t2v-1.3b", ONE), ("wan2.1-t2v-14b", ONE)] + [
        ("wan2.2-t2v-a14b", TWO)
    ]:
        ratios = shipped_mag_ratios(model_name, experts)
        assert list(ratios) == experts
        for expert, values in ratios.items():
            assert len(values) == lengths[model_name, expert] and values[0] == 1.0
            assert all(0.5 < v < 1.1 for v in values)


# The lists MagCache publishes, verbatim (https://github.com/Zehong-Ma/MagCache/blob/
# df81cb181776c2c61477c08e1d21f87fda1cd938/...): cond and uncond entries interleaved (its model
# is called twice per step), behind the scripts' [1.0] * 2 padding.
PUBLISHED = {
    # MagCache4Wan2.1/magcache_generate.py#L910
    "wan2.1-t2v-14b": (
        1.02504, 1.03017, 1.00025, 1.00251, 0.9985, 0.99962, 0.99779, 0.99771, 0.9966,
        0.99658, 0.99482, 0.99476, 0.99467, 0.99451, 0.99664, 0.99656, 0.99434, 0.99431,
        0.99533, 0.99545, 0.99468, 0.99465, 0.99438, 0.99434, 0.99516, 0.99517, 0.99384,
        0.9938, 0.99404, 0.99401, 0.99517, 0.99516, 0.99409, 0.99408, 0.99428, 0.99426,
        0.99347, 0.99343, 0.99418, 0.99416, 0.99271, 0.99269, 0.99313, 0.99311, 0.99215,
        0.99215, 0.99218, 0.99215, 0.99216, 0.99217, 0.99163, 0.99161, 0.99138, 0.99135,
        0.98982, 0.9898, 0.98996, 0.98995, 0.9887, 0.98866, 0.98772, 0.9877, 0.98767,
        0.98765, 0.98573, 0.9857, 0.98501, 0.98498, 0.9838, 0.98376, 0.98177, 0.98173,
        0.98037, 0.98035, 0.97678, 0.97677, 0.97546, 0.97543, 0.97184, 0.97183, 0.96711,
        0.96708, 0.96349, 0.96345, 0.95629, 0.95625, 0.94926, 0.94929, 0.93964, 0.93961,
        0.92511, 0.92504, 0.90693, 0.90678, 0.8796, 0.87945, 0.86111, 0.86189
    ),
    # MagCache4Wan2.1/magcache_generate.py#L912
    "wan2.1-t2v-1.3b": (
        1.0124, 1.02213, 1.00166, 1.0041, 0.99791, 1.00061, 0.99682, 0.99762, 0.99634,
        0.99685, 0.99567, 0.99586, 0.99416, 0.99422, 0.99578, 0.99575, 0.9957, 0.99563,
        0.99511, 0.99506, 0.99535, 0.99531, 0.99552, 0.99549, 0.99541, 0.99539, 0.9954,
        0.99536, 0.99489, 0.99485, 0.99518, 0.99514, 0.99484, 0.99478, 0.99481, 0.99479,
        0.99415, 0.99413, 0.99419, 0.99416, 0.99396, 0.99393, 0.99388, 0.99386, 0.99349,
        0.99349, 0.99309, 0.99304, 0.9927, 0.9927, 0.99228, 0.99226, 0.99171, 0.9917,
        0.99137, 0.99135, 0.99068, 0.99063, 0.99005, 0.99003, 0.98944, 0.98942, 0.98849,
        0.98849, 0.98758, 0.98757, 0.98644, 0.98643, 0.98504, 0.98503, 0.9836, 0.98359,
        0.98202, 0.98201, 0.97977, 0.97978, 0.97717, 0.97718, 0.9741, 0.97411, 0.97003,
        0.97002, 0.96538, 0.96541, 0.9593, 0.95933, 0.95086, 0.95089, 0.94013, 0.94019,
        0.92402, 0.92414, 0.90241, 0.9026, 0.86821, 0.86868, 0.81838, 0.81939
    ),
    # MagCache4Wan2.2/magcache_generate.py#L695
    "wan2.2-t2v-a14b": (
        1.00124, 1.00155, 0.99822, 0.99851, 0.99696, 0.99687, 0.99703, 0.99732, 0.9966,
        0.99679, 0.99602, 0.99658, 0.99578, 0.99664, 0.99484, 0.9949, 0.99633, 0.996,
        0.99659, 0.99683, 0.99534, 0.99549, 0.99584, 0.99577, 0.99681, 0.99694, 0.99563,
        0.99554, 0.9944, 0.99473, 0.99594, 0.9964, 0.99466, 0.99461, 0.99453, 0.99481,
        0.99389, 0.99365, 0.99391, 0.99406, 0.99354, 0.99361, 0.99283, 0.99278, 0.99268,
        0.99263, 0.99057, 0.99091, 0.99125, 0.99126, 0.65523, 0.65252, 0.98808, 0.98852,
        0.98765, 0.98736, 0.9851, 0.98535, 0.98311, 0.98339, 0.9805, 0.9806, 0.97776,
        0.97771, 0.97278, 0.97286, 0.96731, 0.96728, 0.95857, 0.95855, 0.94385, 0.94385,
        0.92118, 0.921, 0.88108, 0.88076, 0.80263, 0.80181
    ),
}  # fmt: skip
A14B_SWITCH = 26  # the t2v-A14B script's high-noise steps: 40 steps, shift 12, boundary 0.875


def test_shipped_ratios_are_the_published_lists():
    """Entry by entry: the cond entries of each published list (the padding's first one and
    every other after it), the A14B's split between its experts at the switch, the low-noise
    expert's first entry (its residual against the other expert's) set to 1.0."""
    for model_name, published in PUBLISHED.items():
        cond = [1.0, 1.0, *published][0::2]
        expected = {"transformer": cond}
        if model_name == "wan2.2-t2v-a14b":
            expected = {
                "transformer": cond[:A14B_SWITCH],
                "transformer_2": [1.0, *cond[A14B_SWITCH + 1 :]],
            }
            assert cond[A14B_SWITCH] == 0.65523  # the jump at the switch, replaced
        shipped = shipped_mag_ratios(model_name, list(expected))
        assert {e: list(r) for e, r in shipped.items()} == expected, model_name
        uncond = [1.0, 1.0, *published][1::2]
        assert list(shipped["transformer"]) != uncond[: len(shipped["transformer"])]


def test_unshipped_model_says_how_to_calibrate():
    with pytest.raises(StepCacheError, match="--calibrate-mag-ratios OUT.json") as error:
        shipped_mag_ratios("tiny", ONE)
    assert "--mag-ratios OUT.json" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(StepCacheError, match="--calibrate-mag-ratios"):
        shipped_mag_ratios("wan2.2-t2v-a14b", ONE)


def _steps(
    cache: StepCache, experts: list[str], skipped: frozenset[int] = frozenset()
) -> list[tuple[str, float]]:
    """Each step's (program, threshold), step i counted as cache_step's skip when in `skipped`."""
    chosen = []
    for i, expert in enumerate(experts):
        chosen.append(cache.choose(expert))
        cache.ran(i, chosen[-1][0], i in skipped)
    return chosen


def test_each_step_runs_the_program_the_request_picks():
    two = ["transformer"] * 2 + ["transformer_2"] * 2
    plain = StepCache(None, FULL_STEP, two, num_layers=3)
    assert _steps(plain, two) == [(FULL_STEP, ALWAYS_COMPUTE)] * 4
    assert (plain.outcome(4).cache, plain.outcome(4).block_steps_run) == (None, 12)
    uncached = StepCache(None, CACHE_STEP, two, num_layers=3)
    assert _steps(uncached, two) == [(CACHE_STEP, ALWAYS_COMPUTE)] * 4
    # The first-block cache: each expert's first step has no residual, so it computes.
    fbcache = StepCache(CacheRequest(kind=FBCACHE, threshold=0.1), CACHE_STEP, two, num_layers=3)
    assert _steps(fbcache, two, skipped=frozenset({1, 3})) == [
        (CACHE_STEP, ALWAYS_COMPUTE), (CACHE_STEP, 0.1), (CACHE_STEP, ALWAYS_COMPUTE),
        (CACHE_STEP, 0.1),
    ]  # fmt: skip
    outcome = fbcache.outcome(4)
    assert (outcome.cache, outcome.settings, outcome.skipped_steps) == (
        FBCACHE,
        {"threshold": 0.1},
        [1, 3],
    )
    assert (outcome.block_steps_run, outcome.block_steps_total) == (3 + 1 + 3 + 1, 12)
    calibrate = CacheRequest(kind=MAGCACHE, threshold=0.06, calibrate=True)
    calibrating = StepCache(calibrate, CACHE_STEP, two, num_layers=3)
    assert _steps(calibrating, two) == [(CACHE_STEP, ALWAYS_COMPUTE)] * 4
    assert calibrating.calibration is not None
    magcache = CacheRequest(
        kind=MAGCACHE, threshold=10.0, retention=0.0, mag_ratios={"transformer": NEAR_ONE}
    )
    one = StepCache(magcache, CACHE_STEP, ["transformer"] * 4, num_layers=3)
    assert (
        _steps(one, ["transformer"] * 4)
        == [(CACHE_STEP, ALWAYS_COMPUTE)] + [(CACHED_STEP, ALWAYS_COMPUTE)] * 3
    )
    outcome = one.outcome(4)
    assert outcome.settings == MagCacheSettings(threshold=10.0, retention=0.0).to_json()
    assert (outcome.skipped_steps, outcome.block_steps_run) == ([1, 2, 3], 3)


def test_options_read_the_kinds(tmp_path):
    for kind, wanted in KINDS.items():
        assert from_options(kind, None, 3, 0.2, None, False, 1).threshold == wanted.threshold
    assert from_options(None, None, 3, 0.2, None, False, 1) is None
    ratios = tmp_path / "r.json"
    ratios.write_text("[1.0, 0.9]")
    given = from_options(MAGCACHE, 0.1, 3, 0.2, ratios, False, 1)
    assert given.mag_ratios == {"transformer": (1.0, 0.9)} and given.threshold == 0.1
    for args, message in [
        ((None, 0.1, 3, 0.2, None, False), "need --cache"),
        ((None, None, 3, 0.2, None, True), "need --cache"),
        ((FBCACHE, None, 3, 0.2, ratios, False), "are MagCache's"),
        ((FBCACHE, None, 3, 0.2, None, True), "are MagCache's"),
        ((MAGCACHE, None, 3, 0.2, ratios, True), "leave out --mag-ratios"),
        (("teacache", None, 3, 0.2, None, False), "^--cache 'teacache' .* magcache, fbcache"),
        ((FBCACHE, -1.0, 3, 0.2, None, False), "^--cache-threshold .* give --cache-threshold "),
        ((MAGCACHE, None, -1, 0.2, None, False), "^--cache-max-skip "),
    ]:
        with pytest.raises(StepCacheError, match=message) as error:
            from_options(*args, 1)
        assert "\n" not in str(error.value)
