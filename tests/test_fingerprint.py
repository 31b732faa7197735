"""jaxpr_fingerprint: equal for equal steps (in this process and in another one), different
when anything the planner reads differs, and never by printing the jaxpr."""

from __future__ import annotations

import functools
import gc
import json
import os
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import models
import optax
import pytest
from jax import lax
from jax._src import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxwap.plans.fingerprint import jaxpr_fingerprint

TESTS = Path(__file__).resolve().parent
F32 = jax.ShapeDtypeStruct((4, 4), jnp.float32)


def fp(f: Callable, *args) -> str:
    """The fingerprint of a fresh trace of f (jax hands back its cached jaxpr for f)."""
    return jaxpr_fingerprint(jax.make_jaxpr(lambda *a: f(*a))(*args))


def named(op: Callable) -> Callable:
    """`op` inside a function always named `inner`, so that two nested bodies differ only
    by what they compute, not by the name jit or scan records."""
    def inner(x):
        return op(x)
    return inner


def jitted(op: Callable) -> Callable:
    return lambda x: jax.jit(named(op))(x) * 2.0


def scanned(op: Callable, length: int = 4) -> Callable:
    return lambda x: lax.scan(lambda c, _: (named(op)(c), None), x, None, length=length)[0]


def custom_vjp(op: Callable) -> Callable:
    f = jax.custom_vjp(named(op))
    f.defvjp(lambda x: (f(x), x), lambda x, g: (g * x,))
    return f


def remat(policy: Callable) -> Callable:
    return lambda x: jax.checkpoint(lambda a: jnp.tanh(a @ a), policy=policy)(x)


def dot(dims) -> Callable:
    return lambda a: lax.dot_general(a, a, (dims, ((), ())))


def conv(spec: tuple[str, str, str]) -> Callable:
    rhs = jax.ShapeDtypeStruct((3, 3, 3, 3), jnp.float32)
    return lambda: fp(lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                                            dimension_numbers=spec),
                      jax.ShapeDtypeStruct((1, 3, 8, 8), jnp.float32), rhs)


def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def constrained(spec: P) -> Callable:
    return lambda x: lax.with_sharding_constraint(x, NamedSharding(mesh(), spec)) * 2


def placed(space) -> Callable:
    return lambda x: jax.device_put(x, space) * 2


def cube(x):
    return jnp.transpose(x.reshape(2, 2, 4), (0, 2, 1))


# name -> (a fingerprint, the fingerprint of a step that differs from it in one thing)
PAIRS: dict[str, tuple[Callable[[], str], Callable[[], str]]] = {
    "shape": (lambda: fp(jnp.sin, F32),
              lambda: fp(jnp.sin, jax.ShapeDtypeStruct((4, 5), jnp.float32))),
    "dtype": (lambda: fp(jnp.sin, F32),
              lambda: fp(jnp.sin, jax.ShapeDtypeStruct((4, 4), jnp.bfloat16))),
    "literal": (lambda: fp(lambda x: x * 2.0, F32), lambda: fp(lambda x: x * 3.0, F32)),
    "literal -0.0": (lambda: fp(lambda x: x * 0.0, F32), lambda: fp(lambda x: x * -0.0, F32)),
    "reduction": (lambda: fp(jnp.sum, F32), lambda: fp(jnp.max, F32)),
    "transpose": (lambda: fp(lambda x: jnp.transpose(cube(x), (2, 0, 1)), F32),
                  lambda: fp(lambda x: jnp.transpose(cube(x), (2, 1, 0)), F32)),
    "dot dims": (lambda: fp(dot(((1,), (0,))), F32), lambda: fp(dot(((1,), (1,))), F32)),
    "conv dims": (conv(("NCHW", "OIHW", "NCHW")), conv(("NCHW", "IOHW", "NCHW"))),
    "scan length": (lambda: fp(scanned(jnp.sin), F32), lambda: fp(scanned(jnp.sin, 5), F32)),
    "scan body": (lambda: fp(scanned(jnp.sin), F32), lambda: fp(scanned(jnp.cos), F32)),
    "pjit body": (lambda: fp(jitted(jnp.sin), F32), lambda: fp(jitted(jnp.cos), F32)),
    "custom_vjp body": (lambda: fp(custom_vjp(jnp.sin), F32),
                        lambda: fp(custom_vjp(jnp.cos), F32)),
    "remat policy": (lambda: fp(remat(jax.checkpoint_policies.dots_saveable), F32),
                     lambda: fp(remat(jax.checkpoint_policies.nothing_saveable), F32)),
    "sharding constraint": (lambda: fp(constrained(P("data", None)), F32),
                            lambda: fp(constrained(P("model", None)), F32)),
    "memory space": (lambda: fp(placed(jax.memory.Space.Device), F32),
                     lambda: fp(placed(jax.memory.Space.Host), F32)),
}


