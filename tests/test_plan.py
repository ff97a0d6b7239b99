"""``meshtron plan``: the PTD-P paper's formulas, the cluster files, the search, the report and the CLI.

The model is held to the paper's published numbers (Table 1, Figure 12's non-interleaved line) and
to the byte counts meshtron's own compiled programs are held to (the same functions in
:mod:`meshtron.hlo.collectives`, :mod:`meshtron.megatron` and :mod:`meshtron.optim.compression`).
"""

import dataclasses
import io
import json
import math
import re
import sys
from pathlib import Path

import pytest

from meshtron.cli import main
from meshtron.config import ConfigError, load_config
from meshtron.hlo.collectives import ring_wire_bytes
from meshtron.megatron import megatron_figures
from meshtron.optim.compression import compressed_bytes_per_device, error_lengths, padded_length
from meshtron.plan import (
    GRADIENTS,
    Gradients,
    Layout,
    ModelShape,
    bubble_fraction,
    data_wire_bytes,
    estimate,
    flops_per_iteration,
    in_flight_chunks,
    load_cluster,
    make_plan,
    memory_per_gpu,
    parameter_count,
    pipe_wire_bytes,
    render,
    search,
    tensor_wire_bytes,
)
from meshtron.plan.cluster import bundled_clusters
from meshtron.plan.model import figures, onebit_padded_length, optimizer_bytes_per_parameter
from meshtron.plan.search import candidate_layouts
from meshtron.plan.timing import layer_gemm_seconds, logits_seconds, tensor_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import plan_vs_paper  # Table 1 and Figure 12 as the benchmark holds them

A100 = load_cluster("a100-80gb")
GPT_175B = ModelShape(layers=96, hidden=12288, heads=96, seq_len=2048, vocab_size=51200)


def shape(heads, hidden, layers):
    return ModelShape(layers=layers, hidden=hidden, heads=heads, seq_len=2048, vocab_size=51200)


# ---------------------------------------------------------------------------------------------
# The paper's counts


@pytest.mark.parametrize("row", plan_vs_paper.TABLE_1, ids=lambda r: f"{r[0]}B")
def test_parameter_count_reproduces_table_1(row):
    billions, heads, hidden, layers = row[:4]
    assert round(parameter_count(shape(heads, hidden, layers)) / 1e9, 1) == billions


def test_flops_are_eq_3_with_full_recomputation_and_less_without():
    B, s, l, h, V = 1536, GPT_175B.seq_len, GPT_175B.layers, GPT_175B.hidden, GPT_175B.vocab_size
    eq3 = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert flops_per_iteration(GPT_175B, B) == pytest.approx(eq3, rel=1e-12)
    none = flops_per_iteration(GPT_175B, B, "none")
    assert none == pytest.approx(72 * B * s * l * h**2 * (1 + s / (6 * h)) + 6 * B * s * h * V, rel=1e-12)
    assert none < flops_per_iteration(GPT_175B, B, "selective") < eq3


@pytest.mark.parametrize(("p", "m", "v", "expected"), [
    (4, 16, 1, 4), (8, 64, 1, 8), (4, 2, 1, 2),  # 1F1B: p in flight (m when m < p: Megatron runs it)
    (4, 8, 2, 2 * 3 + 1 * 4 + 1), (4, 16, 3, 2 * 3 + 2 * 4 + 1), (2, 2, 2, 4),  # interleaved, capped at m·v
])
def test_in_flight_chunks_are_megatrons(p, m, v, expected):
    assert in_flight_chunks(p, m, v) == min(expected, m * v)


