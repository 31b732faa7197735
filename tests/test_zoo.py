"""The benchmarks' model zoo (benchmarks/models/zoo.py), small versions only: they build from shapes
alone, `init` and `synthetic` match `args`, and the steps run with a finite, falling loss."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from benchmarks.models import zoo


def _same_structure(concrete, abstract) -> None:
    assert jax.tree.structure(concrete) == jax.tree.structure(abstract)
    for c, a in zip(jax.tree.leaves(concrete), jax.tree.leaves(abstract), strict=True):
        assert (c.shape, c.dtype) == (a.shape, a.dtype)


@pytest.mark.parametrize("name", sorted(zoo.WORKLOADS))
def test_small_is_abstract_and_consistent(name: str) -> None:
    w = zoo.small(name)
    assert w.name == f"{name}-small"
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(w.args))
    # params is the first argument (every step here takes it first), and is what eval_shape
    # of the step gives back as the new params
    _same_structure(w.params, w.args[0])
    out = jax.eval_shape(w.step, *w.args)
    _same_structure(out[:-1], w.args[:-1])
    assert out[-1]["loss"].shape == ()
    assert w.args[-1][next(iter(w.args[-1]))].shape[0] == w.batch_size


def test_registry_and_overrides() -> None:
    assert set(zoo.WORKLOADS) == set(zoo.SMALL) == {"alexnet", "vgg16", "resnet50", "gpt2"}
    w = zoo.small("gpt2", layers=1, tie_embeddings=False)
    assert w.num_params == zoo.small("gpt2", layers=1).num_params + 64 * 256
    with pytest.raises(KeyError):
        zoo.small("bert")


@pytest.mark.parametrize("name", sorted(zoo.WORKLOADS))
def test_init_matches_args(name: str) -> None:
    # traced only (eval_shape): compiling the models' initialisers takes seconds on a CPU
    w = zoo.small(name)
    _same_structure(jax.eval_shape(lambda: w.init(0)), w.args)


# AlexNet and VGG-16 are the examples' own models and step; running them here would add
# ~10 s of CPU compile for nothing the examples do not already exercise.
@pytest.mark.parametrize("name", ["gpt2", "resnet50"])
def test_small_runs(name: str) -> None:
    w = zoo.small(name)
    args = w.synthetic(0)
    _same_structure(args, w.args)
    step = jax.jit(w.step)
    out = step(*args)
    _same_structure(out[:-1], w.args[:-1])
    losses = [float(out[-1]["loss"])]
    out = step(*out[:-1], args[-1])
    losses.append(float(out[-1]["loss"]))
    assert np.all(np.isfinite(losses))
    assert losses[1] < losses[0]  # the same batch twice: Adam's first step lowers its loss
