"""Direct preference optimisation (``train.objective: dpo``): its loss, gradient and metrics equal a plain
PyTorch computation on the same Hugging Face Llama and pairs, with LoRA's frozen base as the reference
(which adds no second copy of the model to the compiled step); what it cannot run is one line."""

import json
import os

import jax
import numpy as np
import pytest

from meshtron.config import MeshConfig, load_config
from meshtron.data.preference import preprocess_preference
from meshtron.errors import ConfigError
from meshtron.huggingface import CONFIG_FILE, export_hf, import_hf
from meshtron.pretrained import load_pretrained

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 300
LLAMA = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
         "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0}
BETA, SMOOTHING, RANK, ALPHA = 0.5, 0.1, 4, 8.0


LAYOUTS = {  # the parallel layouts DPO is held to PyTorch on
    "data-pipe-tensor-interleaved": ("parallel.data=2", "parallel.pipe=2", "parallel.tensor=2",
                                     "parallel.schedule=interleaved", "parallel.chunks=2", "parallel.microbatches=2"),
    "data-tensor-zero3": ("parallel.data=4", "parallel.tensor=2", "parallel.zero=3"),
    "pipe-1f1b": ("parallel.pipe=2", "parallel.schedule=1f1b", "parallel.microbatches=2"),
    "pipe-zb-h1": ("parallel.pipe=2", "parallel.schedule=zb-h1", "parallel.microbatches=2"),
    "data-context-tensor": ("parallel.data=2", "parallel.context=2", "parallel.tensor=2"),
}


def on_layouts(*names: str, extended: tuple[str, ...] = ()):
    """The test run on each of the named :data:`LAYOUTS`; those in ``extended`` only in make test's tier
    (CI runs every reference on 2x2x2 interleaved, and the LoRA base under ZeRO-3; packed DPO in a 1F1B pipeline
    in tests/test_dpo_packed.py, the precomputed reference over context ranks below)."""
    return pytest.mark.parametrize("layout", [pytest.param(LAYOUTS[n], marks=pytest.mark.extended) if n in extended
                                              else LAYOUTS[n] for n in names], ids=list(names))


@pytest.fixture(scope="module")
def hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return torch, transformers


@pytest.fixture(scope="module")
def case(hf, tmp_path_factory):
    """``(hf model, its import, preference data prefix)``: a random Llama with large weights."""
    torch, transformers = hf
    root = tmp_path_factory.mktemp("dpo")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
    model.eval().save_pretrained(root / "hf")
    imported = import_hf(root / "hf", root / "imported")
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(16):
        word = "".join(rng.choice(list("abcdef"), size=int(rng.integers(2, 6))))
        lines.append({"prompt": f"rev {word}", "chosen": word[::-1], "rejected": word + "q"})
    (root / "pairs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    preprocess_preference(root / "pairs.jsonl", "bytes", root / "pairs", progress=False)
    return model, imported, root / "pairs"


def dpo_config(imported, data, output, *extra):
    return load_config(imported / CONFIG_FILE, [
        f"checkpoint.dir={output}", f"data.path={data}", "data.tokenizer=bytes", "data.holdout_fraction=0.25",
        "model.seq_len=48", "train.steps=2", "train.batch_size=4", "train.eval_batches=1", "train.warmup_steps=0",
        "train.lr=3e-2", "train.log_every=1", f"train.lora.rank={RANK}", f"train.lora.alpha={ALPHA}",
        "train.objective=dpo", f"train.dpo.beta={BETA}", f"train.dpo.label_smoothing={SMOOTHING}", *extra])


def torch_logps(torch, model, batch: np.ndarray):
    """Per-row summed log-probabilities of the counted targets, as a plain PyTorch computation."""
    ids = torch.tensor(batch[..., 0], dtype=torch.long)
    segments, mask = batch[..., 1], batch[..., 2]
    counted = torch.tensor((mask[:, 1:] != 0) & (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] != 0))
    logp = torch.log_softmax(model(ids[:, :-1]).logits.double(), dim=-1)
    taken = torch.gather(logp, -1, ids[:, 1:, None])[..., 0]
    return torch.where(counted, taken, torch.zeros_like(taken)).sum(-1)