@pytest.mark.parametrize("data", [2, 3, 4, 8, 12])
@pytest.mark.parametrize("elements", [1, 1000, 123_457, 10_000_019])
def test_onebit_buffers_and_bytes_are_the_optimizers(elements, data):
    """The planner's 1-bit LAMB figures are the ones meshtron.optim computes (which import JAX)."""
    assert onebit_padded_length(elements, data) == padded_length(elements, data)
    worker, server = error_lengths([elements], data)
    assert (onebit_padded_length(elements, data), onebit_padded_length(elements, data) // data) == (worker, server)
    assert data_wire_bytes(elements, data, "onebit_lamb") == compressed_bytes_per_device(elements, data)
    assert data_wire_bytes(elements, data, "lamb") == pytest.approx(2 * (data - 1) / data * elements * 4)


def test_optimizer_state_counts_onebit_lambs_error_buffers():
    assert optimizer_bytes_per_parameter("adamw", 8) == optimizer_bytes_per_parameter("lamb", 8) == 12
    assert optimizer_bytes_per_parameter("onebit_lamb", 8) == 12 + 4 + 4 + 4 / 8  # v̂, worker and server error
    assert optimizer_bytes_per_parameter("onebit_lamb", 1) == 16  # no data parallelism: nothing to compress
    with pytest.raises(ConfigError, match="--optimizer: must be one of"):
        optimizer_bytes_per_parameter("sgd", 2)


def test_wire_bytes_per_axis_follow_the_figures_the_compiled_programs_are_held_to():
    layout = Layout(tensor=8, pipe=12, data=2, microbatch=1, global_batch=96, chunks=4)
    fig = figures(GPT_175B, layout)
    assert tensor_wire_bytes(GPT_175B, layout) == ring_wire_bytes("all-reduce", fig.tensor_bytes, 8)
    assert pipe_wire_bytes(GPT_175B, layout) == fig.pipe_bytes * 4 / 8  # v times, 1/t each (scatter/gather)
    direct = megatron_figures(vocab_size=51200, hidden=12288, layers=96, seq_len=2048, heads=96,
                              global_batch=96, data=2, pipe=12, tensor=8, microbatches=48,
                              remat=True, bytes_per_element=2)
    assert (fig.tensor_bytes, fig.pipe_bytes, fig.data_bytes) == (direct.tensor_bytes, direct.pipe_bytes,
                                                                 direct.data_bytes)
    assert fig.params == parameter_count(GPT_175B)


def test_memory_adds_up_and_grows_with_onebit_lamb():
    layout = Layout(8, 8, 24, 2, 2304, 2, "full")
    model = shape(96, 12288, 80)
    adamw, onebit = memory_per_gpu(model, layout), memory_per_gpu(model, layout, "onebit_lamb")
    assert adamw.total == adamw.weights + adamw.gradients + adamw.optimizer + adamw.activations
    assert adamw.gradients == 2 * adamw.weights  # fp32 gradients of 16-bit weights
    assert onebit.optimizer / adamw.optimizer == pytest.approx((16 + 4 + 4 / 24) / 12)
    assert onebit.activations == adamw.activations
    none = memory_per_gpu(model, Layout(8, 8, 24, 2, 2304, 2, "none"))
    assert none.activations > adamw.activations  # recomputation is what saves the activations


def test_gradients_as_the_papers_runs_kept_them():
    """``sc21``: fp16 gradients (2 bytes), torch DDP's bucket copy (2) only where it runs (no
    pipelining), the fp16 optimizer's fp32 copy (4) alive at the step, when the activations are not."""
    model = shape(32, 3072, 30)  # 3.6B
    sc21 = GRADIENTS["sc21"]
    for layout, bucket in ((Layout(2, 1, 32, 16, 512, 1, "full"), 2), (Layout(1, 2, 32, 2, 512, 1, "full"), 0)):
        fp32, fp16 = memory_per_gpu(model, layout), memory_per_gpu(model, layout, gradients=sc21)
        params = fp32.weights / 2
        assert fp32.step_copy == 0 and fp16.weights == fp32.weights and fp16.optimizer == fp32.optimizer
        assert fp16.gradients == (2 + bucket) * params and fp16.step_copy == 4 * params
        assert fp16.total == fp16.weights + fp16.gradients + fp16.optimizer + max(fp16.activations, fp16.step_copy)
    alone = memory_per_gpu(model, Layout(1, 1, 64, 2, 512, 1, "full"), gradients=sc21)
    assert alone.step_copy > alone.activations  # the step's peak: 22 bytes per parameter, 79 GB
    assert alone.total == 22 * alone.weights / 2 > A100.usable_memory_bytes


def test_gradients_decide_the_data_parallel_exchange():
    model = shape(32, 3072, 30)
    unpipelined, pipelined = Layout(2, 1, 32, 16, 512, 1, "full"), Layout(1, 2, 32, 2, 512, 1, "full")
    sc21 = GRADIENTS["sc21"]
    assert estimate(model, unpipelined, A100, gradients=sc21).seconds["data"] == 0  # torch DDP hides it
    assert estimate(model, unpipelined, A100).seconds["data"] > 0
    fp16, fp32 = estimate(model, pipelined, A100, gradients=sc21), estimate(model, pipelined, A100)
    assert fp16.data_bytes == fp32.data_bytes / 2
    assert 0 < fp16.seconds["data"] < fp32.seconds["data"]
    assert GRADIENTS["16bit"].overlapped(unpipelined) is False
    assert Gradients(overlap="always").overlapped(pipelined) is True
    with pytest.raises(ConfigError, match="gradients.overlap: must be one of never, unpipelined, always"):
        Gradients(overlap="sometimes")


def test_the_papers_gradients_rule_out_what_its_runs_could_not_fit():
    """3.6B on 64 GPUs: with fp32 gradients and no DDP copy t = 1 fits and ranks first; as the paper's
    Megatron-LM kept gradients it does not fit (22 bytes per parameter), and the paper's (2, 1) ranks first."""
    model, cluster = shape(32, 3072, 30), A100
    fp32 = search(model, 64, 512, cluster, recompute=("full",)).best.layout
    sc21 = search(model, 64, 512, cluster, recompute=("full",), gradients=GRADIENTS["sc21"]).best.layout
    assert (fp32.tensor, fp32.pipe) == (1, 1)
    assert (sc21.tensor, sc21.pipe) == (2, 1)


# ---------------------------------------------------------------------------------------------
# Time


def test_estimate_terms_add_up_and_report_the_papers_metric():
    layout = Layout(8, 12, 1, 1, 60, 4, "full")
    e = estimate(GPT_175B, layout, A100)
    assert sum(e.seconds.values()) == pytest.approx(e.step_seconds)
    assert e.tflops_per_gpu == pytest.approx(flops_per_iteration(GPT_175B, 60) / e.step_seconds / 96 / 1e12)
    assert e.bubble == bubble_fraction(12, 60, 4) == pytest.approx(11 / 240)
    assert e.seconds["data"] == 0  # d = 1
    overlapped = estimate(GPT_175B, Layout(8, 12, 2, 1, 120, 4, "full"), A100, gradients=Gradients(overlap="always"))
    assert overlapped.seconds["data"] == 0 < estimate(GPT_175B, Layout(8, 12, 2, 1, 120, 4), A100).seconds["data"]


def test_table_1_is_predicted_within_10_percent_on_every_row():
    for row in plan_vs_paper.TABLE_1:
        predicted = plan_vs_paper.paper_estimate(row, A100).tflops_per_gpu
        assert predicted == pytest.approx(row[8], rel=0.10), row[0]


@pytest.mark.slow
def test_table_1_top_ranked_tp_is_the_papers_or_within_3_percent_on_seven_rows():
    """7 of 10 rows (docs/plan.md and its report say why 18.4B, 39.1B and 145.6B differ)."""
    rows = plan_vs_paper.table_1(A100)
    assert [r["params_b"] for r in rows if r["paper_tp_gap"] <= 0.03] == [1.7, 3.6, 7.5, 76.1, 310.1, 529.6, 1008.0]


def test_figure_12_non_interleaved_line_and_the_gain_at_the_smallest_and_largest_batch():
    rows = plan_vs_paper.figure_12(A100)
    for r in rows:
        assert r["non_interleaved"] == pytest.approx(r["paper_non_interleaved"], rel=0.02)
    for r in (rows[0], rows[-1]):  # batch 12 and 60, within 5 points of the paper's gain
        assert abs(r["gain"] - r["paper_gain"]) < 0.05, r["batch"]
    assert [r["gain"] for r in rows] == sorted((r["gain"] for r in rows), reverse=True)  # the gap closes


def test_the_bubble_is_the_fill_and_drain_of_the_stages_without_the_head():
    """The last stage sets the pace with its LM head; the (p−1)/v stage-times of fill and drain are
    run by the stages before it, which have none -- and every step pays the host's overhead."""
    layout = Layout(8, 12, 1, 1, 60, 4, "full")
    e = estimate(GPT_175B, layout, A100)
    per_microbatch = {name: e.seconds[name] / 60 for name in ("gemm", "elementwise", "tensor", "pipe", "host")}
    head = logits_seconds(GPT_175B, layout, A100) + tensor_seconds(GPT_175B, layout, A100)[1]
    assert head > 0
    assert e.seconds["bubble"] == pytest.approx((sum(per_microbatch.values()) - head) * 11 / 4)
    assert e.seconds["host"] == pytest.approx(60 * 2 * 4 * A100.step_overhead_us * 1e-6)
    # One layer per stage (Fig. 14's p = 32): the head weighs as much as the layer, and the paper's
    # (p−1)/m of the last stage's time would charge it 31 more times.
    small, one_layer = shape(32, 3840, 32), Layout(1, 32, 2, 1, 32, 1, "full")
    fig14 = estimate(small, one_layer, A100)
    assert logits_seconds(small, one_layer, A100) > 0.5 * layer_gemm_seconds(small, one_layer, A100)
    last_stage = sum(fig14.seconds[name] for name in ("gemm", "elementwise", "tensor", "pipe", "host")) / 16
    assert fig14.seconds["bubble"] < 0.7 * 31 * last_stage
    bare = estimate(small, one_layer, dataclasses.replace(A100, step_overhead_us=0.0))
    assert bare.seconds["host"] == 0 and bare.step_seconds < fig14.step_seconds


def test_gemm_efficiency_interpolates_log_linearly_and_is_flat_outside():
    table = dict(A100.gemm_efficiency)
    assert A100.gemm(1024) == table[1024]
    assert A100.gemm(1) == table[64] and A100.gemm(1e9) == table[16384]
    assert A100.gemm(math.sqrt(1024 * 2048)) == pytest.approx((table[1024] + table[2048]) / 2)


# ---------------------------------------------------------------------------------------------
# Clusters


def test_bundled_clusters_load_and_a_users_file_round_trips(tmp_path):
    assert set(bundled_clusters()) == {"a100-80gb", "h100-80gb", "h200-141gb", "a100-ethernet"}
    for name in bundled_clusters():
        assert load_cluster(name).name == name
    own = tmp_path / "mine.yaml"
    own.write_text(bundled_clusters()["a100-80gb"].read_text().replace("name: a100-80gb", "name: mine")
                   .replace("network_gbps: 200", "network_gbps: 50"))
    mine = load_cluster(own)
    assert (mine.name, mine.network_gbps, mine.gemm_efficiency) == ("mine", 50, A100.gemm_efficiency)
    own.write_text(own.read_text().replace("step_overhead_us: 400", ""))
    assert load_cluster(own).step_overhead_us == 0  # optional: a program without host synchronisation


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.replace("peak_tflops: 312", "peak_tflops: fast"), "peak_tflops: expected a number"),
    (lambda t: t.replace("hbm_gbps: 2039", ""), "hbm_gbps: missing; give one GPU's memory bandwidth"),
    (lambda t: t.replace("  nvlink: 0.8", "  nvlink: 80"), "efficiency.nvlink: a fraction is at most 1"),
    (lambda t: t.replace("  nvlink: 0.8", "  nvlink: 0.8\n  infiniband: 0.9"), "efficiency.infiniband: unknown"),
    (lambda t: t + "\nnvlink_gbs: 3\n", "unknown field 'nvlink_gbs'"),
    (lambda t: t.replace("reserved_gb: 8", "reserved_gb: 90"), "reserved_gb: 90 leaves nothing"),
    (lambda t: t.replace("step_overhead_us: 400", "step_overhead_us: -1"), "step_overhead_us: must be >= 0"),
    (lambda t: "[1, 2", "not valid YAML"),
])
def test_bad_cluster_files_get_one_line_naming_the_field(tmp_path, edit, message):
    path = tmp_path / "bad.yaml"
    path.write_text(edit(bundled_clusters()["a100-80gb"].read_text()))
    with pytest.raises(ConfigError, match=message) as err:
        load_cluster(path)
    assert "\n" not in str(err.value)


