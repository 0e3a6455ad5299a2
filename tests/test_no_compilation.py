"""The zero-compiles claim can fail: the counter counts, and a compile during generation is
refused (controls for every `compile_count == 0` assertion in the suite)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import TINY_SHAPE

from runtime.builds.artifact import ArtifactError
from runtime.builds.loader import Request
from runtime.generation.compiles import CompileCounter, no_compilation
from runtime.generation.pipeline import Pipeline
from wan.configs import VideoShape


def test_counter_counts_a_fresh_jit():
    counter = CompileCounter()
    assert counter.count == 0
    x = np.ones(5, np.float32)  # a host array: no eager op, so only the jit compiles
    jax.jit(lambda x: x * 3 + 1)(x).block_until_ready()
    assert counter.count == 1
    jax.jit(lambda x: x - 7)(x).block_until_ready()
    assert counter.count == 2


def test_no_compilation_refuses_tracing_and_compiling():
    lowered = jax.jit(lambda x: x * 5).lower(np.ones(3, np.float32))
    refused = pytest.raises(ArtifactError, match=r"^1 compilation\(s\) happened during generation")
    with refused, no_compilation():
        lowered.compile()  # no tracing here: only the counter can see it
    with pytest.raises(Exception, match="tracing"), no_compilation():
        jax.jit(lambda x: x / 9)(np.ones(3))


def test_a_compile_inside_generation_fails_it(tiny_build, tiny_weights):
    width, height = (int(v) for v in TINY_SHAPE[1].split("x"))
    shape = VideoShape(width, height, int(TINY_SHAPE[3]), int(TINY_SHAPE[5]), cfg=True)
    pipe = Pipeline.load(tiny_build, tiny_weights, Request(shape))
    frames, report = pipe.generate("a cat", steps=2)
    assert report.compile_count == 0 and frames.shape[0] == 1  # as loaded: compiles nothing

    pipe.exe["vae_decode"] = _CompilesWhenCalled(pipe.exe["vae_decode"])
    with pytest.raises(ArtifactError, match=r"1 compilation\(s\) happened"):
        pipe.generate("a cat", steps=2)


class _CompilesWhenCalled:
    """An executable that compiles a stray program each time it runs (as a runtime that fell
    back to jit would)."""

    def __init__(self, executable):
        self.executable = executable
        self.stray = jax.jit(lambda x: x + 1).lower(np.ones(4, np.float32))

    def __getattr__(self, name):
        return getattr(self.executable, name)

    def __call__(self, *args):
        self.stray.compile()
        return self.executable(*args)
