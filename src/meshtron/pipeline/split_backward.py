"""A layer's backward pass cut in two: the input gradient now, the weight gradient later.

Zero-bubble pipelining (Qi et al., 2023) runs the input gradient ``B`` of a stage at once -- the
previous stage waits for it -- and defers the weight gradient ``W`` into what would otherwise be
pipeline bubbles. In PyTorch that split is written by hand per operator. Here it is derived from
the program JAX already has: the pullback of ``jax.vjp(layer, params, x)`` is a jaxpr of
primitives, and

* ``B`` = every equation the input gradient ``dx`` depends on (the cotangent chain through the
  layer, which every weight gradient also needs);
* ``W`` = the remaining equations the parameter gradients depend on (for a dense layer
  ``dW = xᵀ·dy``: the matmuls that only produce weight gradients, and whatever feeds only them);
* the *boundary* = the values ``W`` reads that ``B`` (or the forward) produced: the cotangents at
  the weight-bearing operations and the forward activations they multiply. ``B`` returns them;
  whoever runs ``W`` later keeps them until then.

No equation runs twice, so ``B`` + ``W`` cost what the full pullback costs, and ``W(B(...))``
equals the pullback exactly (the same primitives on the same values).

When whoever runs ``W`` still holds the layer's residuals (``weight_reads_residuals``: a pipeline
that keeps them until W), W takes from them what it can: the boundary is then only what depends on
the output cotangent, and the forward values W multiplies (a norm's output, GELU's) are recomputed
in W from the residuals, by the same equations B ran on them. A parameter gradient that needs no
matmul (a norm's scale and bias: sums over the tokens) is then computed in B when that spares the
boundary a token-wide value (the norm's output cotangent) -- as zero-bubble implementations defer
only the linear layers' weight gradients. For a transformer layer that cuts what B leaves for W
to about a third (GPT: 9 instead of 26 ``s·b·h`` per layer, plus the norms' [h] gradients; Llama
13 instead of 28); the price is W rerunning a few element-wise forward equations. Still the same
primitives on the same values: bit-for-bit the pullback.

On CPU the runtime also asks for W's matmuls with their operands laid out as XLA's fast GEMM
takes them (``contiguous_weight_matmuls``): a weight gradient contracts over the tokens, which XLA's
CPU backend otherwise runs in a generic loop. The unsplit pullback then runs the same equations the
same way, so B + W still equals it bit for bit; against ``jax.vjp``'s own pullback only rounding differs.

Nested ``jit`` and ``checkpoint`` calls are inlined first, so a jitted or rematerialised helper
that computes both kinds of gradient (Llama's fused projections) is split too; other higher-order
primitives (``custom_jvp_call``, control flow) stay whole and go to ``B`` when ``dx`` needs any of
their outputs.

The forward of the layer is taken apart the same way: :func:`residuals` runs ``jax.vjp`` and
keeps the pullback's residual arrays (a pullback is a pytree whose leaves are exactly those), so
a loop over layers can store them and :class:`SplitPullback` can run the backward from them.
Residuals that *are* the layer's parameters are not stored: they are read from the parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.extend import core as jcore

PyTree = Any


_INLINED = ("jit", "pjit", "checkpoint", "remat", "remat2")  # primitives whose body is split, not kept whole


def _is_literal(atom: Any) -> bool:
    return isinstance(atom, jcore.Literal)


@dataclass(frozen=True)
class _Op:
    """One primitive application of the flattened pullback: inputs and outputs are jaxpr atoms."""

    primitive: Any
    params: dict
    inputs: tuple
    outputs: tuple
    context: Any  # the equation's JaxprEqnContext (compute type, layouts) to bind under


def _flatten(jaxpr: Any, consts: Sequence[Any], alias: dict, ops: list[_Op], inlined: bool = False) -> None:
    """Append ``jaxpr``'s equations to ``ops`` with nested ``jit``/``checkpoint`` calls inlined. ``alias`` maps a
    variable to the atom (variable, literal or constant) it stands for.

    An inlined body's equations get fresh output variables (:class:`_Renamed`): JAX reuses one traced
    body for every call of the same jitted helper with the same shapes (``jnp.take``'s index
    normalisation, called once per gather), so without renaming two calls' results would be one
    variable."""

    def atom(a):
        return a if _is_literal(a) else alias.get(a, a)

    for var, value in zip(jaxpr.constvars, consts):
        alias[var] = _Const(value)
    for eqn in jaxpr.eqns:
        inner = eqn.params.get("jaxpr") if eqn.primitive.name in _INLINED else None
        if inner is not None:
            # `jit` holds a ClosedJaxpr; `checkpoint` (a recomputation inside the backward, which
            # needs no protection there: the forward it would be fused with is not in this program)
            # an open Jaxpr.
            body, body_consts = (inner.jaxpr, inner.consts) if hasattr(inner, "consts") else (inner, ())
            for var, outer in zip(body.invars, eqn.invars):
                alias[var] = atom(outer)
            _flatten(body, body_consts, alias, ops, inlined=True)
            for outer, inner_out in zip(eqn.outvars, body.outvars):
                alias[outer] = atom(inner_out)
            continue
        inputs = tuple(atom(a) for a in eqn.invars)
        if inlined:
            for var in eqn.outvars:
                alias[var] = _Renamed(var.aval)
        ops.append(_Op(eqn.primitive, eqn.params, inputs, tuple(atom(v) for v in eqn.outvars), eqn.ctx))


class _Renamed:
    """One inlined copy of a body's variable (compared by identity, like a jaxpr variable)."""

    __slots__ = ("aval",)

    def __init__(self, aval: Any):
        self.aval = aval