def test_unknown_cluster_names_the_bundled_ones():
    with pytest.raises(ConfigError, match="--cluster: no such file or bundled cluster 'b200'; bundled: a100-80gb"):
        load_cluster("b200")


# ---------------------------------------------------------------------------------------------
# Search and report


def test_tensor_groups_tile_nodes_and_layouts_are_valid():
    layouts = list(candidate_layouts(shape(96, 12288, 80), 1536, 2304, 8, ("full",), node=8))
    assert {lay.tensor for lay in layouts} == {1, 2, 4, 8}  # 3, 6 (dividing 96 heads) straddle 8-GPU nodes
    assert not [lay for lay in layouts if lay.chunks > 1 and lay.pipe <= 2]  # Megatron interleaves only p > 2
    assert {lay.tensor for lay in candidate_layouts(shape(24, 2304, 24), 6, 24, 8, ("full",))} == {1, 2, 3, 6}
    for lay in layouts:
        assert lay.problem(shape(96, 12288, 80)) is None and lay.gpus == 1536


def test_layout_problems_name_the_constraint():
    model = shape(96, 12288, 80)
    assert "tensor=5 does not divide the 96 heads" in Layout(5, 1, 1, 1, 8).problem(model)
    assert "pipe x chunks = 24 does not divide the 80 layers" in Layout(8, 8, 1, 1, 64, 3).problem(model)
    assert "not divisible by data x microbatch" in Layout(8, 8, 3, 1, 64).problem(model)
    assert "a multiple of 8" in Layout(8, 8, 1, 1, 12, 2).problem(model)
    with pytest.raises(ConfigError, match="layout t=5 p=1 d=1: tensor=5"):
        Layout(5, 1, 1, 1, 8).check(model)