@pytest.fixture(scope="module")
def trained(hf, case, tmp_path_factory):
    """Two DPO steps on one device (so the adapters are not zero), logged to a metrics file; the run's
    checkpoint, and its export (the adapters merged) as a PyTorch model: the policy."""
    from transformers import AutoModelForCausalLM

    from meshtron.train.loop import Trainer

    torch, _ = hf
    _, imported, data = case
    root = tmp_path_factory.mktemp("trained")
    with open(root / "metrics.jsonl", "w") as metrics:
        Trainer.from_config(dpo_config(imported, data, root / "run")).run(metrics_file=metrics)
    logged = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    policy = AutoModelForCausalLM.from_pretrained(export_hf(root / "run", root / "exported"), dtype=torch.float32)
    return root / "run", policy.eval(), logged


def check_parity(torch, trainer, params, batch, reference_model, policy_model):
    """The step's DPO loss, its adapters' gradient (of the MLP's down projection) and its metrics at
    ``params`` (canonical layer order) on ``batch`` against PyTorch's on the merged policy and the original
    model: loss within 1e-5, gradients within 1e-4 of their largest entry, metrics within 1e-4."""
    from meshtron.train.pipelined import to_canonical, to_stage_order

    pipe, chunks = trainer.mesh.shape["pipe"], trainer.cfg.pipeline.chunks
    layers = trainer.model_def.layers
    held = to_stage_order(params, layers, pipe, chunks) if pipe > 1 else params
    held = jax.device_put(held, trainer.steps.param_shardings)
    loss, grads = trainer.steps.gradients(held, jax.numpy.asarray(batch))
    grads = to_canonical(jax.device_get(grads), layers, pipe, chunks) if pipe > 1 else grads
    found = trainer.steps.objective_metrics(held, jax.numpy.asarray(batch))

    policy_model.zero_grad()
    pi = torch_logps(torch, policy_model, batch)
    with torch.no_grad():
        ref = torch_logps(torch, reference_model, batch)
    logits = (pi[0::2] - pi[1::2]) - (ref[0::2] - ref[1::2])
    fn = torch.nn.functional.logsigmoid
    expected = (-fn(BETA * logits) * (1 - SMOOTHING) - fn(-BETA * logits) * SMOOTHING).mean()
    expected.backward()
    expected = float(expected.detach())
    mesh = "x".join(str(v) for v in trainer.mesh.shape.values())
    print(f"\n{mesh}: DPO loss {float(loss):.8f}, PyTorch {expected:.8f}: |delta| {abs(float(loss) - expected):.2e}")
    assert abs(float(loss) - expected) <= 1e-5
    assert abs(expected - np.log(2.0)) > 1e-3  # the adapters moved the policy off the reference

    chosen, rejected = BETA * (pi[0::2] - ref[0::2]), BETA * (pi[1::2] - ref[1::2])
    want = {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
            "rewards/accuracies": (chosen > rejected).double().mean(), "rewards/margins": (chosen - rejected).mean(),
            "logps/chosen": pi[0::2].mean(), "logps/rejected": pi[1::2].mean()}
    for name, value in want.items():
        assert found[name] == pytest.approx(float(value.detach()), rel=1e-4, abs=1e-4), name

    scale = ALPHA / RANK
    down = params["blocks"]["mlp"]["down"]
    got = grads["blocks"]["mlp"]["down"]
    for layer in range(LLAMA["num_hidden_layers"]):
        merged_grad = policy_model.model.layers[layer].mlp.down_proj.weight.grad.double().numpy().T  # [mlp, hidden]
        a, b = (np.asarray(down[k][layer], np.float64) for k in ("kernel_lora_a", "kernel_lora_b"))
        for name, want_grad in (("kernel_lora_b", scale * a.T @ merged_grad), ("kernel_lora_a", scale * merged_grad @ b.T)):
            have = np.asarray(got[name][layer], np.float64)
            error = np.max(np.abs(have - want_grad)) / np.max(np.abs(want_grad))
            print(f"  layer {layer} {name}: max|gradient delta| / max|gradient| {error:.2e}")
            assert error <= 1e-4, (layer, name, error)
    assert not np.any(np.asarray(got["kernel"]))  # the base trains nothing


