"""The house: the package's import graph has no cycle (module-level and function-level imports alike),
its lower floors import no higher one, and the old import paths keep working."""

import ast
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "meshtron"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> set[str]:
    """The package's modules ``name`` imports, anywhere in the file (a function-level import too); a
    package's ``__init__`` counts as the modules it imports, not as a module of its own."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: imports(name) for name in MODULES}
# The package faces (meshtron, meshtron.models, ...) only hand names on: an import of one is an import of
# what it re-exports, so they are left out of the cycle search (their own imports point down anyway).
FACES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def test_the_import_graph_has_no_cycle():
    graph = {n: {m for m in GRAPH[n] if m not in FACES} for n in GRAPH if n not in FACES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


@pytest.mark.parametrize("low, high", [
    ("meshtron.errors", "meshtron."),  # the ground floor imports nothing of the package
    ("meshtron.units", "meshtron."),
    ("meshtron.megatron", "meshtron."),
    ("meshtron.families", "meshtron."),  # names and import paths only: a family is loaded when asked for
    ("meshtron.trace_context", "meshtron."),
    ("meshtron.config", "meshtron.pipeline"),  # the schema knows no schedule: meshtron.run resolves them
    ("meshtron.config", "meshtron.train"),
    ("meshtron.hlo.text", "meshtron.hlo.collectives"),
    ("meshtron.pipeline.table", "meshtron.pipeline.schedules"),
    ("meshtron.pipeline.torch_actions", "meshtron.pipeline.schedules"),
])
def test_a_lower_room_imports_nothing_above_it(low, high):
    above = sorted(m for m in GRAPH[low] if m.startswith(high))
    assert not above, f"{low} imports {above}"


@pytest.mark.parametrize("path, names", [
    ("meshtron.config", ["ConfigError", "load_config", "Config"]),
    ("meshtron.pipeline.schedules", ["make_schedule", "is_schedule_file", "check", "compile_program", "Program",
                                     "Schedule", "ScheduleError", "SCHEDULES", "render", "forward_only"]),
    ("meshtron", ["ConfigError", "Trainer", "load_config", "load_pretrained", "sample", "check_parity"]),
])
def test_the_old_import_paths_keep_working(path, names):
    module = importlib.import_module(path)
    assert all(hasattr(module, name) for name in names)


def test_the_architecture_guide_maps_every_module():
    """docs/architecture.md's module map names every module under src/meshtron, and nothing that is not."""
    import re

    guide = (SRC.parent / "docs" / "architecture.md").read_text()
    table = guide[guide.index("## Module map"):guide.index("## Read the code")]
    named = set(re.findall(r"^\| `([\w/]+\.py)` \|", table, re.MULTILINE))
    present = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    assert sorted(present - named) == [], "modules missing from docs/architecture.md's map"
    assert sorted(named - present) == [], "docs/architecture.md names modules that do not exist"


# Checks that span two features, by a fragment of the one line each prints: each is written in one place,
# the run's (a config's own fields are the config's), so a third feature changes one check, not two that
# drift apart. The seq rule's is the model's: it reads the rules a model of the user's own brings.
RUN = "meshtron/run.py"
CROSS_FEATURE_CHECKS = {
    "sequence parallelism x tensor size": ("splits activations over the tensor ranks and needs", RUN),
    "sequence parallelism x sequence length": ("(each tensor rank holds", RUN),
    "LoRA x mixture of experts": ("adapts the matrices of dense blocks", RUN),
    "context x mixture of experts": ("a mixture of experts is split over data ranks only", RUN),
    "context x the seq rule": ("splits every sequence over {CONTEXT!r}", "meshtron/train/data_shards.py"),
    "ring attention x uneven pipeline layout": ("RING_IN_PIPELINE)", RUN),
    "gather_once x zero level": ("gathers parameters split by parallel.zero=3", RUN),
    "gather/reduce dtype x zero level": ("sets the dtypes of parameters gathered by parallel.zero=3", RUN),
    "1-bit LAMB x zero level": ("1-bit LAMB's error feedback compresses", RUN),
    "context x sequence parallelism": ("(the residual stream is split over both)", RUN),
}


@pytest.mark.parametrize("feature", sorted(CROSS_FEATURE_CHECKS))
def test_each_cross_feature_check_is_written_once(feature):
    fragment, home = CROSS_FEATURE_CHECKS[feature]
    found = [f"{path.relative_to(SRC)}" for path in sorted(SRC.rglob("*.py"))
             for _ in range(path.read_text().count(fragment))]
    assert found == [home], f"{feature}: {fragment!r} is written in {found or 'no file'}, not {home}"


def _function(path: Path, name: str, cls: str | None = None) -> ast.AST:
    tree = ast.parse(path.read_text())
    scope = tree.body if cls is None else next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)


def test_the_train_step_is_a_composition_that_names_no_feature():
    # A feature joins the step as a strategy (optim/sync.py), a mask (train/trainable.py), a trace-context
    # field or a gradient source, not as another branch of build_steps.
    step = SRC / "meshtron" / "train" / "step.py"
    text = step.read_text().lower()
    assert [word for word in ("lora", "native", "gather_once") if word in text] == []
    build = _function(step, "build_steps")
    nested = [n for n in ast.walk(build) if isinstance(n, (ast.FunctionDef, ast.Lambda)) and n is not build]
    assert build.end_lineno - build.lineno + 1 <= 80 and len(nested) <= 8


def test_the_trainer_keeps_to_the_loop():
    loop = SRC / "meshtron" / "train" / "loop.py"
    trainer, run = _function(loop, "Trainer"), _function(loop, "_run", cls="Trainer")
    assert trainer.end_lineno - trainer.lineno + 1 <= 250 and run.end_lineno - run.lineno + 1 <= 60


@pytest.mark.parametrize("family", ["gpt", "llama", "deepseek"])
def test_a_model_family_imports_no_training_feature(family):
    tree = ast.parse((SRC / "meshtron" / "models" / f"{family}.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "meshtron.models.lora" not in imported