def flax_step(model=None, x_shape=(16, 8)) -> str:
    """A flax train step with Adam, traced from abstract arguments."""
    model = model or models.MLP((16, 8, 4))
    tx = optax.adam(1e-3)
    x = jax.ShapeDtypeStruct(x_shape, jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    batch = {"x": x, "y": jax.ShapeDtypeStruct((x_shape[0],), jnp.int32)}
    step = models.make_step(model, tx)
    return fp(step, params, jax.eval_shape(tx.init, params), batch)


def all_fingerprints() -> dict[str, str]:
    """Every fingerprint these tests take (the child process prints them)."""
    out = {"flax mlp": flax_step(), "flax cnn": flax_step(models.CNN(), (2, 8, 8, 3))}
    for name, (a, b) in PAIRS.items():
        out[name + " a"], out[name + " b"] = a(), b()
    return out


@functools.cache
def here() -> dict[str, str]:
    return all_fingerprints()


# --------------------------------------------------------------------------- equal
def test_same_step_traced_twice_gives_the_same_fingerprint():
    first = here()
    assert len(first["flax mlp"]) == 64 and int(first["flax mlp"], 16) >= 0
    assert flax_step() == first["flax mlp"]  # a new model, optimizer and step function
    for name, (a, _) in PAIRS.items():
        assert a() == first[name + " a"], name


def test_a_jaxpr_and_its_closed_jaxpr_give_the_same_fingerprint():
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) + jnp.arange(4.0))(F32)
    assert jaxpr_fingerprint(closed.jaxpr) == jaxpr_fingerprint(closed)
    with pytest.raises(TypeError, match="ClosedJaxpr"):
        jaxpr_fingerprint("{ lambda ; a:f32[]. let  in (a,) }")


def test_digests_are_kept_only_while_their_jaxpr_lives():
    f = named(jnp.tanh)
    closed = jax.make_jaxpr(f)(F32)
    digest = jaxpr_fingerprint(closed)
    assert jax.make_jaxpr(f)(F32) is closed  # jax's own trace cache: the same object
    assert jaxpr_fingerprint(closed) == digest
    alive = weakref.ref(closed.jaxpr)
    del closed, f
    gc.collect()
    assert alive() is None


CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
import conftest  # 8 simulated CPU devices, as in this process
import test_fingerprint as t
print(json.dumps(t.all_fingerprints()))
"""


def test_fingerprints_are_the_same_in_another_process():
    """Another interpreter, another hash seed, other object addresses: same digests."""
    env = dict(os.environ, PYTHONHASHSEED="4242", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # conftest sets it again, as here
    out = subprocess.run([sys.executable, "-c", CHILD.format(tests=str(TESTS))],
                         capture_output=True, text=True, env=env, cwd=TESTS, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here()


# --------------------------------------------------------------------------- different
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_fingerprint_changes_with_what_the_planner_reads(name):
    assert here()[name + " a"] != here()[name + " b"]


# --------------------------------------------------------------------------- no printing
def test_fingerprint_never_prints_the_jaxpr(monkeypatch):
    """Printing is what made the old fingerprint slow; a walk must not fall back on it.
    (Each step is traced anew: a digest already taken of the same jaxpr is reused.)"""
    def nested() -> str:
        return fp(lambda x: custom_vjp(jnp.sin)(scanned(jnp.cos)(x)), F32)

    expected, mlp, cnn = nested(), here()["flax mlp"], here()["flax cnn"]

    def refuse(self):
        raise AssertionError("jaxpr_fingerprint printed a jaxpr")

    for cls in (jcore.Jaxpr, jcore.ClosedJaxpr):
        monkeypatch.setattr(cls, "__str__", refuse)
        monkeypatch.setattr(cls, "__repr__", refuse)
    monkeypatch.setattr(jcore, "pp_jaxpr", refuse)
    assert nested() == expected
    assert flax_step() == mlp
    assert flax_step(models.CNN(), (2, 8, 8, 3)) == cnn


class Opaque:
    """A param type the fingerprint does not know: its repr holds an address."""


def test_unusual_params_fingerprint_deterministically_and_exactly():
    prim = jcore.Primitive("jaxwap_test_params")
    prim.def_abstract_eval(lambda x, **_: x)

    def step(*params: dict) -> Callable:
        def f(x):
            for p in params:
                x = prim.bind(x, **p)
            return x
        return f

    opaque = step({"obj": Opaque(), "fn": lambda y: y})
    assert " at 0x" in repr(Opaque())
    assert fp(opaque, F32) == fp(opaque, F32)  # other objects, other addresses
    assert fp(opaque, F32) != fp(opaque, jax.ShapeDtypeStruct((4, 5), jnp.float32))
    # equal (==) params of other types or signs are told apart, even within one jaxpr
    same = [step({"v": 0.0}, {"v": 0.0}), step({"v": 0.0}, {"v": -0.0}),
            step({"v": 1}, {"v": 1}), step({"v": 1}, {"v": True}), step({"v": 1}, {"v": 1.0})]
    assert len({fp(f, F32) for f in same}) == len(same)