def test_lora_dpo_loss_gradient_and_metrics_equal_pytorch(hf, case, trained, tmp_path):
    """On one device: the run logs TRL's metrics beside the loss (log 2 and no margin at the first step,
    where the policy is the reference), and at the trained weights the step's loss, gradient and metrics
    equal PyTorch's (:func:`check_parity`)."""
    from meshtron.train.loop import Trainer

    output, policy_model, logged = trained
    steps = [r for r in logged if "rewards/margins" in r]
    assert len(steps) == 2 and {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen",
                                "logps/rejected", "loss"} <= set(steps[0])
    assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert steps[0]["loss"] == pytest.approx(np.log(2.0), abs=1e-5)
    reference_model, imported, data = case
    trainer = Trainer.from_config(dpo_config(imported, data, tmp_path / "again"))
    params = load_pretrained(output, MeshConfig(1, 1, 1)).params
    check_parity(hf[0], trainer, params, trainer.train_stream().global_batch(0), reference_model, policy_model)


@pytest.mark.slow
@on_layouts("data-pipe-tensor-interleaved", "data-tensor-zero3", "pipe-1f1b", "pipe-zb-h1", "data-context-tensor",
            extended=("pipe-1f1b", "pipe-zb-h1", "data-context-tensor"))
def test_lora_dpo_on_parallel_layouts_equals_pytorch(hf, case, trained, tmp_path, layout):
    """The same on (data, pipe, tensor) = (2, 2, 2) with the interleaved schedule (2 chunks a stage) and 2
    microbatches -- a pair stays in one microbatch of one data shard, and the pipeline's last stage reads the
    reference from rows of its own -- and on 4 data shards x 2 tensor ranks under ZeRO-3 (the reference's
    forward gathers each layer as the policy's does); on 2 stages under 1F1B and ZB-H1 (the reference's rows
    through the split backward), and on (data, context, tensor) = (2, 2, 2) (log-probabilities summed over the
    context ranks)."""
    from meshtron.train.loop import Trainer

    output, policy_model, _ = trained
    reference_model, imported, data = case
    cfg = dpo_config(imported, data, tmp_path / "again", *layout)
    trainer = Trainer.from_config(cfg)
    params = load_pretrained(output, MeshConfig(1, 1, 1)).params
    check_parity(hf[0], trainer, params, trainer.train_stream().global_batch(0), reference_model, policy_model)


def test_the_lora_reference_is_the_base_itself_no_second_copy(case, tmp_path):
    """The compiled DPO step takes exactly the parameter bytes of a plain LoRA step (the reference is the
    same weights with the adapters off), and its outputs no more."""
    from meshtron.train.loop import Trainer

    _, imported, data = case
    sizes = {}
    for objective, batch in (("dpo", 4), ("lm", 8)):  # the same rows: 4 pairs are 8 sequences
        cfg = dpo_config(imported, data, tmp_path / objective, f"train.objective={objective}",
                         f"train.batch_size={batch}")
        trainer = Trainer.from_config(cfg, read_data=False)
        params, opt_state, tokens = trainer.abstract_step_arguments()
        assert tokens.shape == (8, 49, 3)
        memory = trainer.steps.compile(params, opt_state, tokens).memory_analysis()
        sizes[objective] = (memory.argument_size_in_bytes, memory.output_size_in_bytes)
    assert sizes["dpo"] == sizes["lm"]


@pytest.mark.parametrize("override, message", [
    (["train.dpo.loss=ipo"], r"train.dpo.label_smoothing: applies to the sigmoid loss only"),
    (["train.dpo.beta=0"], r"train.dpo.beta: must be > 0"),
    (["train.objective=ppo"], r"train.objective: must be one of lm, dpo"),
    (["parallel.data=2", "train.batch_size=3"], r"^train.batch_size: 3 pairs cannot be split over parallel.data=2"),
    (["data.pairs_per_window=0"], r"data.pairs_per_window: must be a whole number >= 1"),
    (["data.pairs_per_window=2", "train.objective=lm"],
     r"data.pairs_per_window: packs preference pairs, and train.objective=lm"),
])
def test_what_dpo_cannot_run_is_one_line(case, tmp_path, override, message):
    from meshtron.run import check_features

    _, imported, data = case
    with pytest.raises(ConfigError, match=message):
        check_features(dpo_config(imported, data, tmp_path / "x", *override))