def test_search_ranks_by_throughput_and_everything_ranked_fits():
    result = search(shape(64, 8192, 48), 512, 1536, A100, recompute=("full",))
    steps = [float(f"{e.step_seconds:.6g}") for e in result.ranked]  # equal to 6 digits: a tie, broken by size
    assert steps == sorted(steps)
    tied = [(a.layout.tensor * a.layout.pipe, b.layout.tensor * b.layout.pipe)
            for a, b, x, y in zip(result.ranked, result.ranked[1:], steps, steps[1:]) if x == y]
    assert all(small <= large for small, large in tied)
    assert all(e.memory.total <= A100.usable_memory_bytes for e in result.ranked)
    assert result.too_big > 0 and result.tried == len(result.ranked) + result.too_big


def test_search_refuses_what_cannot_run_in_one_line():
    with pytest.raises(ConfigError, match="no layout of this model fits 8 GPUs of a100-80gb"):
        search(GPT_175B, 8, 64, A100)
    with pytest.raises(ConfigError, match="--gpus: no layout of 7 GPUs splits this model"):
        search(GPT_175B, 7, 64, A100)


def test_search_crosses_nodes_only_when_nothing_fits_within_one():
    wide = ModelShape(layers=1, hidden=65536, heads=64, seq_len=2048, vocab_size=51200)  # one huge layer
    result = search(wide, 16, 16, A100, recompute=("full",))
    assert result.beyond_node and result.best.layout.tensor == 16
    assert "Takeaway #1 (tensor parallelism within a node) cannot hold" in render(
        make_plan(wide, 16, 16, A100, recompute=("full",)))


