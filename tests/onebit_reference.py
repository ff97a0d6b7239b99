"""Numpy references for 1-bit LAMB (clean mode of the reference notes, §2 and §3), written from the
formulas, independently of the JAX code: the dense equivalent of the compressed all-reduce and the
optimizer step by step, per worker."""

from __future__ import annotations

import math

import numpy as np


def dense_reference(x, we, se):
    """Compress each worker with its RMS scale, average exactly, compress each chunk with its own.

    ``x`` [P, n], ``we`` [P, padded], ``se`` [P, padded/P]; returns (out, new we, new se, z).
    """
    workers, n = x.shape
    total = we.shape[1]
    chunk = total // workers
    b = np.zeros((workers, total), np.float64)
    b[:, :n] = x + we[:, :n]
    sgn = np.where(b >= 0, 1.0, -1.0)
    alpha = np.sqrt((b ** 2).sum(1) / total)
    new_we = b - alpha[:, None] * sgn
    new_we[:, n:] = 0
    z = (alpha[:, None] * sgn).mean(0).reshape(workers, chunk) + se
    zsgn = np.where(z >= 0, 1.0, -1.0)
    beta = np.sqrt((z ** 2).sum(1) / chunk)
    out = (beta[:, None] * zsgn).reshape(total)[:n]
    return out, new_we, z - beta[:, None] * zsgn, z


HYPER = {"b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "max_coeff": 10.0, "min_coeff": 0.01,
         "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1}


class NumpyOnebitLamb:
    """1-bit LAMB over ``workers`` data-parallel workers, in float64, one parameter dict.

    ``stacked`` names leaves whose leading axis is a layer axis (per-layer trust ratio etc.);
    ``decay`` names leaves that get weight decay; ``momentum_mask`` maps names to 0/1 arrays.
    Leaves are handled in ``jax.tree.leaves`` order, which is also the compressed buffer's.
    """

    def __init__(self, params, workers, *, stacked=(), decay=None, momentum_mask=None, **hyper):
        self.h = {**HYPER, **hyper}
        self.names = sorted(params)
        self.p = {k: np.asarray(v, np.float64) for k, v in params.items()}
        self.workers = workers
        self.stacked = set(stacked)
        self.decay = set(params) if decay is None else set(decay)
        self.mask = momentum_mask or {}
        zeros = {k: np.zeros_like(v) for k, v in self.p.items()}
        self.m, self.v, self.vf = dict(zeros), dict(zeros), dict(zeros)
        self.c = {k: np.zeros(self._layers(k)) for k in self.names}
        self.r = {k: np.ones(self._layers(k)) for k in self.names}
        self.s = {k: np.ones(self._layers(k)) for k in self.names}
        self.factor = {}
        self.ratio = {}
        self.we = self.se = None

    def _layers(self, k):
        return self.p[k].shape[:1] if k in self.stacked else ()

    def _axes(self, k):
        return tuple(range(1, self.p[k].ndim)) if k in self.stacked else None

    def _norm(self, k, x):
        return np.sqrt(np.sum(x * x, axis=self._axes(k)))

    def _bcast(self, k, value):
        value = np.asarray(value)
        return value.reshape(value.shape + (1,) * (self.p[k].ndim - value.ndim))

    def _decayed(self, k, u):
        return u + self.h["weight_decay"] * self.p[k] if k in self.decay else u

    def step(self, grads, compression: bool, lr: float):
        """``grads``: list over workers of dicts of local gradients."""
        if compression:
            self._compression(grads, lr)
        else:
            self._warmup(grads, lr)

    def _warmup(self, grads, lr):
        h = self.h
        for k in self.names:
            g = np.mean([np.asarray(w[k], np.float64) for w in grads], axis=0)
            self.m[k] = h["b1"] * self.m[k] + (1 - h["b1"]) * g
            self.v[k] = h["b2"] * self.v[k] + (1 - h["b2"]) * g * g
            u = self._decayed(k, self.m[k] / (np.sqrt(self.v[k]) + h["eps"]))
            w_norm, u_norm = self._norm(k, self.p[k]), self._norm(k, u)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where((w_norm > 0) & (u_norm > 0),
                                 np.maximum(np.minimum(w_norm / u_norm, h["max_coeff"]), h["min_coeff"]), 1.0)
            self.c[k] = np.where(ratio != 1.0, h["coeff_beta"] * self.c[k] + (1 - h["coeff_beta"]) * ratio, self.c[k])
            self.ratio[k] = ratio
            self.p[k] = self.p[k] - lr * self._bcast(k, ratio) * u
            self.vf[k] = self.v[k].copy()
        rms = {k: self._norm(k, self.m[k]) / np.sqrt(self.m[k][0].size if k in self.stacked else self.m[k].size)
               for k in self.names}
        count = sum(self.p[k].shape[0] if k in self.stacked else 1 for k in self.names)
        united = sum(np.sum(r) for r in rms.values()) / count
        self.s = {k: np.where(r > 0, united / np.where(r > 0, r, 1.0), 1.0) for k, r in rms.items()}

    def _compression(self, grads, lr):
        h, P = self.h, self.workers
        last = {k: self.m[k].copy() for k in self.names}
        local = [{k: (h["b1"] * self.m[k] + (1 - h["b1"]) * np.asarray(w[k], np.float64)) * self._bcast(k, self.s[k])
                  for k in self.names} for w in grads]
        if P > 1:
            x = np.stack([np.concatenate([w[k].reshape(-1) for k in self.names]) for w in local])
            if self.we is None:  # padded to a multiple of P·lcm(P, 8) (reference §2.7)
                step = P * math.lcm(P, 8)
                total = max(step, -(-x.shape[1] // step) * step)
                self.we, self.se = np.zeros((P, total)), np.zeros((P, total // P))
            out, self.we, self.se, _ = dense_reference(x, self.we, self.se)
            synced, start = {}, 0
            for k in self.names:
                synced[k] = out[start:start + self.p[k].size].reshape(self.p[k].shape)
                start += self.p[k].size
        else:
            synced = local[0]
        for k in self.names:
            m = synced[k] / self._bcast(k, self.s[k])
            if k in self.mask:
                m = m * self.mask[k]
            g_hat = (m - h["b1"] * last[k]) / (1 - h["b1"])
            self.vf[k] = h["b2"] * self.vf[k] + (1 - h["b2"]) * g_hat * g_hat
            denom = np.sqrt(self.v[k]) + h["eps"]
            u_plain = m / denom
            u = self._decayed(k, u_plain)
            f = np.max(denom / (np.sqrt(self.vf[k]) + h["eps"]), axis=self._axes(k))
            if h["weight_decay"] > 0:
                rho = np.minimum(1.0, self._norm(k, u_plain) / self._norm(k, u))
                f = f * rho + (1 - rho)
            f = np.maximum(np.minimum(f, h["factor_max"]), h["factor_min"])
            f = np.minimum(f, self.r[k] * (1 + h["factor_threshold"]))
            f = np.maximum(f, self.r[k] * (1 - h["factor_threshold"]))
            self.r[k] = f
            self.m[k] = m
            self.p[k] = self.p[k] - lr * self._bcast(k, self.c[k] * f) * u