def test_a_precomputed_reference_needs_pairs_with_an_index(case, tmp_path):
    """Precomputed log-probabilities are keyed by a pair's index in an indexed dataset; a stream has none."""
    from meshtron.run import check_features

    _, imported, data = case
    cfg = dpo_config(imported, data, tmp_path / "x", "train.dpo.precompute_reference=true")
    cfg.data.source = "hf"
    with pytest.raises(ConfigError, match=r"train.dpo.precompute_reference: .*data.source=hf streams pairs"):
        check_features(cfg)


def test_the_losses_are_trl_formulas():
    """DPO's sigmoid loss with label smoothing, and IPO's, pair by pair, against the formulas in NumPy."""
    import jax.numpy as jnp

    from meshtron.models.preference import PreferenceLoss

    rng = np.random.default_rng(1)
    policy, reference = rng.normal(size=8) * 3, rng.normal(size=8) * 3
    logits = (policy[0::2] - policy[1::2]) - (reference[0::2] - reference[1::2])

    def logsigmoid(x):
        return -np.logaddexp(0.0, -x)

    sigmoid = -logsigmoid(0.3 * logits) * 0.8 - logsigmoid(-0.3 * logits) * 0.2
    ipo = (logits - 1 / (2 * 0.3)) ** 2
    for loss, want in ((PreferenceLoss(0.3, 0.2, "sigmoid"), sigmoid), (PreferenceLoss(0.3, 0.0, "ipo"), ipo)):
        got = loss.per_pair(jnp.asarray(policy, jnp.float32), jnp.asarray(reference, jnp.float32))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)
        assert float(loss(jnp.asarray(policy), jnp.asarray(reference))) == pytest.approx(want.mean(), rel=1e-5)


def test_dpo_needs_pairs_and_pairs_need_dpo(case, tmp_path):
    from meshtron.train.objective import check_objective_data

    with pytest.raises(ConfigError, match=r"train.objective: dpo trains on preference pairs.*--preference"):
        check_objective_data("dpo", False)
    with pytest.raises(ConfigError, match=r"data.path: holds preference pairs .* train.objective=dpo"):
        check_objective_data("lm", True)


def full_config(imported, data, output, *extra, precompute=True):
    """The whole model trains by DPO against the init_from weights: their log-probabilities precomputed, or
    (``precompute=False``) a frozen copy of them."""
    return dpo_config(imported, data, output, "train.lora.rank=0", f"train.dpo.precompute_reference={precompute}",
                      "train.lr=1e-3", *extra)


@pytest.fixture(scope="module")
def trained_full(hf, case, tmp_path_factory):
    """Two full-parameter DPO steps on one device with a precomputed reference; the run's directory and its
    export as a PyTorch model (the policy)."""
    from transformers import AutoModelForCausalLM

    from meshtron.train.loop import Trainer

    torch, _ = hf
    _, imported, data = case
    root = tmp_path_factory.mktemp("trained-full")
    with open(root / "metrics.jsonl", "w") as metrics:
        Trainer.from_config(full_config(imported, data, root / "run")).run(metrics_file=metrics)
    logged = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    policy = AutoModelForCausalLM.from_pretrained(export_hf(root / "run", root / "exported"), dtype=torch.float32)
    return root / "run", policy.eval(), logged


def precomputed_trainer(cfg, params):
    """A trainer for ``cfg`` whose pairs carry the reference log-probabilities computed with ``params``."""
    from meshtron.train.loop import Trainer
    from meshtron.train.reference_pass import attach_reference

    trainer = Trainer.from_config(cfg)
    splits = {"train": trainer.corpus.train, "heldout": trainer.corpus.heldout}
    attach_reference(trainer.cfg, trainer.steps, jax.device_put(params, trainer.steps.param_shardings), splits,
                     None, resumed=False)
    return trainer