def test_report_explains_with_the_takeaways_and_prices_every_optimizer():
    plan = make_plan(shape(24, 2304, 24), 64, 512, load_cluster("a100-ethernet"))
    text = render(plan, top=3)
    for needle in ("Takeaway #1", "Takeaway #2", "Takeaway #3", "Recomputation", "onebit_lamb", "1-bit LAMB on"):
        assert needle in text
    rows = {row.optimizer: row for row in plan.optimizers}
    for name, row in rows.items():  # each on the layout its own search ranks first
        assert row.estimate.layout == search(plan.model, 64, 512, plan.cluster, name).best.layout
    onebit = rows["onebit_lamb"].estimate
    lamb_on_same = estimate(plan.model, onebit.layout, plan.cluster, "lamb")
    assert onebit.data_bytes < lamb_on_same.data_bytes / 30
    assert rows["onebit_lamb"].warmup_seconds == pytest.approx(
        onebit.step_seconds - onebit.seconds["data"] + lamb_on_same.seconds["data"])
    assert rows["onebit_lamb"].run_seconds == pytest.approx(0.16 * rows["onebit_lamb"].warmup_seconds
                                                            + 0.84 * onebit.step_seconds)
    assert rows["lamb"].run_seconds > rows["onebit_lamb"].run_seconds > onebit.step_seconds