@dataclass(frozen=True)
class _Const:
    """A constant captured by a traced function (not a jaxpr variable)."""

    value: Any


def _is_var(a: Any) -> bool:
    return not _is_literal(a) and not isinstance(a, _Const)


def _slice(ops: Sequence[_Op], roots: Sequence[Any], exclude: set[int]) -> set[int]:
    """Indices of the ops (not in ``exclude``) that the atoms ``roots`` depend on."""
    producer = {id(out): i for i, op in enumerate(ops) for out in op.outputs}
    wanted = [a for a in roots if _is_var(a)]
    seen: set[int] = set()
    picked: set[int] = set()
    while wanted:
        a = wanted.pop()
        if id(a) in seen:
            continue
        seen.add(id(a))
        i = producer.get(id(a))
        if i is None or i in exclude or i in picked:
            continue
        picked.add(i)
        wanted.extend(x for x in ops[i].inputs if _is_var(x))
    return picked


def _evaluate(ops: Sequence[_Op], env: dict, contiguous: Mapping[int, bool] | None = None,
              product_barrier: bool = True) -> None:
    """Run ``ops`` in order, reading and writing values in ``env`` (keyed by ``id(variable)``); the
    matmuls whose ``id`` is in ``contiguous`` run on operands laid out as a plain GEMM reads them
    (:func:`_contiguous_matmul`, with ``swap`` the value ``contiguous`` maps them to, and the product behind
    a barrier with ``product_barrier``)."""
    contiguous = contiguous or {}

    read = _reader(env)
    for op in ops:
        bind_params = op.primitive.get_bind_params(op.params)
        subfuns: tuple = ()
        if isinstance(bind_params, tuple):  # JAX releases before 0.7 returned (subfuns, params)
            subfuns, bind_params = bind_params
        with op.context.manager:
            if id(op) in contiguous:
                out = _contiguous_matmul(*map(read, op.inputs), swap=contiguous[id(op)], barrier=product_barrier,
                                         **bind_params)
            elif op.primitive.name == "pvary":
                out = _pvary(read(op.inputs[0]), **bind_params)
            else:
                out = op.primitive.bind(*subfuns, *map(read, op.inputs), **bind_params)
        outs = out if op.primitive.multiple_results else (out,)
        for var, value in zip(op.outputs, outs):
            env[id(var)] = value