def check_full_parity(torch, trainer, params, batch, reference_model, policy_model, reference=None):
    """The step's loss and the whole model's gradient (the MLP's down projection, every layer) at ``params``
    on ``batch``, whose reference log-probabilities were precomputed, against PyTorch's with the original
    model as the reference: loss within 1e-5, gradients within 1e-4 of their largest entry. ``reference``
    (stage-ordered like ``params``): the frozen copy's weights, which the step takes beside ``batch`` and runs
    itself; the row log-probabilities of its forward (``steps.row_logps``) are the reference model's too."""
    from meshtron.train.pipelined import to_canonical, to_stage_order

    pipe, chunks = trainer.mesh.shape["pipe"], trainer.cfg.pipeline.chunks
    layers = trainer.model_def.layers
    held = to_stage_order(params, layers, pipe, chunks) if pipe > 1 else params
    held = jax.device_put(held, trainer.steps.param_shardings)
    inputs = trainer.steps.inputs(jax.numpy.asarray(batch), reference)
    loss, grads = trainer.steps.gradients(held, inputs)
    grads = to_canonical(jax.device_get(grads), layers, pipe, chunks) if pipe > 1 else grads

    plain = batch[..., :3]
    if reference is None:
        precomputed = batch[:, 0, 3].astype(np.int32).view(np.float32)
    else:
        precomputed = trainer.steps.row_logps(reference, jax.numpy.asarray(plain))
    with torch.no_grad():
        ref = torch_logps(torch, reference_model, plain)
    np.testing.assert_allclose(precomputed, ref.numpy(), rtol=1e-5, atol=1e-4)  # the pass's values: the reference's
    policy_model.zero_grad()
    pi = torch_logps(torch, policy_model, plain)
    logits = (pi[0::2] - pi[1::2]) - (ref[0::2] - ref[1::2])
    fn = torch.nn.functional.logsigmoid
    expected = (-fn(BETA * logits) * (1 - SMOOTHING) - fn(-BETA * logits) * SMOOTHING).mean()
    expected.backward()
    expected = float(expected.detach())
    mesh = "x".join(str(v) for v in trainer.mesh.shape.values())
    print(f"\n{mesh}: full DPO loss {float(loss):.8f}, PyTorch {expected:.8f}: |delta| {abs(float(loss) - expected):.2e}")
    assert abs(float(loss) - expected) <= 1e-5
    assert abs(expected - np.log(2.0)) > 1e-3  # training moved the policy off the reference
    got = grads["blocks"]["mlp"]["down"]["kernel"]
    for layer in range(LLAMA["num_hidden_layers"]):
        want = policy_model.model.layers[layer].mlp.down_proj.weight.grad.double().numpy().T  # [mlp, hidden]
        error = np.max(np.abs(np.asarray(got[layer], np.float64) - want)) / np.max(np.abs(want))
        print(f"  layer {layer} down kernel: max|gradient delta| / max|gradient| {error:.2e}")
        assert error <= 1e-4, (layer, error)


def test_full_dpo_with_a_precomputed_reference_equals_pytorch(hf, case, trained_full, tmp_path):
    """Without LoRA the whole model trains against the init_from weights' log-probabilities, computed in
    one pass before training and saved beside the checkpoints: the first step's loss is log 2, the saved
    values are the original model's, and at the trained weights the step's loss and gradient equal
    PyTorch's (:func:`check_full_parity`). A resumed run reads the saved values."""
    from meshtron.train.reference_pass import REFERENCE_FILE, attach_reference

    output, policy_model, logged = trained_full
    steps = [r for r in logged if "rewards/margins" in r]
    assert len(steps) == 2 and steps[0]["loss"] == pytest.approx(np.log(2.0), abs=1e-5)
    assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert (output / REFERENCE_FILE).exists()
    reference_model, imported, data = case
    trainer = precomputed_trainer(full_config(imported, data, tmp_path / "again"),
                                  load_pretrained(imported, MeshConfig(1, 1, 1)).params)
    batch = trainer.train_stream().global_batch(0)
    assert batch.shape == (8, 49, 4)
    check_full_parity(hf[0], trainer, load_pretrained(output, MeshConfig(1, 1, 1)).params, batch, reference_model,
                      policy_model)

    class Store:  # what a resumed run's store tells the pass
        directory = output

    splits = {"train": trainer.corpus.train, "heldout": trainer.corpus.heldout}
    saved = {name: s.reference.copy() for name, s in splits.items()}
    line = attach_reference(trainer.cfg, None, None, splits, Store(), resumed=True)
    assert line.startswith("reference: log-probabilities of 12 pairs read from")
    for name, s in splits.items():
        np.testing.assert_allclose(s.reference, saved[name], rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match=r"checkpoint.dir: resumes a DPO run with train.dpo.precompute_reference"):
        attach_reference(trainer.cfg, None, None, splits, type("Empty", (), {"directory": tmp_path})(), resumed=True)