def test_onebit_lamb_layouts_are_ranked_by_the_run_mean_with_its_warmup():
    result = search(shape(32, 4096, 36), 128, 512, load_cluster("a100-ethernet"), "onebit_lamb", freeze_fraction=0.5)
    means = [e.run_seconds(0.5) for e in result.ranked]
    assert means == sorted(means)
    assert all(e.warmup_seconds > e.step_seconds for e in result.ranked if e.layout.data > 1)


def test_compressed_exchange_is_an_all_to_all_then_a_ring_all_gather():
    from meshtron.plan.timing import allreduce_seconds, alltoall_seconds, data_seconds

    model, layout = shape(32, 4096, 36), Layout(1, 2, 64, 1, 512)
    signs = onebit_padded_length(math.ceil(figures(model, layout).data_bytes / 2), 64) / 8
    expected = alltoall_seconds(signs, 64, 8, A100) + allreduce_seconds(signs / 2, 64, 8, A100)
    assert data_seconds(model, layout, A100, "onebit_lamb") == pytest.approx(expected)
    nic = A100.nic_gbps * 1e9 * A100.network_efficiency  # 7/8 of each GPU's signs leave its node through its NIC
    assert alltoall_seconds(signs, 64, 8, A100) == pytest.approx(56 / 64 * signs / nic + 63 * 10e-6)


def test_compression_pays_more_on_ethernet_than_on_infiniband():
    model = shape(24, 2304, 24)

    def speedup(cluster):
        rows = {r.optimizer: r for r in make_plan(model, 64, 512, load_cluster(cluster), "onebit_lamb").optimizers}
        return rows["lamb"].run_seconds / rows["onebit_lamb"].run_seconds

    assert speedup("a100-ethernet") > speedup("a100-80gb") > 1


# ---------------------------------------------------------------------------------------------
# The command line and describe


def test_plan_command_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", "paper/gpt_18_4b", "--gpus", "256", "--top", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "TF/s/GPU" in text and "why #1" in text and "Takeaway #2" in text
    saved = json.loads(out.read_text())
    assert len(saved["ranked"]) == 3 and saved["gpus"] == 256 and saved["cluster"] == "a100-80gb"
    assert saved["ranked"][0]["tflops_per_gpu"] >= saved["ranked"][1]["tflops_per_gpu"]