def _pvary(x: Any, *, axes: tuple) -> Any:
    """``pvary`` of ``x`` over those of ``axes`` it does not vary over yet. A value the traced pullback
    saw invariant over a manual axis (a residual of the example layer) is read back from a buffer that
    varies over it; casting it again to varying would be an error, and it is already what the cast
    makes."""
    varying = jax.typeof(x).mat.varying
    missing = tuple(a for a in axes if a not in varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _gemm_orders(lhs_ndim: int, lhs_contract: Sequence[int], rhs_ndim: int,
                 rhs_contract: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The dimension orders a plain GEMM reads: ``lhs``'s contracted dimensions last, ``rhs``'s first."""
    return ((*(d for d in range(lhs_ndim) if d not in lhs_contract), *lhs_contract),
            (*rhs_contract, *(d for d in range(rhs_ndim) if d not in rhs_contract)))


def _contiguous_matmul(lhs: jax.Array, rhs: jax.Array, *, dimension_numbers: Any, swap: bool = False,
                       barrier: bool = True, **params: Any) -> jax.Array:
    """``dot_general(lhs, rhs)`` with the contracted dimensions last in the left operand and first in
    the right one.

    A weight gradient contracts over the leading (token) dimensions of both operands (``dW = xᵀ·dy``).
    XLA's CPU backend runs a product in its fast GEMM (YNNPACK) only when the left operand's
    contracted dimensions are its last and the right one's its first; it runs the others in a generic
    loop, 1.6x slower on a 512x1024x256 product here. Transposing an operand explicitly is not enough:
    XLA folds the transpose back into the product's dimension numbers, and a transpose of the product
    (JAX's pullback of ``x @ W`` computes ``(dyᵀ·x)ᵀ``) into swapped operands. So each transposed
    copy, and the product, pass through an optimization barrier, which XLA does not look through. The
    copies cost a few percent of the product; the result is the same product, up to rounding (the
    GEMM sums in another order). Products with batch dimensions, or already in that form, are bound
    as they are.

    ``swap``: compute ``rhs·lhs`` instead, the product's free dimensions in the other order, and
    return it transposed back without a barrier. For JAX's ``(dyᵀ·x)ᵀ`` that is ``xᵀ·dy`` -- the
    weight's own layout -- and XLA cancels the returned transpose against the one that follows,
    where the product as traced is copied once more, weight-sized, to be transposed (16 MB per
    MLP matrix at width 1024). The operand copy moves from ``dy`` to ``x``: a quarter the size for
    the MLP's first matrix, four times for its second, so :func:`_swap_is_cheaper` decides by the
    elements copied (W 43% faster at width 1024 and 256 tokens, 16% at width 256 and 512 tokens,
    where the MLP's second matrix keeps the traced orientation).

    ``barrier=False`` leaves the product itself without a barrier (the operands keep theirs): what XLA:GPU
    needs to add a weight gradient into its accumulator in the GEMM (``parallel.gradient_accumulation_fusion``),
    while the transposed operands still spare the rest of the backward layout copies.
    """
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if lhs_batch or rhs_batch:
        return jax.lax.dot_general_p.bind(lhs, rhs, dimension_numbers=dimension_numbers, **params)
    if swap:
        product = _contiguous_matmul(rhs, lhs, dimension_numbers=((rhs_contract, lhs_contract), ((), ())),
                                     barrier=barrier, **params)
        free_rhs = rhs.ndim - len(rhs_contract)  # leading in ``product``, trailing in the result
        return jax.lax.transpose(product, (*range(free_rhs, product.ndim), *range(free_rhs)))
    lhs_order, rhs_order = _gemm_orders(lhs.ndim, lhs_contract, rhs.ndim, rhs_contract)
    if lhs_order == tuple(range(lhs.ndim)) and rhs_order == tuple(range(rhs.ndim)):
        return jax.lax.dot_general_p.bind(lhs, rhs, dimension_numbers=dimension_numbers, **params)
    if lhs_order != tuple(range(lhs.ndim)):
        lhs = jax.lax.optimization_barrier(jax.lax.transpose(lhs, lhs_order))
    if rhs_order != tuple(range(rhs.ndim)):
        rhs = jax.lax.optimization_barrier(jax.lax.transpose(rhs, rhs_order))
    k = len(lhs_contract)
    contiguous = ((tuple(range(lhs.ndim - k, lhs.ndim)), tuple(range(k))), ((), ()))
    product = jax.lax.dot_general_p.bind(lhs, rhs, dimension_numbers=contiguous, **params)
    return jax.lax.optimization_barrier(product) if barrier else product


class SplitPullback:
    """The pullback of ``layer`` at given residuals, as ``input_gradient`` then ``weight_gradient``.

    Build it once per layer *shape* (every layer of a uniform stack shares it) from example
    residuals and an example output cotangent; then ``input_gradient(res, params, dy) -> (dx, boundary)``
    and ``weight_gradient(params, boundary) -> dparams`` may be traced anywhere, in different loops.
    ``res`` are the residual arrays :func:`residuals` stored (parameters excluded: pass them in
    ``params``). With ``weight_reads_residuals`` W also takes ``res`` (the caller keeps them until
    W) and the boundary holds only what depends on the cotangent; ``early`` then lists the parameter
    gradients (indices in ``params`` order) B computes itself and hands over as boundary values.

    With ``contiguous_weight_matmuls`` W's matmuls run on operands laid out as a plain GEMM reads
    them (:func:`_contiguous_matmul`: what XLA's CPU backend needs to use its fast GEMM for a weight
    gradient), and :meth:`pullback` runs the same equations with the same layouts instead of JAX's
    own pullback, so B + W still equals it bit for bit; both then differ from ``jax.vjp``'s pullback
    by rounding. ``weight_product_barrier=False``: the products themselves without a barrier
    (:func:`_contiguous_matmul`'s ``barrier``), for XLA:GPU.
    """

    def __init__(self, treedef: Any, param_slots: Sequence[int | None], example_res: Sequence[jax.Array],
                 example_params: Sequence[jax.Array], example_dy: jax.Array, weight_reads_residuals: bool = False,
                 contiguous_weight_matmuls: bool = False, weight_product_barrier: bool = True):
        self._treedef = treedef
        self.weight_reads_residuals = weight_reads_residuals
        self.contiguous_weight_matmuls = contiguous_weight_matmuls
        self._product_barrier = weight_product_barrier
        self._param_slots = tuple(param_slots)  # for each pullback residual: params index, or None

        def full(res, params, dy):
            return treedef.unflatten(self._merge(res, params))(dy)

        closed = jax.make_jaxpr(full)(list(example_res), list(example_params), example_dy)
        jaxpr = closed.jaxpr
        ops: list[_Op] = []
        alias: dict = {}
        _flatten(jaxpr, closed.consts, alias, ops)

        def out_atom(a):
            return a if _is_literal(a) else alias.get(a, a)

        outs = [out_atom(a) for a in jaxpr.outvars]
        n_res, n_par = len(example_res), len(example_params)
        self._res_vars = tuple(jaxpr.invars[:n_res])
        self._param_vars = tuple(jaxpr.invars[n_res:n_res + n_par])
        self._dy_var = jaxpr.invars[n_res + n_par]
        *self._dparam_atoms, self._dx_atom = outs  # the pullback returns (dparams..., dx)
        b_ops = _slice(ops, [self._dx_atom], set())
        given = {id(v) for v in self._param_vars}
        if weight_reads_residuals:
            given |= {id(v) for v in self._res_vars}

        early: set[int] = set()  # parameter gradients B computes itself (handed over as they are, not deferred)

        def weight_part(excluded: set[int]) -> tuple[set[int], tuple]:
            deferred = [a for k, a in enumerate(self._dparam_atoms) if k not in early]
            w = _slice(ops, deferred, excluded | _slice(ops, self._early_atoms(early), b_ops))
            return w, _inputs_from_outside(ops, w, self._dparam_atoms, given)

        if weight_reads_residuals:
            # W also reruns B's equations that do not depend on the cotangent (forward recomputation
            # from the residuals), and a cheap cotangent equation whenever W holds its inputs anyway
            # and storing them is smaller (a norm's ``(x - mean)·dy`` before its scale's reduction:
            # W has ``dy`` for the bias and recomputes ``x - mean``). Matmuls always stay in B.
            on_dy = b_ops & _depending_on(ops, self._dy_var)
            w_ops, boundary = weight_part(on_dy)
            producer = {id(out): i for i, op in enumerate(ops) for out in op.outputs}
            shrunk = True
            while shrunk:
                shrunk = False
                for a in boundary:
                    i = producer.get(id(a))
                    if i is None or ops[i].primitive.name in _MATMULS:
                        continue
                    tried = weight_part(on_dy - {i})
                    if _nbytes(tried[1]) < _nbytes(boundary):
                        on_dy, (w_ops, boundary), shrunk = on_dy - {i}, tried, True
                        break
            # A parameter gradient that needs no matmul (a norm's scale and bias: reductions over the
            # tokens) is computed in B when every gradient that reads one of the boundary values is
            # such: the boundary then holds the gradient ([h]) instead of the token-wide value it
            # reduces (the norm's output cotangent, s·b·h) -- as zero-bubble implementations defer
            # only the linear layers' weight gradients.
            for a in boundary:
                readers = {k for k, d in enumerate(self._dparam_atoms) if k not in early and _is_var(d)
                           and id(a) in {id(x) for i in _slice(ops, [d], on_dy) for x in ops[i].inputs}}
                tried_early = early | readers
                before = b_ops | _slice(ops, self._early_atoms(early), b_ops)
                added = _slice(ops, self._early_atoms(readers), before)
                if not readers or any(ops[i].primitive.name in _MATMULS for i in added):
                    continue
                kept_early, early = early, tried_early
                tried = weight_part(on_dy)
                if _nbytes(tried[1]) < _nbytes(boundary):
                    w_ops, boundary = tried
                else:
                    early = kept_early
        else:
            w_ops, boundary = weight_part(b_ops)
        self.early = tuple(sorted(early))
        b_ops = b_ops | _slice(ops, self._early_atoms(early), b_ops)
        self._b_ops = [ops[i] for i in sorted(b_ops)]
        self._w_ops = [ops[i] for i in sorted(w_ops)]
        self._ops = [ops[i] for i in sorted(b_ops | w_ops)]  # the whole pullback, in program order
        self._contiguous = {id(op): _swap_is_cheaper(op, ops, outs) for op in self._w_ops
                            if op.primitive.name == "dot_general" and contiguous_weight_matmuls}
        self._boundary = boundary

    def _early_atoms(self, early: set[int]) -> list[Any]:
        return [self._dparam_atoms[k] for k in sorted(early)]

    def _merge(self, res: Sequence[Any], params: Sequence[Any]) -> list[Any]:
        stored = iter(res)
        return [params[slot] if slot is not None else next(stored) for slot in self._param_slots]

    def _env(self, res: Sequence[Any], params: Sequence[Any]) -> dict:
        env = {id(v): x for v, x in zip(self._res_vars, res)}
        env.update({id(v): x for v, x in zip(self._param_vars, params)})
        return env

    @property
    def boundary_avals(self) -> list[jax.core.ShapedArray]:
        """What ``W`` needs from ``B``: shapes and dtypes of the values to keep between them."""
        return [a.aval for a in self._boundary]

    @property
    def boundary_gradients(self) -> tuple[int | None, ...]:
        """For each boundary value, the index (in ``params`` order) of the parameter gradient it is
        when B computed that gradient itself (``None``: a value W computes from). A caller may add
        those to its gradient accumulator at B and hand ``weight_gradient`` ``None`` in their place."""
        by_atom = {id(self._dparam_atoms[k]): k for k in self.early}
        return tuple(by_atom.get(id(a)) for a in self._boundary)

    @property
    def boundary_homes(self) -> tuple[int | None, ...]:
        """For each boundary value, a stored residual of the same shape and dtype that ``W`` does not
        read (``None``: there is none), each residual given at most once.

        A caller that keeps the residuals until W (``weight_reads_residuals``) may have B write the
        value over that residual: only B needed it, and B has read it by then. In a transformer
        layer the cotangent at the QKV projection replaces the projection's output, which only the
        attention backward (in B) reads: 3 of GPT's 9 ``s·b·h`` per layer then cost nothing more."""
        if not self.weight_reads_residuals:
            return (None,) * len(self._boundary)
        # A gradient B computed is added to the accumulator at B: it never takes a residual's place.
        return _assign_homes(self._res_vars, self._w_ops, self._dparam_atoms,
                             [None if k is not None else a for a, k in zip(self._boundary, self.boundary_gradients)])

    def pullback(self, res: Sequence[jax.Array], params: Sequence[jax.Array],
                 dy: jax.Array) -> tuple[list[jax.Array], jax.Array]:
        """``(dparams, dx)`` in one piece: the layer's own ``jax.vjp`` pullback at the stored
        residuals (what a backward that is not split runs; dparams flat, in ``params`` order); with
        ``contiguous_weight_matmuls``, B's and W's equations in program order, W's matmuls laid out as W lays them out."""
        if not self._contiguous:
            *dparams, dx = jax.tree.leaves(self._treedef.unflatten(self._merge(res, params))(dy))
            return dparams, dx
        env = self._env(res, params)
        env[id(self._dy_var)] = dy
        _evaluate(self._ops, env, self._contiguous, self._product_barrier)
        read = _reader(env)
        return [read(a) for a in self._dparam_atoms], read(self._dx_atom)

    def input_gradient(self, res: Sequence[jax.Array], params: Sequence[jax.Array],
                       dy: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        """``(dx, boundary)``: the gradient w.r.t. the layer input and what ``W`` will need."""
        env = self._env(res, params)
        env[id(self._dy_var)] = dy
        _evaluate(self._b_ops, env)
        read = _reader(env)
        return read(self._dx_atom), [read(a) for a in self._boundary]

    def weight_gradient(self, params: Sequence[jax.Array], boundary: Sequence[jax.Array],
                        res: Sequence[jax.Array] | None = None) -> list[jax.Array]:
        """The parameter gradients (flat, in ``params`` order), from ``B``'s boundary values (and the
        residuals ``res``, which a pullback built with ``weight_reads_residuals`` reads). A gradient B
        computed (:attr:`boundary_gradients`) is returned as given, or ``None`` if given ``None``."""
        if self.weight_reads_residuals and res is None:
            raise ValueError("weight_gradient: this split reads the layer's residuals in W; pass res=")
        env = self._env(res, params) if self.weight_reads_residuals else {
            id(v): x for v, x in zip(self._param_vars, params)}
        env.update({id(a): x for a, x in zip(self._boundary, boundary) if x is not None})
        _evaluate(self._w_ops, env, self._contiguous, self._product_barrier)
        read = _reader(env)
        early = {id(self._dparam_atoms[k]) for k in self.early}
        return [None if id(a) in early and id(a) not in env else read(a) for a in self._dparam_atoms]


_MATMULS = ("dot_general", "conv_general_dilated")


def _assign_homes(res_vars: Sequence[Any], w_ops: Sequence[_Op], dparam_atoms: Sequence[Any],
                  boundary: Sequence[Any]) -> tuple[int | None, ...]:
    """For each boundary value, the first residual of its shape and dtype that ``w_ops`` do not read
    and no earlier value took (``None``: none left, or the value is ``None``: one B keeps itself)."""
    read_by_w = {id(a) for op in w_ops for a in op.inputs if _is_var(a)}
    read_by_w |= {id(a) for a in dparam_atoms if _is_var(a)}
    free = [i for i, v in enumerate(res_vars) if id(v) not in read_by_w]
    homes: list[int | None] = []
    for a in boundary:
        home = None if a is None else next((i for i in free if res_vars[i].aval.shape == a.aval.shape
                                            and res_vars[i].aval.dtype == a.aval.dtype), None)
        if home is not None:
            free.remove(home)
        homes.append(home)
    return tuple(homes)


def _nbytes(atoms: Sequence[Any]) -> int:
    return sum(a.aval.size * a.aval.dtype.itemsize for a in atoms)


def _inputs_from_outside(ops: Sequence[_Op], picked: set[int], outputs: Sequence[Any], given: set[int]) -> tuple:
    """The variables the ops ``picked`` (and the atoms ``outputs`` they return) read that they do not
    produce themselves and that are not ``given``: what must be handed to them, in first-use order."""
    chosen = [ops[i] for i in sorted(picked)]
    produced = {id(out) for op in chosen for out in op.outputs}
    found: dict[int, Any] = {}
    for a in [x for op in chosen for x in op.inputs] + list(outputs):
        if _is_var(a) and id(a) not in produced and id(a) not in given:
            found.setdefault(id(a), a)
    return tuple(found.values())


def _depending_on(ops: Sequence[_Op], var: Any) -> set[int]:
    """Indices of the ops whose outputs depend on ``var`` (``ops`` in program order)."""
    tainted, picked = {id(var)}, set()
    for i, op in enumerate(ops):
        if any(_is_var(a) and id(a) in tainted for a in op.inputs):
            picked.add(i)
            tainted.update(id(out) for out in op.outputs)
    return picked


def _gemm_copy_elements(lhs: Any, lhs_contract: Sequence[int], rhs: Any, rhs_contract: Sequence[int]) -> int:
    """Elements :func:`_contiguous_matmul` copies to put ``lhs``'s contracted dimensions last and
    ``rhs``'s first."""
    orders = _gemm_orders(lhs.aval.ndim, lhs_contract, rhs.aval.ndim, rhs_contract)
    return sum(0 if order == tuple(range(a.aval.ndim)) else int(math.prod(a.aval.shape))
               for a, order in zip((lhs, rhs), orders))


def _swap_is_cheaper(dot: _Op, ops: Sequence[_Op], outputs: Sequence[Any]) -> bool:
    """Whether :func:`_contiguous_matmul` should compute ``rhs·lhs`` (its ``swap``): when the only
    reader of ``dot``'s product is a transpose that puts the right operand's free dimensions first
    (JAX's ``(dyᵀ·x)ᵀ``), the swapped product is already in that layout, and swapping pays when its
    operand copies are smaller than the traced orientation's plus the transposed product's."""
    (lhs_contract, rhs_contract), _ = dot.params["dimension_numbers"]
    product = dot.outputs[0]
    if any(a is product for a in outputs):
        return False
    readers = [op for op in ops if any(a is product for a in op.inputs)]
    if len(readers) != 1 or readers[0].primitive.name != "transpose":
        return False
    free_lhs = dot.inputs[0].aval.ndim - len(lhs_contract)
    ndim = product.aval.ndim
    if tuple(readers[0].params["permutation"]) != (*range(free_lhs, ndim), *range(free_lhs)):
        return False
    lhs, rhs = dot.inputs
    traced = _gemm_copy_elements(lhs, lhs_contract, rhs, rhs_contract) + int(math.prod(product.aval.shape))
    return _gemm_copy_elements(rhs, rhs_contract, lhs, lhs_contract) < traced


def _reader(env: dict) -> Callable[[Any], Any]:
    def read(a):
        if _is_literal(a):
            return a.val
        if isinstance(a, _Const):
            return a.value
        return env[id(a)]

    return read


def residuals(layer: Callable[[PyTree, jax.Array], jax.Array], params: PyTree, x: jax.Array,
              held: Sequence[jax.Array] = ()) -> tuple[jax.Array, list[jax.Array], Any, tuple[int | None, ...]]:
    """``(y, stored, treedef, param_slots)``: the layer's output and its pullback's residuals.

    ``stored`` are the residual arrays that are not parameters; ``param_slots[i]`` says which flat
    parameter the ``i``-th residual is (``None``: it is in ``stored``), so the parameters are read
    where they live instead of being stored a second time per microbatch. ``held``: other arrays the
    layer reads (closed over, not differentiated) that live as long as the parameters; they are
    numbered after the flat parameters and read where they live too.
    """
    y, pullback = jax.vjp(lambda p, h: layer(p, h), params, x)
    leaves, treedef = jax.tree.flatten(pullback)
    flat_params = [*jax.tree.leaves(params), *held]
    by_id = {id(p): i for i, p in enumerate(flat_params)}
    slots = tuple(by_id.get(id(leaf)) for leaf in leaves)
    stored = [leaf for leaf, slot in zip(leaves, slots) if slot is None]
    return y, stored, treedef, slots