@pytest.mark.slow
@on_layouts("data-pipe-tensor-interleaved", "pipe-1f1b", "pipe-zb-h1", "data-context-tensor",
            extended=("pipe-1f1b", "pipe-zb-h1", "data-context-tensor"))
def test_full_dpo_on_parallel_layouts_equals_pytorch(hf, case, trained_full, tmp_path, layout):
    """The same on (data, pipe, tensor) = (2, 2, 2) interleaved, on 2 stages under 1F1B and ZB-H1 (whose
    split backward sees the precomputed reference in the last stage's rows), and on (data, context, tensor)
    = (2, 2, 2) (each answer's log-probability summed over the context ranks its sequence is split over);
    the reference pass itself runs on that mesh (pipelined parameters brought back to model order)."""
    output, policy_model, _ = trained_full
    reference_model, imported, data = case
    cfg = full_config(imported, data, tmp_path / "again", *layout)
    trainer = precomputed_trainer(cfg, stage_ordered(cfg, load_pretrained(imported, MeshConfig(1, 1, 1)).params))
    check_full_parity(hf[0], trainer, load_pretrained(output, MeshConfig(1, 1, 1)).params,
                      trainer.train_stream().global_batch(0), reference_model, policy_model)


def stage_ordered(cfg, params):
    """``params`` (model order) as a run on ``cfg``'s mesh holds them."""
    from meshtron.train.pipelined import to_stage_order

    pipe = cfg.mesh.pipe
    return to_stage_order(params, LLAMA["num_hidden_layers"], pipe, cfg.pipeline.chunks) if pipe > 1 else params


def test_full_dpo_with_a_frozen_copy_equals_pytorch_and_the_precomputed_run(hf, case, trained_full, tmp_path):
    """With a frozen copy of the init_from weights as the reference (an argument of the step, which runs its
    forward) the run logs the precomputed run's losses and metrics step by step, and at the trained weights
    the step's loss and gradient equal PyTorch's."""
    from meshtron.train.loop import Trainer

    output, policy_model, precomputed = trained_full
    reference_model, imported, data = case
    root = tmp_path / "frozen"
    root.mkdir()
    with open(root / "metrics.jsonl", "w") as metrics:
        Trainer.from_config(full_config(imported, data, root / "run", precompute=False)).run(metrics_file=metrics)
    logged = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == len(precomputed)
    for mine, theirs in zip(logged, precomputed):
        for name in ("loss", "heldout_loss", "rewards/margins", "rewards/chosen", "logps/rejected"):
            if name in theirs:
                assert mine[name] == pytest.approx(theirs[name], abs=1e-5), name

    trainer = Trainer.from_config(full_config(imported, data, tmp_path / "again", precompute=False))
    reference = load_pretrained(imported, MeshConfig(1, 1, 1)).params
    batch = trainer.train_stream().global_batch(0)
    assert batch.shape == (8, 49, 3)  # the step adds the reference's values itself
    check_full_parity(hf[0], trainer, load_pretrained(output, MeshConfig(1, 1, 1)).params, batch, reference_model,
                      policy_model, reference=reference)


@pytest.mark.slow
@on_layouts("data-pipe-tensor-interleaved", "pipe-zb-h1", "data-context-tensor",
            extended=("pipe-zb-h1", "data-context-tensor"))
