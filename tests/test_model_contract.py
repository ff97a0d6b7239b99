"""The model contract: what it checks (one clear error per breach), user rules, and the import
direction that keeps the trainer, pipeline, optimizer and checkpoints free of model families."""

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from meshtron.cli import main
from meshtron.config import ConfigError, MeshConfig, ModelConfig
from meshtron.execution import Execution
from meshtron.families import FAMILIES
from meshtron.mesh import build_mesh
from meshtron.models import Context, ModelContractError, stack_blocks
from meshtron.sharding import MEGATRON_RULES, extend_rules, logical_to_spec, placing_rules
from meshtron.train.state import ModelDef, model_def_from_config

SRC = Path(__file__).resolve().parents[1] / "src" / "meshtron"
FAMILY_FREE = [*(SRC / "train").glob("*.py"), *(SRC / "pipeline").glob("*.py"), *(SRC / "optim").glob("*.py"),
               SRC / "checkpoint.py"]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at top level or inside functions, resolved to absolute names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("path", FAMILY_FREE, ids=lambda p: str(p.relative_to(SRC)))
def test_no_family_is_imported_by_the_trainer_pipeline_optimizer_or_checkpoints(path):
    families = {path for f in FAMILIES.values() for path in (f.module, f.counts)}
    bad = {name for name in imported_modules(path) if any(name == f or name.startswith(f + ".") for f in families)}
    assert not bad, f"{path.name} imports a model family: {bad}"
    text = path.read_text()
    assert not any(word in text for word in ("GPTDims", "LlamaDims", "wte", "wpe")), path


# ---- contract checks -------------------------------------------------------------------------


def _w(rngs, shape, axes):
    return nnx.Param(nnx.with_partitioning(nnx.initializers.normal(0.02), axes)(rngs.params(), shape))


class TinyBlock(nnx.Module):
    def __init__(self, rngs, axes=("embed", "mlp")):
        self.w = _w(rngs, (8, 8), axes)

    def __call__(self, x, ctx):
        return x + x @ self.w[...]


class TinyLM(nnx.Module):
    """A minimal contract model; ``breach`` removes or spoils one part of it."""

    def __init__(self, rngs, breach=None):
        self.vocab_size = 16 if breach != "vocab_size" else None
        self.emb = _w(rngs, (16, 8), ("vocab", "embed"))
        if breach == "no_axes":
            self.emb = nnx.Param(jnp.zeros((16, 8)))
        if breach == "unknown_axis":
            self.extra = _w(rngs, (8,), ("wibble",))
        if breach == "layers_outside":
            self.extra = _w(rngs, (2, 8), ("layers", "embed"))
        if breach == "unstacked":
            self.blocks = TinyBlock(rngs)
        elif breach != "no_blocks":
            self.blocks = stack_blocks(lambda r: TinyBlock(r), 2, rngs)

    def embed(self, tokens, ctx):
        return jnp.take(self.emb[...], tokens, axis=0)

    def head(self, x):
        return x @ self.emb[...].T


class NoHead(TinyLM):
    head = None


@pytest.mark.parametrize("breach, message", [
    ("no_blocks", ("model: TinyLM has no attribute 'blocks' holding stacked blocks; set self.blocks = "
                  "meshtron.models.stack_blocks")),
    ("unstacked", "model: parameter blocks.w is under blocks but its first axis is 'embed', not 'layers'"),
    ("vocab_size", "model: TinyLM.vocab_size is None, not a positive int; give the model a vocab_size attribute"),
    ("no_axes", "model: parameter emb has no logical axis names; create it with nnx.with_partitioning"),
    ("unknown_axis", ("model: parameter extra uses logical axis 'wibble', which no sharding rule maps; add a rule, "
                     "e.g. model.rules={wibble: null}")),
    ("layers_outside", "model: parameter extra has a 'layers' axis outside blocks"),
])
def test_each_breach_is_one_error_naming_it_and_the_fix(breach, message):
    with pytest.raises(ModelContractError) as err:
        ModelDef.create(lambda rngs: TinyLM(rngs, breach))
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_missing_method_and_non_module():
    with pytest.raises(ModelContractError, match=r"^model: NoHead has no method head\(\); add head\(x\) -> logits"):
        ModelDef.create(lambda rngs: NoHead(rngs))
    with pytest.raises(ModelContractError, match="^model: the factory returned a dict, not an nnx.Module"):
        ModelDef.create(lambda rngs: {})


def test_a_good_tiny_model_is_accepted_and_described():
    md = ModelDef.create(lambda rngs: TinyLM(rngs))
    assert (md.layers, md.vocab_size, md.vocab_padded, md.max_len, md.can_cache) == (2, 16, 16, None, False)
    assert md.stacked() == {"blocks": {"w": True}, "emb": False}
    loss = jax.jit(md.loss)(md.init(build_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]), 0),
                            jnp.zeros((2, 5), jnp.int32))
    assert jnp.isfinite(loss)


def test_indivisible_parameter_is_a_config_error_naming_the_parameter_and_rule():
    md = ModelDef.create(lambda rngs: TinyLM(rngs), rules=extend_rules(MEGATRON_RULES, {"embed": "tensor"}))
    mesh = build_mesh(MeshConfig(1, 1, 8), jax.devices())
    md.check_mesh(mesh)  # 8 divides 8
    md3 = ModelDef.create(lambda rngs: TinyLM(rngs), rules=extend_rules(MEGATRON_RULES, {"mlp": None}))
    mesh3 = build_mesh(MeshConfig(1, 1, 3), jax.devices()[:3])
    with pytest.raises(ConfigError, match=r"^model: parameter emb has 'vocab' of size 16, which tensor=3 does not "
                                          r"divide; .* model.rules=\{vocab: null\}"):
        md3.check_mesh(mesh3)


