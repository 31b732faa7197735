"""Which leaf of the step's arguments is what: parameter (or a mirror of one), batch, other.

The step is opaque, so its arguments' roles are inferred from structure, not declared:
- a leaf whose key path ends with a parameter's path (relative to the params tree) and
  has its shape is that parameter or mirrors it (the params themselves, optax moments,
  `TrainState.params` and its `opt_state`, an `nnx.State`): it takes the parameter's
  sharding, so optimizer state is sharded exactly like what it tracks. A mirror is state
  the step hands back: where the step's outputs are known, a leaf other than the
  parameter itself that no output of the parameter's path and shape is left for is not
  one (`unreturned`). With flat-tuple params `(W, b)` the path of `W` is just `0`, which
  `x` of a batch `(x, y)` ends with too: the step returns one new `W`, and it is `W`'s;
- a leaf whose leading dimension is the batch size is data, split over the data axis;
- everything else (scalars, step counters, PRNG keys, state the step hands back such as
  batch-norm statistics) is replicated.
The batch size is the leading dimension most common among the leaves that are neither
parameters nor state the step returns (or the `batch_size=` the user gives). A legacy
PRNG key (`jax.random.PRNGKey`: uint32[2], or uint32[4] for rbg) is a plain array, but
its leading dimension is the key's width, not a batch: such leaves do not vote, and are
batch leaves only where `batch_size` is given (`raw_key`).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

PARAM, BATCH, OTHER = "param", "batch", "other"


@dataclass(frozen=True)
class ParamInfo:
    """One parameter leaf: its path within the params tree, shape and dtype."""

    path: tuple[str, ...]
    keystr: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        # Python's product of the dims (the cost model asks this of every parameter for
        # every layout it prices: numpy's per-call overhead was most of that)
        return int(math.prod(int(x) for x in self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * _itemsize(self.dtype)


@functools.cache
def _itemsize(dtype: str) -> int:
    return np.dtype(dtype).itemsize


@dataclass(frozen=True)
class LeafRole:
    """The role of one flattened leaf; `param` indexes `ParamInfo`s when kind == PARAM.

    `mirror` marks a PARAM leaf that is not the parameter itself but state that tracks it
    (optimizer moments): memory planning may shard it over the data axis (ZeRO-1) or keep
    it in host memory while the parameter itself stays put.
    """

    kind: str
    param: int = -1
    mirror: bool = False


# The attribute that names a key-path entry, per entry type (DictKey.key, GetAttrKey.name,
# SequenceKey.idx, ...): looked up once per type, since planning reads every leaf's path.
_TOKEN_ATTR: dict[type, str | None] = {}


def key_token(key: Any) -> str:
    """A key-path entry as a plain token, so a dict key and an attribute of one name match."""
    t = type(key)
    if t not in _TOKEN_ATTR:
        _TOKEN_ATTR[t] = next((a for a in ("key", "name", "idx") if hasattr(key, a)), None)
    attr = _TOKEN_ATTR[t]
    return str(key if attr is None else getattr(key, attr))


def path_tokens(path: Sequence[Any]) -> tuple[str, ...]:
    return tuple(map(key_token, path))


def is_key_dtype(dtype: Any) -> bool:
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


def raw_key(aval: Any) -> bool:
    """A uint32[2] (threefry) or uint32[4] (rbg) array: what `jax.random.PRNGKey` gives.
    Its 2 or 4 is no batch size, so it is not counted when the batch size is inferred:
    a batch of one beside such a key would otherwise tie 1 against 2 and lose."""
    return tuple(aval.shape) in ((2,), (4,)) and str(aval.dtype) == "uint32"


def abstract_leaf(leaf: Any, where: str | Callable[[], str]) -> jax.ShapeDtypeStruct:
    """A leaf as a ShapeDtypeStruct; anything that is not array-like is a clear error
    naming the leaf (`where`, or a function giving it: only an error needs it)."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        if leaf.dtype == object:    # jax cannot hold it; say which leaf before it tries
            where = where() if callable(where) else where
            raise TypeError(f"{where}: a numpy array of Python objects (dtype=object, "
                            f"shape {leaf.shape}) is not an array jax can use; convert it "
                            f"to a numeric dtype")
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=None)
    if isinstance(leaf, (bool, int, float, complex)):
        # Python scalars are traced as weakly typed 0-d arrays, as jax.jit does.
        dtype = jax.dtypes.canonicalize_dtype(np.asarray(leaf).dtype)
        return jax.ShapeDtypeStruct((), dtype, weak_type=not isinstance(leaf, bool))
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)
    where = where() if callable(where) else where
    raise TypeError(f"{where}: expected an array, jax.ShapeDtypeStruct or Python scalar, "
                    f"got {type(leaf).__name__} ({leaf!r:.80})")