def test_full_dpo_with_a_frozen_copy_on_parallel_layouts_equals_pytorch(hf, case, trained_full, tmp_path, layout):
    """The frozen copy's forward inside the step on (data, pipe, tensor) = (2, 2, 2) interleaved and on 2
    stages under ZB-H1 (the forward-only pipeline schedule over the reference's stages) and over context
    ranks (its rows' sums over them): loss and gradient equal PyTorch's."""
    from meshtron.train.loop import Trainer

    output, policy_model, _ = trained_full
    reference_model, imported, data = case
    cfg = full_config(imported, data, tmp_path / "again", *layout, precompute=False)
    trainer = Trainer.from_config(cfg)
    reference = stage_ordered(trainer.cfg, load_pretrained(imported, MeshConfig(1, 1, 1)).params)
    check_full_parity(hf[0], trainer, load_pretrained(output, MeshConfig(1, 1, 1)).params,
                      trainer.train_stream().global_batch(0), reference_model, policy_model, reference=reference)


def test_full_dpo_over_context_ranks_equals_pytorch(hf, case, trained_full, tmp_path):
    """Each sequence split over 2 context ranks: every answer's log-probability is summed over them (the
    reference pass's too), and the step's loss and gradient equal PyTorch's."""
    output, policy_model, _ = trained_full
    reference_model, imported, data = case
    cfg = full_config(imported, data, tmp_path / "again", "parallel.context=2")
    trainer = precomputed_trainer(cfg, load_pretrained(imported, MeshConfig(1, 1, 1)).params)
    check_full_parity(hf[0], trainer, load_pretrained(output, MeshConfig(1, 1, 1)).params,
                      trainer.train_stream().global_batch(0), reference_model, policy_model)


def test_describe_says_what_the_reference_adds(case, tmp_path):
    """describe's memory section names the reference: a frozen copy's bytes (the parameters' again), LoRA's
    base (nothing held; in a pipeline the copied rows the step-memory model counts), a precomputed
    reference (nothing held); the model counts 2 rows a pair, 4 with copies."""
    from meshtron.describe import dpo_reference_line
    from meshtron.plan.step_memory import dpo_rows_per_pair

    _, imported, data = case
    frozen = full_config(imported, data, tmp_path, precompute=False)
    assert dpo_reference_line(frozen, 3 * 2**20).startswith(
        "DPO reference: a frozen copy of the starting weights, 3.0 MiB more, an argument of the step")
    assert "no weights held" in dpo_reference_line(full_config(imported, data, tmp_path), 1)
    lora = dpo_config(imported, data, tmp_path)
    assert "no second copy" in dpo_reference_line(lora, 1)
    assert dpo_reference_line(dpo_config(imported, data, tmp_path, "train.objective=lm"), 1) is None
    piped = dpo_config(imported, data, tmp_path, "parallel.pipe=2")
    assert [dpo_rows_per_pair(c) for c in (lora, piped, frozen)] == [2, 4, 2]
    assert dpo_rows_per_pair(dpo_config(imported, data, tmp_path, "train.objective=lm")) == 1


def test_lora_dpo_with_a_precomputed_reference_equals_pytorch(hf, case, trained, tmp_path):
    """LoRA with ``train.dpo.precompute_reference``: the pass runs the starting weights (the adapters at zero:
    the base) and the step reads its values instead of running the frozen base; the trained LoRA run's loss,
    adapters' gradients and metrics equal PyTorch's as with the frozen base."""
    output, policy_model, _ = trained
    reference_model, imported, data = case
    cfg = dpo_config(imported, data, tmp_path / "again", "train.dpo.precompute_reference=true")
    from meshtron.train.loop import Trainer

    starting = Trainer.from_config(cfg).starting_state(None)[0]  # the base with its adapters at zero
    trainer = precomputed_trainer(cfg, jax.device_get(starting))
    batch = trainer.train_stream().global_batch(0)
    assert batch.shape == (8, 49, 4)
    check_parity(hf[0], trainer, load_pretrained(output, MeshConfig(1, 1, 1)).params, batch, reference_model,
                 policy_model)