def test_plan_command_prices_the_gradients_it_is_told(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--config", "paper/gpt_3_6b", "--gpus", "64", "--recompute", "full", "--top", "1"]
    assert main(argv) == 0
    assert "gradients all-reduced in 32 bits" in capsys.readouterr().out
    assert main([*argv, "--gradients", "sc21", "--json", str(out)]) == 0
    assert "gradients all-reduced in 16 bits" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["gradients"] == {"element_bytes": 2, "step_copy_bytes": 4, "overlap": "unpipelined", "bucket_bytes": 2,
                                  "zero": 0}
    assert (saved["ranked"][0]["tensor"], saved["ranked"][0]["pipe"]) == (2, 1)


def test_zero_levels_split_memory_and_price_the_exchange_that_does_it():
    """Megatron-LM's distributed optimizer (zero=1) divides the fp32 master weights and moments by d and
    exchanges a reduce-scatter of the gradients and an all-gather of the 16-bit weights; fully sharded
    (zero=3) divides the weights and gradients too, holding one layer's whole while it runs, and gathers
    every layer twice per microbatch."""
    from meshtron.plan.model import (
        FP32_GRADIENTS,
        Layout,
        ModelShape,
        data_wire_bytes,
        layer_parameters_per_gpu,
        memory_per_gpu,
        stage_parameters_per_gpu,
    )

    model = ModelShape(layers=32, hidden=4096, heads=32, seq_len=2048, vocab_size=51200)
    layout = Layout(tensor=8, pipe=4, data=16, microbatch=1, global_batch=512)
    zero0 = memory_per_gpu(model, layout)
    zero1 = memory_per_gpu(model, layout, gradients=dataclasses.replace(FP32_GRADIENTS, zero=1))
    zero3 = memory_per_gpu(model, layout, gradients=dataclasses.replace(FP32_GRADIENTS, zero=3))
    params, layer = stage_parameters_per_gpu(model, layout), layer_parameters_per_gpu(model, 8)
    assert zero1.optimizer == pytest.approx(zero0.optimizer / 16) and zero1.weights == zero0.weights
    assert zero1.gradients == zero0.gradients and zero1.activations == zero0.activations
    assert zero3.optimizer == zero1.optimizer
    assert zero3.weights == pytest.approx(2 * params / 16 + 2 * layer)
    assert zero3.gradients == pytest.approx(4 * params / 16 + 4 * layer)
    ring = 15 / 16
    assert data_wire_bytes(1e9, 16, "adamw", 4, zero=1) == pytest.approx(ring * 1e9 * (4 + 2))
    assert data_wire_bytes(1e9, 16, "adamw", 4, zero=3, microbatches=8) == pytest.approx(8 * ring * 1e9 * (4 + 4))
    assert data_wire_bytes(1e9, 16, "adamw", 4) == pytest.approx(2 * ring * 1e9 * 4)  # the all-reduce


def test_plan_command_takes_a_zero_level(capsys):
    argv = ["plan", "--config", "paper/gpt_76_1b", "--gpus", "1024", "--top", "1"]
    assert main([*argv, "--zero", "1"]) == 0
    text = capsys.readouterr().out
    assert "zero=1 (split over data: optimizer state)" in text
    assert re.search(r"^1  4  4  64 ", text, re.MULTILINE)  # a smaller model-parallel size fits than without it
    assert re.search(r"^onebit_lamb ", text, re.MULTILINE)  # priced beside it, with its state whole
    assert main([*argv, "--zero", "1", "--optimizer", "onebit_lamb"]) == 2
    assert capsys.readouterr().err.startswith("meshtron: error: --zero: 1-bit LAMB keeps each worker's whole momentum")


def test_plan_command_ignores_the_presets_mesh_and_takes_a_zero_batch_as_given(capsys):
    assert main(["plan", "--config", "paper/gpt_1t", "--gpus", "64", "model.layers=2", "model.hidden=4096",
                 "model.mlp_dim=16384", "model.heads=32", "--top", "1"]) == 0  # the preset's mesh is 6x64x8
    assert "2 layers, hidden 4096" in capsys.readouterr().out
    assert main(["plan", "--config", "paper/gpt_1t", "--gpus", "64", "--batch", "0"]) == 2
    assert "--batch: must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--recompute", "full,sometimes"], "--recompute: expected a comma-separated subset of full,selective,none"),
    (["--cluster", "nowhere"], "--cluster: no such file or bundled cluster 'nowhere'"),
    (["--gpus", "7"], "--gpus: no layout of 7 GPUs splits this model"),
    (["model.mlp_dim=1000"], "model.mlp_dim: the paper's formulas assume 4 x hidden"),
])
def test_plan_command_bad_input_is_one_line(args, message, capsys):
    base = {"--gpus": "256"}
    argv = ["plan", "--config", "paper/gpt_18_4b"]
    if "--gpus" not in args:
        argv += ["--gpus", base["--gpus"]]
    assert main(argv + args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_describe_prices_a_large_preset_with_the_planners_functions():
    from meshtron.describe import describe

    cfg = load_config("paper/gpt_145_6b")
    out = io.StringIO()
    describe(cfg, out=out)
    text = out.getvalue()
    model = ModelShape.from_config(cfg.model)
    memory = memory_per_gpu(model, Layout(8, 8, 24, 1, 2304, 1, "full"))
    assert "plan on a100-80gb" in text
    assert f"memory per GPU           {memory.total / 1e9:.1f} GB" in text
    # Two memory figures, each saying what it counts: the plan's Megatron-LM program, describe's own run.
    assert "counts                   Megatron-LM's mixed precision as the paper ran it" in text
    assert "memory per device, this run as configured (float32 parameters, gradients and optimizer state; " \
           "bfloat16 activations; meshtron's step as XLA compiles it" in text


def test_the_planner_prices_each_context_exchange_and_refuses_the_shapes_it_cannot_run():
    """Per rank and layer, Ulysses sends (c-1)/c of its queries, keys, values and output each way, so as
    c grows with the sequence its bytes stay flat, while the gathered exchange's grow as c-1; the hybrid
    adds a ring over c/u groups. Shapes Ulysses cannot split are one line naming the way out."""
    from meshtron.plan.model import context_wire_bytes, exchange_wire_bytes

    model = ModelShape(layers=32, hidden=4096, heads=32, seq_len=32768, vocab_size=32000, family="llama",
                       kv_heads=8, mlp_dim=11008)
    longer = dataclasses.replace(model, seq_len=2 * model.seq_len)

    def sent(exchange: str, c: int, shape: ModelShape = model, u: int = 1) -> float:
        return context_wire_bytes(shape, Layout(1, 1, 1, 1, 8, recompute="none", context=c,
                                                context_attention=exchange, ulysses_degree=u))

    tokens, d = 32768 // 4, 128
    assert sent("ulysses", 4) == 2 * 3 / 4 * tokens * d * 2 * (2 * 32 + 2 * 8)  # q, k, v in, out back; each way
    assert sent("ulysses", 8, longer) / sent("ulysses", 4) == pytest.approx((7 / 8) / (3 / 4))  # flat as c grows with s
    assert sent("gathered", 8, longer) / sent("gathered", 4) == pytest.approx(7 / 3)
    # the hybrid: Ulysses over u = 2, then the ring over 4 groups of 2 x the tokens for half the key/value heads
    forward, backward = exchange_wire_bytes("ring", 4, 2 * 32768 // 8, 8 // 2, d, 2, heads=32 // 2)
    assert sent("hybrid", 8, u=2) == sent("ulysses", 2, dataclasses.replace(model, seq_len=32768 // 4)) \
        + forward + backward
    # GQA: a rank's key/value heads are repeated until c divides them (2 to 8) before the all-to-all
    few = dataclasses.replace(model, kv_heads=2)
    assert sent("ulysses", 8, few) == sent("ulysses", 8)
    assert Layout(1, 1, 1, 1, 8, context=8, context_attention="ulysses").problem(few) is None
    # a tensor rank's heads not divisible by c: the hybrid is the way out
    assert Layout(8, 1, 1, 1, 8, context=8, context_attention="ulysses").problem(model) == \
        "ulysses needs the 4 heads per tensor rank divisible by 8; use hybrid with a ulysses_degree that divides them"
    assert Layout(8, 1, 1, 1, 8, context=8, context_attention="hybrid", ulysses_degree=4).problem(model) is None
    assert Layout(1, 1, 1, 1, 8, context=8, context_attention="hybrid", ulysses_degree=8).problem(model) == \
        "hybrid needs ulysses_degree (got 8) between 1 and context=8, dividing it"
    plan = make_plan(model, 64, 8, load_cluster("a100-80gb"), context=8, context_attention="hybrid", ulysses_degree=2)
    assert all(e.layout.context_attention == "hybrid" for e in plan.result.ranked)
    assert "(hybrid: Ulysses all-to-alls over 2 ranks, a ring over 4)" in render(plan, 2)
