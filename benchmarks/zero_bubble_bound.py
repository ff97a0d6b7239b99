"""How much any lockstep table could save over 1F1B with this machine's costs: the bound behind the
zero-bubble benchmark's figures.

The runtime runs a table in lockstep: every tick ends with the stages exchanging activations and
gradients, so a tick lasts as long as its busiest stage. With the paper's t_F = t_B = t_W that costs
nothing, but here W is half as slow again as F, so a tick pairing one stage's W with the other's F
idles the second. This script takes the op costs that ``benchmarks/zero_bubble.py`` measured (one
chunk's forward, B, W and fused backward on one core, kept residuals) and, for p = 2 and each m it
measured, prices:

* 1F1B and ZB-H1 as the runtime runs them (the checker's lockstep time);
* the **best lockstep table** with ZB-H1's bounds (stage s holds at most p - s stashed inputs, at
  most p forwards awaiting W, at most p input-gradient boundaries awaiting W; any mix of F, B and
  W per tick, one of each at most, as the runtime allows), found by a shortest-path search over the
  stages' progress — exact, so no table the runtime can run does better;
* ZB-H1's order run **asynchronously** (each work starts when its inputs exist and its stage is
  free, no ticks): what a runtime without a per-tick exchange could reach.

It also prices the best table with at most one boundary awaiting W per stage (what keeps a split
table within 15% of 1F1B's memory at m = 2, where 1F1B needs no more residual slots than ZB-H1).
It writes ``benchmarks/results/zero_bubble_bound.{json,png}`` (``zero_bubble_pooled_bound`` for
the pooled run's results); seconds to run.

    .venv/bin/python benchmarks/zero_bubble_bound.py [--results benchmarks/results/zero_bubble.json]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
from pathlib import Path

import _common

from meshtron.pipeline.schedules import Costs, make_schedule, zb_h1_order
from meshtron.pipeline.table import run_time

P = 2


def best_lockstep_time(p: int, m: int, costs: Costs, pending: int | None = None) -> float:
    """Least lockstep time of any split table with ZB-H1's bounds (Dijkstra over per-stage counts
    of forwards, Bs and Ws done; a tick's cost is its busiest stage's F + B + W); ``pending``
    tightens the bound on boundaries awaiting W (default p)."""
    pending = p if pending is None else pending
    def moves(state, s):
        nf, nb, nw = state[s]
        for f, b, w in itertools.product((0, 1), repeat=3):
            nf2, nb2, nw2 = nf + f, nb + b, nw + w
            if nf2 > m or nb2 > nf2 or nw2 > nb2:  # B after its F (same tick allowed), W after its B
                continue
            if f and ((s > 0 and state[s - 1][0] <= nf) or nf2 - nb > p - s or nf2 - nw > p):
                continue  # input not yet sent; stash bound; forwards awaiting W
            if b and s < p - 1 and state[s + 1][1] <= nb:
                continue  # output gradient not yet sent
            if nb2 - nw > pending:
                continue  # boundaries awaiting W
            yield (nf2, nb2, nw2), f * costs.forward + b * costs.backward + w * costs.weight

    start, goal = ((0, 0, 0),) * p, ((m, m, m),) * p
    best = {start: 0.0}
    queue = [(0.0, start)]
    while queue:
        time, state = heapq.heappop(queue)
        if state == goal:
            return time
        if time > best[state]:
            continue
        for combo in itertools.product(*(list(moves(state, s)) for s in range(p))):
            nxt = tuple(c[0] for c in combo)
            if nxt == state:
                continue
            t = time + max(c[1] for c in combo)
            if t < best.get(nxt, float("inf")):
                best[nxt] = t
                heapq.heappush(queue, (t, nxt))
    raise AssertionError("unreachable: the bounds always admit a table")


def asynchronous_time(orders: list[list[tuple[str, int]]], costs: dict[str, float]) -> float:
    """Finish time of per-stage work orders run without ticks: each work starts when its stage is
    free and its inputs exist (F: the previous stage's F; B or fused X: own F and the next stage's
    B or X; W: own B)."""
    p = len(orders)
    done: dict[tuple[str, int, int], float] = {}
    clock, position = [0.0] * p, [0] * p
    while any(position[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while position[s] < len(orders[s]):
                kind, mb = orders[s][position[s]]
                needs = {"F": [("F", s - 1, mb)] if s else [], "W": [("B", s, mb)]}.get(
                    kind, [("F", s, mb)] + ([(kind, s + 1, mb)] if s < p - 1 else []))
                if not all(n in done for n in needs):
                    break
                clock[s] = max([clock[s]] + [done[n] for n in needs]) + costs[kind]
                done[(kind, s, mb)] = clock[s]
                position[s] += 1
                moved = True
        if not moved:
            raise AssertionError("a work order waits for work that never runs")
    return max(clock)


def one_f_one_b_order(p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """Megatron's 1F1B on one stage: p - stage warmup forwards, then fused backward X and forward
    alternating."""
    ahead = min(p - stage, m)
    order = [("F", k) for k in range(ahead)]
    for k in range(m):
        order.append(("X", k))
        if ahead < m:
            order.append(("F", ahead))
            ahead += 1
    return order


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--results", default=str(_common.RESULTS / "zero_bubble.json"))
    args = parser.parse_args()
    measured = json.loads(Path(args.results).read_text())
    ops = measured["op_costs_s"]["keep"]
    split = Costs(ops["forward"] * 1e3, ops["input_gradient"] * 1e3, ops["weight_gradient"] * 1e3)
    fused = Costs(ops["forward"] * 1e3, ops["fused_backward"] * 1e3, 0.0)
    kinds = {"F": split.forward, "B": split.backward, "W": split.weight, "X": fused.backward}
    rows, out = [], []
    for m in sorted({r["m"] for r in measured["results"]}):
        one_f_one_b = run_time(make_schedule("1f1b", P, m), fused)
        zb_h1 = run_time(make_schedule("zb-h1", P, m), split)
        best = best_lockstep_time(P, m, split)
        best_one_pending = best_lockstep_time(P, m, split, pending=1)
        unit_best = best_lockstep_time(P, m, Costs())
        unit_1f1b = run_time(make_schedule("1f1b", P, m), Costs())
        zb_async = asynchronous_time([zb_h1_order(P, m, s) for s in range(P)], kinds)
        one_f_one_b_async = asynchronous_time([one_f_one_b_order(P, m, s) for s in range(P)], kinds)
        measured_zb = next(r for r in measured["results"] if r["m"] == m and not r["recompute"]
                           and r["schedule"] == "zb-h1")
        measured_1f1b = next(r for r in measured["results"] if r["m"] == m and not r["recompute"]
                             and r["schedule"] == "1f1b")
        record = {"m": m, "one_f_one_b_ms": one_f_one_b, "zb_h1_ms": zb_h1, "best_lockstep_ms": best, "best_lockstep_one_pending_ms": best_one_pending,
                  "zb_h1_async_ms": zb_async, "one_f_one_b_async_ms": one_f_one_b_async,
                  "unit_cost_saving": 1 - unit_best / unit_1f1b,
                  "measured_saving": 1 - measured_zb["step_s"] / measured_1f1b["step_s"]}
        out.append(record)
        rows.append([m, f"{one_f_one_b:.0f}", f"{zb_h1:.0f}", f"{1 - zb_h1 / one_f_one_b:.1%}", f"{best:.0f}",
                     f"{1 - best / one_f_one_b:.1%}", f"{1 - best_one_pending / one_f_one_b:.1%}",
                     f"{record['unit_cost_saving']:.1%}",
                     f"{1 - zb_async / one_f_one_b_async:.1%}", f"{record['measured_saving']:.1%}"])
    print(f"p = {P}, kept residuals, op costs (ms) t_F {split.forward:.1f}, t_B {split.backward:.1f}, "
          f"t_W {split.weight:.1f}, fused backward {fused.backward:.1f} from {args.results}")
    _common.print_table(["m", "1F1B ms", "ZB-H1 ms", "ZB-H1 saving", "best lockstep ms", "best lockstep saving",
                         "best saving, 1 boundary awaiting W",
                         "best saving, unit costs", "ZB-H1 async saving (vs async 1F1B)", "measured ZB-H1 saving"],
                        rows)
    name = Path(args.results).stem + "_bound"  # zero_bubble_bound, or zero_bubble_pooled_bound
    path = _common.write_results(name, {"p": P, "op_costs_ms": kinds, "source": args.results,
                                                       "results": out})
    plot(out, name)
    print(f"wrote {path}")


def plot(out: list[dict], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    series = [("ZB-H1 (lockstep, as run)", lambda r: 1 - r["zb_h1_ms"] / r["one_f_one_b_ms"]),
              ("best lockstep table, ZB-H1's bounds", lambda r: 1 - r["best_lockstep_ms"] / r["one_f_one_b_ms"]),
              ("best lockstep table, 1 boundary awaiting W",
               lambda r: 1 - r["best_lockstep_one_pending_ms"] / r["one_f_one_b_ms"]),
              ("best table, unit costs", lambda r: r["unit_cost_saving"]),
              ("ZB-H1 asynchronous", lambda r: 1 - r["zb_h1_async_ms"] / r["one_f_one_b_async_ms"]),
              ("measured ZB-H1", lambda r: r["measured_saving"])]
    width = 0.8 / len(series)
    for i, (label, value) in enumerate(series):
        ax.bar([j + i * width for j in range(len(out))], [100 * value(r) for r in out], width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(out))], [f"m={r['m']}" for r in out])
    ax.set_ylabel("saving over 1F1B (%)")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.legend(fontsize=7)
    ax.set_title("p = 2, kept residuals: what a lockstep table can save with this machine's op costs", fontsize=9)
    fig.tight_layout()
    fig.savefig(_common.RESULTS / f"{name}.png", dpi=120)


if __name__ == "__main__":
    main()