TWO_STAGES = ("parallel.data=1", "parallel.tensor=1", "parallel.schedule=1f1b", "parallel.chunks=1",
              "parallel.microbatches=4", "model.seq_len=64", "train.batch_size=4", "train.objective=dpo")


def two_stage_trainer(*extra):
    """A small Llama on 2 pipeline stages (1F1B, 4 microbatches of one pair), DPO over 4 pairs: nothing read."""
    from meshtron.train.loop import Trainer

    cfg = load_config("llama_cpu8", [*TWO_STAGES, *extra])
    return Trainer.from_config(cfg, jax.devices()[:2], read_data=False)


def test_the_frozen_copy_is_an_argument_of_the_step():
    """The compiled step with a frozen copy takes the precomputed reference's step's arguments, less the batch's
    fourth channel (the step adds the copy's values itself), plus the copy's bytes per device as describe prints
    them: one stage's parameters. Its forward runs through the forward-only pipeline schedule: the temporaries
    grow by no parameter-sized buffer and nothing is gathered over ``pipe``. The step-memory model counts the copy
    among the arguments, by the same bytes."""
    from meshtron.describe import bytes_per_device, modelled_step_memory, parameter_rows
    from meshtron.hlo.collectives import collectives
    from meshtron.mesh import AXES
    from meshtron.train.step import StepInputs

    found = {}
    for precompute in (True, False):
        trainer = two_stage_trainer(f"train.dpo.precompute_reference={precompute}")
        params, opt_state, inputs = trainer.abstract_step_arguments()
        program = trainer.steps.compile(params, opt_state, inputs)
        memory = program.memory_analysis()
        rows = parameter_rows(trainer.model_def, dict(zip(AXES, trainer.resolved.mesh_shape)))
        found[precompute] = (memory, modelled_step_memory(trainer.resolved, rows, "cpu"), inputs, trainer,
                             collectives(program, trainer.mesh))
    (pre, pre_model, tokens, _, _), (frozen, frozen_model, inputs, trainer, moved) = found[True], found[False]
    assert isinstance(inputs, StepInputs) and inputs.tokens.shape == (*tokens.shape[:2], 3)
    reference = bytes_per_device(inputs.reference, trainer.steps.reference_shardings)
    assert reference == bytes_per_device(inputs.reference, trainer.steps.param_shardings)  # one stage's, as held
    channel = tokens.shape[0] * tokens.shape[1] * 4  # the precomputed values' channel (one data rank: all rows)
    assert frozen.argument_size_in_bytes == pre.argument_size_in_bytes - channel + reference
    assert abs(frozen.temp_size_in_bytes - pre.temp_size_in_bytes) < reference / 100
    assert not [c for c in moved if "pipe" in c.axes and c.kind == "all-gather"]
    assert frozen_model.reference == reference
    assert frozen_model.arguments - pre_model.arguments == reference
    assert frozen_model.peak - pre_model.peak == reference


def test_pipelined_row_logps_move_activations_not_parameters():
    """The per-row log-probability program (the precomputed reference's pass) runs the forward-only pipeline
    schedule: each device takes its stage's parameters, and over ``pipe`` it sends one microbatch's activation a
    tick and sums the rows' values once -- no parameter is gathered (a whole model per device)."""
    from meshtron.describe import bytes_per_device
    from meshtron.hlo.collectives import collectives

    trainer = two_stage_trainer("train.dpo.precompute_reference=true")
    params, _, tokens = trainer.abstract_step_arguments()
    plain = jax.ShapeDtypeStruct((*tokens.shape[:2], 3), np.int32, sharding=trainer.steps.batch_sharding)
    program = trainer.steps.lower_row_logps(params, plain).compile()
    held = bytes_per_device(params, trainer.steps.param_shardings)
    assert held < 0.6 * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))  # one stage's share
    assert program.memory_analysis().argument_size_in_bytes == held + plain.size * 4
    rows, seq, hidden, m = plain.shape[0], plain.shape[1] - 1, trainer.cfg.model.hidden, 4
    moved = {(c.kind, c.bytes) for c in collectives(program, trainer.mesh) if "pipe" in c.axes}
    assert moved == {("collective-permute", rows // m * seq * hidden * 4), ("all-reduce", rows * 4)}