def param_infos(params: Any) -> tuple[tuple[ParamInfo, ...], Any]:
    """Flatten the params tree into ParamInfos (paths relative to it) and its treedef."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    if not flat:
        raise ValueError("params has no array leaves: pass the parameter pytree "
                         "(arrays or jax.ShapeDtypeStruct)")
    infos = []
    for path, leaf in flat:
        where = f"params{jax.tree_util.keystr(path)}"
        if isinstance(leaf, (bool, int, float, complex)):
            raise TypeError(f"{where}: a parameter must be an array or jax.ShapeDtypeStruct, "
                            f"got the Python scalar {leaf!r}")
        a = abstract_leaf(leaf, where)
        if is_key_dtype(a.dtype):
            raise TypeError(f"{where}: a PRNG key is not a parameter; where the step's "
                            f"first argument holds more than its parameters (an NNX model's "
                            f"whole state, with its RNG streams), pass the trainable ones as "
                            f"params= (e.g. nnx.state(model, nnx.Param))")
        infos.append(ParamInfo(path_tokens(path), jax.tree_util.keystr(path),
                               tuple(int(s) for s in a.shape), str(np.dtype(a.dtype))))
    return tuple(infos), treedef


class SuffixIndex:
    """Items keyed by a path, found by the longest key that ends a given path.

    Matching leaves by key-path suffix is how roles are told (an optax moment at
    `opt_state[0].mu['dense']['kernel']` mirrors `params['dense']['kernel']`); a dict of
    keys answers each leaf in one probe per suffix instead of a scan of every key, which
    keeps planning linear in the number of leaves (a GPT-2 step has 450)."""

    def __init__(self, items: Sequence[tuple[tuple[str, ...], Any]]) -> None:
        self._by_key: dict[tuple[str, ...], list[Any]] = {}
        for key, value in items:
            self._by_key.setdefault(tuple(key), []).append(value)

    def longest(self, tokens: tuple[str, ...], accept: Callable[[Any], bool]) -> Any | None:
        """The first accepted item (in the order given) under the longest key that is a
        suffix of `tokens`; None when no key ending `tokens` has an accepted item."""
        for n in range(len(tokens), 0, -1):
            for value in self._by_key.get(tokens[len(tokens) - n:], ()):
                if accept(value):
                    return value
        return None


def match_param(tokens: tuple[str, ...], shape: tuple[int, ...],
                params: Sequence[ParamInfo] | SuffixIndex) -> int:
    """The parameter a leaf mirrors (longest matching path suffix, same shape), or -1.
    `params` may be a `SuffixIndex` of (path, (index, shape)) made once for many leaves."""
    index = params if isinstance(params, SuffixIndex) else param_index(params)
    hit = index.longest(tokens, lambda js: js[1] == shape)
    return -1 if hit is None else hit[0]


def param_index(params: Sequence[ParamInfo]) -> SuffixIndex:
    return SuffixIndex([(p.path, (j, p.shape)) for j, p in enumerate(params)])


def common_suffix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    """How many trailing tokens two paths share."""
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def unreturned(tokens_of: Sequence[tuple[str, ...]], param_of: Sequence[int],
               own: Sequence[bool], returned: Sequence[tuple[tuple[str, ...], Any]],
               index: SuffixIndex) -> set[int]:
    """The leaves that match a parameter but are neither it nor handed back by the step.

    The step hands back the parameter and each of its mirrors (optimizer moments) at a
    path ending with the parameter's and with its shape. Those outputs are shared out
    among the leaves matching the parameter, the pair with the longest common path suffix
    first (an optax moment `0.mu.0` gets the output `1.0.mu.0`), ties to the parameter
    itself (the user's own array, else the first match) and then to the earlier leaf; a
    leaf left without one is not a mirror. Batch data that merely ends at a parameter's
    path with its shape (`x` of `(x, y)` beside flat-tuple params `(W, b)`) is never
    handed back, so it stays data and is never donated."""
    matches: dict[int, list[int]] = {}
    for i, j in enumerate(param_of):
        if j >= 0:
            matches.setdefault(j, []).append(i)
    outs: dict[int, list[tuple[str, ...]]] = {}
    for tokens, shape in returned:
        j = match_param(tuple(tokens), tuple(int(d) for d in shape), index)
        if j >= 0:
            outs.setdefault(j, []).append(tuple(tokens))
    dropped: set[int] = set()
    for j, leaves in matches.items():
        order = sorted(leaves, key=lambda i: (not own[i], i))  # the parameter itself first
        pairs = sorted((-common_suffix(tokens_of[i], t), r, k)
                       for r, i in enumerate(order) for k, t in enumerate(outs.get(j, ())))
        got: set[int] = set()
        used: set[int] = set()
        for _, r, k in pairs:
            if r not in got and k not in used:
                got.add(r)
                used.add(k)
        dropped |= {i for r, i in enumerate(order) if r > 0 and r not in got and not own[i]}
    return dropped


@dataclass(frozen=True)
class LeafTable:
    """Every flattened leaf of the step's (args, kwargs) with its abstract value and role."""

    paths: tuple[str, ...]
    avals: tuple[jax.ShapeDtypeStruct, ...]
    roles: tuple[LeafRole, ...]
    batch_size: int | None


def abstract_entries(entries: Sequence[tuple[str, Sequence[Any], Any]]
                     ) -> list[jax.ShapeDtypeStruct]:
    """The abstract value of every `(root, key path, leaf)` entry."""
    return [abstract_leaf(leaf, lambda r=root, p=path: f"{r}{jax.tree_util.keystr(tuple(p))}")
            for root, path, leaf in entries]


def likeliest_batch(leading: Counter[int]) -> int | None:
    """The batch size among leaves' leading dims (counted): the dim most of them share,
    the largest of equals; None where no leaf has one."""
    if not leading:
        return None
    top = max(leading.values())
    return max(b for b, c in leading.items() if c == top)


def batch_rows(leaves: Sequence[Any]) -> int | None:
    """A batch's rows: the leading dim most of its array `leaves` share
    (`likeliest_batch`); leaves without it (a PRNG key, class weights, a scalar) are not
    rows; raw PRNG key data (`raw_key`) does not vote, its 2 or 4 being no batch. None
    where no leaf has a leading dim."""
    return likeliest_batch(Counter(int(np.shape(x)[0]) for x in leaves
                                   if np.ndim(x) and not raw_key(x)))


def classify_leaves(entries: Sequence[tuple[str, Sequence[Any], Any]],
                    params: Sequence[ParamInfo], *, identity: dict[int, int] | None = None,
                    batch_size: int | None = None, infer_batch: bool = True,
                    carried: Callable[[tuple[str, ...], tuple[int, ...]], bool] | None = None,
                    returned: Sequence[tuple[tuple[str, ...], Any]] | None = None,
                    by_path: bool = False,
                    avals: Sequence[jax.ShapeDtypeStruct] | None = None) -> LeafTable:
    """Assign roles to `(root, key path, leaf)` entries: param mirror, batch, or other.

    `identity` maps id(array) -> param index for leaves that are the user's own param
    arrays, which settles them whatever their path. `batch_size` fixes B (outputs are
    classified with the inputs' B); otherwise it is inferred. `carried(path, shape)` says
    a leaf is state the step returns (batch-norm statistics, counters): never data, and
    not counted when inferring B. `returned`: the (path, shape) of every output of the
    step, where known; a leaf matching a parameter that is neither the parameter itself
    nor handed back among them is not its mirror (`unreturned`) but data or other, like a
    leaf matching none. Legacy PRNG keys (`raw_key`) neither vote for B nor are batch
    leaves unless `batch_size` is given. `by_path` decides parameter-or-mirror from the path
    alone (`is_parameter_path`), for a tree that holds only optimizer state. `avals`: the
    entries' abstract values when the caller has them (`abstract_entries`).
    """
    identity = identity or {}
    index = param_index(params)
    given = abstract_entries(entries) if avals is None else avals
    paths, avals, param_of, state, own, tokens_of = [], [], [], [], [], []
    for (root, path, leaf), a in zip(entries, given, strict=True):
        where = f"{root}{jax.tree_util.keystr(tuple(path))}"
        shape = tuple(int(s) for s in a.shape)
        tokens = path_tokens(path)
        j = identity.get(id(leaf), -1)
        own.append(j >= 0)
        tokens_of.append(tokens)
        if j < 0:
            j = match_param(tokens, shape, index)
        paths.append(where)
        avals.append(a)
        param_of.append(j)
    dropped = set() if returned is None else unreturned(tokens_of, param_of, own, returned,
                                                        index)
    for i in dropped:
        param_of[i] = -1
    # state the step returns; a dropped leaf's path is handed back only as the parameter's
    state = [j < 0 and i not in dropped and carried is not None
             and carried(t, tuple(int(d) for d in a.shape))
             for i, (j, t, a) in enumerate(zip(param_of, tokens_of, avals, strict=True))]

    given_batch = batch_size is not None
    if batch_size is None and infer_batch:
        counts: Counter[int] = Counter()
        for a, j, st in zip(avals, param_of, state, strict=True):
            if (j < 0 and not st and len(a.shape) >= 1 and not is_key_dtype(a.dtype)
                    and not raw_key(a)):
                counts[int(a.shape[0])] += 1
        batch_size = likeliest_batch(counts)

    # The parameter itself is the user's own array where identity says so, else the first
    # leaf matching it (params come before optimizer state in every conventional step
    # signature and in TrainState); every other match is a mirror.
    by_identity = {j for j, o in zip(param_of, own, strict=True) if o}
    seen: set[int] = set()
    roles = []
    for a, j, st, o, t in zip(avals, param_of, state, own, tokens_of, strict=True):
        if j >= 0:
            if by_path:
                mirror = not is_parameter_path(t, params[j].path)
            else:
                mirror = (not o) if j in by_identity else j in seen
            seen.add(j)
            roles.append(LeafRole(PARAM, j, mirror))
        elif (batch_size is not None and not st and len(a.shape) >= 1
              and not is_key_dtype(a.dtype) and (given_batch or not raw_key(a))
              and int(a.shape[0]) == batch_size):
            roles.append(LeafRole(BATCH))
        else:
            roles.append(LeafRole(OTHER))
    return LeafTable(tuple(paths), tuple(avals), tuple(roles), batch_size)


def is_parameter_path(tokens: tuple[str, ...], param_path: tuple[str, ...]) -> bool:
    """A leaf at `tokens` is the parameter itself (not an optimizer moment) when its path is
    the parameter's own path, or that path under a `params` field (a TrainState)."""
    n = len(param_path)
    return tokens == param_path or (len(tokens) > n and tokens[-n - 1:] == ("params",
                                                                          *param_path))


def check_params_found(table: LeafTable, params: Sequence[ParamInfo]) -> None:
    """Every parameter must appear among the arguments, or the plan would shard nothing,
    and as the dtype `params=` gives it, or the plan would count its bytes wrong."""
    found = {r.param for r in table.roles if r.kind == PARAM}
    missing = [p for j, p in enumerate(params) if j not in found]
    if missing:
        shown = ", ".join(f"params{p.keystr} {p.shape}" for p in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"params not found among the step's arguments: {shown}{more}. "
                         f"Pass the same params pytree (or one of the same structure and "
                         f"shapes) that the step receives.")
    # the parameter's own leaf (not a mirror: an optimizer moment may keep another dtype)
    # must be what params= says, or every byte the plan counts for it is off
    for path, aval, role in zip(table.paths, table.avals, table.roles, strict=True):
        if role.kind == PARAM and not role.mirror \
                and np.dtype(aval.dtype) != np.dtype(params[role.param].dtype):
            p = params[role.param]
            raise TypeError(f"params{p.keystr} is {p.dtype}{list(p.shape)} in params=, but "
                            f"the step receives {np.dtype(aval.dtype)} at {path}: pass "
                            f"params= with the dtypes the step receives (or the arrays "
                            f"themselves)")