# ---- rules -------------------------------------------------------------------------------------


def test_extend_rules_overrides_in_place_and_appends_new_names():
    rules = extend_rules(MEGATRON_RULES, {"mlp": None, "ffn": "tensor"})
    assert ("mlp", None) in rules and ("mlp", "tensor") not in rules
    assert rules[-1] == ("ffn", "tensor")
    assert [n for n, _ in rules].index("mlp") == [n for n, _ in MEGATRON_RULES].index("mlp")
    assert logical_to_spec(("embed", "ffn"), rules) == jax.sharding.PartitionSpec(None, "tensor")
    assert placing_rules(("layers", "embed", "mlp"), MEGATRON_RULES) == [1, 6, 5]
    with pytest.raises(ValueError, match="model.rules.ffn: 'tensr' is not a mesh axis"):
        extend_rules(MEGATRON_RULES, {"ffn": "tensr"})


def test_config_rules_reach_the_layout():
    md = model_def_from_config(ModelConfig(rules={"mlp": None}), tensor=2)
    mesh = build_mesh(MeshConfig(1, 1, 2), jax.devices()[:2])
    fc1 = md.shardings(mesh)["blocks"]["mlp"]["fc1"]["kernel"]
    assert fc1.spec == jax.sharding.PartitionSpec("pipe", None, None)


def test_describe_names_the_rule_that_placed_each_parameter(capsys):
    assert main(["describe", "--config", "cpu8", "model.rules={mlp: null}", "model.layers=2", "parallel.chunks=1",
                 "train.steps=1"]) == 0
    out = capsys.readouterr().out
    fc1 = next(line for line in out.splitlines() if line.startswith("blocks/mlp/fc1/kernel"))
    assert fc1.rstrip().endswith("#1 layers->pipe"), fc1
    qkv = next(line for line in out.splitlines() if line.startswith("blocks/attn/qkv/kernel"))
    assert qkv.rstrip().endswith("#1 layers->pipe, #3 heads->tensor"), qkv


# ---- small things ------------------------------------------------------------------------------


def test_data_path_that_is_a_directory_says_so(tmp_path, capsys):
    assert main(["train", "--config", "cpu8", f"data.path={tmp_path}", "train.steps=1"]) == 2
    assert f"data.path: '{tmp_path}' is a directory; give a UTF-8 text file in it" in capsys.readouterr().err


def test_context_positions_are_shared_and_contiguous():
    ctx = Context.for_sequence(2, 3, start=5)
    assert ctx.positions.tolist() == [[5, 6, 7], [5, 6, 7]] and ctx.cache is None


@pytest.mark.slow
def test_fewer_steps_than_the_checkpoint_is_an_error_not_a_silent_no_op(tmp_path, capsys):
    tiny = ["model.layers=2", "model.hidden=32", "model.mlp_dim=64", "model.seq_len=16", "train.batch_size=8",
            "parallel.microbatches=2", "parallel.chunks=1", "train.eval_batches=1", f"checkpoint.dir={tmp_path}"]
    assert main(["train", "--config", "cpu8", "train.steps=2", *tiny]) == 0
    capsys.readouterr()
    assert main(["train", "--config", "cpu8", "train.steps=1", *tiny]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"meshtron: error: train.steps: 1 is below the step of the newest checkpoint in {tmp_path} (2); "
                       "raise train.steps to train on from it, or use another checkpoint.dir"), err


def test_model_attention_reaches_dot_product_attention(monkeypatch):
    """``model.attention`` picks jax.nn.dot_product_attention's implementation for every model (cudnn:
    flash attention on GPUs); on CPU cudnn is one config error."""
    seen = []
    real = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, implementation=None, **k: seen.append(implementation) or real(*a, **k))
    cfg = ModelConfig(layers=1, seq_len=8)
    md, execution = model_def_from_config(cfg, 1), Execution.of_model_config(cfg)
    params = md.init(build_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]), 0)
    with md.scope(execution):
        jax.jit(md.loss)(params, jnp.zeros((1, 9), jnp.int32))
    assert seen == ["xla"]
    with pytest.raises(ConfigError, match="^model.attention: cudnn .flash attention. needs GPUs, this run has cpu"):
        model_def_from_config(ModelConfig(attention="cudnn"), 1)
    with pytest.raises(ConfigError, match="^model.attention: must be 'xla' or 'cudnn'"):
        _validate_attention("flash")


def _validate_attention(name):
    from meshtron.config import Config, validate

    validate(Config(model=ModelConfig(attention=name)))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_states_its_counts_in_pure_python(name):
    """The planner, the step-memory model and describe ask a family for its numbers
    (:mod:`meshtron.families`); they run without JAX, so a family's counts import none."""
    family = FAMILIES[name]
    counts = family.load_counts()
    for attr in ("BLOCK", "PAPER_GPT", "kv_heads", "block_parameters", "other_parameters", "weight_boundary"):
        assert hasattr(counts, attr), f"{family.counts} has no {attr}"
    heavy = {n for n in imported_modules(Path(counts.__file__)) if n.split(".")[0] in ("jax", "jaxlib", "flax")}
    assert not heavy, f"{family.counts} imports {heavy}"
